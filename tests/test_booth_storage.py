"""Issue 58, findings 1-3: storage that ages out per client instead of refusing, and sessions that
did work outrank floods.

Over raw HTTP against the launched app (conftest.launch_app), as a booth visitor, a booth kiosk and
an attacker would: clients are source addresses on the loopback (127.0.x.y: the app keys a client by
the address that sent the request). Each test fails on the code before issue 58: there the results
flood filled the cache and others got 503, the kiosk was refused from its quota on, and a flood of
fresh sessions calling the History refresh pushed out a visitor who had edited.
"""

from __future__ import annotations

import json

import httpx
import pytest
from helpers import random_picture, raw_edit, wait_for

from hidream_ui.server import gradio_internals


def client(app, address: str, timeout: float = 120) -> httpx.Client:
    return httpx.Client(base_url=app["url"], timeout=timeout, transport=httpx.HTTPTransport(local_address=address))


def picture(seed: int) -> bytes:
    import io

    buffer = io.BytesIO()
    random_picture(seed, (64, 48)).save(buffer, format="PNG")
    return buffer.getvalue()


def upload(http: httpx.Client, name: str, data: bytes) -> httpx.Response:
    return http.post("/gradio_api/upload", files={"files": (name, data, "image/png")})


def edit(http: httpx.Client, path: str, session: str, steps: int = 2, seed: int = 1) -> dict:
    return raw_edit(http, path, "p.png", session, seed=seed, steps=steps)


def cache_count(app) -> int:
    """Files of this app in gradio's cache: what --cache-max-files counts (the examples' copies excluded)."""
    demo = app["demo"]
    return len(gradio_internals.app_cache_files(demo, demo.hidream_services.cache_folder))


def within_cap(app, cap: int) -> int:
    """The cache's file count once the janitor has had its round (it is woken by every charge past a cap)."""
    return (
        wait_for(lambda: (n := cache_count(app)) <= cap and n + 1, what=f"the cache within {cap} files", timeout=20) - 1
    )


def visitor_edits(app, address: str, seed: int) -> None:
    """A visitor's first upload and edit, from an address of its own: both succeed."""
    with client(app, address) as http:
        answer = upload(http, f"visitor{seed}.png", picture(seed))
        assert answer.status_code == 200, answer.text
        done = edit(http, answer.json()[0], session=f"visitor-{address}-{seed}")
    assert done["event"] == "complete", done


@pytest.fixture(scope="module")
def flood_app(launch_app):
    # The finding's set-up: a cache of 60 files, a live preview at every step.
    return launch_app("booth-flood", cache_max_files=60, preview_every=1, max_jobs_per_client=2)


@pytest.mark.slow
def test_a_results_flood_from_fresh_sessions_stays_within_the_cap_and_locks_nobody_out(flood_app):
    """Finding 1 (HIGH): one upload, then 14 edits of 8 steps each from a new session: every result and
    preview is charged to the client and ages out within its quota, and another address's first upload
    and edit succeed (the cache went to 134 files against 60, and others got 503 for ten minutes)."""
    counts = []
    with client(flood_app, "127.0.3.1") as attacker:
        answer = upload(attacker, "flood.png", picture(1))
        assert answer.status_code == 200, answer.text
        path = answer.json()[0]
        for i in range(14):
            done = edit(attacker, path, session=f"flood-{i}", steps=8, seed=i)
            assert done["event"] in ("complete", "error"), done
            counts.append(within_cap(flood_app, 60))
    assert max(counts) <= 60, counts
    visitor_edits(flood_app, "127.0.3.2", seed=2)
    assert within_cap(flood_app, 60) <= 60


@pytest.fixture(scope="module")
def kiosk_app(launch_app):
    # A kiosk: one address for every visitor. Small caps so that the finding shows in a few edits.
    return launch_app("booth-kiosk", cache_max_files=40, client_quota_files=12, preview_every=0)


@pytest.mark.slow
def test_a_kiosk_editing_picture_after_picture_is_never_refused(kiosk_app):
    """Finding 2 (HIGH for a booth): one address uploads a new picture and edits it, again and again,
    past its quota of 12 files: every upload and edit succeeds, its oldest files age out, the cache
    stays within its caps, and another address's first upload and edit succeed along the way (the
    upload past the quota got 429 "try again in 3600 s")."""
    storage = kiosk_app["demo"].hidream_services.janitor.storage
    with client(kiosk_app, "127.0.4.1") as kiosk:
        for i in range(16):
            answer = upload(kiosk, f"visitor{i}.png", picture(100 + i))
            assert answer.status_code == 200, (i, answer.text)
            done = edit(kiosk, answer.json()[0], session=f"kiosk-page-{i // 4}", seed=i)
            assert done["event"] == "complete", (i, done)
            assert within_cap(kiosk_app, 40) <= 40
            if i == 8:
                visitor_edits(kiosk_app, "127.0.4.2", seed=3)
        wait_for(lambda: storage.usage("address:127.0.4.1")[0] <= 12, what="the kiosk within its quota", timeout=20)


def test_a_picture_that_aged_out_says_so(kiosk_app):
    """What a page still shows may have aged out: the app says "expired, upload it again", and not
    that the file is not an upload of this app (nor an error of its own)."""
    janitor = kiosk_app["demo"].hidream_services.janitor
    with client(kiosk_app, "127.0.4.3") as http:
        first = upload(http, "first.png", picture(300)).json()[0]
        for i in range(14):  # past the quota of 12: `first`, the least recently used, ages out
            assert upload(http, f"next{i}.png", picture(301 + i)).status_code == 200
        janitor.run_once()
        assert janitor.storage.expired(first)
        done = edit(http, first, session="expired-page")
    assert done["event"] == "error" and "expired" in json.dumps(done["data"]), done
    assert "upload it again" in json.dumps(done["data"])


# ---------------------------------------------------------------------------------------------
# Finding 3: sessions that did work outrank floods; new sessions per address are limited
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def session_app(launch_app):
    return launch_app("booth-sessions")


@pytest.fixture(scope="module")
def limited_app(launch_app):
    return launch_app("booth-new-sessions", max_new_sessions=30)


def _history_refresh(demo):
    """The History refresh's event, as a raw client finds it (by fn_index)."""
    for index, fn in demo.fns.items():
        if getattr(getattr(fn, "fn", None), "__name__", "") == "refresh_history":
            return index, fn
    raise AssertionError("no History refresh event")


def refresh(http: httpx.Client, demo, session: str, entries: list) -> int:
    """One History refresh by fn_index from `session` (a fresh session for a flood); its HTTP status."""
    index, fn = _history_refresh(demo)
    body = {"fn_index": index, "data": [entries] + [None] * (len(fn.inputs) - 1), "session_hash": session}
    if not fn.queue:
        return http.post("/gradio_api/run/predict", json=body).status_code
    joined = http.post("/gradio_api/queue/join", json=body)
    if joined.status_code != 200:
        return joined.status_code
    with http.stream("GET", "/gradio_api/queue/data", params={"session_hash": session}) as stream:
        for line in stream.iter_lines():
            if '"process_completed"' in line:
                break
    return joined.status_code


@pytest.mark.slow
def test_a_flood_of_fresh_sessions_evicts_itself_before_a_visitor_who_edited(session_app):
    """Finding 3 (MEDIUM): at gradio's session cap the flood's sessions go first, however much State
    its History refreshes wrote: the visitor's session, which ran an edit, keeps its state. The cap is
    lowered to 40 here (gradio's is 10,000) so that the flood takes seconds, from several addresses so
    that the new-session limit does not stop it first."""
    demo = session_app["demo"]
    holder = demo.state_holder
    capacity = holder.capacity
    holder.capacity = 40
    try:
        with client(session_app, "127.0.5.1") as visitor:
            path = upload(visitor, "mine.png", picture(7)).json()[0]
            assert edit(visitor, path, session="visitor")["event"] == "complete"
        assert "visitor" in holder.session_data
        entries = [{"params": {"instruction": "make it blue", "seed": 1}}]
        for burst in range(3):
            with client(session_app, f"127.0.5.{10 + burst}") as flood:
                codes = [refresh(flood, demo, f"flood-{burst}-{i}", entries) for i in range(25)]
            assert codes == [200] * 25, codes
        assert len(holder.session_data) <= 40
        assert "visitor" in holder.session_data, "the visitor who edited was evicted by the flood"
        assert holder.session_data["visitor"].state_data  # its result and history are still there
    finally:
        holder.capacity = capacity


@pytest.mark.slow
def test_new_sessions_per_address_are_limited_and_known_sessions_are_not(limited_app):
    demo = limited_app["demo"]
    with client(limited_app, "127.0.6.1") as flood, client(limited_app, "127.0.6.2") as other:
        codes = [refresh(flood, demo, f"burst-{i}", []) for i in range(34)]
        assert codes[:30] == [200] * 30 and set(codes[30:]) == {429}, codes
        assert refresh(flood, demo, "burst-0", []) == 200  # a session it already has goes on
        assert refresh(other, demo, "elsewhere", []) == 200  # another address is not affected
        answer = flood.post("/gradio_api/queue/join", json={"fn_index": 0, "data": [], "session_hash": "one-more"})
    assert answer.status_code == 429 and "new sessions" in answer.json()["detail"]
    assert int(answer.headers["retry-after"]) >= 1


def test_the_storage_rule_in_the_docs_states_the_codes_figures():
    """docs/security.md states the rule for a booth operator with its figures: each is the code's."""
    import re
    from pathlib import Path

    from hidream_ui.cli.app import JANITOR_INTERVAL
    from hidream_ui.config import AppConfig
    from hidream_ui.server.storage_limits import HEADROOM, LATEST_HOLD
    from hidream_ui.server.upload_gate import EXPIRED

    text = (Path(__file__).resolve().parents[1] / "docs" / "security.md").read_text()
    # The storage bullet and the sessions bullet after it.
    after = text.split("**Storage ages out per client; nobody is locked out.**", 1)[1]
    rule = " ".join(" ".join(after.split("\n- ")[:2]).split())
    config = AppConfig()
    for flag, value in (
        ("client-quota-files", config.client_quota_files),
        ("client-quota-mb", config.client_quota_mb),
        ("cache-max-files", config.cache_max_files),
        ("cache-max-mb", config.cache_max_mb),
        ("max-new-sessions", config.max_new_sessions),
    ):
        assert f"`--{flag}` ({value})" in rule, flag
    assert f"`--cache-max-age` ({config.cache_max_age} s)" in rule
    assert f"for {LATEST_HOLD / 60:.0f} minutes" in rule
    assert f"every {JANITOR_INTERVAL:.0f} s" in rule
    assert f"down to {HEADROOM:.0%} below each cap".replace("%", " %") in rule
    assert f'"{EXPIRED.split(":")[0]}' in rule
    assert re.search(r"never another visitor's and never with a refusal", rule)


def test_a_body_of_55000_history_entries_is_refused_before_it_is_parsed(session_app):
    """Finding 4 (MEDIUM): the History refresh of 55,000 `{"params": {}}` entries (859 KB, under
    --max-body-kb) cost 2.8 CPU-s on the server; four clients repeating it pushed /status to 8.2 s.
    The guard counts the body's objects before anything parses it: refused at once, for almost nothing."""
    import time

    demo = session_app["demo"]
    index, fn = _history_refresh(demo)
    flood = [{"params": {}}] * 55_000
    body = json.dumps(
        {"fn_index": index, "data": [flood] + [None] * (len(fn.inputs) - 1), "session_hash": "history-cpu"},
        separators=(",", ":"),
    ).encode()
    assert len(body) < session_app["config"].max_body_kb * 1024  # under the body limit: the finding's request
    with client(session_app, "127.0.7.1") as http:
        http.get("/gradio_api/info")  # the connection is made before the clock starts
        started = time.process_time()  # the server runs in this process: its CPU time and the client's
        answer = http.post("/gradio_api/queue/join", content=body, headers={"content-type": "application/json"})
        spent = time.process_time() - started
        assert answer.status_code == 413 and "objects and lists" in answer.json()["detail"], answer.text
        small = {"fn_index": index, "data": [[]] + [None] * (len(fn.inputs) - 1), "session_hash": "history-cpu"}
        assert http.post("/gradio_api/queue/join", json=small).status_code == 200  # a real History passes
    assert spent < 0.2, f"{spent:.2f} CPU-s for one refused request"


def test_the_gate_says_expired_only_for_a_file_that_aged_out():
    """Only a path the storage removed as a client's file is "expired"; any other unknown path keeps the
    one generic refusal (it says nothing about whether a file exists)."""
    import pickle

    from hidream_ui.edits import RequestError
    from hidream_ui.server.upload_gate import EXPIRED, NOT_UPLOADED, PictureExpired, UploadGate

    gate = UploadGate(lambda path: False, expired=lambda path: path == "/cache/h1/old.png")
    with pytest.raises(PictureExpired) as expired:
        gate.path({"path": "/cache/h1/old.png", "orig_name": "old.png"}, "image")
    assert str(expired.value) == EXPIRED and expired.value.field == "image"
    assert str(pickle.loads(pickle.dumps(expired.value))) == EXPIRED  # it crosses a process as itself
    with pytest.raises(RequestError) as other:
        gate.path({"path": "/cache/h2/never.png", "orig_name": "never.png"}, "image")
    assert not isinstance(other.value, PictureExpired) and other.value.expected == NOT_UPLOADED
