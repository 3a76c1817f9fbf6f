"""The pieces behind the hardening, without a server: jobs and tokens, the login throttle, the
upload gate, served results, cache pruning, path redaction, text validation, History thumbnails."""

from __future__ import annotations

import time
import types
from pathlib import Path

import pytest
from PIL import Image

from hidream_ui.edits import EditParams, RequestError
from hidream_ui.engine.jobs import CancelToken, JobRegistry
from hidream_ui.server.guard import LoginThrottle
from hidream_ui.server.served_results import ServedResults
from hidream_ui.server.upload_gate import NOT_UPLOADED, UploadGate
from hidream_ui.ui.services import redact_paths

# ---------------------------------------------------------------------------------------------
# Jobs
# ---------------------------------------------------------------------------------------------


def test_a_cancel_touches_only_the_named_session_and_event():
    jobs = JobRegistry()
    with (
        jobs.start("edit", "alice", "e1") as a1,
        jobs.start("batch", "alice", "e2") as a2,
        jobs.start("edit", "bob", "e3") as b,
    ):
        assert jobs.cancel(None) == 0  # an anonymous caller cancels nothing
        assert jobs.cancel("alice", "e2") == 1
        assert a2.token.cancelled and not a1.token.cancelled and not b.token.cancelled
        assert jobs.cancel("alice") == 2  # a1, and a2 again (already cancelled: kept its first reason)
        assert a1.token.cancelled and not b.token.cancelled
    assert jobs.running() == [] and {j.id for j in jobs.history} == {a1.id, a2.id, b.id}


def test_a_cancel_that_arrives_before_its_job_starts_is_applied_at_start():
    jobs = JobRegistry()
    assert jobs.cancel("carol", "e9") == 0  # the event still waits for the model
    with jobs.start("edit", "carol", "e9") as job:
        assert job.token.cancelled and job.token.reason == "cancelled before it started"
    with jobs.start("edit", "carol", "e9") as again:  # remembered once, not forever
        assert not again.token.cancelled


def test_a_token_records_where_it_was_cancelled_and_asks_its_liveness_probe():
    token = CancelToken()
    token.step = 4
    token.cancel("stop")
    token.step = 5
    token.cancel("ignored: only the first reason counts")
    assert (token.reason, token.cancelled_at_step, token.step) == ("stop", 4, 5)
    connected = {"yes": True}
    probed = CancelToken(alive=lambda: connected["yes"])
    assert not probed.cancelled
    connected["yes"] = False
    assert probed.cancelled and probed.reason == "the client went away"

    def broken():
        raise RuntimeError("probe bug")

    assert not CancelToken(alive=broken).cancelled  # a broken probe never stops good work


# ---------------------------------------------------------------------------------------------
# Login throttle
# ---------------------------------------------------------------------------------------------


def test_login_throttle_counts_attempts_up_front_per_address_and_per_user():
    now = {"t": 1000.0}
    throttle = LoginThrottle(max_failures=3, window=60, clock=lambda: now["t"])
    # Three attempts in flight at once (none answered yet) already use up the address's budget.
    attempts = [throttle.begin("address:10.0.0.1", "user:booth") for _ in range(3)]
    assert all(wait == 0 and attempt is not None for wait, attempt in attempts)
    wait, attempt = throttle.begin("address:10.0.0.1", "user:booth")
    assert attempt is None and wait == pytest.approx(60)
    # Another address guessing the same user is throttled too (addresses can be spoofed) ...
    assert throttle.begin("address:10.0.0.2", "user:booth")[1] is None
    # ... while another user from another address is not.
    assert throttle.begin("address:10.0.0.3", "user:visitor")[1] is not None
    now["t"] += 61
    wait, attempt = throttle.begin("address:10.0.0.1", "user:booth")
    assert wait == 0 and attempt is not None
    throttle.succeeded(attempt, "address:10.0.0.1", "user:booth")  # a good login clears the slate
    assert throttle.retry_after("address:10.0.0.1") == 0 and throttle.retry_after("user:booth") == 0


# ---------------------------------------------------------------------------------------------
# Files
# ---------------------------------------------------------------------------------------------


def test_the_upload_gate_opens_stored_files_and_trusted_folders_only(tmp_path):
    stored = tmp_path / "cache" / "abc" / "photo.png"
    stored.parent.mkdir(parents=True)
    stored.write_bytes(b"x")
    trusted = tmp_path / "examples"
    trusted.mkdir()
    (trusted / "apple.png").write_bytes(b"x")
    outside = tmp_path / "secret.png"
    outside.write_bytes(b"x")
    link = trusted / "escape.png"
    link.symlink_to(outside)
    gate = UploadGate(lambda path: path == str(stored), roots=[trusted])

    assert gate.path({"path": str(stored), "orig_name": "mine.png"}) == (str(stored), "mine.png")
    assert gate.path(str(trusted / "apple.png")) == (str(trusted / "apple.png"), "apple.png")
    picture = Image.new("RGB", (4, 4))
    assert gate.path(picture) == (picture, None)  # not a file: nothing to open
    messages = set()
    for value in (
        {"path": str(outside)},
        {"path": str(tmp_path / "missing.png")},
        str(link),
        {"path": str(trusted / ".." / "secret.png")},
        types.SimpleNamespace(path=str(outside)),
    ):
        with pytest.raises(RequestError) as info:
            gate.path(value)
        messages.add(str(info.value))
    assert messages == {f"image: got 'upload'; expected {NOT_UPLOADED}"}  # same text, exists or not
    with pytest.raises(RequestError, match="did not arrive"):
        gate.path({"url": "x"})


def test_served_results_follow_retention(tmp_path):
    served = ServedResults(fixed=["/assets"])
    first, second = tmp_path / "a.png", tmp_path / "b.png"
    first.write_bytes(b"x")
    second.write_bytes(b"x")
    allowed = served.allowed  # the list object gradio holds
    served.add(first)
    served.add(second, None)
    assert allowed == ["/assets", str(first), str(second)]
    first.unlink()  # retention deleted it
    served.add()
    assert allowed == ["/assets", str(second)] and str(first) not in served


def test_cache_pruning_keeps_examples_and_the_newest_files(tmp_path):
    from hidream_ui.server import gradio_internals

    files = []
    for i in range(6):
        path = tmp_path / f"h{i}" / "f.png"
        path.parent.mkdir()
        path.write_bytes(b"x")
        files.append(str(path))
        time.sleep(0.01)  # distinct creation times: h0 oldest
    stray = tmp_path / "session-copy" / "batch.zip"  # a file no gradio record lists (a session copy)
    stray.parent.mkdir()
    stray.write_bytes(b"zip")
    uploads, outputs = set(files[:3]), set(files[3:])
    example = types.SimpleNamespace(keep_in_cache={files[0]})
    demo = types.SimpleNamespace(temp_file_sets=[uploads, outputs], blocks={1: example})
    removed = gradio_internals.prune_cache(demo, tmp_path, max_files=2, max_age=3600)
    assert removed == 4  # 7 files: the example stays, the newest two stay
    left = sorted(str(p) for p in gradio_internals.cache_files(tmp_path))
    assert left == sorted([files[0], files[5], str(stray)])
    assert not Path(files[1]).parent.exists()  # emptied hash folders go too
    assert uploads | outputs == {files[0], files[5]}  # gradio's records follow
    assert gradio_internals.prune_cache(demo, tmp_path, max_files=100, max_age=0, now=time.time() + 10) == 2
    assert [str(p) for p in gradio_internals.cache_files(tmp_path)] == [files[0]]


def test_only_uploads_and_examples_count_as_the_apps_files():
    from hidream_ui.server import gradio_internals

    example = types.SimpleNamespace(keep_in_cache={"/cache/ex/apple.png"})
    component = types.SimpleNamespace(keep_in_cache=set())
    demo = types.SimpleNamespace(
        upload_file_set={"/cache/up/photo.png"},
        blocks={1: example, 2: component},
        temp_file_sets=[{"/cache/up/photo.png"}, {"/cache/other/named-by-a-client.png"}],
    )
    assert gradio_internals.is_app_file(demo, "/cache/up/photo.png")
    assert gradio_internals.is_app_file(demo, "/cache/ex/apple.png")
    # Gradio records any cache path a client names in a component's files: that is not an upload.
    assert not gradio_internals.is_app_file(demo, "/cache/other/named-by-a-client.png")


def test_unknown_gradio_internals_degrade_to_safe_answers():
    from hidream_ui.server import gradio_internals

    nothing = types.SimpleNamespace()
    assert gradio_internals.event_alive(nothing, "e1") is True  # never cancels on "unknown"
    assert gradio_internals.is_app_file(nothing, "/etc/passwd") is False  # never accepts on "unknown"
    assert gradio_internals.queue_figures(nothing, "device") is None
    assert (
        gradio_internals.admit_jobs(nothing, "device", max_waiting=1, per_session=1, per_session_message=str) is False
    )


# ---------------------------------------------------------------------------------------------
# Text
# ---------------------------------------------------------------------------------------------


def test_absolute_paths_are_redacted_to_their_last_component():
    text = "the configured model is incomplete: /srv/models/HiDream-E1-1/transformer missing; C:\\m\\llama gone"
    assert redact_paths(text) == "the configured model is incomplete: transformer missing; llama gone"


@pytest.mark.parametrize("field", ["instruction", "negative_prompt"])
def test_an_unpaired_surrogate_is_a_clear_request_error(field):
    values = {"instruction": "make it red", field: "make it \ud83d red"}
    with pytest.raises(RequestError, match="unpaired surrogate") as info:
        EditParams(**values).validated()
    assert info.value.field == field


def test_history_keeps_the_settings_of_results_retention_deleted(tmp_path):
    from hidream_ui.server.served_results import ServedResults
    from hidream_ui.ui.history_entries import check_entries, new_entry, render_entries, signed

    served = ServedResults()
    kept, pruned = tmp_path / "kept.png", tmp_path / "pruned.png"
    for path in (kept, pruned):
        Image.new("RGB", (8, 8)).save(path)
    served.add(kept, pruned)
    picture = Image.new("RGB", (8, 8))
    secret = "this-browser"
    entries = [
        signed(
            new_entry(
                result=served.result_id(path),
                name=path.name,
                params={"instruction": name, "seed": 5},
                before=picture,
                after=picture,
            ),
            lambda result: served.ticket(result, secret),
        )
        for path, name in ((pruned, "old"), (kept, "new"))
    ]
    pruned.unlink()  # retention
    checked = check_entries(entries, lambda result, ticket: served.stored(result, ticket, secret))
    assert [entry.params.instruction for entry in checked] == ["old", "new"]  # indexes still match
    assert (checked[0].available, checked[0].png) == (False, None)
    assert (checked[1].available, checked[1].png) == (True, str(kept))
    assert render_entries(checked).count("no longer on this server") == 1


# ---------------------------------------------------------------------------------------------
# Batches: limits before decoding
# ---------------------------------------------------------------------------------------------


def test_a_batch_over_the_item_limit_is_refused_before_any_image_is_decoded():
    from hidream_ui.edits import EditSettings
    from hidream_ui.engine.batch import BatchRequest, BatchSource, plan_batch

    decoded = []

    def open_fn(data, name=None):
        decoded.append(name)
        return Image.new("RGB", (8, 8))

    request = BatchRequest(
        sources=tuple(BatchSource(f"{i}.png", b"") for i in range(3)), instructions=("a", "b"), settings=EditSettings()
    )
    with pytest.raises(RequestError, match="at most 4 items"):
        plan_batch(request, open_fn, max_items=4)
    assert decoded == []


def test_a_batch_holds_at_most_its_pixel_budget_decoded():
    from hidream_ui.engine.batch import BatchSource, open_sources

    def open_fn(data, name=None):
        return Image.new("RGB", (100, 100))  # 10,000 pixels each

    sources = [BatchSource(f"{i}.png", b"") for i in range(5)]
    opened, rejected = open_sources(sources, open_fn, max_total_pixels=25_000)
    assert [name for name, _ in opened] == ["0.png", "1.png", "2.png"]
    assert [name for name, _ in rejected] == ["3.png", "4.png"]
    assert "at most 25,000 per batch" in rejected[0][1]


def test_reading_settings_never_decodes_a_huge_image(tmp_path, monkeypatch):
    from PIL import PngImagePlugin

    from hidream_ui.outputs import TEXT_SCAN_MAX_PIXELS, MetadataError, read_metadata

    huge = tmp_path / "huge.png"
    Image.new("1", (6000, 5000)).save(huge)  # 30 MP, a few KB, no settings
    assert 6000 * 5000 > TEXT_SCAN_MAX_PIXELS

    def no_decoding(self):
        raise AssertionError("the image was decoded")

    monkeypatch.setattr(PngImagePlugin.PngImageFile, "load", no_decoding)
    with pytest.raises(MetadataError, match="no hidream_ui settings"):
        read_metadata(huge)


# ---------------------------------------------------------------------------------------------
# Process
# ---------------------------------------------------------------------------------------------


def test_sigterm_ends_the_app_like_ctrl_c():
    import signal

    from hidream_ui.cli.app import stop_on_signals

    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    try:
        stop_on_signals()
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        with pytest.raises(KeyboardInterrupt):
            signal.getsignal(signal.SIGTERM)(signal.SIGTERM, None)
    finally:
        signal.signal(signal.SIGINT, before[0])
        signal.signal(signal.SIGTERM, before[1])
