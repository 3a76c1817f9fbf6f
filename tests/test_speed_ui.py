"""The Speed setting through the running app (`/set_speed`, `/status`, an edit's metadata) and the
status panel's speed line."""

from __future__ import annotations

import pytest
from gradio_client import Client, handle_file
from gradio_client.exceptions import AppError

from hidream_ui.engine.status import EngineStatus, Progress, PromptCacheStats
from hidream_ui.outputs import read_metadata
from hidream_ui.pipeline.speed.settings import SPEED_PRESETS
from hidream_ui.ui.layout import ASSETS_DIR
from hidream_ui.ui.speed_setting import speed_choices
from hidream_ui.ui.status_panel import render_status, state_line


def test_speed_choices_offer_the_presets_and_a_configured_spec():
    fast, faster = SPEED_PRESETS["fast"], SPEED_PRESETS["faster"]
    assert speed_choices("none") == [("exact", "none"), (f"fast ({fast})", fast), (f"faster ({faster})", faster)]
    assert speed_choices("first-block:0.05")[-1] == ("first-block:0.05", "first-block:0.05")


def test_status_panel_shows_speed_compiling_and_the_compile_error():
    speed = {
        "moe": "sync-free",
        "compile": "blocks",
        "compiled": False,
        "compile_backend": "inductor",
        "compile_error": "compile failed, running eager: BackendCompilerFailed: boom",
        "warmup_seconds": None,
        "cache_default": SPEED_PRESETS["fast"],
        "last_cache": "none",
    }
    status = EngineStatus(
        state="compiling",
        progress=Progress(),
        loaded=True,
        variant="e1.1",
        model_source="tiny",
        attention="sdpa",
        attention_note=None,
        refiner="e1",
        text_encoders="device",
        prompt_cache=PromptCacheStats(0, 0, 0),
        speed=speed,
    )
    assert state_line(status) == ("compiling", "compiling the transformer blocks (--compile blocks, first call)")
    html = render_status(status)
    assert "fast · compiling failed, runs uncompiled" in html  # plain words (issue 21)
    assert "BackendCompilerFailed: boom" in html


@pytest.fixture(scope="module")
def client(launch_app):
    return Client(launch_app("speed_ui")["url"], verbose=False)


@pytest.mark.slow
def test_set_speed_changes_the_next_edits_and_is_recorded(client):
    fast = SPEED_PRESETS["fast"]
    assert client.predict(name="fast", api_name="/set_speed") == fast
    assert client.predict(api_name="/status")["speed"]["cache_default"] == fast
    with pytest.raises(AppError, match="speed='warp'"):
        client.predict(name="warp", api_name="/set_speed")
    (_, _), saved, _, _ = client.predict(
        image=handle_file(str(ASSETS_DIR / "apple.png")),
        instruction="make it blue",
        num_inference_steps=8,
        working_resolution="draft",
        api_name="/edit",
    )
    metadata = read_metadata(saved)  # 8 steps: enough calls for any preset to skip some (TaylorSeer warms up 3)
    assert metadata["params"]["cache"] == fast
    assert metadata["speed"]["cache"] == fast and metadata["speed"]["skipped_fraction"] > 0
    assert client.predict(name="exact", api_name="/set_speed") == "none"
    (_, _), saved, _, _ = client.predict(
        image=handle_file(str(ASSETS_DIR / "apple.png")),
        instruction="make it blue",
        num_inference_steps=2,
        working_resolution="draft",
        api_name="/edit",
    )
    assert read_metadata(saved)["speed"] is None
