"""The synthetic world as the lab uses it: the runtime's scenes (hidream_ui/model/tiny/world.py, re-exported
here so lab code and tests read one namespace), the held-out cases and the success metric.

Why two modules: the app needs the world's scenes and words (the offline examples, the banner) but never the
ground truth that judges an edit; that stays here, out of the runtime. Nothing here changes a case: the cases
are the runtime's `make_case`, so training, `bench quality`, the quality floor test and the app's examples all
draw the very same scenes from a seed.

The metric (issue 22's rule): the named region has the named colour (nearest in the palette) and the untouched
region keeps at least UNTOUCHED_MIN_PSNR_DB of PSNR against the source. Only numpy (and PIL to resize an output)
is imported.
"""

from __future__ import annotations

import math

import numpy as np

from hidream_ui.model.tiny.world import (
    BACKGROUNDS,
    COLOURS,
    EDIT_KINDS,
    EXAMPLE_SEED_START,
    GAP,
    HELD_OUT_SEED_START,
    MAX_BOX,
    MIN_BOX,
    SHAPES,
    SIZE,
    WORDS,
    Case,
    Edit,
    Scene,
    Shape,
    apply_edit,
    example_cases,
    make_case,
    render,
    sample_edit,
    sample_scene,
    shape_mask,
)

__all__ = [
    "BACKGROUNDS",
    "COLOURS",
    "EDIT_KINDS",
    "EXAMPLE_SEED_START",
    "FLOOR_SEED_START",
    "GAP",
    "HELD_OUT_SEED_START",
    "MARGIN_PX",
    "MAX_BOX",
    "MIN_BOX",
    "SHAPES",
    "SIZE",
    "UNTOUCHED_MIN_PSNR_DB",
    "WORDS",
    "Case",
    "Edit",
    "Scene",
    "Shape",
    "apply_edit",
    "as_canvas",
    "dilate",
    "erode",
    "example_cases",
    "held_out_cases",
    "make_case",
    "moved_cells",
    "nearest",
    "psnr",
    "render",
    "sample_edit",
    "sample_scene",
    "score",
    "shape_mask",
    "untouched_mask",
]

# Erosion/dilation radius of the success metric and the PSNR an untouched region must keep.
MARGIN_PX = 3
UNTOUCHED_MIN_PSNR_DB = 22.0
# The quality floor test's cases (tests/test_quality_floor.py) start here: held out from training, past any
# `bench quality --cases N` and before the examples, so the floor is set on cases no choice was made on.
FLOOR_SEED_START = HELD_OUT_SEED_START + 250_000_000


def held_out_cases(n: int, start: int = HELD_OUT_SEED_START) -> list[Case]:
    """``n`` evaluation cases from the held-out seed range."""
    return [make_case(start + i) for i in range(n)]


def _disk_shift(mask: np.ndarray, radius: int, grow: bool) -> np.ndarray:
    """Dilate (grow) or erode a boolean mask with a disk of ``radius`` px; outside the canvas counts as
    not-in-mask for dilation and as in-mask for erosion (so shapes touching no border erode only inward)."""
    out = mask.copy()
    padded = np.pad(mask, radius, constant_values=not grow)
    for dy in range(-radius, radius + 1):
        for dx in range(-radius, radius + 1):
            if dy * dy + dx * dx > radius * radius:
                continue
            window = padded[radius + dy : radius + dy + SIZE, radius + dx : radius + dx + SIZE]
            out = (out | window) if grow else (out & window)
    return out


def dilate(mask: np.ndarray, radius: int = MARGIN_PX) -> np.ndarray:
    return _disk_shift(mask, radius, grow=True)


def erode(mask: np.ndarray, radius: int = MARGIN_PX) -> np.ndarray:
    return _disk_shift(mask, radius, grow=False)


def moved_cells(source: np.ndarray, target: np.ndarray, rows: int, columns: int) -> np.ndarray:
    """(rows, columns) bool: the cells of a rows x columns grid over the canvas (a latent pixel's share of the
    image) in which some pixel differs between `source` and `target`."""
    moved = (np.asarray(source) != np.asarray(target)).any(axis=-1)
    return moved.reshape(rows, SIZE // rows, columns, SIZE // columns).any(axis=(1, 3))


def psnr(a: np.ndarray, b: np.ndarray, mask: np.ndarray) -> float:
    """PSNR in dB over the masked pixels (inf when identical or the mask is empty)."""
    if not mask.any():
        return math.inf
    diff = a.astype(np.float64)[mask] - b.astype(np.float64)[mask]
    mse = float(np.mean(diff * diff))
    return math.inf if mse == 0 else 10 * math.log10(255.0**2 / mse)


def nearest(rgb: np.ndarray, palette: dict[str, tuple[int, int, int]]) -> str:
    """The name of the palette colour nearest `rgb` (the metric's verdict on a region's mean colour)."""
    return min(palette, key=lambda k: float(np.sum((rgb - np.asarray(palette[k], np.float64)) ** 2)))


def as_canvas(image) -> np.ndarray:
    """Accept a uint8 array or a PIL image; other sizes are resized to the canvas (bilinear)."""
    arr = np.asarray(image)
    if arr.ndim != 3 or arr.shape[2] < 3:
        raise ValueError(f"expected an RGB image, got an array of shape {arr.shape}")
    arr = arr[..., :3]
    if arr.shape[:2] != (SIZE, SIZE):
        from PIL import Image

        arr = np.asarray(Image.fromarray(arr.astype(np.uint8)).resize((SIZE, SIZE), Image.BILINEAR))
    return arr.astype(np.uint8)


def untouched_mask(case: Case) -> np.ndarray:
    """(SIZE, SIZE) bool: the pixels the edit must leave as they were. A background edit: the shape interiors
    (eroded, so anti-aliased rims that blend with the old background do not count); a shape edit: everything
    outside the dilated target shape."""
    masks = {s.kind: shape_mask(s) for s in case.scene.shapes}
    if case.edit.kind == "background":
        untouched = np.zeros((SIZE, SIZE), bool)
        for m in masks.values():
            untouched |= erode(m)
        return untouched
    return ~dilate(masks[case.edit.target])


def score(case: Case, output) -> dict:
    """Success of one edit by the issue's rule: the named region has the named colour (nearest in the
    palette) and the untouched region keeps at least UNTOUCHED_MIN_PSNR_DB of PSNR against the source."""
    out = as_canvas(output)
    src = case.source
    edit, scene = case.edit, case.scene
    masks = {s.kind: shape_mask(s) for s in scene.shapes}
    if edit.kind == "background":
        any_shape = np.zeros((SIZE, SIZE), bool)
        for m in masks.values():
            any_shape |= m
        region = ~dilate(any_shape)
        got = nearest(out[region].astype(np.float64).mean(axis=0), BACKGROUNDS)
        colour_ok = got == edit.value
    else:
        target = masks[edit.target]
        inner = erode(target)
        if not inner.any():  # a shape too thin to erode (never at 24 px, but keep the metric defined)
            inner = target
        mean = out[inner].astype(np.float64).mean(axis=0)
        if edit.kind == "recolour":
            got = nearest(mean, COLOURS)
            colour_ok = got == edit.value
        else:
            got = nearest(mean, {**COLOURS, **BACKGROUNDS})
            colour_ok = got == scene.background
    p = psnr(out, src, untouched_mask(case))
    return {
        "seed": case.seed,
        "kind": edit.kind,
        "instruction": edit.instruction,
        "got": got,
        "colour_ok": bool(colour_ok),
        "untouched_psnr_db": p,
        "success": bool(colour_ok and p >= UNTOUCHED_MIN_PSNR_DB),
    }
