"""The system panel beside the tabs (visible on all of them): engine status, the live telemetry
plot, and the engine-wide controls (attention, speed, load model).

`build_system_panel(...)` builds and wires it and returns `SystemPanelHandles`. With ``--kiosk``
the controls sit in one column that only the operator's page shows (server/operator.py). API:
``/set_attention``, ``/load_model``, ``/set_speed`` (ui/speed_setting.py); ``/status`` and
``/cancel`` never wait in the queue. The handlers are `handlers.Handlers`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import gradio as gr

from hidream_ui.engine.pool import ALL_ENGINES
from hidream_ui.engine.protocol import Engine
from hidream_ui.ui.common import DEVICE_GROUP
from hidream_ui.ui.handlers import Handlers
from hidream_ui.ui.speed_setting import build_speed_setting
from hidream_ui.ui.status_panel import STATUS_CSS

STATUS_SECONDS = 2  # how often the panel and the plot refresh


@dataclass(frozen=True)
class SystemPanelHandles:
    status_panel: gr.HTML
    telemetry_plot: gr.LinePlot
    engine_controls: gr.Column  # shown per page (page_load): everyone, or with --kiosk the operator
    attention: gr.Dropdown
    attention_engine: Any  # a Dropdown with several engines, else a State holding "all"
    attention_note: gr.Markdown
    speed: gr.Dropdown
    load_button: gr.Button
    load_message: gr.Markdown


def build_system_panel(engine: Engine, handlers: Handlers, lane: int) -> SystemPanelHandles:
    """Adds the panel (call inside the column it sits in) and wires its events."""
    config = engine.config
    gr.Markdown("### System")
    status_panel = gr.HTML(value='<div class="hui-status">connecting…</div>', css_template=STATUS_CSS,
                           elem_id="hui-status-panel")
    telemetry_plot = gr.LinePlot(x="seconds", y="percent", color="series", y_lim=[0, 100], height=200,
                                 x_title="seconds ago", y_title="%", label="Memory and utilisation",
                                 elem_id="hui-telemetry-plot")
    # The engine-wide controls. With --kiosk they are the operator's: hidden in the page config,
    # shown by `page_load` to the operator's browser only (their events refuse everyone else anyway).
    with gr.Column(visible=not config.kiosk, elem_id="hui-engine-controls") as engine_controls:
        attention_options = dict(label="Attention", choices=[(str(config.attention), str(config.attention))],
                                 value=str(config.attention), interactive=True, elem_id="hui-attention")
        if lane > 1:  # a pool (--devices): the switch applies to every engine or to the one chosen
            with gr.Row(equal_height=True):
                attention = gr.Dropdown(scale=3, **attention_options)
                attention_engine = gr.Dropdown(
                    label="Engine", choices=[("all engines", ALL_ENGINES)] + [
                        (label, label) for label in engine.labels()],
                    value=ALL_ENGINES, interactive=True, scale=1, min_width=90, elem_id="hui-attention-engine")
        else:
            attention = gr.Dropdown(**attention_options)
            attention_engine = gr.State(ALL_ENGINES)
        attention_note = gr.Markdown(elem_id="hui-attention-note")
        speed = build_speed_setting(engine, allowed=handlers.require_operator)  # also /set_speed
        load_button = gr.Button("Load model", size="sm", elem_id="hui-load-model")
        load_message = gr.Markdown(label="Model")
    panel = SystemPanelHandles(status_panel=status_panel, telemetry_plot=telemetry_plot,
                               engine_controls=engine_controls, attention=attention,
                               attention_engine=attention_engine, attention_note=attention_note, speed=speed,
                               load_button=load_button, load_message=load_message)
    _wire(panel, handlers, lane)
    return panel


def _wire(panel: SystemPanelHandles, handlers: Handlers, lane: int) -> None:
    private = {"queue": False, "show_progress": "hidden", "api_visibility": "private"}
    panel.load_button.click(handlers.load_model, None, panel.load_message, api_name="load_model",
                            concurrency_id=DEVICE_GROUP, concurrency_limit=lane, show_progress_on=[panel.load_message])
    # Attention: the dropdown's `.select` (user changes only, so setting its value from the server
    # does not trigger it again); the API endpoint is a plain typed function.
    panel.attention.select(handlers.change_attention, [panel.attention, panel.attention_engine],
                           [panel.attention, panel.attention_note, panel.status_panel],
                           concurrency_id=DEVICE_GROUP, concurrency_limit=lane, api_visibility="private")
    if lane > 1:
        panel.attention_engine.select(handlers.attention_target, [panel.attention_engine],
                                      [panel.attention, panel.attention_note], **private)
    gr.api(handlers.set_attention, api_name="set_attention", concurrency_id=DEVICE_GROUP, concurrency_limit=lane)
    # Status and cancel bypass the queue: they must answer while it is full (that is when people
    # need them), and the panel keeps moving while an edit runs.
    gr.api(handlers.status, api_name="status", queue=False)
    gr.api(handlers.cancel, api_name="cancel", queue=False)
    timer = gr.Timer(STATUS_SECONDS)
    timer.tick(handlers.status_panel, None, panel.status_panel, **private)
    timer.tick(handlers.telemetry_plot, None, panel.telemetry_plot, **private)


__all__ = ["SystemPanelHandles", "build_system_panel", "STATUS_SECONDS"]
