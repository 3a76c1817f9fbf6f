"""The Compare tab: one image and one instruction over a grid of settings (one or two axes).

`build_compare_tab(engine, config, services)` adds a `gr.Tab("Compare")` to the Blocks being built. API:
``/compare`` (image, instruction, axes and their values, shared settings -> labelled grid image,
gallery of the cells, report). Two dropdowns pick any two cells for a before/after slider.

Like the Batch tab, the handler validates the whole grid first (values, cell limit, attention
availability), then streams: `compare.run_compare` runs in a worker thread and every finished
cell updates the grid image and the gallery. Imports gradio at the top: only the UI imports it.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import gradio as gr

from hidream_ui.config import AppConfig
from hidream_ui.edits import EditParams, RequestError, seed_from_form, settings_from_form
from hidream_ui.engine.compare import AXES, CompareResult, cell_caption, plan_compare, render_grid, run_compare
from hidream_ui.engine.jobs import StepInfo
from hidream_ui.engine.protocol import Engine
from hidream_ui.engine.runner import stream_job
from hidream_ui.ui.common import (
    RunTabHandles,
    device_run,
    disable_on_click,
    format_seconds,
    guarded,
    move_bar,
    settings_widgets,
    stop_on_click,
)
from hidream_ui.ui.region_input import open_region
from hidream_ui.ui.services import AppServices

logger = logging.getLogger(__name__)

AXIS_CHOICES = tuple((axis.label, axis.name) for axis in AXES.values())
NO_AXIS = "none"
# What the values box suggests for each axis (the placeholder changes with the dropdown).
AXIS_HINTS = MappingProxyType(
    {
        "seed": "1, 2, 3  or  0:7",
        "guidance": "2, 3.5, 5  or  1.5:4.5:1",
        "image_guidance": "1, 1.5, 2",
        "steps": "10, 20, 28",
        "refine": "0:0.6:0.2",
        "attention": "sdpa, math, chunked",
        "resolution": "draft, auto, 768",
        "speed": "exact, fast, faster  or  none, interval:2, taylorseer:2, fbcache:0.1",
    }
)


class CompareTab:
    """The Compare tab's handlers for one engine (runs are jobs of the shared registry)."""

    def __init__(self, engine: Engine, config: AppConfig, services: AppServices | None = None):
        self.engine = engine
        self.config = config
        self.services = services or AppServices.for_config(config)

    @guarded("the comparison")
    def run(
        self,
        image,
        instruction,
        axis_x,
        values_x,
        axis_y,
        values_y,
        negative_prompt,
        guidance_scale,
        image_guidance_scale,
        num_inference_steps,
        refine_strength,
        clip_cfg_norm,
        working_resolution,
        seed,
        mask=None,
        request: gr.Request = None,
        progress=gr.Progress(),
    ):
        """Edits the image once per grid cell (y values are rows, x values columns).

        Streams (labelled grid image, gallery of cells, report) as cells finish. Values: comma
        lists or ranges start:stop[:step]; attention and resolution take names. `mask` (optional,
        white = may change) limits every cell's edit to that region, as for /edit.
        """
        if image is None:
            raise RequestError("image", None, "an image: upload one")
        settings = settings_from_form(locals())  # the SHARED_FORM fields among the arguments
        params = settings.params(instruction if isinstance(instruction, str) else "", seed_from_form(seed))
        # Resolve a random seed once: every cell of a grid that does not vary the seed shares it.
        params = params.validated().resolve_seed()
        region = open_region(self.services, mask)
        if region is not None:
            params = dataclasses.replace(params, mask=region).validated()
        y_axis = None if axis_y in (None, "", NO_AXIS) else axis_y
        plan = plan_compare(params, axis_x, values_x, y_axis, values_y, max_cells=self.config.max_grid_cells)
        source, name = self.services.gate.path(image, "image")
        picture = self.engine.open_image(source, name=name)
        total = len(plan.cells)

        cells: list = []
        gallery: list[tuple[str, str]] = []
        started = time.perf_counter()
        state = {"step": ""}

        def partial(cancelled: bool = False) -> CompareResult:
            return CompareResult(
                plan=plan,
                source_image=picture,
                cells=list(cells),
                cancelled=cancelled,
                seconds=round(time.perf_counter() - started, 4),
            )

        def report(done: bool = False, cancelled: bool = False) -> str:
            head = "Stopped" if cancelled else ("Done" if done else "Running")
            text = (
                f"**{head}: {len(cells)}/{total} cells** · {format_seconds(time.perf_counter() - started)}"
                f" · seed {params.seed}"
            )
            if not done and state["step"]:
                text += f" · {state['step']}"
            return text

        yield render_grid(partial(), source=True), [], report(), []

        result: CompareResult | None = None
        with self.services.job("compare", request) as job:
            move_bar(progress, job, 0.0, "Loading the model" if not self.engine.loaded else "Starting")

            def work(emit):
                # The values as typed (not the parsed ones): the result's plan keeps the user's words.
                return run_compare(
                    self.engine,
                    picture,
                    params,
                    plan.axis_x,
                    values_x,
                    plan.axis_y,
                    values_y if plan.axis_y is not None else None,
                    on_cell=lambda cell, result: emit("cell", (cell, result)),
                    on_step=lambda info: emit("step", info),
                    source_name=name,
                    cancel=job.token,
                )

            for event in stream_job(work, job.token, name="hidream-compare"):
                kind, payload = event.kind, event.payload
                if kind == "step":
                    info: StepInfo = payload
                    state["step"] = f"cell {len(cells) + 1}: {info.stage} step {info.step}/{info.total}"
                    # The running cell's steps count: the bar moves before the first cell ends.
                    move_bar(
                        progress,
                        job,
                        (len(cells) + info.step / max(1, info.total)) / max(1, total),
                        f"{len(cells)}/{total} cells · {state['step']}",
                        step=info.step,
                        total=info.total,
                    )
                elif kind == "cell":
                    cell, cell_result = payload
                    self.services.results.add(cell_result.saved_png)
                    cells.append(cell_result)
                    shown = str(cell_result.saved_png) if cell_result.saved_png else cell_result.image
                    gallery.append((shown, cell_caption(plan, cell)))
                    move_bar(progress, job, len(cells) / max(1, total), f"{len(cells)}/{total} cells")
                    yield render_grid(partial(), source=True), list(gallery), report(), list(gallery)
                elif kind == "done":
                    result = payload
        yield (
            render_grid(result, source=True),
            list(gallery),
            report(done=True, cancelled=result.cancelled),
            list(gallery),
        )

    def stop(self, request: gr.Request = None) -> None:
        """Stops this session's comparison after the current step; finished cells are kept."""
        if self.services.cancel(request, kind="compare"):
            logger.info("comparison stopped by its user")

    @staticmethod
    def hint(axis: str):
        """The values box's placeholder for the axis chosen."""
        return gr.update(placeholder=AXIS_HINTS.get(axis, "") if axis != NO_AXIS else "(no y axis)")

    # ------------------------------------------------------------------ the slider pickers
    @staticmethod
    def pickers(cells: Any):
        """Dropdown choices (one per finished cell) and a first pair for the slider: the first and
        the last cell, usually the two ends of the range.

        `cells` is the session's own list of (result file, caption), kept in a gr.State by the run:
        never the gallery's value, which a client could fill with any server path."""
        entries = _cell_entries(cells)
        choices = [(caption or f"cell {i + 1}", i) for i, (_, caption) in enumerate(entries)]
        if not entries:
            return gr.update(choices=[], value=None), gr.update(choices=[], value=None), None
        a, b = 0, len(entries) - 1
        return (
            gr.update(choices=choices, value=a),
            gr.update(choices=choices, value=b),
            (entries[a][0], entries[b][0]),
        )

    @staticmethod
    def pair(cells: Any, a: Any, b: Any):
        entries = _cell_entries(cells)
        try:
            first, second = entries[int(a)][0], entries[int(b)][0]
        except (TypeError, ValueError, IndexError):
            return gr.update()
        return (first, second)


def _cell_entries(cells: Any) -> list[tuple[Any, str]]:
    """(result file or image, caption) pairs from the session's cell list."""
    return [
        (entry[0], entry[1] if len(entry) > 1 else "")
        for entry in (cells or [])
        if isinstance(entry, (list, tuple)) and entry
    ]


@dataclass(frozen=True, kw_only=True)
class CompareHandles(RunTabHandles):
    """What `build_compare_tab` made: its handlers (a CompareTab), /compare's inputs and its widgets."""

    grid: gr.Image
    cells: gr.Gallery
    report: gr.Markdown
    slider: gr.ImageSlider


def build_compare_tab(engine: Engine, config: AppConfig, services: AppServices | None = None) -> CompareHandles:
    """Adds the Compare tab to the Blocks being built; returns its handles."""
    handlers = CompareTab(engine, config, services)
    defaults = EditParams.defaults_for(config.variant)
    with gr.Tab("Compare", id="compare"):
        gr.Markdown(
            "Edit one image with one instruction over a grid of settings. Values: `1, 2, 3` or a range "
            f"`start:stop:step` (end included); attention and resolution take names. At most "
            f"{config.max_grid_cells} cells. Cells that do not vary the seed share one."
        )
        with gr.Row(equal_height=False):
            with gr.Column():
                image = gr.Image(
                    label="Source image",
                    type="filepath",
                    sources=["upload", "clipboard"],
                    height=260,
                    elem_id="hui-compare-source",
                )
                instruction = gr.Textbox(label="Instruction", lines=2, elem_id="hui-compare-instruction")
                with gr.Row():
                    axis_x = gr.Dropdown(list(AXIS_CHOICES), value="guidance", label="Columns (x axis)")
                    values_x = gr.Textbox(label="x values", value="2, 3.5, 5", placeholder=AXIS_HINTS["guidance"])
                with gr.Row():
                    axis_y = gr.Dropdown([("none", NO_AXIS), *AXIS_CHOICES], value=NO_AXIS, label="Rows (y axis)")
                    values_y = gr.Textbox(label="y values", value="", placeholder="(no y axis)")
                with gr.Row():
                    run_button = gr.Button("Compare", variant="primary", elem_id="hui-compare-run")
                    stop_button = gr.Button("Stop", variant="stop", elem_id="hui-compare-stop")
            with gr.Column():
                # No label: it would sit on top of the axis names drawn in the image's top-left corner.
                grid = gr.Image(
                    label="Grid",
                    show_label=False,
                    type="pil",
                    format="png",
                    interactive=False,
                    elem_id="hui-compare-grid",
                )
                report = gr.Markdown(elem_id="hui-compare-report")
                # interactive=False: it is read by the slider pickers, which would otherwise make it an upload box.
                cells = gr.Gallery(
                    label="Cells",
                    columns=4,
                    height=260,
                    object_fit="contain",
                    interactive=False,
                    elem_id="hui-compare-cells",
                )
                # One above the other: side by side, a phone cut their captions to a few letters.
                pick_a = gr.Dropdown(label="Left", choices=[], interactive=True, elem_id="hui-compare-left")
                pick_b = gr.Dropdown(label="Right", choices=[], interactive=True, elem_id="hui-compare-right")
                slider = gr.ImageSlider(
                    label="Two cells side by side",
                    type="filepath",
                    interactive=False,
                    height=380,
                    elem_id="hui-compare-slider",
                )

        # Below the results, not between the Run button and them (on a phone the results come first).
        with gr.Accordion("Shared settings", open=False):
            settings = settings_widgets(defaults)
            seed = gr.Number(
                value=defaults.seed,
                precision=0,
                minimum=-1,
                label="Seed",
                info="-1: one random seed for the whole grid",
            )
            mask = gr.Image(
                label="Region mask (optional): white = may change, black = keep",
                sources=["upload", "clipboard"],
                type="filepath",
                image_mode=None,
                height=160,
                elem_id="hui-compare-mask",
            )
        for axis, values in ((axis_x, values_x), (axis_y, values_y)):
            axis.change(handlers.hint, [axis], [values], queue=False, show_progress="hidden", api_visibility="private")
        # The order of /compare's inputs (CompareTab.run's parameters).
        inputs = [image, instruction, axis_x, values_x, axis_y, values_y, *settings.values(), seed, mask]
        cell_files = gr.State([])  # (result file, caption) per cell: server-side, read by the slider pickers
        disable_on_click(run_button)
        event = device_run(
            run_button,
            handlers.run,
            inputs,
            [grid, cells, report, cell_files],
            api_name="compare",
            lane=engine.size,
            progress_on=grid,
        )
        event.then(
            handlers.pickers,
            [cell_files],
            [pick_a, pick_b, slider],
            queue=False,
            show_progress="hidden",
            api_visibility="private",
        )
        for picker in (pick_a, pick_b):
            picker.input(
                handlers.pair,
                [cell_files, pick_a, pick_b],
                [slider],
                queue=False,
                show_progress="hidden",
                api_visibility="private",
            )
        stop_on_click(stop_button, handlers.stop)
    return CompareHandles(
        handlers=handlers,
        inputs=tuple(inputs),
        settings=settings,
        run_button=run_button,
        stop_button=stop_button,
        grid=grid,
        cells=cells,
        report=report,
        slider=slider,
        runs=((run_button, event),),
    )


__all__ = ["build_compare_tab", "CompareTab", "CompareHandles", "AXIS_CHOICES", "AXIS_HINTS", "NO_AXIS"]
