"""What the OpenAI-compatible images route (`server/openai_api.py`) reads and answers, apart from the
route itself: OpenAI's error shape, the checks of an ``images.edit`` request, OpenAI's mask turned
into the app's, and the model ids.

Pure functions and dataclasses (PIL for the mask): no gradio, no ASGI. Every refusal is an
`OpenAIError` that names the field (`param`, OpenAI's own names: ``image``, ``mask``, ``prompt``,
``n``, ``size``...) and what it takes.
"""

from __future__ import annotations

import io
import re
from dataclasses import dataclass, field
from typing import Any, Mapping

from hidream_ui.edit_fields import EDIT_FORM, FIELD_SPECS
from hidream_ui.edit_values import MAX_PROMPT_CHARS, SEED_MAX

# Images one request may ask for (`n`): each is one edit, run one after another in one of the
# caller's job slots (seed, seed + 1, ...), so one request never holds more than one slot.
MAX_IMAGES = 4
RESPONSE_FORMATS = ("b64_json", "url")
# The app's own settings an edit may carry beside OpenAI's fields (extensions, by their /edit names);
# `prompt` is the instruction, `size` the working resolution, `seed` its own extension.
EXTENSION_FIELDS: tuple[str, ...] = tuple(
    name for name in EDIT_FORM if name not in ("instruction", "seed", "randomize_seed", "working_resolution")
)
# OpenAI's names of the app's fields, for `param` in an error the app raised (its RequestError names them).
OPENAI_PARAMS = {
    "instruction": "prompt",
    "working_resolution": "size",
    "seed": "seed",
    "image": "image",
    "mask": "mask",
}
# Fields OpenAI's SDK may send that the app takes as they are or has no use for: accepted, ignored.
IGNORED_FIELDS = (
    "user",
    "quality",
    "background",
    "input_fidelity",
    "safety_identifier",
    "output_compression",
    "partial_images",
)
MAX_FIELDS = 32  # a form of OpenAI's fields and the extensions has fewer
MAX_FIELD_BYTES = MAX_PROMPT_CHARS * 4 + 1024  # the longest prompt in UTF-8, with room

# The HTTP status -> OpenAI's error `type` (its SDK picks the exception class by the status alone).
_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",  # OpenAI's own answer to a wrong key: code "invalid_api_key"
    403: "permission_error",
    404: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    499: "invalid_request_error",
    503: "server_error",
}


class OpenAIError(Exception):
    """A refusal in OpenAI's shape: the HTTP `status`, `message`, `code`, the field it is about
    (`param`) and, for 429 / 503, the seconds after which a retry may succeed."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        retry_after: float | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.retry_after = retry_after

    @property
    def type(self) -> str:
        return _TYPES.get(self.status, "server_error")

    def body(self) -> dict[str, Any]:
        """``{"error": {"message", "type", "param", "code"}}``: what OpenAI's API answers."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(max(1, round(self.retry_after)))} if self.retry_after is not None else {}


def invalid(param: str | None, message: str, code: str | None = None) -> OpenAIError:
    """A 400 about `param`."""
    return OpenAIError(400, message, param=param, code=code)


# A queue that is full frees a place when an edit ends: a retry after this many seconds may find one.
QUEUE_FULL_RETRY_AFTER = 10.0


def from_refusal(status: int, code: str, message: str, retry_after: float | None = None) -> OpenAIError:
    """The OpenAI error of a `loopback.CallRefused` (the app's own routes refused or failed)."""
    if status == 503:
        return OpenAIError(503, message, code="queue_full", retry_after=retry_after or QUEUE_FULL_RETRY_AFTER)
    if status == 422:  # gradio's validation answer of anything but the per-client refusal
        return invalid(None, message, code)
    if status == 400:
        return invalid(_param_of(message), message, code)
    if status in (401, 403, 404, 413, 429, 499):
        return OpenAIError(status, message, code=code, retry_after=retry_after)
    return OpenAIError(500, message, code="server_error")


def _param_of(message: str) -> str | None:
    """OpenAI's name of the field an app message names first ("num_inference_steps: got -5; ...")."""
    found = re.match(r"\s*([a-z_]+):", message)
    if not found:
        return None
    name = found.group(1)
    return OPENAI_PARAMS.get(name, name if name in EXTENSION_FIELDS else None)


# ---------------------------------------------------------------------------------------------
# The request
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class EditsRequest:
    """A checked ``POST /v1/images/edits`` without its files: what to run and how to answer."""

    prompt: str
    n: int = 1
    size: str = "auto"  # the working resolution: "auto" or a side ("512")
    response_format: str = "b64_json"
    seed: int | None = None  # None: a random one
    extensions: Mapping[str, str] = field(default_factory=dict)  # EXTENSION_FIELDS given, as sent

    def seeds(self, first: int) -> list[int]:
        """The seed of each image: `first`, `first + 1`, ... (wrapping at the app's largest seed)."""
        return [(first + index) % (SEED_MAX + 1) for index in range(self.n)]


def parse_edits(fields: Mapping[str, str], *, models: tuple[str, ...], sides: tuple[str, ...]) -> EditsRequest:
    """The checked request of an edit's text fields (`fields`: name -> value, files left out).
    `models`: the ids `GET /v1/models` lists; `sides`: the square sides the model takes."""
    model = fields.get("model")
    if model not in (None, "", *models):
        raise OpenAIError(
            404,
            f"The model '{model}' does not exist: this server runs {', '.join(models)}.",
            param="model",
            code="model_not_found",
        )
    prompt = fields.get("prompt")
    if prompt is None or not prompt.strip():
        raise invalid("prompt", "prompt is required: the instruction, e.g. 'make the square blue'.", "missing_prompt")
    if len(prompt) > MAX_PROMPT_CHARS:
        raise invalid("prompt", f"prompt is {len(prompt)} characters long; at most {MAX_PROMPT_CHARS}.")
    if _truthy(fields.get("stream")):
        raise invalid("stream", "stream is not supported here: ask without it (the answer comes when the edit ends).")
    output_format = (fields.get("output_format") or "png").strip().lower()
    if output_format != "png":
        raise invalid("output_format", f"output_format '{output_format}' is not offered: the results are PNG.")
    response_format = (fields.get("response_format") or "b64_json").strip()
    if response_format not in RESPONSE_FORMATS:
        raise invalid("response_format", f"response_format '{response_format}': one of {', '.join(RESPONSE_FORMATS)}.")
    return EditsRequest(
        prompt=prompt,
        n=_whole(fields.get("n"), "n", 1, MAX_IMAGES, default=1),
        size=parse_size(fields.get("size"), sides),
        response_format=response_format,
        seed=_seed(fields.get("seed")),
        extensions=_extensions(fields),
    )


def _extensions(fields: Mapping[str, str]) -> dict[str, str]:
    """The Edit form's settings the request gives (as sent: /edit reads them itself), each checked
    here first with the app's own check of that field, so that a bad one is refused before the image
    is uploaded (a refused edit would leave its upload in the cache)."""
    from hidream_ui.edit_fields import _check_field  # the one check of a field (edits.py's too)
    from hidream_ui.edit_values import RequestError

    given = {name: fields[name] for name in EXTENSION_FIELDS if fields.get(name) not in (None, "")}
    for name, value in given.items():
        try:
            _check_field(FIELD_SPECS[name], value)
        except RequestError as exc:
            raise invalid(name, str(exc), "edit_failed") from None
    return given


def parse_size(value: str | None, sides: tuple[str, ...]) -> str:
    """`size` -> the working resolution: "auto" (absent too) or a square ``NxN`` whose side the model
    takes (`sides`, e.g. ("256", "512")); else a 400 that lists the sizes offered."""
    text = (value or "auto").strip().lower()
    if text == "auto":
        return "auto"
    found = re.fullmatch(r"(\d{1,5})x(\d{1,5})", text)
    if found and found.group(1) == found.group(2) and str(int(found.group(1))) in sides:
        return str(int(found.group(1)))
    offered = ", ".join(["auto", *(f"{side}x{side}" for side in sides)])
    raise invalid("size", f"size '{value}' is not offered by this model: one of {offered}.", "invalid_size")


def _whole(value: str | None, name: str, lo: int, hi: int, *, default: int) -> int:
    if value in (None, ""):
        return default
    try:
        number = int(str(value).strip())
    except ValueError:
        number = None
    if number is None or not lo <= number <= hi:
        raise invalid(name, f"{name} '{value}': a whole number from {lo} to {hi}.")
    return number


def _seed(value: str | None) -> int | None:
    """The `seed` extension: absent or -1 = a random one, else 0 .. the app's largest seed."""
    if value in (None, "") or str(value).strip() == "-1":
        return None
    return _whole(value, "seed", 0, SEED_MAX, default=0)


def _truthy(value: str | None) -> bool:
    return value is not None and value.strip().lower() in ("true", "1", "yes", "on")


def form_defaults(variant: str) -> dict[str, Any]:
    """The Edit form's values of `variant` (what the page starts with): the base of every API edit."""
    from hidream_ui.edits import EditParams

    values = EditParams.defaults_for(variant).to_dict()
    values["randomize_seed"] = FIELD_SPECS["randomize_seed"].default
    return {name: values[name] for name in EDIT_FORM}


# ---------------------------------------------------------------------------------------------
# The mask
# ---------------------------------------------------------------------------------------------


def image_size(data: bytes, param: str, max_pixels: int) -> tuple[int, int]:
    """(width, height) of an uploaded image as the app will see it (EXIF orientation applied), from
    its header (nothing decoded); 400 when it is none.

    Opened as the app opens every upload (`imaging.open_header`: its formats only). A bare
    `Image.open` tries every Pillow plugin, and some decode inside `open()` (an ICO directory saying
    256x256 can hold a 12000x12000 PNG: half a GB and seconds of CPU before any limit is looked at),
    while others (PSD, EPS, DDS, ...) are decoders nobody needs to reach with a mask."""
    from hidream_ui.imaging import ImageError, UnreadableImage, open_header

    try:
        with open_header(io.BytesIO(data), param, max_pixels) as picture:
            size = picture.size
            if size[0] * size[1] <= max_pixels and _turned(picture):
                size = (size[1], size[0])
    except UnreadableImage:
        raise invalid(
            param, f"{param} is not an image this server can read (send a PNG).", f"invalid_{param}"
        ) from None
    except ImageError:  # a header claiming billions of pixels (PIL's own limit fired): never decoded
        raise invalid(param, f"{param} claims more than {max_pixels:,} pixels (--max-pixels).") from None
    except (OSError, ValueError):
        raise invalid(
            param, f"{param} is not an image this server can read (send a PNG).", f"invalid_{param}"
        ) from None
    if size[0] * size[1] > max_pixels:
        raise invalid(param, f"{param} is {size[0]}x{size[1]}: at most {max_pixels:,} pixels (--max-pixels).")
    return size


# EXIF orientations that turn the picture a quarter (the app's `ImageOps.exif_transpose` swaps its sides).
_QUARTER_TURNS = (5, 6, 7, 8)


def _turned(picture) -> bool:
    """Whether the app will turn `picture` a quarter by its EXIF orientation. Read from the header
    only: a PNG's eXIf chunk counts when it comes before the pixels (Pillow's `getexif` would decode
    the whole image to look for one after them)."""
    if picture.format == "PNG" and "exif" not in picture.info:
        return False
    try:
        return picture.getexif().get(0x0112) in _QUARTER_TURNS
    except (OSError, ValueError, KeyError, TypeError, SyntaxError):  # a broken EXIF block: the app ignores it
        return False


def app_mask(data: bytes, size: tuple[int, int], max_pixels: int) -> bytes:
    """OpenAI's mask (a PNG whose fully or mostly transparent pixels mark where the image may change)
    as the app's (a grey PNG: white = may change, black = keep). The mask must be an image of the
    source's size with an alpha channel that marks something: else a 400 (`invalid_mask`) saying
    which."""
    from PIL import ImageOps

    from hidream_ui.imaging import open_header

    mask_size = image_size(data, "mask", max_pixels)
    if mask_size != size:
        raise _bad_mask(
            f"the mask is {mask_size[0]}x{mask_size[1]}, the image {size[0]}x{size[1]}: they must be the same size"
        )
    with open_header(io.BytesIO(data), "mask", max_pixels) as picture:
        has_alpha = picture.mode in ("RGBA", "LA", "PA") or "transparency" in picture.info
        if not has_alpha:
            raise _bad_mask(
                f"the mask has no alpha channel (mode {picture.mode}): its transparent pixels mark where the "
                "image may change"
            )
        try:
            # Turned by its EXIF orientation as the app turns the image (`image_size` said so).
            alpha = ImageOps.exif_transpose(picture).convert("RGBA").getchannel("A")
        except (OSError, ValueError, SyntaxError, EOFError):
            raise _bad_mask("the mask could not be decoded") from None
    # Transparent (alpha under half) = may change -> white; the rest is kept -> black.
    plane = alpha.point(lambda a: 255 if a < 128 else 0)
    if plane.getbbox() is None:
        raise _bad_mask("the mask has no transparent pixel: it marks nothing that may change")
    buffer = io.BytesIO()
    plane.save(buffer, format="PNG")
    return buffer.getvalue()


def _bad_mask(what: str) -> OpenAIError:
    return invalid("mask", f"Invalid mask: {what}.", "invalid_mask")


# ---------------------------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------------------------


def model_id(config) -> str:
    """The id `GET /v1/models` lists: ``hidream-<variant>`` (e.g. hidream-e1.1, hidream-e1-full);
    the offline tiny model adds ``-tiny-<profile>`` (its results are not the real model's)."""
    base = f"hidream-{config.variant}"
    return f"{base}-tiny-{config.tiny_profile}" if config.uses_tiny_model else base


def model_object(name: str, created: int) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": created, "owned_by": "hidream-ui"}


__all__ = [
    "EXTENSION_FIELDS",
    "IGNORED_FIELDS",
    "MAX_IMAGES",
    "QUEUE_FULL_RETRY_AFTER",
    "RESPONSE_FORMATS",
    "EditsRequest",
    "OpenAIError",
    "app_mask",
    "form_defaults",
    "from_refusal",
    "image_size",
    "invalid",
    "model_id",
    "model_object",
    "parse_edits",
    "parse_size",
]
