"""The region brush: a `gr.ImageEditor` over the source image where people paint what may change.

Its value is the `mask` input of ``/edit`` and ``/edit_rewritten`` (their last input). The handlers
read it with ``preprocess=False`` (`region_input.open_region`): the painted layers as files gradio
stored for this app (transparent = keep, painted = may change). API clients keep sending a plain
mask file (white = may change, black = keep) in the same place, so the component's data model
takes either: gradio's own ImageEditor model would validate a plain file into an empty editor
value (pydantic drops the unknown keys) and the mask would be lost without a word.

Two things keep the painted layers reaching the handler as files:
* no ``.change`` / ``.input`` listener on the editor: with one, the browser streams its layers to
  the component's blob store and sends only an id, which only gradio's preprocessing resolves
  (`region_input.open_region` refuses such a value with what to do rather than edit everywhere);
* the background is the source image (set by `EditHandlers.region_background` whenever the source
  changes): the layers have the source's size, so the mask has its shape.

Imports gradio at the top: only the UI imports this module.
"""

from __future__ import annotations

import logging
from typing import Mapping, Union

import gradio as gr
from gradio.components.image_editor import EditorData
from gradio.data_classes import FileData, GradioRootModel
from pydantic import Field, ValidationError

from hidream_ui.edits import RequestError
from hidream_ui.ui.common import gr_error, people_message

logger = logging.getLogger(__name__)

# What a `mask` value may be: the refusal of anything else says so.
MASK_EXPECTED = (
    'a mask file as gradio sends one ({"path": the path an upload returned, "meta": {"_type": '
    '"gradio.FileData"}}), a painted region {"background", "layers", "composite"} with its layers as '
    "such files, or null (no mask)"
)
EDITOR_KEYS = frozenset(EditorData.model_fields)  # background, layers, composite, id

# One colour, see-through so the picture stays visible under the paint (its alpha is what counts:
# imaging.open_mask).
BRUSH_COLOR = ("#e11d48", 0.55)
BRUSH_SIDE_FRACTION = 24  # brush radius = the source's shorter side / this (a 1024 px photo: 43 px)
MIN_BRUSH = 3
DEFAULT_BRUSH = 16  # px radius before a source is known


class RegionData(GradioRootModel):
    """The region the edit may change (optional; null: the whole image may change). Either a mask file (white = may
    change, black = keep; an image painted on transparency: painted = may change), or a painted region
    {"background": the source, "layers": [images painted on transparency], "composite": null}: painted = may change,
    transparent = keep, nothing painted = no mask."""

    # The docstring is what /gradio_api/info and gradio_client show for the parameter. The file is tried
    # first: an editor value has no `path`, so it never passes for a file.
    root: Union[FileData, EditorData] = Field(union_mode="left_to_right")

    @classmethod
    def model_validate(cls, obj, *args, **kwargs):
        """Gradio validates an input against its data model before the handler runs, outside the
        handler's error handling: a pydantic ValidationError there is logged with its traceback and
        reaches the client as {"error": null}. A value that is no mask is refused here instead, the
        way a handler refuses a bad field: one log line, and the client reads what `mask` may be.

        Also refused: a mapping with a `path` that is no valid file, and one with none of the
        editor's keys. The union would take either for an empty editor value (pydantic drops the
        unknown keys), and the edit would change the whole image without a word."""
        keys = obj.keys() if isinstance(obj, Mapping) else None
        if keys and "path" not in keys and not EDITOR_KEYS & keys:
            raise _refusal(obj)
        try:
            value = super().model_validate(obj, *args, **kwargs)
        except ValidationError:
            raise _refusal(obj) from None
        if keys and "path" in keys and not isinstance(value.root, FileData):
            raise _refusal(obj)
        return value


def _refusal(value: object) -> gr.Error:
    error = RequestError("mask", value, MASK_EXPECTED)
    logger.info("refused: %s", error)
    return gr_error(people_message(error))


# Strokes that start in the editor's margin (the canvas around the picture): gradio 6's brush starts a
# stroke only on a pointerdown over the picture (`on_pointer_down` returns when the cursor is not over
# the image) and never later, so a stroke begun a little outside painted nothing at all. This script
# (page-wide, installed once) follows such a press and, the first time it moves onto the picture,
# hands the canvas one pointerdown there: the brush then paints from where the stroke entered. The
# picture's place is the editor's own fit (centred, `border_padding` 30 px, scaled to fit, as its
# `calculate_min_zoom`) of the source's size (`#hui-source img`, the picture the editor shows). One
# pointerdown at most per press: a second one while drawing would restart the stroke and drop what it
# painted; one that lands outside the picture (a zoomed or panned view) is ignored by the brush itself.
# The synthetic event is sent after the real move has been handled (setTimeout), so the brush's cursor
# already knows it is over the picture.
MARGIN_STROKE_JS = """
(() => {
  if (window.__huiMarginStrokes) return;
  window.__huiMarginStrokes = true;
  const PAD = 30;  // gradio's ImageEditor border_padding
  const pictureRect = (canvas) => {
    const img = document.querySelector('#hui-source img');
    const box = canvas.getBoundingClientRect();
    if (!img || !img.naturalWidth || !img.naturalHeight || !box.width || !box.height) return null;
    const scale = Math.min((box.width - 2 * PAD) / img.naturalWidth, (box.height - 2 * PAD) / img.naturalHeight);
    const w = img.naturalWidth * scale, h = img.naturalHeight * scale;
    const left = box.left + (box.width - w) / 2, top = box.top + (box.height - h) / 2;
    return {left, top, right: left + w, bottom: top + h};
  };
  const inside = (r, x, y, margin) =>
    x >= r.left + margin && x <= r.right - margin && y >= r.top + margin && y <= r.bottom - margin;
  let pending = null;
  document.addEventListener('pointerdown', (e) => {
    pending = null;
    if (!e.isTrusted || e.button !== 0 || !(e.target instanceof HTMLCanvasElement)) return;
    if (!e.target.closest('#hui-mask')) return;
    const rect = pictureRect(e.target);
    if (rect && !inside(rect, e.clientX, e.clientY, -1)) pending = {id: e.pointerId, canvas: e.target};
  }, true);
  document.addEventListener('pointermove', (e) => {
    if (!pending || !e.isTrusted || e.pointerId !== pending.id || !(e.buttons & 1)) return;
    const rect = pictureRect(pending.canvas);
    if (!rect || !inside(rect, e.clientX, e.clientY, 2)) return;
    const {canvas} = pending;
    pending = null;
    const init = {
      bubbles: true, cancelable: true, composed: true, clientX: e.clientX, clientY: e.clientY,
      screenX: e.screenX, screenY: e.screenY, pointerId: e.pointerId, pointerType: e.pointerType,
      isPrimary: e.isPrimary, button: 0, buttons: 1, pressure: 0.5,
    };
    setTimeout(() => canvas.dispatchEvent(new PointerEvent('pointerdown', init)), 0);
  }, true);
  for (const type of ['pointerup', 'pointercancel']) {
    document.addEventListener(type, (e) => {
      if (e.isTrusted && pending && e.pointerId === pending.id) pending = null;
    }, true);
  }
})();
"""


def brush_radius(size: tuple[int, int] | None) -> int:
    """The brush's radius in source pixels: a stroke covers a sensible part of any image."""
    if not size:
        return DEFAULT_BRUSH
    return max(MIN_BRUSH, round(min(size) / BRUSH_SIDE_FRACTION))


def brush(size: tuple[int, int] | None = None) -> gr.Brush:
    return gr.Brush(
        colors=[BRUSH_COLOR], default_color=BRUSH_COLOR, color_mode="fixed", default_size=brush_radius(size)
    )


def eraser(size: tuple[int, int] | None = None) -> gr.Eraser:
    return gr.Eraser(default_size=brush_radius(size))


def build_region_editor(elem_id: str) -> gr.ImageEditor:
    """The editor, empty until a source image arrives (`EditHandlers.region_background` fills it).

    A plain gr.ImageEditor whose data model (an instance attribute, read by gradio when it validates
    an input and when it describes the API) is `RegionData`. Not a subclass: gradio writes a .pyi file
    beside the module of every Component subclass when the class is defined. Events that take it as an
    input run with ``preprocess=False`` (gradio's ImageEditor.preprocess expects its own model)."""
    editor = gr.ImageEditor(
        label="Paint where the edit may change",
        show_label=False,
        sources=[],
        transforms=(),
        layers=False,
        brush=brush(),
        eraser=eraser(),
        type="filepath",
        image_mode="RGBA",
        format="png",
        height=360,
        buttons=[],
        elem_id=elem_id,
    )
    editor.data_model = RegionData
    # An empty block whose only job is MARGIN_STROKE_JS (on load, page-wide, once).
    gr.HTML("", js_on_load=MARGIN_STROKE_JS, container=False, padding=False, elem_id=f"{elem_id}-strokes")
    return editor


__all__ = [
    "BRUSH_COLOR",
    "MARGIN_STROKE_JS",
    "MASK_EXPECTED",
    "RegionData",
    "brush",
    "brush_radius",
    "build_region_editor",
    "eraser",
]
