"""Working-size geometry: how a source image becomes the model's input and the result its size again.

Pure arithmetic on sizes plus the two PIL resizes that follow it (`to_working_size`,
`restore_size`); decoding uploads is `imaging.py`'s job. E1.1 keeps the area near 1024^2 at the
source's aspect ratio (multiples of 16, the transformer's patch grid times the VAE's factor);
E1-Full resizes to 768x768; "draft" and explicit sides are ours (README "Working resolution").
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from PIL import Image

from hidream_ui.edits import RequestError, parse_working_resolution
from hidream_ui.variants import VARIANTS

__all__ = [
    "RESTORE_RESAMPLE",
    "WorkingPlan",
    "e11_plan",
    "e11_working_size",
    "prepare_working_image",
    "resize_plan",
    "restore_size",
    "to_working_size",
    "working_plan",
]

# Bicubic is what upstream gets from `Image.resize(original_size)` (Pillow's default filter for RGB
# since Pillow 7), so results are restored exactly as the reference scripts restore them.
RESTORE_RESAMPLE = Image.Resampling.BICUBIC


# ---------------------------------------------------------------------------------------------
# Working size
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class WorkingPlan:
    """How a source image becomes the model input; enough to redo or explain it.

    Steps: ``halvings`` BOX halvings (each ``(w // 2, h // 2)``), then a bicubic resize to
    ``resized_size``, then a crop with ``crop_box`` (left, top, right, bottom in resized
    coordinates) giving ``working_size``.
    """

    source_size: tuple[int, int]
    halvings: int
    resized_size: tuple[int, int]
    crop_box: tuple[int, int, int, int]
    working_size: tuple[int, int]

    @property
    def halved_size(self) -> tuple[int, int]:
        width, height = self.source_size
        return width >> self.halvings, height >> self.halvings


def e11_plan(width: int, height: int, image_size: int = 1024, multiple: int = 16) -> WorkingPlan:
    """The HiDream-E1.1 working-size rule (as in the upstream demo's ``resize_image``).

    1. Halve (BOX) while the short side is >= 2 * image_size: cheap anti-aliasing before the
       bicubic step.
    2. Pick the largest of the four size candidates ``round|floor(side * scale) // m * m``
       (scale = sqrt(image_size**2 / area)) whose area is <= image_size**2.
    3. Resize bicubic, aspect preserved, to cover that size and centre-crop to it.

    Unlike upstream, degenerate aspect ratios (a side that would round to 0) are clamped to one
    ``multiple`` and the long side is then capped so the area stays within image_size**2.
    """
    for label, value in (("width", width), ("height", height), ("image_size", image_size), ("multiple", multiple)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{label} must be a positive integer (got {value!r})")
    if image_size < multiple:
        raise ValueError(f"image_size must be >= multiple (got {image_size} < {multiple})")

    halvings = 0
    w, h = width, height
    while min(w, h) >= 2 * image_size:
        w, h = w // 2, h // 2
        halvings += 1

    area_max = image_size * image_size
    scale = math.sqrt(area_max / (w * h))
    sw, sh = w * scale, h * scale
    candidates = [
        (round(sw) // multiple * multiple, round(sh) // multiple * multiple),
        (round(sw) // multiple * multiple, math.floor(sh) // multiple * multiple),
        (math.floor(sw) // multiple * multiple, round(sh) // multiple * multiple),
        (math.floor(sw) // multiple * multiple, math.floor(sh) // multiple * multiple),
    ]
    candidates.sort(key=lambda size: size[0] * size[1], reverse=True)
    # floor/floor never exceeds the budget, so a candidate is always found.
    target_w, target_h = next(c for c in candidates if c[0] * c[1] <= area_max)
    target_w, target_h = _clamp_degenerate(target_w, target_h, area_max, multiple)

    # Cover the target with the aspect ratio kept, then centre-crop (upstream's arithmetic).
    s1, s2 = w / target_w, h / target_h
    if s1 < s2:
        resized = (target_w, max(target_h, round(h / s1)))
        top = (resized[1] - target_h) // 2
        box = (0, top, target_w, top + target_h)
    else:
        resized = (max(target_w, round(w / s2)), target_h)
        left = (resized[0] - target_w) // 2
        box = (left, 0, left + target_w, target_h)
    return WorkingPlan(
        source_size=(width, height),
        halvings=halvings,
        resized_size=resized,
        crop_box=box,
        working_size=(target_w, target_h),
    )


def _clamp_degenerate(w: int, h: int, area_max: int, multiple: int) -> tuple[int, int]:
    if w >= multiple and h >= multiple:
        return w, h
    # A 16 x 40000 strip: one side rounds to 0. Give it one grid cell and cap the other side so
    # the token count stays within the budget; the crop then takes the middle of the strip.
    long_cap = max(multiple, area_max // multiple // multiple * multiple)
    if w < multiple:
        return multiple, min(max(h, multiple), long_cap)
    return min(max(w, multiple), long_cap), multiple


def e11_working_size(width: int, height: int, image_size: int = 1024, multiple: int = 16) -> tuple[int, int]:
    """The E1.1 working size for a source of ``width`` x ``height`` (see :func:`e11_plan`)."""
    return e11_plan(width, height, image_size, multiple).working_size


def resize_plan(width: int, height: int, size: tuple[int, int]) -> WorkingPlan:
    """A plain resize to ``size`` (aspect ratio not kept), as upstream does for E1-Full."""
    return WorkingPlan(
        source_size=(width, height),
        halvings=0,
        resized_size=tuple(size),
        crop_box=(0, 0, size[0], size[1]),
        working_size=tuple(size),
    )


def to_working_size(image: Image.Image, plan: WorkingPlan) -> Image.Image:
    """Execute ``plan`` on ``image`` (which must have ``plan.source_size``)."""
    if image.size != plan.source_size:
        raise ValueError(f"the plan is for a {plan.source_size} image, got {image.size}")
    for _ in range(plan.halvings):
        image = image.resize((image.width // 2, image.height // 2), resample=Image.Resampling.BOX)
    if image.size != plan.resized_size:
        image = image.resize(plan.resized_size, resample=Image.Resampling.BICUBIC)
    if plan.crop_box != (0, 0, *plan.resized_size):
        image = image.crop(plan.crop_box)
    return image.copy() if image.size == plan.source_size else image


def _draft_side(side: int, divisor: float, multiple: int = 16) -> int:
    return max(multiple, int(round(side / divisor / multiple)) * multiple)


def working_plan(
    size: tuple[int, int],
    *,
    variant: str,
    image_size: int = 1024,
    working_resolution: str | int = "auto",
    fixed_size: tuple[int, int] = (768, 768),
) -> WorkingPlan:
    """The plan that maps a source of `size` (width, height) to the size the ``variant`` runs at.

    * ``"e1.1"``: the E1.1 area rule (:func:`e11_plan`) with side ``image_size`` for "auto",
      ``image_size / 2`` (on the 16-px grid) for "draft", or the given side.
    * ``"e1-full"``: a plain resize (no crop, as upstream) to ``fixed_size`` for "auto", to
      ``fixed_size / 1.5`` (768 -> 512) for "draft", or to N x N for a given side.

    Pure arithmetic: callers that only need the working size (grouping a batch, checking a
    compare grid) never resize a pixel.
    """
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {', '.join(VARIANTS)} (got {variant!r})")
    try:
        resolution = parse_working_resolution(working_resolution)
    except RequestError as exc:
        raise ValueError(str(exc)) from None
    width, height = size
    if variant == "e1.1":
        if resolution == "auto":
            side = image_size
        elif resolution == "draft":
            side = _draft_side(image_size, 2.0)
        else:
            side = int(resolution)
        return e11_plan(width, height, side)
    if resolution == "auto":
        target = (int(fixed_size[0]), int(fixed_size[1]))
    elif resolution == "draft":
        target = (_draft_side(fixed_size[0], 1.5), _draft_side(fixed_size[1], 1.5))
    else:
        target = (int(resolution), int(resolution))
    return resize_plan(width, height, target)


def prepare_working_image(
    image: Image.Image,
    *,
    variant: str,
    image_size: int = 1024,
    working_resolution: str | int = "auto",
    fixed_size: tuple[int, int] = (768, 768),
) -> tuple[Image.Image, WorkingPlan]:
    """Resize a normalised RGB image to the size the ``variant`` runs at (see :func:`working_plan`)."""
    plan = working_plan(
        image.size, variant=variant, image_size=image_size, working_resolution=working_resolution, fixed_size=fixed_size
    )
    return to_working_size(image, plan), plan


def restore_size(image: Image.Image, size: tuple[int, int]) -> Image.Image:
    """Resize a result back to the source size (bicubic, like upstream's ``resize(original_size)``).

    For E1.1 the working image was centre-cropped by up to ``multiple - 1`` pixels; like upstream,
    the result is stretched back over the full source frame rather than padded.
    """
    size = (int(size[0]), int(size[1]))
    if size[0] < 1 or size[1] < 1:
        raise ValueError(f"size must be positive (got {size})")
    if image.size == size:
        return image.copy()
    return image.resize(size, resample=RESTORE_RESAMPLE)
