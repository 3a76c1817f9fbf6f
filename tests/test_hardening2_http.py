"""Hardening II, the HTTP side: login limits read what the login reads, request bodies are capped,
files named by URL are refused before gradio fetches them, and a new session costs little.

Every finding is reproduced over raw HTTP (httpx, as an attacker would) against the real app
(conftest.launch_app) on the offline tiny model.
"""

from __future__ import annotations

import gc
import json
import time
import tracemalloc
import uuid

import httpx
import pytest

from hidream_ui.server import gradio_internals
from hidream_ui.ui.layout import ASSETS_DIR

PASSWORD = "s3cret-pass"
EXAMPLE = ASSETS_DIR / "apple.png"
EDIT_ARGS = ["make it blue", "", 3.0, 1.5, 2, 0.3, True, "draft", 1, False, True, False]


@pytest.fixture(scope="module")
def private_app(launch_app, tmp_path_factory):
    users = tmp_path_factory.mktemp("hardening2_auth") / "users.txt"
    users.write_text(f"booth:{PASSWORD}\nvisitor:{PASSWORD}\n")
    # Behind a local proxy that it trusts (--forwarded-allow-ips): each login try below names an
    # address of its own in X-Forwarded-For, so only the per-user limit can stop them.
    return launch_app("hardening2_auth", auth_file=users, max_login_failures=3, forwarded_allow_ips=("127.0.0.1",))


@pytest.fixture(scope="module")
def public_app(launch_app):
    # These tests open hundreds of fresh sessions from one address to measure what a session costs and
    # which go first at the cap: the per-address limit on new sessions (its own test: test_booth_storage.py)
    # is lifted here.
    return launch_app("hardening2_public", max_queue=8, max_jobs_per_client=2, max_new_sessions=100_000)


def login(url: str, address: str, **body) -> httpx.Response:
    """One login try from `address` (the app trusts X-Forwarded-For from 127.0.0.1, its proxy: each
    try comes from an address of its own, so only the per-user limit can stop them)."""
    with httpx.Client(base_url=url, timeout=30, headers={"X-Forwarded-For": address}) as http:
        return http.post("/login", **body)


# ---------------------------------------------------------------------------------------------
# Login: the per-user limit reads the user name the login form reads
# ---------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_locked_user_stays_locked_whatever_the_body_looks_like(private_app):
    url = private_app["url"]
    for i in range(3):  # three wrong passwords, each from another address: the user is locked
        assert login(url, f"10.1.0.{i}", data={"username": "booth", "password": f"guess{i}"}).status_code == 400
    assert login(url, "10.1.0.9", data={"username": "booth", "password": PASSWORD}).status_code == 429

    right = f"password={PASSWORD}"
    tries = {
        # The guard once read the first user name; gradio's form parser reads the last.
        "duplicated user name": dict(
            content=f"username=nobody&username=booth&{right}",
            headers={"content-type": "application/x-www-form-urlencoded"},
        ),
        # The browser's own login form is multipart: it must be read, not skipped.
        "multipart": dict(files={"username": (None, "booth"), "password": (None, PASSWORD)}),
        # Bodies over 64 KB were passed on unread.
        "oversized": dict(
            content=f"pad={'x' * 70_000}&username=booth&{right}",
            headers={"content-type": "application/x-www-form-urlencoded"},
        ),
        "oversized, chunked": dict(
            content=iter([b"pad=" + b"x" * 70_000, f"&username=booth&{right}".encode()]),
            headers={"content-type": "application/x-www-form-urlencoded"},
        ),
        "a file in the form": dict(
            files={
                "username": (None, "booth"),
                "password": (None, PASSWORD),
                "avatar": ("a.png", b"\x89PNG" + b"0" * 100, "image/png"),
            }
        ),
    }
    answers = {name: login(url, f"10.2.0.{i}", **body) for i, (name, body) in enumerate(tries.items())}
    codes = {name: answer.status_code for name, answer in answers.items()}
    assert 200 not in codes.values(), codes  # the right password never gets in while the user is locked
    assert codes["duplicated user name"] == 429 and codes["multipart"] == 429, codes
    assert codes["oversized"] == 413 and codes["oversized, chunked"] == 413, codes
    assert "64 KB" in answers["oversized"].json()["detail"]
    assert codes["a file in the form"] in (400, 429), codes


def test_the_browsers_multipart_login_still_works_and_counts(private_app):
    url = private_app["url"]
    ok = login(url, "10.3.0.1", files={"username": (None, "visitor"), "password": (None, PASSWORD)})
    assert ok.status_code == 200, ok.text
    assert any(name.startswith("access-token") for name in ok.cookies)
    # Wrong passwords in multipart count for the user just as urlencoded ones do.
    codes = [
        login(url, f"10.3.1.{i}", files={"username": (None, "visitor"), "password": (None, f"g{i}")}).status_code
        for i in range(4)
    ]
    assert codes == [400, 400, 400, 429], codes


def test_oversized_login_bodies_count_against_their_address(private_app):
    url = private_app["url"]
    big = dict(content="pad=" + "x" * 70_000, headers={"content-type": "application/x-www-form-urlencoded"})
    codes = [login(url, "10.4.0.1", **big).status_code for _ in range(4)]
    assert codes == [413, 413, 413, 429], codes


# ---------------------------------------------------------------------------------------------
# Request bodies other than uploads are capped
# ---------------------------------------------------------------------------------------------


def big_join(size: int) -> bytes:
    return json.dumps(
        {"data": ["x" * size], "fn_index": 0, "session_hash": "big-body", "event_id": None, "trigger_id": None}
    ).encode()


@pytest.mark.slow
def test_a_2mb_json_body_to_the_queue_is_refused_with_413(public_app):
    body = big_join(2 * 1024 * 1024)
    with httpx.Client(base_url=public_app["url"], timeout=30) as http:
        declared = http.post("/gradio_api/queue/join", content=body, headers={"content-type": "application/json"})
        assert declared.status_code == 413, declared.text
        assert "larger than 1 MB" in declared.json()["detail"]
        # Without a declared length (chunked), the body is cut while it streams.
        chunks = iter([body[i : i + 65536] for i in range(0, len(body), 65536)])
        streamed = http.post("/gradio_api/queue/join", content=chunks, headers={"content-type": "application/json"})
        assert streamed.status_code == 413, streamed.text
        for route in ("/gradio_api/call/status", "/gradio_api/run/status", "/gradio_api/cancel"):
            assert http.post(route, content=body, headers={"content-type": "application/json"}).status_code == 413
        # The app still answers, and small bodies pass.
        status = http.post("/gradio_api/run/status", json={"data": [], "session_hash": "after-big"})
        assert status.status_code == 200, status.text


# ---------------------------------------------------------------------------------------------
# Files named by URL are refused before gradio fetches anything
# ---------------------------------------------------------------------------------------------


def tree(folder) -> set[str]:
    return {str(path.relative_to(folder)) for path in folder.rglob("*")}


@pytest.mark.parametrize("route", ["/gradio_api/queue/join", "/gradio_api/call/edit"])
def test_a_file_named_by_url_is_refused_and_leaves_nothing_behind(public_app, route):
    folder = public_app["demo"].hidream_services.cache_folder
    before = tree(folder)
    url = "http://remote.invalid/picture.png"
    remote = {"path": url, "url": url, "orig_name": "picture.png", "meta": {"_type": "gradio.FileData"}}
    edit_index = next(i for i, fn in public_app["demo"].fns.items() if fn.api_name == "edit")
    body = {"data": [remote, *EDIT_ARGS], "session_hash": "remote-file", "event_id": None, "trigger_id": None}
    if route.endswith("join"):
        body["fn_index"] = edit_index
    with httpx.Client(base_url=public_app["url"], timeout=30) as http:
        answer = http.post(route, json=body)
        assert answer.status_code == 400, answer.text
        assert "cannot be named by URL" in answer.json()["detail"] and url in answer.json()["detail"]
        # Nested (an editor's layers, a gallery) and https alike.
        nested = dict(
            body, data=[{"background": None, "layers": [dict(remote, path="https://x.invalid/a.png")]}, *EDIT_ARGS]
        )
        assert http.post(route, json=nested).status_code == 400
    assert tree(folder) - before == set()  # no download folder (gradio made one per try)


def test_a_browser_style_file_whose_url_points_at_the_app_still_works(public_app):
    """The browser sends an uploaded file's `url` as an absolute http URL of the app itself; only
    a URL in `path` makes gradio fetch, so only that is refused."""
    with httpx.Client(base_url=public_app["url"], timeout=60) as http:
        uploaded = http.post("/gradio_api/upload", files={"files": ("p.png", _png(), "image/png")})
        assert uploaded.status_code == 200, uploaded.text
        path = uploaded.json()[0]
        value = {
            "path": path,
            "url": f"{public_app['url']}gradio_api/file={path}",
            "orig_name": "p.png",
            "meta": {"_type": "gradio.FileData"},
        }
        posted = http.post("/gradio_api/call/edit", json={"data": [value, *EDIT_ARGS], "session_hash": "browser"})
        assert posted.status_code == 200, posted.text
        text = http.get(f"/gradio_api/call/edit/{posted.json()['event_id']}").text
    assert "event: complete" in text, text[-500:]


def _png() -> bytes:
    import io

    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (64, 64), (200, 30, 30)).save(buffer, format="PNG")
    return buffer.getvalue()


# ---------------------------------------------------------------------------------------------
# Sessions cost little, and idle ones go
# ---------------------------------------------------------------------------------------------


def test_a_flood_of_fresh_sessions_evicts_its_own_kind_not_a_session_with_state(public_app):
    """Gradio keeps at most `capacity` sessions and pushes the oldest out: a flood of fresh ones
    (each costs a request) must not push out a visitor's history."""
    demo = public_app["demo"]
    holder = demo.state_holder
    edit_index = next(i for i, fn in demo.fns.items() if fn.api_name == "edit")
    with httpx.Client(base_url=public_app["url"], timeout=60) as http:
        # A session that did work (an edit; issue 58: only a job makes a session worth keeping) ...
        path = http.post("/gradio_api/upload", files={"files": ("apple.png", EXAMPLE.read_bytes(), "image/png")})
        image = {"path": path.json()[0], "meta": {"_type": "gradio.FileData"}, "orig_name": "apple.png"}
        joined = http.post(
            "/gradio_api/queue/join",
            json={"data": [image, *EDIT_ARGS], "fn_index": edit_index, "session_hash": "honest"},
        )
        assert joined.status_code == 200, joined.text
        with http.stream("GET", "/gradio_api/queue/data", params={"session_hash": "honest"}) as stream:
            finished = next(line for line in stream.iter_lines() if "process_completed" in line)
        assert '"success": true' in finished or '"success":true' in finished, finished
        assert holder.session_data["honest"].worth == 2
        capacity = holder.capacity
        holder.capacity = len(holder.session_data) + 1  # full after one more: each new session then pushes one out
        try:  # ... outlives a flood of fresh sessions, although it is the oldest left after it
            for _ in range(holder.capacity + 5):
                fresh = http.post("/gradio_api/run/status", json={"data": [], "session_hash": uuid.uuid4().hex})
                assert fresh.status_code == 200, fresh.text
            assert len(holder.session_data) <= holder.capacity
            assert "honest" in holder.session_data
            # Page loads and History refreshes write widgets and State values for their session, as every
            # real page does: a flood of them must not push out a session that did work either.
            page_load = next(i for i, fn in demo.fns.items() if getattr(fn.fn, "__name__", "") == "page_load")
            for _ in range(holder.capacity + 5):
                loaded = http.post(
                    "/gradio_api/run/predict",
                    json={"fn_index": page_load, "data": [], "session_hash": uuid.uuid4().hex},
                )
                assert loaded.status_code == 200, loaded.text
            assert len(holder.session_data) <= holder.capacity
            assert "honest" in holder.session_data
        finally:
            holder.capacity = capacity


MAX_SESSION_BYTES = 20 * 1024


def bytes_per_session(demo, call, count: int) -> float:
    """Memory the server keeps per new session (traced in this process, where the app runs),
    after `count` calls each with a fresh session; checks the sessions really exist."""
    for _ in range(10):
        call(uuid.uuid4().hex)  # first-call caches of the route, the handler and httpx
    sessions = len(demo.state_holder.session_data)
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.take_snapshot()
        for _ in range(count):
            call(uuid.uuid4().hex)
        gc.collect()
        after = tracemalloc.take_snapshot()
    finally:
        tracemalloc.stop()
    assert len(demo.state_holder.session_data) >= sessions + count  # gradio holds every one of them
    grown = sum(stat.size_diff for stat in after.compare_to(before, "filename"))
    return grown / count


@pytest.mark.slow
def test_a_fresh_session_calling_status_costs_under_20_kb(public_app):
    assert gradio_internals.lean_sessions(public_app["demo"])  # made lean at start-up (True: already done)
    with httpx.Client(base_url=public_app["url"], timeout=30) as http:

        def status(session: str) -> None:
            answer = http.post("/gradio_api/run/status", json={"data": [], "session_hash": session})
            assert answer.status_code == 200, answer.text

        per_session = bytes_per_session(public_app["demo"], status, 150)
    assert per_session < MAX_SESSION_BYTES, f"{per_session / 1024:.1f} KB per session"


@pytest.mark.slow
def test_a_fresh_session_joining_the_queue_costs_under_20_kb(public_app):
    """A queued event that ends at once (an edit with no image: a clear error, no job)."""
    edit_index = next(i for i, fn in public_app["demo"].fns.items() if fn.api_name == "edit")
    with httpx.Client(base_url=public_app["url"], timeout=30) as http:

        def queued(session: str) -> None:
            joined = http.post(
                "/gradio_api/queue/join",
                json={
                    "data": [None, *EDIT_ARGS],
                    "fn_index": edit_index,
                    "session_hash": session,
                    "event_id": None,
                    "trigger_id": None,
                },
            )
            assert joined.status_code == 200, joined.text
            with http.stream("GET", "/gradio_api/queue/data", params={"session_hash": session}) as stream:
                for line in stream.iter_lines():
                    if "process_completed" in line:
                        break

        per_session = bytes_per_session(public_app["demo"], queued, 60)
    assert per_session < MAX_SESSION_BYTES, f"{per_session / 1024:.1f} KB per session"


@pytest.mark.slow
def test_idle_sessions_expire(public_app):
    demo = public_app["demo"]
    with httpx.Client(base_url=public_app["url"], timeout=30) as http:
        assert http.post("/gradio_api/run/status", json={"data": [], "session_hash": "idle"}).status_code == 200
    assert "idle" in demo.state_holder.session_data
    assert gradio_internals.expire_sessions(demo, 3600) == 0  # nobody has been idle for an hour
    # An hour later (the clock moved on), every idle session is gone.
    assert gradio_internals.expire_sessions(demo, 3600, now=time.time() + 3601) > 0
    assert "idle" not in demo.state_holder.session_data and gradio_internals.session_count(demo) == 0
    with httpx.Client(base_url=public_app["url"], timeout=30) as http:  # and coming back just works
        assert http.post("/gradio_api/run/status", json={"data": [], "session_hash": "idle"}).status_code == 200
        # Gradio's deep-link route renders a session's widgets: the lean session renders them on demand.
        assert http.get("/gradio_api/deep_link", params={"session_hash": "idle"}).status_code == 200


def test_unknown_gradio_session_internals_degrade_to_doing_nothing():
    class Unknown:
        state_holder = object()

    assert gradio_internals.lean_sessions(Unknown()) is False
    assert gradio_internals.session_count(Unknown()) == 0
    assert gradio_internals.expire_sessions(Unknown(), 0) == 0


@pytest.mark.slow
def test_the_body_cap_and_the_zip_budget_follow_their_flags(launch_app):
    """--max-body-kb reaches the guard and --max-zip-mb the batch's zip budget (the README lists each
    limit with its flag): a 300 KB body passes the default cap and is refused under 256 KB."""
    from hidream_ui.config import ConfigError, from_args

    app = launch_app("hardening2_flags", max_body_kb=256, max_zip_mb=3)
    body = big_join(300 * 1024)
    with httpx.Client(base_url=app["url"], timeout=30) as http:
        answer = http.post("/gradio_api/queue/join", content=body, headers={"content-type": "application/json"})
        assert answer.status_code == 413 and "larger than 256 KB" in answer.json()["detail"], answer.text
    batch = next(f for f in app["demo"].fns.values() if f.api_name == "batch_edit").fn.__self__  # the BatchTab
    assert batch.zip_limits.max_total_bytes == 3 * 2**20 and batch.zip_limits.max_member_bytes == 3 * 2**20
    config = from_args(["--max-zip-mb", "600", "--max-body-kb", "64", "--session-idle-expiry", "90"], environ={})
    assert (config.max_zip_mb, config.max_body_kb, config.session_idle_expiry) == (600, 64, 90)
    with pytest.raises(ConfigError, match="session_idle_expiry=0"):
        from_args(["--session-idle-expiry", "0"], environ={})
