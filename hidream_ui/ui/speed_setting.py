"""The system panel's "Speed" setting and `/set_speed` (README "Speed modes").

Engine-wide, like the attention strategy: it sets the step cache of the next edits (Edit, Batch,
and Compare cells that do not vary speed); each result records the mode it ran with. Built inside
the layout's Blocks context by `build_speed_setting`.
"""

from __future__ import annotations

import html
import logging

import gradio as gr

from hidream_ui.engine.errors import EngineError
from hidream_ui.engine.protocol import Engine
from hidream_ui.pipeline.speed.settings import SPEED_PRESETS, parse_cache
from hidream_ui.ui.common import CONTROL_GROUP, guarded
from hidream_ui.ui.operator_gate import operator_only
from hidream_ui.ui.services import AppServices, TabHandlers, require_capability

logger = logging.getLogger(__name__)


def speed_choices(current: str) -> list[tuple[str, str]]:
    """(label, cache spec) for the presets, plus the configured spec when it is none of them."""
    choices = [(name if spec == "none" else f"{name} ({spec})", spec) for name, spec in SPEED_PRESETS.items()]
    if current not in SPEED_PRESETS.values():
        choices.append((current, current))
    return choices


def speed_info(record: dict | None = None) -> str:
    """The dropdown's note: what each preset buys and costs by the offline model's recorded `bench quality`
    run (model/tiny/quality_record.py; `record` None: the shipped one), in short words."""
    from hidream_ui.model.tiny import quality_record

    record = quality_record.read() if record is None else record
    parts, cases = ["exact: every block, every step"], None
    for preset in SPEED_PRESETS:
        if preset == "exact":
            continue
        figures = quality_record.preset_figures(preset, record)
        if figures is None:
            parts.append(f"{preset}: not measured")
            continue
        cases = figures["cases"]
        change = figures["success_change_points"]
        more = "more" if change > 0 else "less"
        success = "same success" if change == 0 else f"{abs(change):g} points {more} success"
        text = (
            f"{preset}: transformer {figures['transformer_speedup']:.1f}x as fast, {success}, "
            f"{figures['psnr_vs_exact_db']:.0f} dB from exact"
        )
        parts.append(text + (" (misses its rule)" if figures["misses"] else ""))
    measured = f" (offline model, {cases} edits; docs/speed.md)" if cases else ""
    return " · ".join(parts) + measured + ". Check your own pictures in Compare, axis speed."


class SpeedSetting(TabHandlers):
    """The handlers of the Speed dropdown and `/set_speed`. With --kiosk only the operator may change
    engine-wide settings (`@operator_only`; see server/operator.py)."""

    @guarded("setting the speed")
    @operator_only("the speed setting")
    def set_speed(self, name: str, request: gr.Request = None) -> str:
        """Step cache of the next edits: exact | fast | faster | any --cache value (CACHE_GRAMMAR) -> the spec."""
        require_capability(self.engine, "speed")
        return self.engine.set_speed(name)

    @operator_only("the speed setting")
    def change_speed(self, name: str, request: gr.Request = None):
        try:
            spec = self.engine.set_speed(name)
            return gr.update(value=spec), f"Speed: <b>{html.escape(spec)}</b> for the next edits."
        except EngineError as exc:
            logger.info("speed %r refused: %s", name, exc)
            gr.Warning(html.escape(str(exc), quote=False))
            return gr.update(value=self.engine.status().speed["cache_default"]), html.escape(str(exc))


def build_speed_setting(engine: Engine, services: AppServices, visible: bool = True) -> gr.Dropdown:
    """The dropdown, its note and `/set_speed` (see `SpeedSetting`; with --kiosk only the operator may
    change it, see server/operator.py). `visible=False`: the executor cannot switch the speed (the
    System panel says why); `/set_speed` stays an API name and answers with the executor's reason."""
    handlers = SpeedSetting(engine, services)
    current = str(parse_cache(engine.config.cache))
    dropdown = gr.Dropdown(
        label="Speed",
        choices=speed_choices(current),
        value=current,
        interactive=True,
        info=speed_info(),
        visible=visible,
        elem_id="hui-speed",
    )
    note = gr.Markdown(visible=visible, elem_id="hui-speed-note")
    # Queued (one way in: the app serves with api_open=False), on a lane of its own: it only changes
    # what the next edit will ask for, so it never waits behind edits.
    dropdown.select(
        handlers.change_speed,
        [dropdown],
        [dropdown, note],
        concurrency_id=CONTROL_GROUP,
        concurrency_limit=1,
        show_progress="hidden",
        api_visibility="private",
    )
    gr.api(handlers.set_speed, api_name="set_speed", concurrency_id=CONTROL_GROUP, concurrency_limit=1)
    return dropdown


__all__ = ["build_speed_setting", "speed_choices", "speed_info", "SpeedSetting"]
