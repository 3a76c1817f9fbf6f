"""Issue 58, History: the refresh looks at 30 entries whatever the browser sends and runs on a lane
of its own; an entry names its result by an opaque id signed for one browser's secret, so an entry
replayed in another browser opens nothing, and the browser's storage holds no server path.

Reproduced over raw HTTP (httpx, the queue's own routes, as an attacker would) against the real
app (conftest.launch_app) on the offline tiny model. The History's events are private (no API
name): they are called by fn_index, found in the app object by handler name, their inputs filled
by component (the BrowserStates by storage key).
"""

from __future__ import annotations

import json
import os
import secrets
import time
from collections.abc import Mapping

import httpx
import pytest

from hidream_ui.server.served_results import ServedResults
from hidream_ui.ui import history_entries

EXAMPLE_ARGS = ["make it blue", "", 3.0, 1.5, 2, 0.3, True, "draft", 5, False, True, False]
STORAGE_KEY = "hidream-ui-history"  # history_tab.STORAGE_KEY: the browser's History
SECRET_KEY = "hidream-ui-history-secret"  # history_tab.SECRET_KEY: the browser's secret


@pytest.fixture(scope="module")
def app(launch_app):
    return launch_app("history_security", max_queue=8, max_jobs_per_client=2)


def fn_index(demo, name: str) -> int:
    return next(i for i, fn in demo.fns.items() if getattr(fn.fn, "__name__", "") == name)


def inputs(demo, index: int, **values) -> list:
    """The `data` list of event `index`: each input by its storage key or elem_id (None otherwise:
    a gr.State input is read from the session, whatever the client sends)."""
    keyed = {STORAGE_KEY: values.get("stored"), SECRET_KEY: values.get("secret")}
    return [
        keyed.get(getattr(block, "storage_key", None), values.get(getattr(block, "elem_id", None) or ""))
        for block in demo.fns[index].inputs
    ]


def queued(url: str, index: int, data: list, session: str) -> dict:
    """Joins the queue as the browser does and returns the event's `process_completed` message."""
    with httpx.Client(base_url=url, timeout=120) as http:
        joined = http.post(
            "/gradio_api/queue/join",
            json={"data": data, "fn_index": index, "session_hash": session, "event_id": None, "trigger_id": None},
        )
        assert joined.status_code == 200, joined.text
        event_id = joined.json()["event_id"]
        with http.stream("GET", "/gradio_api/queue/data", params={"session_hash": session}) as stream:
            for line in stream.iter_lines():
                if line.startswith("data:"):
                    message = json.loads(line[5:])
                    if message.get("msg") == "process_completed" and message.get("event_id") == event_id:
                        return message
    raise AssertionError("the event never completed")


def edited_history(app, session: str, secret: str) -> tuple[list, dict]:
    """One edit in `session`, then what the browser does next (add_history): returns the list the
    browser stores and the whole add_history message."""
    demo, url = app["demo"], app["url"]
    with httpx.Client(base_url=url, timeout=60) as http:
        uploaded = http.post("/gradio_api/upload", files={"files": ("apple.png", _png(), "image/png")}).json()[0]
    image = {"path": uploaded, "meta": {"_type": "gradio.FileData"}, "orig_name": "apple.png"}
    edit = next(i for i, fn in demo.fns.items() if fn.api_name == "edit")
    done = queued(url, edit, [image, *edit_args(demo, edit)], session)
    assert done["success"], done
    add = fn_index(demo, "add_history")
    message = queued(url, add, inputs(demo, add, stored=[], secret=secret), session)
    assert message["success"], message
    return message["output"]["data"][0], message


def edit_args(demo, index: int) -> list:
    """The edit's settings after its image, with None for inputs added later (the mask)."""
    return [*EXAMPLE_ARGS, *([None] * (len(demo.fns[index].inputs) - 1 - len(EXAMPLE_ARGS)))]


def _png() -> bytes:
    import io

    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (64, 48), (200, 30, 30)).save(buffer, format="PNG")
    return buffer.getvalue()


def opens_result(app, entries: list, secret: str, session: str) -> dict:
    """Another page (`session`) holding `entries` and `secret`: refresh, then "Edit again" on the
    first entry. Returns edit_again's message."""
    demo, url = app["demo"], app["url"]
    refresh = fn_index(demo, "refresh_history")
    shown = queued(url, refresh, inputs(demo, refresh, stored=entries, secret=secret), session)
    assert shown["success"], shown
    again = fn_index(demo, "edit_again")
    return queued(url, again, inputs(demo, again, **{"hui-history-picker": 0}), session)


# ---------------------------------------------------------------------------------------------
# (a) The refresh looks at 30 entries, on a lane of its own
# ---------------------------------------------------------------------------------------------


class CountingParams(history_entries.EditParams):
    validated = 0

    @classmethod
    def from_dict(cls, d):
        CountingParams.validated += 1
        return super().from_dict(d)


def test_a_refresh_of_2000_entries_validates_30_and_costs_little(app, monkeypatch):
    """Issue 58 finding 4: 55,000 `{"params": {}}` entries (859 KB, under --max-body-kb) were all
    validated before the 30-entry cap applied (2.8 CPU-s per request outside the queue, measured
    there with the rest of the request). A body that large is now refused by the guard before it is
    parsed (test_booth_storage.py); 2,000 entries pass it, and the handler looks at 30."""
    from hidream_ui.ui import history_tab as handlers

    spent = []
    check = handlers.check_entries

    def timed(*args, **kwargs):
        started = time.thread_time()
        try:
            return check(*args, **kwargs)
        finally:
            spent.append(time.thread_time() - started)

    monkeypatch.setattr(handlers, "check_entries", timed)
    monkeypatch.setattr(history_entries, "EditParams", CountingParams)
    CountingParams.validated = 0
    demo = app["demo"]
    refresh = fn_index(demo, "refresh_history")
    flood = [{"params": {}}] * 2_000
    message = queued(app["url"], refresh, inputs(demo, refresh, stored=flood, secret=None), "flooder")
    assert message["success"], message
    assert "No results yet" in json.dumps(message["output"]["data"])
    # Measured here with 55,000 entries: 0.26 CPU-s before (every entry validated), under 1 ms after.
    assert sum(spent) < 0.05, f"{sum(spent):.3f} CPU-s checking the entries"
    assert CountingParams.validated <= history_entries.MAX_ENTRIES, CountingParams.validated


class CountingMapping(Mapping):
    """An entry's params of 200,000 keys that counts how often it is read."""

    def __init__(self, **extra):
        self.items_ = {**{f"k{i}": i for i in range(200_000)}, **extra}
        self.reads = 0

    def __getitem__(self, key):
        self.reads += 1
        return self.items_[key]

    def __iter__(self):
        for key in self.items_:
            self.reads += 1
            yield key

    def __len__(self):
        return len(self.items_)


def test_each_entry_is_looked_at_only_as_far_as_its_settings():
    """An entry's params mapping can hold anything: only the keys the validator reads are read, and
    a container there is not repr'd into an error."""
    params = CountingMapping(instruction="red")
    [checked] = history_entries.check_entries([{"params": params}], lambda *_: None)
    assert checked.params.instruction == "red" and params.reads < 50, params.reads
    entries = [
        {"params": {"instruction": ["x"] * 2_000_000}},
        {"params": {"instruction": "red", "seed": {"x": "y" * 10_000_000}}},
        {"params": {"instruction": "x" * 2_000_000}},
    ]
    started = time.thread_time()
    assert history_entries.check_entries(entries, lambda *_: None) == []
    assert time.thread_time() - started < 0.02, f"{time.thread_time() - started:.3f} CPU-s"


def test_the_cap_comes_before_any_validation(monkeypatch):
    monkeypatch.setattr(history_entries, "EditParams", CountingParams)
    CountingParams.validated = 0
    history_entries.check_entries([{"params": {}}] * 5_000, lambda *_: None)
    assert CountingParams.validated == history_entries.MAX_ENTRIES
    assert len(history_entries.added([{"params": {}}] * 5_000, None)) == history_entries.MAX_ENTRIES


def test_the_refresh_runs_on_a_small_lane_of_its_own_never_beside_the_queue(app):
    from hidream_ui.server.lanes import ALL_LANES, HISTORY_CONCURRENCY, HISTORY_GROUP

    demo = app["demo"]
    refreshes = [fn for fn in demo.fns.values() if getattr(fn.fn, "__name__", "") == "refresh_history"]
    assert len(refreshes) == 2  # page load and tab opened
    for fn in refreshes:
        assert fn.queue and fn.concurrency_id == HISTORY_GROUP and fn.concurrency_limit == HISTORY_CONCURRENCY
    assert HISTORY_GROUP in ALL_LANES  # admission limits apply (cli/app.py hands ALL_LANES to admit_jobs)
    with httpx.Client(base_url=app["url"], timeout=30) as http:
        index = fn_index(demo, "refresh_history")
        direct = http.post(
            "/gradio_api/run/predict",
            json={"fn_index": index, "session_hash": "direct", "data": inputs(demo, index, stored=[])},
        )
    assert direct.status_code == 404, direct.text  # gradio's "join the queue"


# ---------------------------------------------------------------------------------------------
# (b) An entry opens its result only in the browser it was signed for
# ---------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_an_entry_replayed_in_another_browser_does_not_open_the_result(app):
    """Issue 58 finding 5: the signature covered the path only, so browser B, sent browser A's
    entry, opened A's full-size result with "Edit again"."""
    secret_a, secret_b = (secrets.token_urlsafe(32) for _ in range(2))
    entries, _ = edited_history(app, "browser-a", secret_a)
    assert len(entries) == 1
    # A itself, after a reload (a new session, the same storage): its result opens.
    home = opens_result(app, entries, secret_a, "browser-a-reloaded")
    assert home["success"], home
    assert entries[0]["name"] and entries[0]["name"] in json.dumps(home["output"]["data"][0])  # the result
    # Browser B (its own secret) replays A's entry: nothing opens, and it says so.
    stolen = opens_result(app, entries, secret_b, "browser-b")
    assert not stolen["success"], stolen
    assert "no longer on this server" in json.dumps(stolen["output"]), stolen


# ---------------------------------------------------------------------------------------------
# (c) The browser's storage holds no server path
# ---------------------------------------------------------------------------------------------


def strings(value):
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from strings(item)
    elif isinstance(value, list):
        for item in value:
            yield from strings(item)


def test_the_browsers_history_storage_holds_no_server_path(app):
    output_dir = os.path.realpath(app["config"].output_dir)
    entries, message = edited_history(app, "browser-c", secrets.token_urlsafe(32))
    assert entries and [text for text in strings(entries) if os.path.isabs(text)] == []
    assert output_dir not in json.dumps(message)  # nor anything else History sends the page
    # The refresh's answer neither (its checked list stays server-side).
    demo = app["demo"]
    refresh = fn_index(demo, "refresh_history")
    shown = queued(app["url"], refresh, inputs(demo, refresh, stored=entries, secret=None), "browser-c")
    assert output_dir not in json.dumps(shown)


def test_served_results_bound_what_a_browser_sends_before_hashing(tmp_path):
    served = ServedResults()
    path = tmp_path / "r.png"
    path.write_bytes(b"png")
    served.add(path)
    result = served.result_id(path)
    secret = secrets.token_urlsafe(32)
    ticket = served.ticket(result, secret)
    assert served.stored(result, ticket, secret) == str(path)
    assert str(tmp_path) not in result and len(result) == ServedResults.ID_CHARS
    for bad in (
        (result * 50_000, ticket, secret),
        (result, ticket * 2, secret),
        (result, ticket, "x" * 10**6),
        (result, ticket, ""),
        (str(path), ticket, secret),
        (None, ticket, secret),
        (result, "é" * 64, secret),
        (result, "\ud800" * 64, secret),
    ):
        assert served.stored(*bad) is None
