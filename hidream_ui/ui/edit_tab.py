"""The Edit tab: one image, one instruction, the settings of hidream_ui.edits.FIELDS -> before/after.

`build_edit_tab(...)` adds the tab to the Blocks being built and returns its `EditTabHandles`;
`wire_edit_tab(...)` connects its events (``/edit``, ``/rewrite``, ``/edit_rewritten``, Stop) once
the History tab exists (a finished edit is added to it). The handlers are `handlers.Handlers`.

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
    example_instruction,
    instruction_placeholder,
    variant_hint,
    widget,
)
from hidream_ui.ui.handlers import Handlers
from hidream_ui.ui.services import ASSETS_DIR

logger = logging.getLogger(__name__)

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
    mask: gr.Image  # optional region mask (white = may change): the last input of /edit and /edit_rewritten
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
    summary: gr.Markdown
    last_entry: gr.State  # the finished edit's History entry

    @property
    def inputs(self) -> list[Any]:
        return [self.form[name] for name in EDIT_FORM]

    @property
    def outputs(self) -> list[Any]:
        return [self.result_slider, self.saved_png, self.seed_used, self.summary, self.last_entry]


def build_edit_tab(config: AppConfig, rewriter) -> EditTabHandles:
    """Adds the Edit tab (call inside `gr.Tabs()`); widgets only, `wire_edit_tab` connects them."""
    variant = config.variant
    defaults = EditParams.defaults_for(variant)
    value = defaults.to_dict()
    form: dict[str, Any] = {}
    with gr.Tab("Edit", id="edit"):
        with gr.Row(equal_height=False):
            with gr.Column():
                image = gr.Image(label="Source image", sources=["upload", "clipboard", "webcam"], type="filepath",
                                 image_mode=None, height=340, elem_id="hui-source")
                form["instruction"] = widget("instruction", "", lines=2, placeholder=instruction_placeholder(variant),
                                             elem_id="hui-instruction")
                # On by default for E1-Full, the variant trained on the long two-part prompts
                # (upstream's "Refine Instruction"); hidden without a rewriter.
                rewrite = gr.Checkbox(value=rewriter is not None and variant == "e1-full",
                                      visible=rewriter is not None, label="Rewrite instruction",
                                      info=rewrite_info(rewriter, variant), elem_id="hui-rewrite-on")
                gr.Markdown(variant_hint(variant))
                form["negative_prompt"] = widget("negative_prompt", value["negative_prompt"])
                with gr.Row():
                    edit_button = gr.Button("Edit", variant="primary", elem_id="hui-edit")
                    stop_button = gr.Button("Stop", variant="stop", elem_id="hui-stop")
                with gr.Accordion("Rewritten instruction", open=True, visible=rewriter is not None,
                                  elem_id="hui-rewrite-box"):
                    rewritten = gr.Textbox(label="Prompt the edit uses (editable)", lines=3, elem_id="hui-rewritten")
                    rewrite_note = gr.Markdown(elem_id="hui-rewrite-note")
                    with gr.Row():
                        rewrite_button = gr.Button("Rewrite", size="sm", elem_id="hui-rewrite")
                        edit_rewritten_button = gr.Button("Edit with this", size="sm", elem_id="hui-edit-rewritten")
                    rewrite_details = gr.JSON(label="Rewriter's answer", open=False, elem_id="hui-rewrite-details")
                with gr.Accordion("Advanced settings", open=False):
                    for name in ("guidance_scale", "image_guidance_scale", "num_inference_steps", "refine_strength",
                                 "clip_cfg_norm", "working_resolution"):
                        form[name] = widget(name, value[name])
                    with gr.Row():
                        form["seed"] = widget("seed", value["seed"])
                        form["randomize_seed"] = widget("randomize_seed", FIELD_SPECS["randomize_seed"].default)
                    form["collapse_padding"] = widget("collapse_padding", value["collapse_padding"])
                    # Region edits (an upload; a brush on the source is the integrator's to add).
                    mask = gr.Image(label="Region mask (optional): white = may change, black = keep",
                                    sources=["upload", "clipboard"], type="filepath", image_mode=None, height=160,
                                    elem_id="hui-mask")
            with gr.Column():
                result_slider = gr.ImageSlider(label="Before / after", type="pil", format="png", interactive=False,
                                               max_height=460, elem_id="hui-result")
                # Hidden until the first result: an empty Number would read "0".
                with gr.Row(equal_height=True, visible=False) as result_details:
                    seed_used = gr.Number(value=None, label="Seed used", interactive=False, precision=0,
                                          placeholder="shown after the edit", elem_id="hui-seed-used")
                    # The saved file, not the slider's re-encoded copy: it carries the settings (PNG
                    # text chunk) that the History tab can read back.
                    saved_png = gr.DownloadButton("Download PNG (with settings)", value=None, variant="secondary",
                                                  elem_id="hui-saved")
                summary = gr.Markdown(label="Summary", elem_id="hui-summary")
        examples = load_examples(variant)
        if examples:
            gr.Examples(examples=examples, inputs=[image, form["instruction"]], cache_examples=False,
                        examples_per_page=len(examples), label="Examples (CC0, see assets/)")
        last_entry = gr.State(None)
    return EditTabHandles(image=image, form=form, mask=mask, rewrite=rewrite, edit_button=edit_button,
                          stop_button=stop_button,
                          rewritten=rewritten, rewrite_note=rewrite_note, rewrite_button=rewrite_button,
                          edit_rewritten_button=edit_rewritten_button, rewrite_details=rewrite_details,
                          result_slider=result_slider, result_details=result_details, seed_used=seed_used,
                          saved_png=saved_png, summary=summary, last_entry=last_entry)


def wire_edit_tab(tab: EditTabHandles, handlers: Handlers, lane: int, on_edit) -> None:
    """The tab's events. `lane`: device jobs at once (one per engine); `on_edit(event)` chains what a
    finished edit updates elsewhere (the History tab)."""
    instruction = tab.form["instruction"]
    private = {"queue": False, "show_progress": "hidden", "api_visibility": "private"}
    rewrite_outputs = [tab.rewritten, tab.rewrite_details, tab.rewrite_note]
    # preprocess=False: the handler opens the upload itself and can say what is wrong with a damaged
    # file (gradio's own decode error is a developer message). The progress sits on the summary: the
    # slider shows the live previews meanwhile (gradio's progress overlay would hide them).
    edit_event = tab.edit_button.click(
        handlers.edit, inputs=[tab.image, *tab.inputs, tab.rewrite, tab.mask], outputs=tab.outputs, api_name="edit",
        concurrency_id=DEVICE_GROUP, concurrency_limit=lane, preprocess=False, show_progress_on=[tab.summary])
    on_edit(edit_event).then(handlers.show_rewrite, [tab.last_entry], rewrite_outputs, **private)

    # Rewriting: "Rewrite" shows the prompt (editable) before any edit; "Edit with this" edits with
    # the box's text and records the rewriter's answer beside it. A remote rewriter's requests wait
    # on the network, not the device: their own lane (see common.REWRITER_GROUP).
    on_device = handlers.services.rewriter is not None and handlers.services.rewriter.uses_device
    rewrite_event = tab.rewrite_button.click(
        handlers.rewrite, inputs=[tab.image, instruction], outputs=[tab.rewritten, tab.rewrite_details],
        api_name="rewrite", concurrency_id=DEVICE_GROUP if on_device else REWRITER_GROUP,
        concurrency_limit=lane if on_device else REWRITER_CONCURRENCY, preprocess=False,
        show_progress_on=[tab.rewritten])
    rewrite_event.success(handlers.rewrite_note, [tab.rewrite_details], [tab.rewrite_note], **private)
    rewrite_event.failure(handlers.rewrite_failed, [instruction], rewrite_outputs, **private)
    edit_rewritten_event = tab.edit_rewritten_button.click(
        handlers.edit_rewritten, inputs=[tab.image, tab.rewritten, tab.rewrite_details, *tab.inputs[1:], tab.mask],
        outputs=tab.outputs, api_name="edit_rewritten", concurrency_id=DEVICE_GROUP, concurrency_limit=lane,
        preprocess=False, show_progress_on=[tab.summary])
    on_edit(edit_rewritten_event)
    # A rewrite belongs to one image and one instruction: a new one clears it. In the browser only
    # (`js`, no handler): `.input` fires on every keystroke.
    for trigger in (instruction.input, tab.image.change):
        trigger(None, None, rewrite_outputs, js=CLEAR_REWRITE_JS, **private)
    # Stop never queues: it must get through while the edit holds the device group.
    tab.stop_button.click(handlers.stop, None, None, cancels=[edit_event, edit_rewritten_event, rewrite_event],
                          **private)


__all__ = ["EditTabHandles", "build_edit_tab", "wire_edit_tab", "load_examples", "rewrite_info", "CLEAR_REWRITE_JS"]
