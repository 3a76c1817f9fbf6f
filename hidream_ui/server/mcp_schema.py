"""What the MCP tools take (server/mcp_tools.py): their input schemas and the `/edit` call an `edit`
tool call becomes.

The `edit` tool's settings are the edit's own fields (hidream_ui/edit_fields.py `FIELDS`): their
names, ranges, defaults (those of the app's `--variant`) and descriptions are read from there, so an
agent sees exactly what the Edit form and the `edit` command take and cannot drift from them. The one
difference is the seed: `-1` means a random seed (the `edit` command's `--seed -1`), which is what the
form's "Random seed" box does, and the default (as in the browser).

Standard library and the edit schema only: the `mcp` package is imported by mcp_tools.py alone.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from hidream_ui.edit_fields import EDIT_FORM, FIELD_SPECS, FieldSpec
from hidream_ui.edits import EditSettings

# Fields of the Edit form that are not a tool argument of their own: the seed says it (-1 = random).
FOLDED = ("randomize_seed",)
RANDOM_SEED = -1
IMAGE_MAGIC = (
    (b"\x89PNG\r\n\x1a\n", "png"),
    (b"\xff\xd8\xff", "jpg"),
    (b"RIFF", "webp"),
    (b"GIF8", "gif"),
    (b"BM", "bmp"),
    (b"II*\x00", "tiff"),
    (b"MM\x00*", "tiff"),
)

EDIT_DESCRIPTION = (
    "Edit an image following an instruction (HiDream-E1). Send the image as base64 (PNG, JPEG, WebP, ...); "
    "the answer is the edited PNG and, as text, the seed used and the settings that reproduce it (the "
    "same recipe the PNG carries in its metadata). The edit waits in the app's queue like a browser's: "
    "a busy app answers later, a full queue or too many jobs of yours is refused with the reason."
)
STATUS_DESCRIPTION = (
    "The app's status as JSON (the same thing its System panel reads): device, model, attention, "
    "speed, memory, state and the queue (waiting and running jobs). Never waits in the queue."
)
RECIPE_DESCRIPTION = (
    "The recipe of a result: the settings (instruction, seed, guidance, steps, ...) that reproduce an "
    "image this app made, read from the metadata of its PNG (send the PNG back as base64). Other "
    "images carry no recipe: the answer says so."
)


class ToolArgumentError(ValueError):
    """A tool argument that cannot be used (the message names it and says what is expected)."""


def _property(spec: FieldSpec, default: Any) -> dict[str, Any]:
    """The JSON schema of one edit field (its range, its default, its description)."""
    text = spec.help or spec.info or spec.label
    if spec.kind == "float":
        schema: dict[str, Any] = {"type": "number", "minimum": spec.lo, "maximum": spec.hi}
    elif spec.kind == "int":
        schema = {"type": "integer", "minimum": int(spec.lo), "maximum": int(spec.hi)}
    elif spec.kind == "seed":
        schema = {"type": "integer", "minimum": RANDOM_SEED, "maximum": int(spec.hi)}
        text = "-1 (the default): a random seed; the seed used comes back with the result"
        default = RANDOM_SEED
    elif spec.kind == "bool":
        schema = {"type": "boolean"}
        if spec.flag_value is not None and spec.flag and spec.help:
            text = f"{spec.info or spec.label} (false: {spec.help})"
    elif spec.kind == "resolution":
        schema = {"type": ["string", "integer"]}
        text = spec.help
    else:
        schema = {"type": "string"}
    schema["default"] = default
    schema["description"] = f"{spec.label}: {text}" if text != spec.label else spec.label
    return schema


def defaults(variant: str) -> dict[str, Any]:
    """The edit fields' defaults of `variant` (E1-Full guides differently from E1.1)."""
    settings = dataclasses.asdict(EditSettings.defaults_for(variant))
    return {name: settings.get(name, FIELD_SPECS[name].default) for name in EDIT_FORM}


def edit_schema(variant: str, *, max_upload_mb: int, rewriter: bool) -> dict[str, Any]:
    """The `edit` tool's input schema: the image, the instruction, every setting of the Edit form,
    an optional mask, and `rewrite` where the app has a rewriter."""
    values = defaults(variant)
    properties: dict[str, Any] = {
        "image": {
            "type": "string",
            "contentEncoding": "base64",
            "description": f"the source image as base64 (PNG, JPEG, WebP, ...; at most {max_upload_mb} MB decoded)",
        },
    }
    for name in EDIT_FORM:
        if name in FOLDED:
            continue
        properties[name] = _property(FIELD_SPECS[name], values[name])
    properties["instruction"].pop("default")
    properties["instruction"]["minLength"] = 1
    properties["mask"] = {
        "type": "string",
        "contentEncoding": "base64",
        "description": "optional: limits the edit to a region: a base64 image the size of the source, "
        "white = may change, black = keep (transparent = keep)",
    }
    if rewriter:
        properties["rewrite"] = {
            "type": "boolean",
            "default": False,
            "description": "rewrite the instruction with the app's rewriter first (the recipe records both)",
        }
    return {"type": "object", "properties": properties, "required": ["image", "instruction"]}


def recipe_schema(max_upload_mb: int) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {
            "image": {
                "type": "string",
                "contentEncoding": "base64",
                "description": f"a PNG this app made, as base64 (at most {max_upload_mb} MB decoded)",
            }
        },
        "required": ["image"],
    }


def operator_tool_fields() -> list[dict[str, Any]]:
    """Name, title, description and input schema of each engine-wide control (mcp_tools.py lists them
    only without --kiosk)."""
    text = {"type": "string"}
    return [
        {
            "name": "set_attention",
            "title": "Attention strategy",
            "description": "Switch the attention strategy of every engine (or of one: `engine`, a device label "
            "from status `devices`); answers the active strategy (what 'auto' became). Changes it for everyone.",
            "input_schema": {
                "type": "object",
                "properties": {
                    "name": {**text, "description": "a strategy: auto, or one status lists as available"},
                    "engine": {**text, "default": "all", "description": "all, or one engine's label"},
                },
                "required": ["name"],
            },
        },
        {
            "name": "set_speed",
            "title": "Speed setting",
            "description": "Set the step cache of the next edits: exact | fast | faster | any --cache value; "
            "answers the setting. Changes it for everyone.",
            "input_schema": {"type": "object", "properties": {"name": {**text, "description": "exact, fast, faster"}}},
        },
        {
            "name": "load_model",
            "title": "Load the model",
            "description": "Load the model now (otherwise the first edit loads it); answers how long it took.",
            "input_schema": {"type": "object", "properties": {}},
        },
    ]


def max_body_bytes(max_upload_mb: int) -> int:
    """The largest MCP request body: an image and a mask of --max-upload-mb each, as base64 (4/3 of
    their size), and 64 KB for the JSON around them (the instruction, the settings, the envelope)."""
    return (2 * max_upload_mb * 1024 * 1024 * 4 + 2) // 3 + 64 * 1024


def decode_image(value: object, field: str, max_bytes: int, max_pixels: int | None = None) -> tuple[bytes, str]:
    """(the bytes, a file name by their format) of a base64 image argument; a ``data:`` URL is taken
    too. The size is checked on the text before anything is decoded.

    With `max_pixels`, the image's header is read too (the app's formats only: `imaging.open_header`,
    no pixel decoded) and an unreadable image, or one over `max_pixels`, is refused here: before it
    is uploaded, so a refused call leaves nothing in the app's cache (the app's /edit would refuse
    it just the same, but after storing it)."""
    if not isinstance(value, str) or not value.strip():
        raise ToolArgumentError(f"{field}: expected an image as a base64 string, got {type(value).__name__}")
    text = value.strip()
    if text.startswith("data:"):
        text = text.partition(",")[2]
    if len(text) // 4 * 3 > max_bytes + 2:
        raise ToolArgumentError(f"{field}: the image is over {max_bytes / 2**20:.3g} MB (--max-upload-mb)")
    try:
        data = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise ToolArgumentError(f"{field}: not valid base64") from None
    if len(data) > max_bytes:
        raise ToolArgumentError(f"{field}: the image is over {max_bytes / 2**20:.3g} MB (--max-upload-mb)")
    if not data:
        raise ToolArgumentError(f"{field}: the image is empty")
    extension = next((ext for magic, ext in IMAGE_MAGIC if data.startswith(magic)), "png")
    if max_pixels is not None:
        extension = _checked_header(data, f"{field}.{extension}", max_pixels) or extension
    return data, f"{field}.{extension}"


def _checked_header(data: bytes, label: str, max_pixels: int) -> str | None:
    """The file extension of `data`'s format, after reading its header as the app does; ToolArgumentError
    (the app's own message) for an image the app would not open or that is over `max_pixels`."""
    import io

    from hidream_ui.imaging import ImageError, open_header

    try:
        with open_header(io.BytesIO(data), label, max_pixels) as picture:
            width, height = picture.size
            fmt = str(picture.format or "")
    except ImageError as exc:
        raise ToolArgumentError(str(exc)) from None
    if width * height > max_pixels:
        raise ToolArgumentError(
            f"{label}: the image is too large ({width}x{height} = {width * height:,} pixels; the limit is "
            f"{max_pixels:,} pixels, --max-pixels); downscale it before uploading"
        )
    return {"JPEG": "jpg", "PNG": "png", "WEBP": "webp", "GIF": "gif", "BMP": "bmp", "TIFF": "tiff"}.get(fmt)


@dataclass(frozen=True)
class EditCall:
    """An `edit` tool call, checked: the values of the `/edit` inputs other than the files."""

    values: dict[str, Any]  # by /edit parameter name (image and mask are set by the caller)
    image: str  # base64
    mask: str | None


def edit_call(arguments: Mapping[str, Any] | None, variant: str, *, rewriter: bool) -> EditCall:
    """The `/edit` values of `arguments` (the app's variant's defaults for what is left out).
    Unknown arguments are refused by name: a misspelt setting must not silently be its default.
    The values themselves are checked by the app's own handler, which names the field it refuses."""
    arguments = dict(arguments or {})
    known = list(edit_schema(variant, max_upload_mb=1, rewriter=rewriter)["properties"])
    unknown = sorted(set(arguments) - set(known))
    if unknown:
        raise ToolArgumentError(f"unknown argument(s) {', '.join(unknown)}; the edit tool takes {', '.join(known)}")
    for name in ("image", "instruction"):
        if arguments.get(name) in (None, ""):
            raise ToolArgumentError(f"{name}: required")
    values: dict[str, Any] = defaults(variant)
    values.update({name: arguments[name] for name in EDIT_FORM if name in arguments})
    seed = arguments.get("seed", RANDOM_SEED)
    random = isinstance(seed, int) and not isinstance(seed, bool) and seed == RANDOM_SEED
    values["seed"] = FIELD_SPECS["seed"].default if random else seed
    values["randomize_seed"] = random
    values["rewrite"] = bool(arguments.get("rewrite", False))
    return EditCall(values=values, image=arguments["image"], mask=arguments.get("mask"))


def ordered(values: Mapping[str, Any], parameters: Sequence[str]) -> list[Any]:
    """`values` in the order of the `/edit` inputs (gradio's API info), None for any not given."""
    return [values.get(name) for name in parameters]


__all__ = [
    "EDIT_DESCRIPTION",
    "RECIPE_DESCRIPTION",
    "STATUS_DESCRIPTION",
    "EditCall",
    "ToolArgumentError",
    "decode_image",
    "defaults",
    "edit_call",
    "edit_schema",
    "max_body_bytes",
    "operator_tool_fields",
    "ordered",
    "recipe_schema",
]
