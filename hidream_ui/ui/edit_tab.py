"""The Edit tab: one image, one instruction, the settings of hidream_ui.edits.FIELDS -> before/after.

`build_edit_tab(...)` adds the tab to the Blocks being built and returns its `EditTabHandles`;
`wire_edit_tab(...)` connects its events (``/edit``, ``/rewrite``, ``/edit_rewritten``, Stop) once
the History tab exists (a finished edit is added to it). The handlers are `edit_handlers.EditHandlers`.

Imports gradio at the top: only the UI imports this module.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import gradio as gr

from hidream_ui.config import AppConfig
from hidream_ui.edits import EDIT_FORM, FIELD_SPECS, EditParams
from hidream_ui.ui.common import (
    DEVICE_GROUP,
    REWRITER_CONCURRENCY,
    REWRITER_GROUP,
    SETTINGS_FILE_CONCURRENCY,
    SETTINGS_FILE_GROUP,
    device_run,
    disable_on_click,
    example_instruction,
    instruction_placeholder,
    variant_hint,
    widget,
)
from hidream_ui.ui.edit_handlers import EditHandlers
from hidream_ui.ui.region_editor import build_region_editor
from hidream_ui.ui.services import ASSETS_DIR
from hidream_ui.ui.world_examples import world_examples, world_hint, world_placeholder

logger = logging.getLogger(__name__)

REGION_HINT = (
    "Paint over what may change; the rest keeps the source (a soft edge joins them). "
    "Nothing painted: the whole image may change."
)
# The values of the rewritten prompt box, the rewriter's answer and its note once a rewrite is stale.
CLEAR_REWRITE_JS = "() => ['', null, '']"
# Brings an element into view unless it already is (the page is long on a phone).
# Once now and once after the re-render the click causes (the progress overlay, a disabled button).
_SCROLL_TO = (
    "(() => {{ const show = () => {{ const el = document.querySelector('{selector}'); if (!el) return; "
    "const r = el.getBoundingClientRect(); "
    "if (r.top < 0 || r.top > window.innerHeight - {margin}) "
    "el.scrollIntoView({{behavior: 'instant', block: '{block}'}}); }}; show(); setTimeout(show, 300); }})()"
)
# On Edit: the result area (where the progress bar runs), its top at the top of the screen.
SHOW_RESULT_JS = "() => { " + _SCROLL_TO.format(selector="#hui-result", margin=200, block="start") + "; }"
# After an example or "Edit the result": the source image and the instruction.
SHOW_FORM_JS = "() => { " + _SCROLL_TO.format(selector="#hui-source", margin=200, block="start") + "; }"


def rewrite_info(rewriter, variant: str) -> str:
    """The "Rewrite instruction" checkbox's hint: who rewrites, and what it does."""
    if rewriter is None:
        return "no rewriter configured (--rewriter-url or --rewriter local)"
    what = (
        "sends the image and your instruction to "
        if not rewriter.uses_device
        else "text only, with the model's own Llama: "
    ) + rewriter.label
    goal = (
        "builds the Editing Instruction + Target Image Description prompt"
        if variant == "e1-full"
        else "makes the instruction precise"
    )
    return f"{goal}; {what}"


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


@dataclass(frozen=True)
class EditTabHandles:
    """The Edit tab's widgets. `form` maps every name of EDIT_FORM to its widget; `inputs` is the
    form in EDIT_FORM order (the /edit API's inputs after the image)."""

    image: gr.Image
    form: Mapping[str, Any]
    mask: gr.ImageEditor  # the painted region (from the API also a mask file): /edit's and /edit_rewritten's last input
    clear_region: gr.Button  # "Clear the region": the source again, nothing painted
    rewrite: gr.Checkbox
    edit_button: gr.Button
    stop_button: gr.Button
    rewritten: gr.Textbox
    rewrite_note: gr.Markdown
    rewrite_button: gr.Button
    edit_rewritten_button: gr.Button
    rewrite_details: gr.JSON
    result_slider: gr.ImageSlider
    result_details: gr.Row
    seed_used: gr.Number
    saved_png: gr.DownloadButton
    summary: gr.Markdown  # the result's summary, or what happened instead ("Stopped after 3 of 28 steps")
    last_entry: gr.State  # the finished edit's History entry
    edit_result_button: gr.Button  # "Edit the result": the result becomes the next source
    examples: Any = None  # the gr.Examples (None without the bundled assets)

    @property
    def inputs(self) -> list[Any]:
        return [self.form[name] for name in EDIT_FORM]

    @property
    def outputs(self) -> list[Any]:
        return [self.result_slider, self.saved_png, self.seed_used, self.summary, self.last_entry]


def build_edit_tab(config: AppConfig, rewriter) -> EditTabHandles:
    """Adds the Edit tab (call inside `gr.Tabs()`); widgets only, `wire_edit_tab` connects them.

    Layout: the source, the instruction and Edit / Stop on the left, the result area (progress,
    before/after, "Edit the result", seed, download, summary) on the right; the settings below both.
    On a phone the columns stack, so the result comes right after the Edit button (not below the
    settings), and pressing Edit scrolls it into view (EDIT_CLICK_JS).
    """
    variant = config.variant
    defaults = EditParams.defaults_for(variant)
    value = defaults.to_dict()
    form: dict[str, Any] = {}
    with gr.Tab("Edit", id="edit", elem_id="hui-edit-tab"):
        with gr.Row(equal_height=False):
            with gr.Column(min_width=300):
                image = gr.Image(
                    label="Source image",
                    sources=["upload", "clipboard", "webcam"],
                    type="filepath",
                    image_mode=None,
                    height=300,
                    elem_id="hui-source",
                )
                # What the model in use can follow: the offline model's own words, else the variant's format.
                form["instruction"] = widget(
                    "instruction",
                    "",
                    lines=2,
                    placeholder=world_placeholder(config) or instruction_placeholder(variant),
                    elem_id="hui-instruction",
                )
                # On by default for E1-Full, the variant trained on the long two-part prompts
                # (upstream's "Refine Instruction"); hidden without a rewriter.
                rewrite = gr.Checkbox(
                    value=rewriter is not None and variant == "e1-full",
                    visible=rewriter is not None,
                    label="Rewrite instruction",
                    info=rewrite_info(rewriter, variant),
                    elem_id="hui-rewrite-on",
                )
                with gr.Row(elem_id="hui-edit-actions"):
                    edit_button = gr.Button("Edit", variant="primary", min_width=100, elem_id="hui-edit")
                    stop_button = gr.Button("Stop", variant="stop", min_width=100, elem_id="hui-stop")
                # The examples right under Edit, not below Region and Advanced: on a phone they were two
                # screens down (issue 56); a phone shows them compact (layout.APP_CSS).
                world = world_examples(config)  # the trained offline model knows only its shapes world
                examples = world or load_examples(variant)
                example_set = None
                if examples:
                    label = (
                        "Examples from the offline model's world (it knows only these scenes and words)"
                        if world
                        else "Examples (CC0, see assets/)"
                    )
                    example_set = gr.Examples(
                        examples=examples,
                        inputs=[image, form["instruction"]],
                        cache_examples=False,
                        examples_per_page=len(examples),
                        label=label,
                        elem_id="hui-examples",
                    )
                gr.Markdown(world_hint(config) or variant_hint(variant), elem_classes=["hui-hint"])
            # The result area: the progress bar, the before/after slider (and, from the pipeline,
            # the live previews) all show here, beside the button on a wide screen, right under it
            # on a phone.
            with gr.Column(min_width=300, elem_id="hui-result-area"):
                result_slider = gr.ImageSlider(
                    label="Before / after",
                    type="pil",
                    format="png",
                    interactive=False,
                    max_height=420,
                    elem_id="hui-result",
                )
                summary = gr.Markdown(elem_id="hui-summary")
                # Hidden until the first result: an empty Number would read "0".
                # Widths: a seed has up to 10 digits and its label must stay on one line beside the two
                # buttons in the result column of a 1440 px screen (it was cut to "334768" under "Seed / used").
                with gr.Row(equal_height=True, visible=False) as result_details:
                    edit_result_button = gr.Button(
                        "Edit the result", variant="secondary", min_width=110, elem_id="hui-edit-result"
                    )
                    # The saved file, not the slider's re-encoded copy: it carries the settings (PNG
                    # text chunk) that the History tab can read back.
                    saved_png = gr.DownloadButton(
                        "Download PNG", value=None, variant="secondary", min_width=110, elem_id="hui-saved"
                    )
                    seed_used = gr.Number(
                        value=None,
                        label="Seed used",
                        interactive=False,
                        precision=0,
                        placeholder="shown after the edit",
                        min_width=170,
                        elem_id="hui-seed-used",
                    )
                # "Send to my phone" and, with --wall, "Show on the wall": ui/share_phone.py.
                from hidream_ui.ui.share_phone import build_share_phone

                build_share_phone(config, result_slider, saved_png)
        with gr.Accordion("Rewritten instruction", open=True, visible=rewriter is not None, elem_id="hui-rewrite-box"):
            rewritten = gr.Textbox(label="Prompt the edit uses (editable)", lines=3, elem_id="hui-rewritten")
            rewrite_note = gr.Markdown(elem_id="hui-rewrite-note")
            with gr.Row():
                rewrite_button = gr.Button("Rewrite", size="sm", elem_id="hui-rewrite")
                edit_rewritten_button = gr.Button("Edit with this", size="sm", elem_id="hui-edit-rewritten")
            rewrite_details = gr.JSON(label="Rewriter's answer", open=False, elem_id="hui-rewrite-details")
        # Region edits: a brush on the source image (region_editor). Painted = may change, the rest
        # keeps the source; nothing painted: the whole image may change.
        with gr.Accordion("Region (optional): paint where the edit may change", open=False, elem_id="hui-region-box"):
            mask = build_region_editor("hui-mask")
            with gr.Row(equal_height=False):
                gr.Markdown(REGION_HINT, elem_classes=["hui-hint"])
                clear_region = gr.Button(
                    "Clear the region", size="sm", variant="secondary", min_width=140, scale=0, elem_id="hui-mask-clear"
                )
        with gr.Accordion("Advanced settings", open=False, elem_id="hui-advanced"):
            form["negative_prompt"] = widget("negative_prompt", value["negative_prompt"])
            with gr.Row():
                for name in ("guidance_scale", "image_guidance_scale", "num_inference_steps", "refine_strength"):
                    form[name] = widget(name, value[name], min_width=240)
            with gr.Row():
                form["working_resolution"] = widget("working_resolution", value["working_resolution"], min_width=240)
                form["seed"] = widget("seed", value["seed"], min_width=160)
                form["randomize_seed"] = widget("randomize_seed", FIELD_SPECS["randomize_seed"].default, min_width=160)
            with gr.Row():
                form["clip_cfg_norm"] = widget("clip_cfg_norm", value["clip_cfg_norm"])
                form["collapse_padding"] = widget("collapse_padding", value["collapse_padding"])
        last_entry = gr.State(None)
    return EditTabHandles(
        image=image,
        form=form,
        mask=mask,
        clear_region=clear_region,
        rewrite=rewrite,
        edit_button=edit_button,
        stop_button=stop_button,
        rewritten=rewritten,
        rewrite_note=rewrite_note,
        rewrite_button=rewrite_button,
        edit_rewritten_button=edit_rewritten_button,
        rewrite_details=rewrite_details,
        result_slider=result_slider,
        result_details=result_details,
        seed_used=seed_used,
        saved_png=saved_png,
        summary=summary,
        last_entry=last_entry,
        edit_result_button=edit_result_button,
        examples=example_set,
    )


def wire_edit_tab(tab: EditTabHandles, handlers: EditHandlers, lane: int, on_edit) -> list[tuple[gr.Button, Any]]:
    """The tab's events. `lane`: device jobs at once (one per engine); `on_edit(event)` chains what a
    finished edit updates elsewhere (the History tab). Returns (button, event) for each run the
    page should watch (`system_panel.watch_run`: the button is unavailable while it runs)."""
    instruction = tab.form["instruction"]
    private = {"queue": False, "show_progress": "hidden", "api_visibility": "private"}
    rewrite_outputs = [tab.rewritten, tab.rewrite_details, tab.rewrite_note]
    # The progress and the result come into view when an edit starts (in the browser only). First
    # of the click's listeners: the browser runs them in order, and the others wait for the server.
    for button in (tab.edit_button, tab.edit_rewritten_button):
        button.click(None, None, None, js=SHOW_RESULT_JS, **private)
        disable_on_click(button)
    # The progress sits on the summary, right under the before/after slider, so the live previews
    # streamed into the slider stay visible while the edit runs (an overlay on the slider hid them).
    # preprocess=False: the handler opens the upload itself and can say what is wrong with a damaged
    # file (gradio's own decode error is a developer message).
    edit_event = device_run(
        tab.edit_button,
        handlers.edit,
        [tab.image, *tab.inputs, tab.rewrite, tab.mask],
        tab.outputs,
        api_name="edit",
        lane=lane,
        progress_on=tab.summary,
    )
    on_edit(edit_event).then(handlers.show_rewrite, [tab.last_entry], rewrite_outputs, **private)

    # Rewriting: "Rewrite" shows the prompt (editable) before any edit; "Edit with this" edits with
    # the box's text and records the rewriter's answer beside it. A remote rewriter's requests wait
    # on the network, not the device: their own lane (see common.REWRITER_GROUP).
    on_device = handlers.services.rewriter is not None and handlers.services.rewriter.uses_device
    rewrite_event = tab.rewrite_button.click(
        handlers.rewrite,
        inputs=[tab.image, instruction],
        outputs=[tab.rewritten, tab.rewrite_details],
        api_name="rewrite",
        concurrency_id=DEVICE_GROUP if on_device else REWRITER_GROUP,
        concurrency_limit=lane if on_device else REWRITER_CONCURRENCY,
        preprocess=False,
        show_progress_on=[tab.rewritten],
    )
    rewrite_event.success(handlers.rewrite_note, [tab.rewrite_details], [tab.rewrite_note], **private)
    rewrite_event.failure(handlers.rewrite_failed, [instruction], rewrite_outputs, **private)
    edit_rewritten_event = device_run(
        tab.edit_rewritten_button,
        handlers.edit_rewritten,
        [tab.image, tab.rewritten, tab.rewrite_details, *tab.inputs[1:], tab.mask],
        tab.outputs,
        api_name="edit_rewritten",
        lane=lane,
        progress_on=tab.summary,
    )
    on_edit(edit_rewritten_event)
    if tab.examples is not None:  # an example picked far down the page: back to the form it filled
        tab.examples.dataset.click(None, None, None, js=SHOW_FORM_JS, **private)
    # A rewrite belongs to one image and one instruction: a new one clears it. In the browser only
    # (`js`, no handler): `.input` fires on every keystroke.
    for trigger in (instruction.input, tab.image.change):
        trigger(None, None, rewrite_outputs, js=CLEAR_REWRITE_JS, **private)
    # An error belongs to the form it refused: any change to the form dismisses it (in the browser,
    # layout.APP_JS: gradio's own input/change events did not reach a js-only listener here).
    # An upload is checked when it arrives (a text file renamed .png is refused now, not at Edit).
    # It decodes a client's file: queued on the small settings-file lane, like the PNG reader.
    tab.image.upload(
        handlers.check_source,
        [tab.image],
        [tab.image, tab.summary],
        concurrency_id=SETTINGS_FILE_GROUP,
        concurrency_limit=SETTINGS_FILE_CONCURRENCY,
        show_progress="hidden",
        api_visibility="private",
        preprocess=False,
    )
    # The region editor shows the source to paint on, whatever put it there (an upload, an example,
    # "Edit the result", History's "Edit again"); a new source starts with nothing painted. "Clear
    # the region" (and the editor's own clear) start over on the same source. No .change or .input
    # listener on the editor itself: with one the browser would send its layers by id, not as files
    # (region_editor.py). preprocess=False: the gate hands over the stored file, nothing is decoded.
    region = {"queue": False, "show_progress": "hidden", "api_visibility": "private", "preprocess": False}
    tab.image.change(handlers.region_background, [tab.image], [tab.mask], **region)
    tab.clear_region.click(handlers.region_background, [tab.image], [tab.mask], **region)
    tab.mask.clear(handlers.region_background, [tab.image], [tab.mask], **region)
    # The edit loop: the result becomes the source; the instruction box keeps its text to be changed.
    tab.edit_result_button.click(handlers.edit_result, [tab.last_entry], [tab.image, tab.summary], **private)
    tab.edit_result_button.click(None, None, None, js=SHOW_FORM_JS, **private)
    # Stop never queues: it must get through while the edit holds the device group. Its answer
    # ("Stopped after k of N steps") replaces the summary: a stop is not an error.
    tab.stop_button.click(
        handlers.stop,
        None,
        [*tab.outputs, tab.result_details],  # Stop clears what it stopped (EditHandlers.stop)
        cancels=[edit_event, edit_rewritten_event, rewrite_event],
        **private,
    )
    return [(tab.edit_button, edit_event), (tab.edit_rewritten_button, edit_rewritten_event)]


__all__ = [
    "EditTabHandles",
    "build_edit_tab",
    "wire_edit_tab",
    "load_examples",
    "rewrite_info",
    "CLEAR_REWRITE_JS",
    "SHOW_RESULT_JS",
    "SHOW_FORM_JS",
]
