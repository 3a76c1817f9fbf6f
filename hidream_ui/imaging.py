"""Images in and out: open + validate + normalise uploads, and map them to the working size.

Two jobs, both pure PIL/numpy:

* :func:`open_image` turns whatever the UI, CLI or API hands us (bytes, a path, a file object, a
  PIL image, a numpy array) into a fully decoded 8-bit RGB image, or raises :class:`ImageError`
  with a message a user can act on. Nothing here touches PIL's process-wide settings
  (``Image.MAX_IMAGE_PIXELS``, ``ImageFile.LOAD_TRUNCATED_IMAGES``, warning filters): the limit
  is per call and checked from the header before any pixel is decoded.
* :func:`prepare_working_image` resizes to the size the model runs at, following the upstream
  rule of each variant, and returns a :class:`WorkingPlan` that records what was done;
  :func:`restore_size` maps the result back to the source size.
"""

from __future__ import annotations

import io
import logging
import math
import os
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Union

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from hidream_ui.config import VARIANTS
from hidream_ui.edits import RequestError, parse_working_resolution

__all__ = [
    "ACCEPTED_FORMATS",
    "ImageError",
    "ImageSource",
    "open_header",
    "sniff_format",
    "WorkingPlan",
    "open_image",
    "e11_plan",
    "e11_working_size",
    "resize_plan",
    "apply_plan",
    "prepare_working_image",
    "working_plan",
    "restore_size",
    "RESTORE_RESAMPLE",
]

logger = logging.getLogger(__name__)

ImageSource = Union[bytes, bytearray, memoryview, str, os.PathLike, IO[bytes], Image.Image, np.ndarray]

# Bicubic is what upstream gets from `Image.resize(original_size)` (Pillow's default filter for RGB
# since Pillow 7), so results are restored exactly as the reference scripts restore them.
RESTORE_RESAMPLE = Image.Resampling.BICUBIC

# Errors PIL raises for damaged files. PIL is not consistent: plugins raise OSError, SyntaxError,
# ValueError, EOFError or struct.error depending on where the damage is, and zlib.error escapes
# from some PNG paths.
_DECODE_ERRORS = (OSError, SyntaxError, ValueError, EOFError, IndexError, struct.error, zlib.error)

_WHITE = (255, 255, 255)

# The formats an upload may be, as Pillow names them. Each opens lazily: `Image.open` reads the
# header, the pixels are decoded by `load()`, so the size is checked before any decoding. Left out
# on purpose: ICO, CUR and ICNS decode a whole embedded image inside `Image.open` (a directory
# saying 256x256 can hold a 12000x12000 PNG: half a GB before any limit is looked at), and the
# long tail of Pillow plugins (PSD, EPS, FITS, DDS, ...) is attack surface nobody needs to upload
# a photo. TIFF stays for 16-bit scans (see `_to_uint8`); MPO opens as JPEG.
ACCEPTED_FORMATS = ("PNG", "JPEG", "WEBP", "BMP", "GIF", "TIFF")
ACCEPTED_NAMES = "PNG, JPEG, WebP, BMP, GIF or TIFF"
_SNIFF_BYTES = 16  # what Pillow's own format checks look at (`Image.open` reads as many)


class ImageError(ValueError):
    """The input is not a usable image; the message says which input and why."""


# ---------------------------------------------------------------------------------------------
# Opening
# ---------------------------------------------------------------------------------------------


def open_image(
    src: ImageSource,
    *,
    max_pixels: int = 40_000_000,
    min_side: int = 16,
    name: str | None = None,
) -> Image.Image:
    """Open, fully decode and normalise an image to 8-bit RGB.

    Accepts bytes, a path (``str``/``PathLike``), a binary file object, a PIL image or a numpy
    array (H x W or H x W x C with C in 1..4), which covers what Gradio and the CLI hand over.
    EXIF orientation is applied; transparency is composited on white; 16-bit and float greyscale
    are scaled to 8 bits (see :func:`_to_uint8`); animated images give their first frame.

    Raises :class:`ImageError` for unreadable, damaged or truncated data, for images with more
    than ``max_pixels`` pixels (checked from the header before decoding) and for images with a
    side shorter than ``min_side``.
    """
    if max_pixels < 1 or min_side < 1:
        raise ValueError(f"max_pixels and min_side must be >= 1 (got {max_pixels}, {min_side})")
    label = name or _describe(src)

    if isinstance(src, np.ndarray):
        _check_size(label, _array_size(src, label), max_pixels, min_side)
        image = _array_to_image(src, label)
        return _to_rgb(image, label)

    if isinstance(src, Image.Image):
        return _normalise(src, label, max_pixels, min_side)

    if isinstance(src, (bytes, bytearray, memoryview)):
        if len(src) == 0:
            raise ImageError(f"{label}: the upload is empty (0 bytes)")
        return _open_stream(io.BytesIO(bytes(src)), label, max_pixels, min_side)

    if isinstance(src, (str, os.PathLike)):
        path = Path(src)
        if not path.is_file():
            raise ImageError(f"{label}: not an existing file ({path})")
        with path.open("rb") as fp:
            return _open_stream(fp, label, max_pixels, min_side)

    if hasattr(src, "read"):
        return _open_stream(src, label, max_pixels, min_side)

    raise ImageError(
        f"{label}: cannot read an image from a {type(src).__name__}; "
        "pass bytes, a file path, a file object, a PIL image or a numpy array"
    )


def _describe(src: object) -> str:
    if isinstance(src, (str, os.PathLike)):
        return Path(src).name or str(src)
    filename = getattr(src, "filename", None) or getattr(src, "name", None)
    if isinstance(filename, (str, os.PathLike)) and str(filename):
        return Path(filename).name
    return "uploaded image"


def _open_stream(fp: IO[bytes], label: str, max_pixels: int, min_side: int) -> Image.Image:
    with open_header(fp, label, max_pixels) as image:
        return _normalise(image, label, max_pixels, min_side)


def open_header(fp: IO[bytes], label: str, max_pixels: int | None = None) -> Image.Image:
    """`Image.open` limited to :data:`ACCEPTED_FORMATS`: the header is read, no pixel is decoded.

    Raises :class:`ImageError` naming the format of a file that is a known image of another kind
    (an ICO uploaded as ``icon.png``), or saying that the data is no image at all. `max_pixels`
    only names the caller's limit in the message when PIL's own hard limit fires inside open().
    """
    try:
        return Image.open(fp, formats=ACCEPTED_FORMATS)  # lazy: reads the header only
    except Image.DecompressionBombError as exc:
        # PIL's own hard limit (2 x MAX_IMAGE_PIXELS) fires inside open(); report our limit.
        raise ImageError(_bomb_message(label, _pixels_from_message(exc), max_pixels)) from None
    except UnidentifiedImageError:
        other = _sniff_stream(fp)
        if other is not None and other not in ACCEPTED_FORMATS:  # an accepted one is damaged
            raise ImageError(
                f"{label}: the file holds {other} data, a format this app does not open "
                f"(whatever the file's name says); convert it to {ACCEPTED_NAMES}"
            ) from None
        raise ImageError(
            f"{label}: not a recognised image format (or the file is damaged); "
            f"upload a {ACCEPTED_NAMES} image"
        ) from None
    except _DECODE_ERRORS as exc:
        raise ImageError(f"{label}: the image header is damaged ({exc})") from None


def _sniff_stream(fp: IO[bytes]) -> str | None:
    try:
        fp.seek(0)
        return sniff_format(fp.read(_SNIFF_BYTES))
    except (OSError, ValueError, AttributeError):
        return None


def sniff_format(prefix: bytes) -> str | None:
    """The Pillow name of the format whose signature `prefix` (the first bytes of a file) carries,
    for every format Pillow knows; None when none matches. Reads no more than `prefix`: each
    plugin's own signature check, nothing is opened or decoded."""
    Image.init()
    for fmt in Image.ID:
        _, accept = Image.OPEN.get(fmt, (None, None))
        if accept is None:  # plugins without a signature check would claim anything
            continue
        try:
            if accept(prefix) is True:
                return fmt
        except (*_DECODE_ERRORS, TypeError):
            continue
    return None


def _normalise(image: Image.Image, label: str, max_pixels: int, min_side: int) -> Image.Image:
    # Size first, from the header: a 1-bit PNG of 50 KB can claim 400 megapixels.
    _check_size(label, image.size, max_pixels, min_side)
    try:
        image.seek(0)  # animated GIF/WebP/APNG: the first frame is the image
    except (EOFError, AttributeError, ValueError):
        pass
    try:
        image.load()  # force a full decode now, so damage is reported here and not mid-edit
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        # Only reachable when the caller's limit is above PIL's, or warnings are errors.
        raise ImageError(_bomb_message(label, image.width * image.height, max_pixels)) from None
    except _DECODE_ERRORS as exc:
        reason = "the file is truncated" if "truncated" in str(exc) else f"the data is damaged ({exc})"
        raise ImageError(f"{label}: cannot decode the image: {reason}; re-export or re-upload it") from None
    image = _exif_transpose(image, label)
    # EXIF rotation swaps the sides, so the minimum is checked again on the final orientation.
    _check_size(label, image.size, max_pixels, min_side)
    rgb = _to_rgb(image, label)
    # The file's own metadata stays behind: PIL keeps a PNG's text chunks in `info` (up to 64 MB,
    # inflated from a few KB of zTXt) and every copy or convert carries them along, while a batch
    # holds its decoded images for the whole run. Nothing downstream reads them.
    rgb.info = {}
    return rgb


def _exif_transpose(image: Image.Image, label: str) -> Image.Image:
    try:
        transposed = ImageOps.exif_transpose(image)
    except (*_DECODE_ERRORS, KeyError, TypeError) as exc:
        # A broken EXIF block should not make a perfectly decodable image unusable.
        logger.warning("%s: ignoring unreadable EXIF orientation (%s)", label, exc)
        return image
    return transposed if transposed is not None else image


def _check_size(label: str, size: tuple[int, int], max_pixels: int, min_side: int) -> None:
    width, height = size
    if width * height > max_pixels:
        raise ImageError(_bomb_message(label, width * height, max_pixels, size))
    if min(width, height) < min_side:
        raise ImageError(
            f"{label}: the image is {width}x{height} px; the minimum is {min_side} px on each side"
        )


def _bomb_message(label: str, pixels: int | None, limit: int | None,
                  size: tuple[int, int] | None = None) -> str:
    what = f"{pixels:,} pixels" if pixels else "more pixels than PIL accepts"
    if size:
        what = f"{size[0]}x{size[1]} = {what}"
    limit_text = f"; the limit is {limit:,} pixels" if limit else ""
    return f"{label}: the image is too large ({what}{limit_text}); downscale it before uploading"


def _pixels_from_message(exc: Exception) -> int | None:
    # PIL's message reads "Image size (N pixels) exceeds limit of M pixels, ..."
    text = str(exc)
    start = text.find("(")
    if start < 0:
        return None
    digits = text[start + 1 :].split(" ", 1)[0]
    return int(digits) if digits.isdigit() else None


def _array_size(array: np.ndarray, label: str) -> tuple[int, int]:
    if array.ndim not in (2, 3) or (array.ndim == 3 and array.shape[2] not in (1, 2, 3, 4)):
        raise ImageError(
            f"{label}: an image array must be H x W or H x W x C with C in 1..4 (got shape {array.shape})"
        )
    return int(array.shape[1]), int(array.shape[0])


def _array_to_image(array: np.ndarray, label: str) -> Image.Image:
    if array.ndim == 3 and array.shape[2] == 1:
        array = array[:, :, 0]
    if array.dtype.kind not in "biuf":
        raise ImageError(f"{label}: unsupported array dtype {array.dtype}; use uint8, uint16 or float")
    # uint8 H x W -> L, x2 -> LA, x3 -> RGB, x4 -> RGBA: PIL infers the mode from the shape.
    return Image.fromarray(np.ascontiguousarray(_to_uint8(array)))


def _to_uint8(values: np.ndarray) -> np.ndarray:
    """Scale an integer or float array to uint8 without clipping away its range.

    * uint8 / bool: as they are (bool -> 0 / 255).
    * uint16 (16-bit PNG, TIFF): full-range scaling, 65535 -> 255.
    * other integers (PIL "I"): 0..255 data is 8-bit already, 0..65535 is 16-bit, anything else is
      stretched min..max. PIL hands 16-bit files over as "I" in some versions, hence the guess.
    * floats (PIL "F", numpy): 0..1 is scaled by 255, 0..255 is kept, anything else is stretched
      min..max; NaN becomes 0.
    """
    if values.dtype == np.uint8:
        return values
    if values.dtype == np.bool_:
        return values.astype(np.uint8) * 255
    if values.dtype.kind == "u" and values.dtype.itemsize == 2:
        return ((values.astype(np.uint32) * 255 + 32767) // 65535).astype(np.uint8)
    data = values.astype(np.float64)
    data = np.nan_to_num(data, nan=0.0, posinf=0.0, neginf=0.0)
    lo, hi = (float(data.min()), float(data.max())) if data.size else (0.0, 0.0)
    if values.dtype.kind == "f" and lo >= 0.0 and hi <= 1.0:
        scaled = data * 255.0
    elif lo >= 0.0 and hi <= 255.0:
        scaled = data
    elif values.dtype.kind in "iu" and lo >= 0.0 and hi <= 65535.0:
        scaled = data * (255.0 / 65535.0)
    elif hi > lo:
        scaled = (data - lo) * (255.0 / (hi - lo))
    else:
        scaled = np.zeros_like(data)
    return np.clip(np.rint(scaled), 0, 255).astype(np.uint8)


def _to_rgb(image: Image.Image, label: str) -> Image.Image:
    """Convert any PIL mode to RGB; transparent pixels become white (what a viewer shows)."""
    mode = image.mode
    if mode in ("I;16", "I;16L", "I;16B", "I;16N", "I", "F"):
        return Image.fromarray(_to_uint8(np.asarray(image))).convert("RGB")
    if _has_alpha(image):
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, _WHITE + (255,))
        return Image.alpha_composite(background, rgba).convert("RGB")
    if mode == "RGB":
        return image.copy()  # detach from the file and from the caller's object
    try:
        # 1, L, P, CMYK, YCbCr, RGBX, ... PIL converts these directly. CMYK uses PIL's naive
        # formula (no ICC colour management): good enough for a preview-grade editing demo.
        return image.convert("RGB")
    except ValueError as exc:
        raise ImageError(f"{label}: unsupported colour mode {mode!r} ({exc}); convert it to RGB first") from None


def _has_alpha(image: Image.Image) -> bool:
    if image.mode in ("PA", "LA", "La", "RGBA", "RGBa"):
        return True
    # Palette, greyscale and RGB PNGs can carry transparency in a tRNS chunk instead of a channel.
    if image.mode in ("P", "L", "RGB", "1") and "transparency" in image.info:
        return True
    palette = image.palette if image.mode == "P" else None
    return palette is not None and palette.mode == "RGBA"


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


def apply_plan(image: Image.Image, plan: WorkingPlan) -> Image.Image:
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
    plan = working_plan(image.size, variant=variant, image_size=image_size,
                        working_resolution=working_resolution, fixed_size=fixed_size)
    return apply_plan(image, plan), plan


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
