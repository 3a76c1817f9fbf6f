"""The system panel beside the tabs (visible on all of them): engine status, the live telemetry
plot, and the engine-wide controls (attention, speed, load model).

`build_system_panel(...)` builds and wires it and returns `SystemPanelHandles`. With ``--kiosk``
the controls sit in one column that only the operator's page shows (server/operator.py), at the
top of the panel, under the state line, so a desktop shows them without scrolling (the operator's
badge, ui/operator_badge.py, links to them). API:
``/set_attention``, ``/load_model``, ``/set_speed`` (ui/speed_setting.py); ``/status`` and
``/cancel`` never wait in the queue. The handlers are `system_handlers.SystemHandlers`.

The panel shows only what the running executor can do (`Engine.capabilities`): a control it cannot
serve (attention switching, the speed setting) is not shown, and the panel says why, as it does for
a tab left out (Compare, Batch: ui/layout.py). Nothing is refused only after a click.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import gradio as gr

from hidream_ui.engine.pool import ALL_ENGINES
from hidream_ui.engine.protocol import CAPABILITY_NAMES, Capabilities, Engine
from hidream_ui.ui.common import DEVICE_GROUP, enable_js, md
from hidream_ui.ui.services import AppServices
from hidream_ui.ui.speed_setting import build_speed_setting
from hidream_ui.ui.status_panel import STATUS_CSS
from hidream_ui.ui.system_handlers import SystemHandlers

STATUS_SECONDS = 2  # how often the panel and the plot refresh
FAST_SECONDS = 0.5  # the state line while a run of this page goes

# What each capability is called where the panel says it is missing.
CAPABILITY_LABELS = {
    "compare": "Compare tab",
    "attention": "Attention switch",
    "speed": "Speed setting",
    "local_rewriter": "Local instruction rewriter",
    "previews": "Live previews",
    "batch": "Batch tab",
}
if set(CAPABILITY_LABELS) != set(CAPABILITY_NAMES):  # a new capability needs its words here
    raise TypeError(
        f"CAPABILITY_LABELS {sorted(CAPABILITY_LABELS)} are not the capabilities {sorted(CAPABILITY_NAMES)}"
    )


def missing_note(capabilities: Capabilities) -> str:
    """Markdown: what this executor does not offer, each with its reason ("" when it offers all)."""
    missing = [name for name in CAPABILITY_NAMES if not capabilities.has(name)]
    if not missing:
        return ""
    lines = "\n".join(f"- **{CAPABILITY_LABELS[name]}**: {md(capabilities.missing[name])}" for name in missing)
    return f"**Not available with this executor**\n\n{lines}"


@dataclass(frozen=True)
class SystemPanelHandles:
    status_state: gr.HTML  # the state line: the running jobs' progress, else idle / loading
    status_panel: gr.HTML  # the details (device, model, memory, devices)
    visitor_card: gr.HTML  # with --kiosk, what a visitor sees instead: device, queue, their place
    telemetry_plot: gr.LinePlot
    engine_controls: gr.Column  # shown per page (page_load): everyone, or with --kiosk the operator
    capabilities: gr.Markdown  # what the executor does not offer, and why (hidden when it offers all)
    attention: gr.Dropdown
    attention_engine: Any  # a Dropdown with several engines, else a State holding "all"
    attention_note: gr.Markdown
    attention_unavailable: gr.Markdown  # the strategies this device cannot run, and why
    speed: gr.Dropdown
    load_button: gr.Button
    load_message: gr.Markdown
    fast_timer: gr.Timer  # on while a run of this page goes: the state line follows it closely
    handlers: Any = None

    @property
    def operator_view(self) -> list[Any]:
        """What only the operator's page shows with --kiosk (visitors get the small card)."""
        return [self.status_panel, self.telemetry_plot]

    def watch_run(self, button: gr.Button, event: Any) -> None:
        """A long run (edit, batch, comparison) started by `button` (which its tab disables in the
        browser on click, `common.disable_js`): the button is back when the run ends, however it
        ends (done, refused, failed or stopped); meanwhile the state line refreshes every
        FAST_SECONDS, and at the end at once."""
        private = {"queue": False, "show_progress": "hidden", "api_visibility": "private"}
        button.click(self.handlers.run_started, None, [self.fast_timer], **private)
        # `.then` follows a success and a cancelled event, not an error (gradio 6): `.failure` too.
        for ended in (event.then, event.failure):
            ended(None, None, None, js=enable_js(button.elem_id), **private)
            ended(
                self.handlers.run_finished,
                None,
                [self.fast_timer, self.status_state, self.status_panel, self.load_button],
                **private,
            )


def build_system_panel(
    engine: Engine, handlers: SystemHandlers, services: AppServices, lane: int, capabilities: Capabilities
) -> SystemPanelHandles:
    """Adds the panel (call inside the column or accordion it sits in) and wires its events. `capabilities`: the
    executor's; a control it cannot serve is not shown, and the panel says why."""
    config = engine.config
    # No heading of its own: the panel sits in layout's "System" accordion, open on a wide screen and
    # folded on a phone (layout.APP_JS), where it ended every tab (issue 56).
    with gr.Column(elem_id="hui-status-panel"):
        status_state = gr.HTML(
            value='<div class="hui-status">connecting…</div>', css_template=STATUS_CSS, elem_id="hui-status-state"
        )
        if config.kiosk:  # the operator's page: the controls first, in view without scrolling on a desktop
            controls = _engine_controls(engine, services, lane, capabilities, kiosk=True)
        visitor_card = gr.HTML(value="", css_template=STATUS_CSS, visible=config.kiosk, elem_id="hui-visitor-card")
        status_panel = gr.HTML(
            value="", css_template=STATUS_CSS, visible=not config.kiosk, elem_id="hui-status-details"
        )
        # Beside the status, for visitors too: it explains a tab or a control they do not find.
        note = missing_note(capabilities)
        missing = gr.Markdown(note, visible=bool(note), elem_id="hui-capabilities", elem_classes=["hui-hint"])
    # x: seconds relative to now (negative, so "now" sits at the right end), whole seconds on the
    # ticks ("d": no "-0.100000"); the series names are the legend's own, without a title.
    telemetry_plot = gr.LinePlot(
        x="seconds",
        y="percent",
        color="series",
        y_lim=[0, 100],
        height=200,
        x_title="time (s, 0 = now)",
        y_title="%",
        color_title=" ",
        x_axis_format="d",
        label="Memory and utilisation",
        visible=not config.kiosk,
        elem_id="hui-telemetry-plot",
    )
    if not config.kiosk:  # everyone's: under the status, as they always were
        controls = _engine_controls(engine, services, lane, capabilities, kiosk=False)
    fast_timer = gr.Timer(FAST_SECONDS, active=False)
    panel = SystemPanelHandles(
        status_state=status_state,
        status_panel=status_panel,
        visitor_card=visitor_card,
        telemetry_plot=telemetry_plot,
        engine_controls=controls.column,
        capabilities=missing,
        attention=controls.attention,
        attention_engine=controls.attention_engine,
        attention_note=controls.attention_note,
        attention_unavailable=controls.attention_unavailable,
        speed=controls.speed,
        load_button=controls.load_button,
        load_message=controls.load_message,
        fast_timer=fast_timer,
        handlers=handlers,
    )
    _wire(panel, handlers, lane, kiosk=config.kiosk)
    return panel


class _EngineControls(NamedTuple):
    column: gr.Column
    attention: gr.Dropdown
    attention_engine: Any
    attention_unavailable: gr.Markdown
    attention_note: gr.Markdown
    speed: gr.Dropdown
    load_button: gr.Button
    load_message: gr.Markdown


def _engine_controls(
    engine: Engine, services: AppServices, lane: int, capabilities: Capabilities, kiosk: bool
) -> _EngineControls:
    """The engine-wide controls in their column. With --kiosk they
    are the operator's: hidden in the page config, shown by `page_load` to the operator's browser
    only (their events refuse everyone else anyway), under a heading that says whose they are."""
    with gr.Column(visible=not kiosk, elem_id="hui-engine-controls") as column:
        if kiosk:
            gr.Markdown(
                "**Operator controls**: they change the engine for every visitor.",
                elem_id="hui-operator-controls-title",
                elem_classes=["hui-hint"],
            )
        attention, attention_engine, unavailable, note = _attention_controls(
            engine, lane, visible=capabilities.attention
        )
        speed = build_speed_setting(engine, services, visible=capabilities.speed)  # also /set_speed
        load_button = gr.Button("Load model", size="sm", elem_id="hui-load-model")
        load_message = gr.Markdown(label="Model")
    return _EngineControls(column, attention, attention_engine, unavailable, note, speed, load_button, load_message)


def _attention_controls(engine: Engine, lane: int, visible: bool) -> tuple[Any, Any, gr.Markdown, gr.Markdown]:
    """The attention dropdown (filled on page load), the Engine choice of a pool (a State holding
    "all" for one engine), and their notes. `visible=False`: the executor cannot switch attention."""
    config = engine.config
    options = dict(
        label="Attention",
        choices=[(str(config.attention), str(config.attention))],
        value=str(config.attention),
        interactive=True,
        visible=visible,
        elem_id="hui-attention",
    )
    if lane > 1:  # a pool (--devices): the switch applies to every engine or to the one chosen
        with gr.Row(equal_height=True, visible=visible):
            attention = gr.Dropdown(scale=3, **options)
            attention_engine = gr.Dropdown(
                label="Engine",
                choices=[("all engines", ALL_ENGINES)] + [(label, label) for label in engine.labels()],
                value=ALL_ENGINES,
                interactive=True,
                scale=1,
                min_width=90,
                elem_id="hui-attention-engine",
            )
    else:
        attention = gr.Dropdown(**options)
        attention_engine = gr.State(ALL_ENGINES)
    unavailable = gr.Markdown(visible=visible, elem_id="hui-attention-unavailable")
    note = gr.Markdown(visible=visible, elem_id="hui-attention-note")
    return attention, attention_engine, unavailable, note


def _wire(panel: SystemPanelHandles, handlers: SystemHandlers, lane: int, kiosk: bool = False) -> None:
    private = {"queue": False, "show_progress": "hidden", "api_visibility": "private"}
    load_event = panel.load_button.click(
        handlers.load_model,
        None,
        panel.load_message,
        api_name="load_model",
        concurrency_id=DEVICE_GROUP,
        concurrency_limit=lane,
        show_progress_on=[panel.load_message],
    )
    # "Load model" goes once the model is loaded (by it, or by the first edit: `run_finished`).
    load_event.then(handlers.load_button_update, None, panel.load_button, **private)
    # Attention: the dropdown's `.select` (user changes only, so setting its value from the server
    # does not trigger it again); the API endpoint is a plain typed function.
    panel.attention.select(
        handlers.change_attention,
        [panel.attention, panel.attention_engine],
        [panel.attention, panel.attention_note, panel.status_panel],
        concurrency_id=DEVICE_GROUP,
        concurrency_limit=lane,
        api_visibility="private",
    )
    if lane > 1:
        panel.attention_engine.select(
            handlers.attention_target, [panel.attention_engine], [panel.attention, panel.attention_note], **private
        )
    gr.api(handlers.set_attention, api_name="set_attention", concurrency_id=DEVICE_GROUP, concurrency_limit=lane)
    # Status and cancel bypass the queue: they must answer while it is full (that is when people
    # need them), and the panel keeps moving while an edit runs.
    gr.api(handlers.status, api_name="status", queue=False)
    gr.api(handlers.cancel, api_name="cancel", queue=False)
    timer = gr.Timer(STATUS_SECONDS)
    timer.tick(handlers.status_state, None, panel.status_state, **private)
    timer.tick(handlers.status_panel, None, panel.status_panel, **private)
    timer.tick(handlers.telemetry_plot, None, panel.telemetry_plot, **private)
    if kiosk:
        timer.tick(handlers.visitor_card, None, panel.visitor_card, **private)
    # Only the state line, and only while this page runs something (`watch_run`): cheap.
    panel.fast_timer.tick(handlers.follow_run, None, [panel.status_state, panel.fast_timer], **private)


__all__ = ["SystemPanelHandles", "build_system_panel", "missing_note", "STATUS_SECONDS", "FAST_SECONDS"]
