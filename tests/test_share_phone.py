""" "Send to my phone" and the booth's wall (--wall): the links expire, name no path, serve only what
the app's file route serves the visitor, and the wall lists only opted-in results (server/share_links.py,
server/share_routes.py, ui/share_phone.py)."""

from __future__ import annotations

import pytest
from starlette.testclient import TestClient

from hidream_ui.config import AppConfig
from hidream_ui.server.loopback import Caller, CallRefused
from hidream_ui.server.share_links import ShareLinks
from hidream_ui.server.share_routes import ShareRoutes
from hidream_ui.ui.share_phone import phone_html

VISITOR = Caller(address="10.0.0.5", agent="share:10.0.0.5")


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class FakeLoopback:
    """The app's file route: serves the files it holds, as anyone (the real one checks the caller)."""

    def __init__(self, files: dict[str, bytes]):
        self.files = files
        self.asked: list[tuple[Caller, str]] = []

    async def fetch(self, caller: Caller, path: str) -> bytes:
        self.asked.append((caller, path))
        if path not in self.files:
            raise CallRefused(403, "file", "not served")
        return self.files[path]


def client(table, files=None, *, wall=True, public=True, signed_in=lambda scope: None):
    loopback = FakeLoopback(files or {})
    routes = ShareRoutes(table, loopback, wall=wall, public=public, signed_in=signed_in)
    return TestClient(routes.app()), loopback


def test_phone_link_serves_the_png_until_it_expires():
    clock = Clock()
    table = ShareLinks(ttl=3600, clock=clock)
    link = table.phone_link(VISITOR, "/cache/abc/result.png", "http://booth.local:7860/")
    assert link.url.startswith("http://booth.local:7860/share/")
    assert "/cache/" not in link.url and "result.png" not in link.url  # no server path in the link
    http, loopback = client(table, {"/cache/abc/result.png": b"\x89PNG-bytes"})
    path = link.url.removeprefix("http://booth.local:7860")
    answer = http.get(path)
    assert answer.status_code == 200 and answer.content == b"\x89PNG-bytes"
    assert answer.headers["content-type"] == "image/png"
    assert loopback.asked == [(VISITOR, "/cache/abc/result.png")]  # read as the visitor who made it
    clock.now += 3599
    assert http.get(path).status_code == 200
    clock.now += 2
    gone = http.get(path)
    assert gone.status_code == 404 and "expired" in gone.text
    assert http.get("/share/not-a-token").status_code == 404


def test_a_result_the_file_route_refuses_answers_404():
    table = ShareLinks()
    link = table.phone_link(VISITOR, "/etc/passwd", "http://x")
    http, _ = client(table, {})
    answer = http.get(link.url.removeprefix("http://x"))
    assert answer.status_code == 404 and "passwd" not in answer.text


def test_wall_lists_only_opted_in_results_newest_first_and_bounded():
    clock = Clock()
    table = ShareLinks(ttl=100, wall_size=2, clock=clock)
    table.phone_link(VISITOR, "/r/phone-only.png", "http://x")  # a phone link is not a wall entry
    table.show_on_wall(VISITOR, "/r/a.png", True)
    table.show_on_wall(VISITOR, "/r/b.png", True)
    table.show_on_wall(VISITOR, "/r/c.png", True)  # pushes a out
    table.show_on_wall(VISITOR, "/r/b.png", False)  # ticked off again
    http, loopback = client(table, {"/r/c.png": b"C", "/r/b.png": b"B", "/r/a.png": b"A"})
    results = http.get("/wall/list.json").json()["results"]
    assert len(results) == 1 and results[0].startswith("/share/")
    assert http.get(results[0]).content == b"C"
    page = http.get("/wall")
    assert page.status_code == 200 and "/wall/list.json" in page.text
    assert "<button" not in page.text and "<input" not in page.text and "http" not in page.text.split("<script>")[0]
    clock.now += 101  # the entry's link expired: it leaves the wall
    assert http.get("/wall/list.json").json() == {"results": []}


def test_wall_is_off_without_the_flag_and_needs_a_login_where_the_app_has_one():
    table = ShareLinks()
    off, _ = client(table, wall=False)
    assert off.get("/wall").status_code == 404 and off.get("/wall/list.json").status_code == 404
    locked, _ = client(table, public=False)
    assert locked.get("/wall").status_code == 401 and locked.get("/wall/list.json").status_code == 401
    signed, _ = client(table, public=False, signed_in=lambda scope: "booth")
    assert signed.get("/wall/list.json").status_code == 200


def test_phone_html_carries_the_link_and_when_it_expires():
    table = ShareLinks()
    link = table.phone_link(VISITOR, "/r/x.png", "https://booth.example")
    text = phone_html(link, now=link.expires_at - 3600)
    assert f'data-link="{link.url}"' in text and "data:image/png;base64," in text
    assert "60 minutes" in text and "UTC" in text


def test_wall_flag_is_off_by_default_and_read_from_the_flag_or_the_environment():
    from hidream_ui.config import from_args

    assert AppConfig().wall is False and from_args([], {}).wall is False
    assert from_args(["--wall"], {}).wall is True
    assert from_args([], {"HIDREAM_WALL": "1"}).wall is True


def test_bad_wall_size_is_named():
    with pytest.raises(ValueError, match="wall_size"):
        ShareLinks(wall_size=0)
