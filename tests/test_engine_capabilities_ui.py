"""The UI shows only what the running executor can do (issue 53): a tab or a control the executor
declares missing (`Engine.capabilities`) is not shown, and the System panel says why in the
executor's own words. Nothing is refused only after a click; the API names of a hidden control
(`/set_attention`, `/set_speed`) stay and answer with the same reason."""

from __future__ import annotations

from typing import Any

import gradio as gr
import pytest

from hidream_ui.config import AppConfig
from hidream_ui.engine.pool import EnginePool
from hidream_ui.engine.protocol import ALL_CAPABILITIES, Capabilities
from hidream_ui.ui.layout import build_demo

COMPARE_REASON = "Compare needs one engine held for several edits; Ray replicas are independent"
ATTENTION_REASON = "the replicas keep the attention they started with (--attention)"
SPEED_REASON = "this executor runs every edit exact"
BATCH_REASON = "no batch lane on this executor"
REWRITER_REASON = "the model lives in the replicas, not beside the app"


class Executor:
    """An executor that declares `capabilities`, in front of an in-process pool (nothing loaded):
    the UI may ask it anything else an engine answers."""

    def __init__(self, pool: EnginePool, capabilities: Capabilities):
        self._pool = pool
        self.capabilities = capabilities

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pool, name)


def executor(tmp_path, capabilities: Capabilities, **config: Any) -> Executor:
    return Executor(EnginePool.for_config(AppConfig(device="cpu", output_dir=tmp_path, **config)), capabilities)


def tab_ids(demo: gr.Blocks) -> list[str]:
    return [block.id for block in demo.blocks.values() if isinstance(block, gr.Tab)]


def by_id(demo: gr.Blocks, elem_id: str) -> Any:
    (block,) = [block for block in demo.blocks.values() if getattr(block, "elem_id", None) == elem_id]
    return block


def api_names(demo: gr.Blocks) -> set[str]:
    return set(demo.get_api_info()["named_endpoints"])


def test_an_executor_without_compare_shows_no_compare_tab_and_the_panel_says_why(tmp_path):
    demo = build_demo(executor(tmp_path, Capabilities.without(compare=COMPARE_REASON)))
    assert tab_ids(demo) == ["edit", "batch", "history"]
    assert "/compare" not in api_names(demo) and "/edit" in api_names(demo)
    note = by_id(demo, "hui-capabilities")
    assert note.visible and "Compare tab" in note.value and COMPARE_REASON in note.value, note.value
    assert by_id(demo, "hui-attention").visible and by_id(demo, "hui-speed").visible  # only Compare is missing


def test_with_every_capability_every_tab_is_there_and_the_panel_explains_nothing(tmp_path):
    demo = build_demo(executor(tmp_path, ALL_CAPABILITIES))
    assert tab_ids(demo) == ["edit", "batch", "compare", "history"]
    assert {"/compare", "/batch_edit", "/set_attention", "/set_speed"} <= api_names(demo)
    note = by_id(demo, "hui-capabilities")
    assert not note.visible and not note.value
    assert by_id(demo, "hui-attention").visible and by_id(demo, "hui-speed").visible


def test_without_attention_speed_and_batch_their_controls_are_hidden_and_their_apis_say_why(tmp_path):
    from hidream_ui.ui.speed_setting import SpeedSetting
    from hidream_ui.ui.system_handlers import SystemHandlers

    limited = executor(
        tmp_path, Capabilities.without(attention=ATTENTION_REASON, speed=SPEED_REASON, batch=BATCH_REASON)
    )
    demo = build_demo(limited)
    assert tab_ids(demo) == ["edit", "compare", "history"]
    for elem_id in ("hui-attention", "hui-attention-note", "hui-attention-unavailable", "hui-speed"):
        assert not by_id(demo, elem_id).visible, elem_id
    assert by_id(demo, "hui-load-model").visible  # what the executor can do stays
    note = by_id(demo, "hui-capabilities").value
    for words in ("Attention switch", ATTENTION_REASON, "Speed setting", SPEED_REASON, "Batch tab", BATCH_REASON):
        assert words in note, (words, note)
    # The API names stay (a contract) and refuse with the executor's reason, before touching the engine.
    services = demo.hidream_services
    with pytest.raises(gr.Error, match="attention they started with"):
        SystemHandlers(limited, services).set_attention("math")
    with pytest.raises(gr.Error, match="runs every edit exact"):
        SpeedSetting(limited, services).set_speed("fast")
    assert limited.attention_of() == "auto" and limited.status().speed["cache_default"] == "none"
    # The page's first fill leaves the hidden dropdown alone (no attention choices asked for).
    attention, *_ = SystemHandlers(limited, services).page_load()
    assert "choices" not in attention


@pytest.mark.slow
def test_an_executor_without_a_local_rewriter_offers_no_local_rewrite_and_says_why(tmp_path):
    demo = build_demo(executor(tmp_path, Capabilities.without(local_rewriter=REWRITER_REASON), rewriter="local"))
    assert demo.hidream_services.rewriter is None
    assert not by_id(demo, "hui-rewrite-on").visible
    assert REWRITER_REASON in by_id(demo, "hui-capabilities").value
    with_rewriter = build_demo(executor(tmp_path, ALL_CAPABILITIES, rewriter="local"))
    assert with_rewriter.hidream_services.rewriter is not None and by_id(with_rewriter, "hui-rewrite-on").visible


def test_with_ray_the_compare_tab_is_hidden_and_the_panel_gives_rays_own_reasons(tmp_path):
    """What `--ray` builds: RayEngine declares RAY_CAPABILITIES (read here without starting Ray)."""
    from hidream_ui.engine.ray_serve import RAY_CAPABILITIES

    demo = build_demo(executor(tmp_path, RAY_CAPABILITIES))
    assert "compare" not in tab_ids(demo) and "/compare" not in api_names(demo)
    note = by_id(demo, "hui-capabilities").value
    for name, reason in RAY_CAPABILITIES.missing.items():
        assert reason in note, (name, note)
    assert not by_id(demo, "hui-attention").visible
