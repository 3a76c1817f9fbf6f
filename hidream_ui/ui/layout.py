"""The Gradio layout: widgets and their wiring, nothing else (the work is in `handlers`).

API names are part of the app's contract (README, tests, MCP):

* ``/edit``           image, instruction and every advanced setting -> before/after, saved PNG,
                      seed used, summary
* ``/status``         engine status as JSON (state, device, dtype, attention, memory, queue, ...);
                      never queued, so it answers while the queue is full
* ``/cancel``         stops the caller's own running edit / batch / comparison; never queued
* ``/set_attention``  strategy name [, engine label or "all"] -> the active strategy (refusals are
                      errors with the reason)
* ``/load_model``     loads the model now (otherwise the first edit does)
* ``/set_speed``      exact | fast | faster | a ``--cache`` spec -> the step cache of the next edits
* ``/rewrite``        image, instruction -> the prompt the rewriter makes of it, and its answer
                      (``--rewriter``; an error with the reason when it fails or none is configured)
* ``/edit_rewritten`` like ``/edit``, with the (edited) rewritten prompt and the ``/rewrite`` answer,
                      which the result's metadata records beside the prompt used

Tabs: Edit, then the Batch and Compare tabs (built by `batch_tab` / `compare_tab`), then History.
The system panel sits outside the tabs so it is visible on all of them.

Everything that touches the device (edit, load, attention switch) shares the concurrency group
``"device"`` with a limit of 1: the model is not re-entrant and users see their queue position.
The status timer, ``/status``, ``/cancel`` and the Stop buttons never wait behind it. Every event
that does work on a client's input is queued (the app serves with ``api_open=False``: the queue
is the only way in); events left unqueued only read server-side state or the status.

With ``--kiosk`` the engine-wide controls (attention, speed, load model) sit in one column that
only the operator's page shows (server/operator.py).

Imported lazily by the app (it imports gradio at the top).
"""

from __future__ import annotations

import importlib
import json
import logging
from pathlib import Path
from typing import Any, Callable, Sequence

import gradio as gr

from hidream_ui.engine.engine import EditEngine
from hidream_ui.engine.pool import ALL_ENGINES, device_labels, lane_size
from hidream_ui.requests import GUIDANCE_RANGE, IMAGE_GUIDANCE_RANGE, REFINE_RANGE, STEPS_RANGE, EditParams
from hidream_ui.server import gradio_internals
from hidream_ui.ui.common import (
    DEVICE_GROUP,
    REWRITER_CONCURRENCY,
    REWRITER_GROUP,
    SETTINGS_FILE_CONCURRENCY,
    SETTINGS_FILE_GROUP,
    WORKING_RESOLUTIONS,
    example_instruction,
    instruction_placeholder,
    variant_hint,
)
from hidream_ui.ui.handlers import Handlers
from hidream_ui.ui.services import ASSETS_DIR, AppServices
from hidream_ui.ui.speed_setting import build_speed_setting
from hidream_ui.ui.status_panel import STATUS_CSS

logger = logging.getLogger(__name__)


TINY_BANNER = (
    "⚠️ **Offline tiny model with random weights: every result is noise.** It exists to try the "
    "app, the queue and the device plumbing without the 17B checkpoints. To edit for real, start "
    "`python app.py --model-dir /path/to/models` (a folder holding `Llama-3.1-8B-Instruct/`, "
    "`HiDream-I1-Full/` and `HiDream-E1-1/` or `HiDream-E1-Full/`), or set `HIDREAM_MODEL_DIR`."
)

APP_CSS = """
#hui-tiny-banner { border: 1px solid #f59e0b; background: rgba(245, 158, 11, 0.12);
                   border-radius: 8px; padding: 0.4em 0.9em; }
#hui-system { position: sticky; top: 0.5em; }
#hui-attention-note { font-size: 0.85em; min-height: 1.2em; }
"""


# The values of the rewritten prompt box, the rewriter's answer and its note once a rewrite is stale.
CLEAR_REWRITE_JS = "() => ['', null, '']"


def rewrite_info(rewriter, variant: str) -> str:
    """The "Rewrite instruction" checkbox's hint: who rewrites, and what it does."""
    if rewriter is None:
        return "no rewriter configured (--rewriter-url or --rewriter local)"
    what = ("sends the image and your instruction to " if not rewriter.uses_device else
            "text only, with the model's own Llama: ") + rewriter.label
    goal = ("builds the Editing Instruction + Target Image Description prompt" if variant == "e1-full" else
            "makes the instruction precise")
    return f"{goal}; {what}"


def launch_options() -> dict[str, Any]:
    """Theme and CSS: Gradio 6 takes them in `launch()`, not in `gr.Blocks()`."""
    return {"theme": gr.themes.Soft(), "css": APP_CSS}


def load_examples(variant: str, assets_dir: Path = ASSETS_DIR) -> list[list[str]]:
    """[[image path, instruction], ...] from assets/examples.json; [] when the assets are absent
    (an installed package without the repository's assets still runs)."""
    listing = assets_dir / "examples.json"
    try:
        entries = json.loads(listing.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        logger.info("no examples (%s): %s", listing, exc)
        return []
    examples = []
    for entry in entries:
        path = assets_dir / entry["image"]
        if path.is_file():
            examples.append([str(path), example_instruction(entry["instruction"], variant, entry.get("target"))])
    return examples


# Tabs built by their own modules: (module, builder). Each builder is called as
# `builder(engine, config, services)` inside the `gr.Tabs()` context, adds one `gr.Tab` and returns
# its handlers (whose `resolution_dropdown`, if any, gets the model's working resolutions on load).
EXTRA_TABS = (
    ("hidream_ui.ui.batch_tab", "build_batch_tab"),
    ("hidream_ui.ui.compare_tab", "build_compare_tab"),
)
TabBuilder = Callable[[EditEngine, Any, AppServices], Any]


def default_extra_tabs() -> list[TabBuilder]:
    """The Batch and Compare tab builders. A tab module that is absent (a trimmed install) is
    skipped with a log line; one that fails to import for any other reason is a bug and raises."""
    builders = []
    for module_name, attribute in EXTRA_TABS:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name != module_name:
                raise
            logger.info("tab module %s not present; its tab is left out", module_name)
            continue
        builders.append(getattr(module, attribute))
    return builders


def build_demo(engine: EditEngine, extra_tabs: Sequence[TabBuilder] | None = None,
               services: AppServices | None = None) -> gr.Blocks:
    """The whole UI for `engine`. Builds widgets only: no model load, no torch import.

    `extra_tabs` are tab builders placed between Edit and History (default: Batch and Compare).
    `services` (jobs, upload gate, served results) are shared by every tab; `demo.hidream_services`
    holds them afterwards.
    """
    extra_tabs = default_extra_tabs() if extra_tabs is None else list(extra_tabs)
    config = engine.config
    variant = config.variant
    defaults = EditParams.defaults_for(variant)
    services = services or AppServices.for_config(config)
    if services.rewriter is None:
        from hidream_ui.rewrite.service import RewriteService

        services.rewriter = RewriteService.for_config(config, engine)  # None when rewriting is off
    rewriter = services.rewriter
    handlers = Handlers(engine, services=services)
    lane = lane_size(engine)  # device jobs at once: one per engine (--devices)
    # Gradio's own cache clean-up: files older than the limit go (checked every minute or
    # sooner), and all of this app's files at shutdown. The file-count limit is the janitor's.
    delete_cache = (max(1, min(60, config.cache_max_age)), config.cache_max_age)

    with gr.Blocks(title="HiDream-E1 image editing", delete_cache=delete_cache) as demo:
        gr.Markdown(f"## HiDream-{variant.upper()} instruction-based image editing")
        if config.uses_tiny_model:
            gr.Markdown(TINY_BANNER, elem_id="hui-tiny-banner")
        history = gr.State([])
        last_entry = gr.State(None)
        selected_index = gr.State(None)

        with gr.Row(equal_height=False):
            with gr.Column(scale=4):
                with gr.Tabs(selected="edit") as tabs:
                    with gr.Tab("Edit", id="edit"):
                        with gr.Row(equal_height=False):
                            with gr.Column():
                                image = gr.Image(label="Source image", sources=["upload", "clipboard", "webcam"],
                                                 type="filepath", image_mode=None, height=340,
                                                 elem_id="hui-source")
                                instruction = gr.Textbox(label="Instruction", lines=2,
                                                         placeholder=instruction_placeholder(variant),
                                                         elem_id="hui-instruction")
                                # On by default for E1-Full, the variant trained on the long two-part
                                # prompts (upstream's "Refine Instruction"); hidden without a rewriter.
                                rewrite = gr.Checkbox(
                                    value=rewriter is not None and variant == "e1-full",
                                    visible=rewriter is not None, label="Rewrite instruction",
                                    info=rewrite_info(rewriter, variant), elem_id="hui-rewrite-on")
                                gr.Markdown(variant_hint(variant))
                                negative_prompt = gr.Textbox(label="Negative prompt", value=defaults.negative_prompt)
                                with gr.Row():
                                    edit_button = gr.Button("Edit", variant="primary", elem_id="hui-edit")
                                    stop_button = gr.Button("Stop", variant="stop", elem_id="hui-stop")
                                with gr.Accordion("Rewritten instruction", open=True, visible=rewriter is not None,
                                                  elem_id="hui-rewrite-box"):
                                    rewritten = gr.Textbox(label="Prompt the edit uses (editable)", lines=3,
                                                           elem_id="hui-rewritten")
                                    rewrite_note = gr.Markdown(elem_id="hui-rewrite-note")
                                    with gr.Row():
                                        rewrite_button = gr.Button("Rewrite", size="sm", elem_id="hui-rewrite")
                                        edit_rewritten_button = gr.Button("Edit with this", size="sm",
                                                                          elem_id="hui-edit-rewritten")
                                    rewrite_details = gr.JSON(label="Rewriter's answer", open=False,
                                                              elem_id="hui-rewrite-details")
                                with gr.Accordion("Advanced settings", open=False):
                                    guidance_scale = gr.Slider(*GUIDANCE_RANGE, step=0.1, value=defaults.guidance_scale,
                                                               label="Guidance scale",
                                                               info="how strongly to follow the instruction")
                                    image_guidance_scale = gr.Slider(
                                        *IMAGE_GUIDANCE_RANGE, step=0.1, value=defaults.image_guidance_scale,
                                        label="Image guidance scale", info="how closely to keep the source image")
                                    num_inference_steps = gr.Slider(*STEPS_RANGE, step=1,
                                                                    value=defaults.num_inference_steps,
                                                                    label="Steps")
                                    refine_strength = gr.Slider(*REFINE_RANGE, step=0.05,
                                                                value=defaults.refine_strength,
                                                                label="Refine strength",
                                                                info="share of the steps run by the refine stage")
                                    clip_cfg_norm = gr.Checkbox(value=defaults.clip_cfg_norm, label="CLIP CFG norm",
                                                                info="rescale guidance to the conditional norm")
                                    working_resolution = gr.Dropdown(
                                        choices=list(WORKING_RESOLUTIONS), value=defaults.working_resolution,
                                        allow_custom_value=True, label="Working resolution",
                                        info="auto: the model's size · draft: half-size preview · "
                                             "or a side in px (multiple of 16)")
                                    with gr.Row():
                                        seed = gr.Number(value=defaults.seed, precision=0, label="Seed", minimum=-1)
                                        randomize_seed = gr.Checkbox(value=False, label="Random seed",
                                                                     info="the seed used is shown with the result")
                                    collapse_padding = gr.Checkbox(
                                        value=defaults.collapse_padding, label="Collapse padding",
                                        info="exact; skips the padded tokens of non-square images")
                            with gr.Column():
                                result_slider = gr.ImageSlider(label="Before / after", type="pil", format="png",
                                                               interactive=False, max_height=460,
                                                               elem_id="hui-result")
                                # Hidden until the first result: an empty Number would read "0".
                                with gr.Row(equal_height=True, visible=False) as result_details:
                                    seed_used = gr.Number(value=None, label="Seed used", interactive=False,
                                                          precision=0, placeholder="shown after the edit",
                                                          elem_id="hui-seed-used")
                                    # The saved file, not the slider's re-encoded copy: it carries the
                                    # settings (PNG text chunk) that the History tab can read back.
                                    saved_png = gr.DownloadButton("Download PNG (with settings)", value=None,
                                                                  variant="secondary", elem_id="hui-saved")
                                summary = gr.Markdown(label="Summary", elem_id="hui-summary")
                        examples = load_examples(variant)
                        if examples:
                            gr.Examples(examples=examples, inputs=[image, instruction], cache_examples=False,
                                        examples_per_page=len(examples), label="Examples (CC0, see assets/)")

                    tab_handlers = [build_tab(engine, config, services) for build_tab in extra_tabs]

                    with gr.Tab("History", id="history") as history_tab:
                        gr.Markdown("Results of this session, newest first. Select one to see its settings.")
                        gallery = gr.Gallery(label="Results", columns=5, height=300, object_fit="contain",
                                             allow_preview=False, fit_columns=False, interactive=False,
                                             elem_id="hui-gallery")
                        with gr.Row():
                            with gr.Column(scale=2):
                                selected_params = gr.JSON(label="Settings of the selected result",
                                                          elem_id="hui-selected-params")
                            with gr.Column(scale=1):
                                apply_button = gr.Button("Load these settings into the form", interactive=False)
                                settings_file = gr.File(label="…or read the settings of a PNG saved by this app",
                                                        file_types=[".png"], type="filepath",
                                                        elem_id="hui-settings-file")

            with gr.Column(scale=1, min_width=270, elem_id="hui-system"):
                gr.Markdown("### System")
                status_panel = gr.HTML(value='<div class="hui-status">connecting…</div>', css_template=STATUS_CSS,
                                       elem_id="hui-status-panel")
                telemetry_plot = gr.LinePlot(x="seconds", y="percent", color="series", y_lim=[0, 100], height=200,
                                             x_title="seconds ago", y_title="%", label="Memory and utilisation",
                                             elem_id="hui-telemetry-plot")
                # The engine-wide controls. With --kiosk they are the operator's: hidden in the page
                # config, shown by `page_load` to the operator's browser only (their events refuse
                # everyone else anyway, see server/operator.py).
                with gr.Column(visible=not config.kiosk, elem_id="hui-engine-controls") as engine_controls:
                    attention_kwargs = dict(label="Attention", choices=[(str(config.attention), str(config.attention))],
                                            value=str(config.attention), interactive=True, elem_id="hui-attention")
                    if lane > 1:  # a pool (--devices): the switch applies to every engine or to the one chosen
                        with gr.Row(equal_height=True):
                            attention = gr.Dropdown(scale=3, **attention_kwargs)
                            attention_engine = gr.Dropdown(
                                label="Engine", choices=[("all engines", ALL_ENGINES)] + [
                                    (label, label) for label in device_labels(engine)],
                                value=ALL_ENGINES, interactive=True, scale=1, min_width=90,
                                elem_id="hui-attention-engine")
                    else:
                        attention = gr.Dropdown(**attention_kwargs)
                        attention_engine = gr.State(ALL_ENGINES)
                    attention_note = gr.Markdown(elem_id="hui-attention-note")
                    # The step cache of the next edits; also /set_speed.
                    build_speed_setting(engine, allowed=handlers.require_operator)
                    load_button = gr.Button("Load model", size="sm", elem_id="hui-load-model")
                    load_message = gr.Markdown(label="Model")

        form = [instruction, negative_prompt, guidance_scale, image_guidance_scale, num_inference_steps,
                refine_strength, clip_cfg_norm, working_resolution, seed, randomize_seed, collapse_padding]

        # ---- edit: preprocess=False so the handler opens the upload itself and can say what is
        # wrong with a damaged file (gradio's own decode error is a developer message).
        edit_outputs = [result_slider, saved_png, seed_used, summary, last_entry]
        edit_event = edit_button.click(
            handlers.edit, inputs=[image, *form, rewrite], outputs=edit_outputs,
            api_name="edit", concurrency_id=DEVICE_GROUP, concurrency_limit=lane, preprocess=False,
            show_progress_on=[result_slider],
        )
        edit_event.success(handlers.add_history, [history, last_entry], [history, gallery, result_details],
                           queue=False, show_progress="hidden", api_visibility="private"
                           ).then(handlers.show_rewrite, [last_entry], [rewritten, rewrite_details, rewrite_note],
                                  queue=False, show_progress="hidden", api_visibility="private")

        # ---- rewriting: "Rewrite" shows the prompt (editable) before any edit; "Edit with this" edits
        # with the box's text and records the rewriter's answer beside it. A remote rewriter's
        # requests wait on the network, not the device: their own lane (see common.REWRITER_GROUP).
        on_device = rewriter is not None and rewriter.uses_device
        rewrite_event = rewrite_button.click(
            handlers.rewrite, inputs=[image, instruction], outputs=[rewritten, rewrite_details], api_name="rewrite",
            concurrency_id=DEVICE_GROUP if on_device else REWRITER_GROUP,
            concurrency_limit=lane if on_device else REWRITER_CONCURRENCY, preprocess=False,
            show_progress_on=[rewritten])
        rewrite_event.success(handlers.rewrite_note, [rewrite_details], [rewrite_note], queue=False,
                              show_progress="hidden", api_visibility="private")
        rewrite_event.failure(handlers.rewrite_failed, [instruction], [rewritten, rewrite_details, rewrite_note],
                              queue=False, show_progress="hidden", api_visibility="private")
        edit_rewritten_event = edit_rewritten_button.click(
            handlers.edit_rewritten, inputs=[image, rewritten, rewrite_details, *form[1:]], outputs=edit_outputs,
            api_name="edit_rewritten", concurrency_id=DEVICE_GROUP, concurrency_limit=lane, preprocess=False,
            show_progress_on=[result_slider])
        edit_rewritten_event.success(handlers.add_history, [history, last_entry], [history, gallery, result_details],
                                     queue=False, show_progress="hidden", api_visibility="private")
        # A rewrite belongs to one image and one instruction: a new one clears it. In the browser
        # only (`js`, no handler): `.input` fires on every keystroke.
        for trigger in (instruction.input, image.change):
            trigger(None, None, [rewritten, rewrite_details, rewrite_note], js=CLEAR_REWRITE_JS, queue=False,
                    show_progress="hidden", api_visibility="private")

        # Stop never queues: it must get through while the edit holds the device group.
        stop_button.click(handlers.stop, None, None, cancels=[edit_event, edit_rewritten_event, rewrite_event],
                          queue=False, show_progress="hidden", api_visibility="private")

        load_button.click(handlers.load_model, None, load_message, api_name="load_model",
                          concurrency_id=DEVICE_GROUP, concurrency_limit=lane, show_progress_on=[load_message])

        # ---- attention: the dropdown's `.input` (user changes only, so setting its value from the
        # server does not trigger it again); the API endpoint is a plain typed function.
        attention.select(handlers.change_attention, [attention, attention_engine],
                         [attention, attention_note, status_panel],
                         concurrency_id=DEVICE_GROUP, concurrency_limit=lane, api_visibility="private")
        if lane > 1:
            attention_engine.select(handlers.attention_target, [attention_engine], [attention, attention_note],
                                    queue=False, show_progress="hidden", api_visibility="private")
        gr.api(handlers.set_attention, api_name="set_attention", concurrency_id=DEVICE_GROUP, concurrency_limit=lane)

        # ---- status and cancel bypass the queue: they must answer while it is full (that is when
        # people need them), and the panel keeps moving while an edit runs.
        gr.api(handlers.status, api_name="status", queue=False)
        gr.api(handlers.cancel, api_name="cancel", queue=False)
        timer = gr.Timer(2)
        timer.tick(handlers.status_panel, None, status_panel, queue=False, show_progress="hidden",
                   api_visibility="private")
        timer.tick(handlers.telemetry_plot, None, telemetry_plot, queue=False, show_progress="hidden",
                   api_visibility="private")
        demo.load(handlers.page_load, None, [attention, status_panel, working_resolution, engine_controls],
                  queue=False, show_progress="hidden", api_visibility="private")
        for tab in tab_handlers:
            dropdown = getattr(tab, "resolution_dropdown", None)
            if dropdown is not None:
                demo.load(handlers.resolution_choices, None, dropdown, queue=False, show_progress="hidden",
                          api_visibility="private")

        # ---- history
        history_tab.select(handlers.refresh_history, [history], [gallery], queue=False, show_progress="hidden",
                           api_visibility="private")
        gallery.select(handlers.select_history, [history], [selected_params, selected_index, apply_button],
                       queue=False, show_progress="hidden", api_visibility="private")
        apply_button.click(handlers.apply_history, [history, selected_index], [*form, tabs], queue=False,
                           api_visibility="private")
        # It decodes a client's file: queued on a small lane of its own, with the device lane's
        # admission limits (cli/app.py `admission`), never a way around the queue.
        settings_file.upload(handlers.settings_from_file, [settings_file], [*form, tabs],
                             concurrency_id=SETTINGS_FILE_GROUP, concurrency_limit=SETTINGS_FILE_CONCURRENCY,
                             show_progress="minimal", api_visibility="private", preprocess=False)

    handlers.queue_info = lambda: gradio_internals.queue_figures(demo, DEVICE_GROUP)
    services.demo = demo
    demo.hidream_services = services
    return demo


__all__ = ["build_demo", "default_extra_tabs", "launch_options", "load_examples", "DEVICE_GROUP", "TINY_BANNER",
           "APP_CSS", "ASSETS_DIR"]
