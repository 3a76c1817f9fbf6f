"""The synthetic world of issue 22: seeded scenes, the three instruction templates, and the success metric.

Exact so that anyone can generate fresh cases: a 128x128 RGB canvas with one solid background colour and
1 to 3 shapes of different kinds, each in one of six colours, bounding box 24-40 px, at least 4 px apart and
fully inside the canvas. An edit is one of ``make the {shape} {colour}``, ``remove the {shape}`` or
``make the background {background}``. ``make_case(seed)`` draws a scene and an edit from that seed alone,
so training (seeds below ``HELD_OUT_SEED_START``) and evaluation (seeds from it upward) never share a case.

Only numpy is imported here; images are ``uint8`` arrays of shape (128, 128, 3).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

SIZE = 128
BACKGROUNDS = {"white": (245, 245, 245), "black": (20, 20, 20), "gray": (128, 128, 128)}
COLOURS = {
    "red": (220, 40, 40),
    "green": (40, 170, 60),
    "blue": (40, 80, 220),
    "yellow": (240, 210, 40),
    "purple": (140, 60, 180),
    "orange": (240, 130, 30),
}
SHAPES = ("circle", "square", "triangle")
EDIT_KINDS = ("recolour", "remove", "background")
MIN_BOX, MAX_BOX, GAP = 24, 40, 4
# Erosion/dilation radius of the success metric and the PSNR an untouched region must keep.
MARGIN_PX = 3
UNTOUCHED_MIN_PSNR_DB = 22.0
# Training draws seeds below this; `bench quality` draws from here upward, so no held-out case was seen.
HELD_OUT_SEED_START = 1_000_000_000
# The app's offline examples start here: held out from training, and past any `bench quality --cases N`.
EXAMPLE_SEED_START = HELD_OUT_SEED_START + 500_000_000
# The quality floor test's cases (tests/test_quality_floor.py) start here: held out from training, past any
# `bench quality --cases N` and before the examples, so the floor is set on cases no choice was made on.
FLOOR_SEED_START = HELD_OUT_SEED_START + 250_000_000
# Every word an instruction can contain (the trained tokenizers must know each of them).
WORDS = ("make", "the", "remove", "background", *SHAPES, *COLOURS, *BACKGROUNDS)


@dataclass(frozen=True)
class Shape:
    kind: str
    colour: str
    x: int  # left of the bounding box
    y: int  # top of the bounding box
    size: int  # the bounding box is size x size


@dataclass(frozen=True)
class Scene:
    background: str
    shapes: tuple[Shape, ...]
    antialias: bool


@dataclass(frozen=True)
class Edit:
    kind: str  # one of EDIT_KINDS
    target: str  # shape kind, or "background"
    value: str  # new colour or background name; "" for remove

    @property
    def instruction(self) -> str:
        if self.kind == "recolour":
            return f"make the {self.target} {self.value}"
        if self.kind == "remove":
            return f"remove the {self.target}"
        return f"make the background {self.value}"


@dataclass(frozen=True)
class Case:
    seed: int
    scene: Scene
    edit: Edit
    source: np.ndarray
    target: np.ndarray  # the exact answer: the edited scene rendered

    @property
    def instruction(self) -> str:
        return self.edit.instruction


def _coverage(shape: Shape, supersample: int = 4) -> np.ndarray:
    """Fraction of each pixel covered by the shape (supersampled), float32 (SIZE, SIZE)."""
    n = SIZE * supersample
    c = (np.arange(n, dtype=np.float32) + 0.5) / supersample
    yy, xx = np.meshgrid(c, c, indexing="ij")
    s = float(shape.size)
    x0, y0 = float(shape.x), float(shape.y)
    if shape.kind == "square":
        inside = (xx >= x0) & (xx < x0 + s) & (yy >= y0) & (yy < y0 + s)
    elif shape.kind == "circle":
        r = s / 2
        inside = (xx - x0 - r) ** 2 + (yy - y0 - r) ** 2 <= r * r
    elif shape.kind == "triangle":
        # Upright isosceles: apex at the top middle, base along the bottom of the box.
        t = (yy - y0) / s  # 0 at the apex row, 1 at the base
        half = t * s / 2
        inside = (t >= 0) & (t <= 1) & (np.abs(xx - x0 - s / 2) <= half)
    else:
        raise ValueError(f"unknown shape kind {shape.kind!r}; expected one of {SHAPES}")
    return inside.reshape(SIZE, supersample, SIZE, supersample).mean(axis=(1, 3)).astype(np.float32)


def shape_mask(shape: Shape) -> np.ndarray:
    """Boolean mask of the pixels that belong to the shape (coverage at least one half)."""
    return _coverage(shape) >= 0.5


def render(scene: Scene) -> np.ndarray:
    """The scene as a uint8 (128, 128, 3) image."""
    img = np.empty((SIZE, SIZE, 3), np.float32)
    img[:] = BACKGROUNDS[scene.background]
    for shape in scene.shapes:
        cov = _coverage(shape)
        if not scene.antialias:
            cov = (cov >= 0.5).astype(np.float32)
        img = img * (1 - cov[..., None]) + np.asarray(COLOURS[shape.colour], np.float32) * cov[..., None]
    return np.clip(np.rint(img), 0, 255).astype(np.uint8)


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


def _boxes_apart(a: Shape, b: Shape) -> bool:
    return (
        a.x + a.size + GAP <= b.x or b.x + b.size + GAP <= a.x or a.y + a.size + GAP <= b.y or b.y + b.size + GAP <= a.y
    )


def sample_scene(rng: np.random.Generator) -> Scene:
    """1-3 shapes of different kinds, placed by rejection so boxes are GAP px apart and inside the canvas."""
    while True:
        n = int(rng.integers(1, 4))
        kinds = [SHAPES[i] for i in rng.permutation(len(SHAPES))[:n]]
        shapes: list[Shape] = []
        for kind in kinds:
            for _ in range(100):
                size = int(rng.integers(MIN_BOX, MAX_BOX + 1))
                x = int(rng.integers(0, SIZE - size + 1))
                y = int(rng.integers(0, SIZE - size + 1))
                cand = Shape(kind, str(rng.choice(list(COLOURS))), x, y, size)
                if all(_boxes_apart(cand, other) for other in shapes):
                    shapes.append(cand)
                    break
        if len(shapes) == n:
            return Scene(str(rng.choice(list(BACKGROUNDS))), tuple(shapes), bool(rng.integers(0, 2)))


def sample_edit(scene: Scene, rng: np.random.Generator) -> Edit:
    """One of the three templates, uniformly by kind; the new colour/background always differs."""
    kind = EDIT_KINDS[int(rng.integers(0, len(EDIT_KINDS)))]
    if kind == "background":
        choices = [b for b in BACKGROUNDS if b != scene.background]
        return Edit("background", "background", str(rng.choice(choices)))
    shape = scene.shapes[int(rng.integers(0, len(scene.shapes)))]
    if kind == "remove":
        return Edit("remove", shape.kind, "")
    choices = [c for c in COLOURS if c != shape.colour]
    return Edit("recolour", shape.kind, str(rng.choice(choices)))


def apply_edit(scene: Scene, edit: Edit) -> Scene:
    """The scene the instruction asks for."""
    if edit.kind == "background":
        return replace(scene, background=edit.value)
    if edit.kind == "remove":
        return replace(scene, shapes=tuple(s for s in scene.shapes if s.kind != edit.target))
    if edit.kind == "recolour":
        return replace(
            scene, shapes=tuple(replace(s, colour=edit.value) if s.kind == edit.target else s for s in scene.shapes)
        )
    raise ValueError(f"unknown edit kind {edit.kind!r}; expected one of {EDIT_KINDS}")


def make_case(seed: int) -> Case:
    """The case of ``seed``: same seed, same scene, edit and images on every machine."""
    if seed < 0:
        raise ValueError(f"seed must be >= 0, got {seed}")
    rng = np.random.default_rng(seed)
    scene = sample_scene(rng)
    edit = sample_edit(scene, rng)
    return Case(seed, scene, edit, render(scene), render(apply_edit(scene, edit)))


def held_out_cases(n: int, start: int = HELD_OUT_SEED_START) -> list[Case]:
    """``n`` evaluation cases from the held-out seed range."""
    return [make_case(start + i) for i in range(n)]


def example_cases(per_kind: int = 2, start: int = EXAMPLE_SEED_START) -> list[Case]:
    """The first ``per_kind`` cases of each edit kind from ``start`` on (the app's offline examples): every
    kind shown, none picked by how well a model does on it."""
    chosen: dict[str, list[Case]] = {kind: [] for kind in EDIT_KINDS}
    seed = start
    while any(len(cases) < per_kind for cases in chosen.values()):
        case = make_case(seed)
        if len(chosen[case.edit.kind]) < per_kind:
            chosen[case.edit.kind].append(case)
        seed += 1
    return [case for kind in EDIT_KINDS for case in chosen[kind]]


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
