"""A region to edit, as the Edit and Compare tabs receive it: the region editor's painted layers or
an uploaded mask file -> a validated `EditMask` (hidream_ui.edits). Opened through the same upload
gate and decoder as a source image: only files gradio stored for this app are opened, never a path
a client names.
"""

from __future__ import annotations

from typing import Any, Mapping

from PIL import Image

from hidream_ui.edits import RequestError, validated_mask
from hidream_ui.ui.services import AppServices

MAX_REGION_LAYERS = 8  # the brush paints one; each is a full-size image to decode
# An editor value that names its layers only by an id: the browser streamed them to the component
# (it does when the editor has a .change or .input listener), where only gradio's preprocessing finds them.
LAYERS_NOT_SENT = (
    "the painted layers as files (the region did not arrive: paint it again, or send a mask file "
    "or {background, layers, composite} with the layers as files)"
)


def open_region(services: AppServices, mask) -> Any:
    """The validated EditMask of an optional mask (None: none), for /edit and /compare: an uploaded
    file (white = may change, black = keep), or the region editor's value (`region_editor`: its
    painted layers, ``preprocess=False``; transparent = keep, painted = may change; nothing painted:
    no mask). Through the same gate and decoder as a source image: only files gradio stored for
    this app are opened, never a path a client names."""
    from PIL import ImageChops

    from hidream_ui.imaging import open_mask

    def opened(value, layer: bool = False) -> tuple[Any, str | None]:
        source, name = services.gate.path(value, "mask")
        return open_mask(source, max_pixels=services.config.max_pixels, name=name, layer=layer), name

    if mask is None:
        return None
    if isinstance(mask, Mapping) and "path" not in mask and ("layers" in mask or "background" in mask):
        layers = mask.get("layers") or []
        if not isinstance(layers, list) or len(layers) > MAX_REGION_LAYERS:
            what = f"{len(layers)} layers" if isinstance(layers, list) else type(layers).__name__
            raise RequestError("mask", what, f"layers as a list of at most {MAX_REGION_LAYERS} image files")
        if not layers and mask.get("id"):
            raise RequestError("mask", "an editor value without its layers", LAYERS_NOT_SENT)
        planes = [opened(layer, layer=True)[0] for layer in layers if layer]
        if not planes or all(plane.getbbox() is None for plane in planes):
            return None  # nothing painted: the whole image may change, exactly as without a mask
        union = planes[0]
        for plane in planes[1:]:
            union = ImageChops.lighter(union, plane.resize(union.size))
        return validated_mask(union, "painted region")
    plane, name = opened(mask)
    return validated_mask(plane, name)


def source_size(source: Any, name: str | None = None) -> tuple[int, int]:
    """The size of a source the gate let through (a stored file: from its header, nothing decoded)."""
    from hidream_ui.imaging import open_header

    if isinstance(source, Image.Image):
        return source.size
    with open(source, "rb") as fp, open_header(fp, name or "image") as picture:
        return picture.size


__all__ = ["LAYERS_NOT_SENT", "MAX_REGION_LAYERS", "open_region", "source_size"]
