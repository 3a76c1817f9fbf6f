"""Images in: open + validate + normalise uploads (the working-size maths is `geometry.py`).

:func:`open_image` turns whatever the UI, CLI or API hands us (bytes, a path, a file object, a
PIL image, a numpy array) into a fully decoded 8-bit RGB image, or raises :class:`ImageError`
with a message a user can act on. Nothing here touches PIL's process-wide settings
(``Image.MAX_IMAGE_PIXELS``, ``ImageFile.LOAD_TRUNCATED_IMAGES``, warning filters): the limit
is per call and checked from the header before any pixel is decoded.
"""

from __future__ import annotations

import io
import logging
import os
import struct
import zlib
from pathlib import Path
from typing import IO, Union

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

__all__ = [
    "ACCEPTED_FORMATS",
    "ImageError",
    "UnreadableImage",
    "ImageSource",
    "open_header",
    "sniff_format",
    "SNIFF_BYTES",
    "open_image",
    "open_mask",
]

logger = logging.getLogger(__name__)

ImageSource = Union[bytes, bytearray, memoryview, str, os.PathLike, IO[bytes], Image.Image, np.ndarray]


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
# What `sniff_format` needs: the 16 bytes Pillow's own format checks look at (`Image.open` reads as
# many), and TGA's whole 18-byte header (TGA has no signature: its header fields are the check).
SNIFF_BYTES = 18
# Pillow's ICO and CUR checks read 4 bytes (reserved 0, type 1 or 2), and an uncompressed TGA with no
# ID or colour map starts with exactly those (its first 3 bytes: ID length, colour map type, image
# type 1 or 2). An icon directory also counts its images (bytes 4-5, at least one), where that TGA
# has 0, so the count is checked too before a file is called an icon.
_ICON_FORMATS = ("ICO", "CUR")


class ImageError(ValueError):
    """The input is not a usable image; the message says which input and why."""


class UnreadableImage(ImageError):
    """The bytes are not an image we can decode (another format, damaged, or not an image at all), as
    opposed to a readable image that breaks a limit (size, pixels, mode)."""


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


def open_mask(
    src: ImageSource,
    *,
    max_pixels: int = 40_000_000,
    min_side: int = 16,
    name: str | None = None,
    layer: bool = False,
) -> Image.Image:
    """Open a region mask: the same sources, formats, limits and checks as :func:`open_image` (one
    decoder for every upload), but returned as mode "L" (255 = may change, 0 = keep).

    Strokes on transparency (a brush layer of the app's region editor, a PNG painted on a
    transparent canvas) count by their ALPHA, never their colour: every painted pixel, however
    faint or dark its paint, may change; a transparent one is kept, whatever RGB lies under it.
    An image without transparency (no alpha channel, or one that is opaque everywhere: a black and
    white mask saved as RGBA) counts by its grey level (white = may change, black = keep).
    `layer=True` (a brush layer, which has no colours to read): the alpha decides even where the
    layer is painted all over. `edits.validated_mask` binarises the result at 128."""
    if max_pixels < 1 or min_side < 1:
        raise ValueError(f"max_pixels and min_side must be >= 1 (got {max_pixels}, {min_side})")
    label = name or _describe(src)
    if isinstance(src, (np.ndarray, Image.Image)):
        image = _array_to_image(src, label) if isinstance(src, np.ndarray) else src
        if isinstance(src, np.ndarray):
            _check_size(label, _array_size(src, label), max_pixels, min_side)
        return _mask_plane(_decoded(image, label, max_pixels, min_side), layer)
    if isinstance(src, (bytes, bytearray, memoryview)):
        if len(src) == 0:
            raise ImageError(f"{label}: the upload is empty (0 bytes)")
        src = io.BytesIO(bytes(src))
    if isinstance(src, (str, os.PathLike)):
        path = Path(src)
        if not path.is_file():
            raise ImageError(f"{label}: not an existing file ({path})")
        with path.open("rb") as fp, open_header(fp, label, max_pixels) as image:
            return _mask_plane(_decoded(image, label, max_pixels, min_side), layer)
    if hasattr(src, "read"):
        with open_header(src, label, max_pixels) as image:
            return _mask_plane(_decoded(image, label, max_pixels, min_side), layer)
    raise ImageError(
        f"{label}: cannot read a mask from a {type(src).__name__}; pass bytes, a file path, "
        "a file object, a PIL image or a numpy array"
    )


def _mask_plane(image: Image.Image, layer: bool = False) -> Image.Image:
    if _has_alpha(image):
        alpha = image.convert("RGBA").getchannel("A")
        if layer or alpha.getextrema()[0] < 255:  # strokes on transparency: painted at all = may change
            return alpha.point(lambda a: 255 if a > 0 else 0)
        image = image.convert("RGB")  # opaque everywhere: its alpha says nothing, its grey level does
    if image.mode in ("I;16", "I;16L", "I;16B", "I;16N", "I", "F"):
        return Image.fromarray(_to_uint8(np.asarray(image))).convert("L")
    return image.convert("L")


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
            raise UnreadableImage(
                f"{label}: the file holds {other} data, a format this app does not open "
                f"(whatever the file's name says); convert it to {ACCEPTED_NAMES}"
            ) from None
        raise UnreadableImage(
            f"{label}: not a recognised image format (or the file is damaged); upload a {ACCEPTED_NAMES} image"
        ) from None
    except _DECODE_ERRORS as exc:
        raise UnreadableImage(f"{label}: the image header is damaged ({exc})") from None


def _sniff_stream(fp: IO[bytes]) -> str | None:
    try:
        fp.seek(0)
        return sniff_format(fp.read(SNIFF_BYTES))
    except (OSError, ValueError, AttributeError):
        return None


def sniff_format(prefix: bytes) -> str | None:
    """The Pillow name of the format whose signature `prefix` (the first bytes of a file, best
    :data:`SNIFF_BYTES` of them) carries, for every format Pillow knows; None when none matches.
    Reads no more than `prefix`: each plugin's own signature check, an icon's image count (see
    `_ICON_FORMATS`) and, last, TGA's header; nothing is decoded."""
    Image.init()
    for fmt in Image.ID:
        _, accept = Image.OPEN.get(fmt, (None, None))
        if accept is None:  # plugins without a signature check would claim anything
            continue
        try:
            if accept(prefix) is True and (fmt not in _ICON_FORMATS or int.from_bytes(prefix[4:6], "little") > 0):
                return fmt
        except (*_DECODE_ERRORS, TypeError):
            continue
    return "TGA" if _is_tga_header(prefix) else None


def _is_tga_header(prefix: bytes) -> bool:
    """Whether Pillow's TGA reader takes `prefix` as a TGA header (its own field checks: TGA has no
    signature). Only the header is read, from `prefix` alone: no pixel is decoded."""
    from PIL import TgaImagePlugin

    try:
        TgaImagePlugin.TgaImageFile(io.BytesIO(prefix[:SNIFF_BYTES])).close()
    except (*_DECODE_ERRORS, TypeError, KeyError):
        return False
    return True


def _normalise(image: Image.Image, label: str, max_pixels: int, min_side: int) -> Image.Image:
    rgb = _to_rgb(_decoded(image, label, max_pixels, min_side), label)
    # The file's own metadata stays behind: PIL keeps a PNG's text chunks in `info` (up to 64 MB,
    # inflated from a few KB of zTXt) and every copy or convert carries them along, while a batch
    # holds its decoded images for the whole run. Nothing downstream reads them.
    rgb.info = {}
    return rgb


def _decoded(image: Image.Image, label: str, max_pixels: int, min_side: int) -> Image.Image:
    """The size checks (from the header first), the full decode and the EXIF rotation: what every
    upload goes through, an image or a mask."""
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
        raise UnreadableImage(f"{label}: cannot decode the image: {reason}; re-export or re-upload it") from None
    image = _exif_transpose(image, label)
    # EXIF rotation swaps the sides, so the minimum is checked again on the final orientation.
    _check_size(label, image.size, max_pixels, min_side)
    return image


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
        raise ImageError(f"{label}: the image is {width}x{height} px; the minimum is {min_side} px on each side")


def _bomb_message(label: str, pixels: int | None, limit: int | None, size: tuple[int, int] | None = None) -> str:
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
        raise ImageError(f"{label}: an image array must be H x W or H x W x C with C in 1..4 (got shape {array.shape})")
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
