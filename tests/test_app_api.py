"""The Gradio app driven through its public API (gradio_client) on the offline tiny model.

One app per module (launched with prevent_thread_lock on a free port); the tiny checkpoint and
the outputs live in pytest tmp dirs. Edits run 2 steps at the draft working size, so the whole
module takes seconds after the one-time tiny build and load.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from gradio_client import Client, handle_file
from gradio_client.exceptions import AppError
from PIL import Image

from hidream_ui.config import AppConfig
from hidream_ui.edits import SEED_MAX, EditParams, RequestError
from hidream_ui.imaging import ImageError, open_image
from hidream_ui.outputs import load_settings
from hidream_ui.ui.common import WRITE_INSTRUCTION
from hidream_ui.ui.layout import ASSETS_DIR
from hidream_ui.ui.services import AppServices

EXAMPLE = ASSETS_DIR / "apple.png"
FAST = {"num_inference_steps": 2, "working_resolution": "draft"}


@pytest.fixture(scope="module")
def app(launch_app):
    return launch_app("app_api")


@pytest.fixture(scope="module")
def client(app):
    return Client(app["url"], verbose=False)


def edit(client, image=EXAMPLE, instruction="Replace the red apple with a green pear", **kwargs):
    return client.predict(
        image=handle_file(str(image)), instruction=instruction, **{**FAST, **kwargs}, api_name="/edit"
    )


@pytest.mark.slow
def test_edit_returns_image_and_used_seed(client, app):
    (before, after), saved, seed_used, summary = edit(client, randomize_seed=True)
    source = Image.open(EXAMPLE)
    with Image.open(after) as result:
        assert result.size == source.size  # restored from the working size to the source size
    with Image.open(before) as shown_source:
        assert shown_source.size == source.size
    assert isinstance(seed_used, int) and 0 <= seed_used <= SEED_MAX
    assert str(seed_used) in summary
    # The downloadable PNG carries the settings, with the seed actually used.
    settings = load_settings(saved)
    assert settings.seed == seed_used
    assert settings.num_inference_steps == 2
    assert settings.instruction == "Replace the red apple with a green pear"

    # A fixed seed is used as given.
    _, saved_fixed, seed_fixed, _ = edit(client, seed=1234, randomize_seed=False)
    assert seed_fixed == 1234
    assert load_settings(saved_fixed).seed == 1234


@pytest.mark.slow
def test_status_has_device_fields_and_follows_an_edit(client, app):
    status = client.predict(api_name="/status")
    for key in ("state", "device", "device_type", "device_name", "dtype", "attention", "model_source", "memory"):
        assert key in status, key
    assert status["device_type"] == app["engine"].primary.device.type
    assert status["model_source"] == "tiny"
    for key in ("allocated", "reserved", "peak", "total", "host_total", "host_available", "process_rss"):
        assert key in status["memory"], key
    assert status["memory"]["process_rss"] > 0
    edits_before = status["counters"]["edits"]

    # Poll /status from another thread while an edit runs: it must not wait behind the edit.
    seen: list[dict] = []
    done = threading.Event()
    poller = Client(app["url"], verbose=False)

    def poll() -> None:
        while not done.is_set():
            seen.append(poller.predict(api_name="/status"))

    thread = threading.Thread(target=poll, daemon=True)
    thread.start()
    try:
        edit(client, num_inference_steps=6)
    finally:
        done.set()
        thread.join(timeout=30)
    editing = [s for s in seen if s["state"] == "editing"]
    assert editing, f"no status during the edit showed it: {[s['state'] for s in seen]}"
    assert {s["progress"].get("total") for s in editing} == {6}
    assert any(s.get("queue", {}).get("running") == 1 for s in editing)
    after = client.predict(api_name="/status")
    assert after["state"] == "idle"
    assert after["counters"]["edits"] == edits_before + 1


@pytest.mark.slow
def test_set_attention_switches_and_refuses_unavailable(client, app):
    engine = app["engine"]
    assert client.predict(name="math", api_name="/set_attention") == "math"
    assert client.predict(api_name="/status")["attention"] == "math"

    statuses = {s.name: s for s in engine.attention_choices()}
    assert not statuses["npu_fusion"].available  # this machine has no NPU
    with pytest.raises(AppError) as refused:
        client.predict(name="npu_fusion", api_name="/set_attention")
    message = str(refused.value)
    assert "npu_fusion" in message and "not available" in message
    assert statuses["npu_fusion"].reason in message
    # The refusal leaves the current strategy active and the app serving.
    assert client.predict(api_name="/status")["attention"] == "math"

    resolved = client.predict(name="auto", api_name="/set_attention")
    assert resolved != "auto" and statuses[resolved].available
    assert client.predict(api_name="/status")["attention"] == resolved
    # Edits still work after the switches.
    _, _, seed_used, _ = edit(client, seed=7, randomize_seed=False)
    assert seed_used == 7


def test_corrupt_upload_is_a_readable_error(client, tmp_path):
    broken = tmp_path / "broken.png"
    broken.write_bytes(b"\x89PNG\r\n\x1a\n this is not really an image")
    with pytest.raises(ImageError) as expected:
        open_image(broken, name="broken.png")
    with pytest.raises(AppError) as got:
        edit(client, image=broken)
    # Said for people first (issue 21), then the reader's reason.
    assert str(got.value) == f"This file is not an image we can read. {expected.value}"
    assert "broken.png" in str(got.value) and "Traceback" not in str(got.value)


def test_empty_instruction_is_a_readable_error(client):
    with pytest.raises(RequestError, match="^instruction:"):  # the Python API names the field
        EditParams(instruction="   ").validated()
    with pytest.raises(AppError) as got:
        edit(client, instruction="   ")
    assert str(got.value) == WRITE_INSTRUCTION  # the app says what to do (issue 21)


def test_bad_setting_names_the_field(client):
    with pytest.raises(AppError) as got:
        edit(client, working_resolution="77")
    assert str(got.value).startswith("working_resolution:") and "'77'" in str(got.value)


# ---------------------------------------------------------------------------------------------
# Without a server: the error guard and the start-up refusals.
# ---------------------------------------------------------------------------------------------


def test_unexpected_exception_becomes_a_named_error(caplog):
    import gradio as gr

    from hidream_ui.ui.common import guarded

    @guarded("the frobnication")
    def broken():
        raise KeyError("missing-key")

    with caplog.at_level("ERROR"), pytest.raises(gr.Error) as got:
        broken()
    assert "the frobnication failed unexpectedly" in got.value.message
    assert "missing-key" in got.value.message
    assert any(record.exc_info for record in caplog.records)  # the traceback is logged server-side


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["--port", "abc"], "--port='abc' is not a whole number"),
        (["--dtype", "fp8"], "dtype='fp8' is not one of"),
        (["--auth", "nopassword"], "--auth must look like user:password"),
    ],
)
def test_bad_config_exits_2_with_one_line(argv, fragment, capsys):
    from hidream_ui.cli.app import main

    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and fragment in err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_missing_auth_file_exits_2(tmp_path, capsys):
    from hidream_ui.cli.app import main

    assert main(["--auth-file", str(tmp_path / "absent.txt")]) == 2
    err = capsys.readouterr().err
    assert "absent.txt" in err and err.count("\n") == 1


def test_history_settings_round_trip(client, app):
    from hidream_ui.ui.common import form_values
    from hidream_ui.ui.history_tab import HistoryHandlers

    _, saved, seed_used, _ = edit(
        client, seed=99, randomize_seed=False, guidance_scale=4.5, instruction="Add a rainbow over the sea"
    )
    # In-process, the PNG's folder is trusted the way the bundled examples are (the app's own event
    # opens only what gradio stored as an upload: see test_hardening2_queue).
    services = AppServices.for_config(app["config"], trusted_roots=[Path(saved).parent])
    handlers = HistoryHandlers(app["engine"], services=services)
    *values, tabs = handlers.settings_from_file(saved)
    assert tuple(values) == form_values(load_settings(saved))
    assert values[0] == "Add a rainbow over the sea" and values[2] == 4.5 and values[8] == seed_used == 99
    assert values[9] is False  # "random seed" off, so the loaded seed is the one used
    assert tabs.selected == "edit"


def test_settings_from_a_png_without_metadata_is_a_readable_error(tmp_path):
    import gradio as gr

    from hidream_ui.outputs import MetadataError
    from hidream_ui.ui.history_tab import HistoryHandlers

    plain = tmp_path / "plain.png"
    Image.new("RGB", (32, 32), "white").save(plain)
    with pytest.raises(MetadataError) as expected:
        load_settings(plain)
    with pytest.raises(gr.Error) as got:
        HistoryHandlers(
            engine=None, services=AppServices.for_config(AppConfig(), trusted_roots=[tmp_path])
        ).settings_from_file(str(plain))
    assert got.value.message == str(expected.value)
    # A path this app neither stored nor trusts is refused without being opened.
    with pytest.raises(gr.Error, match="uploaded to this app"):
        HistoryHandlers(engine=None).settings_from_file(str(plain))


class _Request:
    def __init__(self, session_hash):
        self.session_hash = session_hash


def test_stop_only_cancels_the_callers_own_edit():
    from hidream_ui.ui.edit_handlers import EditHandlers
    from hidream_ui.ui.system_handlers import SystemHandlers

    edit = EditHandlers(engine=None)
    panel = SystemHandlers(engine=None, services=edit.services)  # one demo: one job registry
    jobs = edit.services.jobs
    edit.stop(_Request("alice"))  # nothing running: nothing to do, no error
    with jobs.start("edit", "alice") as alice, jobs.start("edit", "bob") as bob:
        edit.stop(_Request("bob"))  # bob's Stop stops bob's edit only
        assert bob.token.cancelled and not alice.token.cancelled
        assert panel.cancel(_Request("mallory")) == "nothing of yours is running"
        assert not alice.token.cancelled
        assert panel.cancel(_Request("alice")) == "stopped 1 job(s)"
        assert alice.token.cancelled and alice.token.reason == "cancelled through /cancel"


def test_status_panel_shows_accelerator_memory_and_escapes_text():
    from hidream_ui.device.memory import MemorySnapshot
    from hidream_ui.engine.status import EngineStatus, Progress, PromptCacheStats, QueueFigures
    from hidream_ui.ui.status_panel import render_status

    gib = 1024**3
    status = EngineStatus(
        state="editing",
        progress=Progress(step=3, total=28, stage="edit"),
        loaded=True,
        device="npu:0",
        device_type="npu",
        device_name="Ascend <910B>",
        dtype="bf16",
        variant="e1.1",
        model_source="real",
        attention="npu_fusion",
        attention_note=None,
        refiner="e1",
        text_encoders="device",
        prompt_cache=PromptCacheStats(0, 0, 0),
        queue=QueueFigures(waiting=2, running=1),
        memory=MemorySnapshot(
            device="npu:0",
            allocated=30 * gib,
            reserved=40 * gib,
            peak=50 * gib,
            free=10 * gib,
            total=64 * gib,
            utilization=87.0,
            host_total=512 * gib,
            host_available=256 * gib,
            process_rss=20 * gib,
            timestamp=0.0,
        ),
    )
    html_text = render_status(status)
    assert "editing · step 3/28" in html_text
    assert "Ascend &lt;910B&gt;" in html_text and "<910B>" not in html_text
    for label in ("allocated", "reserved", "peak", "device in use", "host RAM", "process RSS", "NPU utilisation"):
        assert label in html_text, label
    assert "30.0 GiB / 64.0 GiB" in html_text and "2 waiting · 1 running" in html_text
    assert "width:46.9%" in html_text  # 30 of 64 GiB allocated


# ---------------------------------------------------------------------------------------------
# Messages for people (issue 21): what to do, not what the check found
# ---------------------------------------------------------------------------------------------


def _refusal(client, **inputs) -> str:
    with pytest.raises(AppError) as refused:
        client.predict(api_name="/edit", **inputs)
    return str(refused.value)


def test_a_missing_image_or_instruction_says_what_to_do(client, tmp_path, app):
    picture = tmp_path / "ok.png"
    Image.new("RGB", (64, 48), (10, 120, 200)).save(picture)
    edits = app["engine"].counters["edits"]
    both = _refusal(client, image=None, instruction="  ")
    assert "Add an image and write an instruction" in both and "got" not in both
    no_image = _refusal(client, image=None, instruction="make it red")
    assert "Add an image" in no_image and "PNG, JPEG" in no_image and "got None" not in no_image
    no_instruction = _refusal(client, image=handle_file(str(picture)), instruction="")
    assert "Write an instruction" in no_instruction and "got ''" not in no_instruction
    text = tmp_path / "notes.png"  # a text file named like an image
    text.write_text("hello, not a picture")
    unreadable = _refusal(client, image=handle_file(str(text)), instruction="make it red")
    assert "This file is not an image we can read" in unreadable
    assert app["engine"].counters["edits"] == edits  # refused before any work


# ---------------------------------------------------------------------------------------------
# Region edits and live previews (issue 21)
# ---------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_an_edit_with_a_left_half_mask_keeps_the_right_half(client, tmp_path):
    import numpy as np

    from hidream_ui.outputs import read_metadata

    rng = np.random.default_rng(7)
    source = tmp_path / "noise.png"
    Image.fromarray(rng.integers(0, 256, (96, 128, 3), dtype=np.uint8)).save(source)
    mask = tmp_path / "left.png"
    painted = Image.new("L", (128, 96), 0)
    painted.paste(255, (0, 0, 64, 96))
    painted.save(mask)
    (_, after), saved, _, _ = edit(
        client,
        image=source,
        instruction="make it blue",
        mask=handle_file(str(mask)),
        seed=5,
        randomize_seed=False,
        num_inference_steps=4,
    )
    meta = read_metadata(saved)
    feather = meta["mask"]["feather"]
    src = np.asarray(Image.open(source), dtype=np.int16)
    with Image.open(after) as shown:
        out = np.asarray(shown.convert("RGB"), dtype=np.int16)
    assert np.abs(out[:, 64 + feather :] - src[:, 64 + feather :]).max() <= 2
    assert np.abs(out[:, : 64 - feather] - src[:, : 64 - feather]).mean() > 10
    assert meta["mask"]["name"] == "left.png" and meta["parent"]["file"] == "noise.png"
    # Without the mask the right half changes: the mask is what kept it.
    (_, free), _, _, _ = edit(
        client, image=source, instruction="make it blue", seed=5, randomize_seed=False, num_inference_steps=4
    )
    with Image.open(free) as shown:
        assert (
            np.abs(np.asarray(shown.convert("RGB"), dtype=np.int16)[:, 64 + feather :] - src[:, 64 + feather :]).mean()
            > 10
        )


def test_a_mask_that_is_not_an_image_is_refused_before_any_work(client, tmp_path, app):
    text = tmp_path / "mask.png"
    text.write_text("not a picture")
    edits = app["engine"].counters["edits"]
    refused = _refusal(client, image=handle_file(str(EXAMPLE)), instruction="make it red", mask=handle_file(str(text)))
    assert "not an image we can read" in refused
    assert app["engine"].counters["edits"] == edits


@pytest.mark.slow
def test_edit_streams_live_previews_before_its_result(client, monkeypatch):
    """/edit's progress carries a (before, preview) pair every --preview-every steps (4 by default).

    Each preview's "before" half is the same image. Gradio writes a yielded PIL image in place, so
    yielding it again rewrote a file the client could be downloading, and the client got a short
    download (CI saw "Response content shorter than Content-Length"): every write is recorded."""
    written: list[str] = []
    write_bytes = Path.write_bytes

    def recording(self, data):
        written.append(str(Path(self).resolve()))
        return write_bytes(self, data)

    monkeypatch.setattr(Path, "write_bytes", recording)
    job = client.submit(
        image=handle_file(str(EXAMPLE)),
        instruction="make it blue",
        num_inference_steps=9,
        working_resolution="draft",
        api_name="/edit",
    )
    final = job.result()
    outputs = job.outputs()
    assert len(outputs) == 3  # previews after steps 4 and 8, then the result
    previews = [Path(pair[1]) for pair, *_ in outputs[:-1]]
    assert all(path.is_file() for path in previews) and final == outputs[-1]
    first, second = (Image.open(path).convert("RGB") for path in previews)
    assert first.tobytes() != second.tobytes()  # the preview changes as it denoises
    # A preview leaves the other outputs as they are (no saved file, no seed yet): it is never saved.
    assert final[1] is not None and all(value == {"__type__": "update"} for value in outputs[0][1:])
    assert written and len(written) == len(set(written)), sorted(written)  # no file written twice
