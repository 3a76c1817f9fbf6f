"""The field spec: the one list of an edit's fields (`FIELDS`) and what is derived from it alone.

The settings and params dataclasses (hidream_ui.edits), the Edit form's widgets and the Batch /
Compare settings widgets (ui/common.py `widget`), the handlers' inputs (their order is the Gradio
API's), the form round trip (`form_values`), the CLI `edit` flags (`add_edit_arguments`) and README's
flag table (`edit_flags_table`) are derived from it; tests/test_edit_schema.py fails when one of
them drifts. The defaults are upstream E1.1's, kept with the pipeline's signature
(pipeline/defaults.py); `VARIANT_DEFAULTS` says what E1-Full changes.

Standard library only (and the pipeline's plain-Python rules): part of the edit schema
(hidream_ui.edits re-exports every name).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Mapping

from hidream_ui.edit_values import (
    SEED_MAX,
    RequestError,
    _as_bool,
    _as_float,
    _as_int,
    _as_text,
    parse_working_resolution,
)
from hidream_ui.pipeline import defaults
from hidream_ui.pipeline.speed.settings import CACHE_GRAMMAR, MAX_STEPS_RANGE, cache_unavailable, parse_cache
from hidream_ui.variants import DEFAULT_VARIANT

# Upstream's negative prompt (both variants).
DEFAULT_NEGATIVE = defaults.NEGATIVE_PROMPT
GUIDANCE_RANGE = (0.0, 30.0)
IMAGE_GUIDANCE_RANGE = (0.0, 30.0)
STEPS_RANGE = MAX_STEPS_RANGE  # one home: a cache's `@S` cap takes the same range
REFINE_RANGE = (0.0, 1.0)


# ---------------------------------------------------------------------------------------------
# The field spec: the one list of an edit's fields. The dataclasses below, the Edit form's widgets
# and the Batch / Compare settings widgets (ui/common.py `widget`), the handlers' inputs (their
# order is the Gradio API's), the form round trip (`form_values`), the CLI `edit` flags
# (`add_edit_arguments`) and README's flag table (`edit_flags_table`) are derived from it;
# tests/test_edit_schema.py fails when one of them drifts.
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FieldSpec:
    """One field of an edit (or of the Edit form): its type, range, default, widget and CLI flag."""

    name: str
    kind: str  # "text" | "float" | "int" | "bool" | "resolution" | "cache" | "seed"
    default: Any
    label: str
    info: str = ""  # the widget's hint (the Edit form's advanced settings)
    lo: float | None = None
    hi: float | None = None
    step: float | None = None
    flag: str | None = None  # the `edit` command's flag; None: none (see `why_no_flag`)
    flag_value: Any = None  # for a bool flag: the value it sets (e.g. --padded sets collapse_padding False)
    help: str = ""  # the flag's help, also README's flag table
    why_no_flag: str = ""
    form: bool = True  # a widget of the Edit form (and an input of /edit, in this order)
    shared: bool = False  # a widget of the Batch and Compare tabs' shared settings (in this order)
    settings: bool = True  # a field of EditSettings (False: instruction, seed, form-only widgets)


FIELDS: tuple[FieldSpec, ...] = (
    FieldSpec(
        "instruction",
        "text",
        "",
        "Instruction",
        settings=False,
        flag="--instruction",
        help="what to change (E1-Full: 'Editing Instruction: ... Target Image Description: ...')",
    ),
    FieldSpec(
        "negative_prompt",
        "text",
        DEFAULT_NEGATIVE,
        "Negative prompt",
        shared=True,
        flag="--negative-prompt",
        help="what to steer away from",
    ),
    FieldSpec(
        "guidance_scale",
        "float",
        defaults.GUIDANCE_SCALE,
        "Guidance scale",
        "how strongly to follow the instruction",
        *GUIDANCE_RANGE,
        0.1,
        shared=True,
        flag="--guidance-scale",
        help="how strongly to follow the instruction",
    ),
    FieldSpec(
        "image_guidance_scale",
        "float",
        defaults.IMAGE_GUIDANCE_SCALE,
        "Image guidance scale",
        "how closely to keep the source image",
        *IMAGE_GUIDANCE_RANGE,
        0.1,
        shared=True,
        flag="--image-guidance-scale",
        help="how closely to keep the source image",
    ),
    FieldSpec(
        "num_inference_steps",
        "int",
        defaults.NUM_INFERENCE_STEPS,
        "Steps",
        "",
        *STEPS_RANGE,
        1,
        shared=True,
        flag="--steps",
        help="denoising steps",
    ),
    FieldSpec(
        "refine_strength",
        "float",
        defaults.REFINE_STRENGTH,
        "Refine strength",
        "share of the steps run by the refine stage",
        *REFINE_RANGE,
        0.05,
        shared=True,
        flag="--refine-strength",
        help="share of the steps run by the refine stage",
    ),
    FieldSpec(
        "clip_cfg_norm",
        "bool",
        defaults.CLIP_CFG_NORM,
        "CLIP CFG norm",
        "rescale guidance to the conditional norm",
        shared=True,
        flag="--no-clip-cfg-norm",
        flag_value=False,
        help="use plain two-scale guidance",
    ),
    FieldSpec(
        "working_resolution",
        "resolution",
        "auto",
        "Working resolution",
        "auto: the model's size · draft: half-size preview · or a side in px (multiple of 16)",
        shared=True,
        flag="--working-resolution",
        help="auto | draft | N (side of the working area in pixels, a multiple of 16)",
    ),
    FieldSpec(
        "seed",
        "seed",
        3,
        "Seed",
        "",
        -1,
        SEED_MAX,
        settings=False,
        flag="--seed",
        help="-1 for random (the used seed is printed)",
    ),
    # On: Edit twice gives two different images (the seed used is shown, and saved with the result).
    FieldSpec(
        "randomize_seed",
        "bool",
        True,
        "Random seed",
        "the seed used is shown with the result",
        settings=False,
        why_no_flag="--seed -1",
    ),
    FieldSpec(
        "collapse_padding",
        "bool",
        defaults.COLLAPSE_PADDING,
        "Collapse padding",
        "exact; skips the padded tokens of non-square images",
        flag="--padded",
        flag_value=False,
        help="run the padded transformer (no padding collapse)",
    ),
    FieldSpec(
        "cache",
        "cache",
        "default",
        "Step cache",
        form=False,
        why_no_flag="the `--cache` model flag sets it for the whole run",
    ),
)
FIELD_SPECS: Mapping[str, FieldSpec] = MappingProxyType({spec.name: spec for spec in FIELDS})
# The Edit form's fields in the order of the /edit API's inputs (after the image).
EDIT_FORM: tuple[str, ...] = tuple(spec.name for spec in FIELDS if spec.form)
# The Batch and Compare tabs' shared-settings widgets, in the order of their APIs' inputs.
SHARED_FORM: tuple[str, ...] = tuple(spec.name for spec in FIELDS if spec.shared)
SETTING_NAMES: tuple[str, ...] = tuple(spec.name for spec in FIELDS if spec.settings)

# Upstream's defaults per variant: what differs from FIELDS' defaults, which are E1.1's (the one
# table of them; README and the flags' help read it through `default_text`).
VARIANT_DEFAULTS: Mapping[str, Mapping[str, Any]] = MappingProxyType(
    {
        "e1.1": MappingProxyType({}),
        "e1-full": MappingProxyType({"guidance_scale": 5.0, "image_guidance_scale": 4.0}),
    }
)


def _check_field(spec: FieldSpec, value: object) -> Any:
    """The one check of one field: its coerced value, or RequestError naming it."""
    if spec.kind == "text":
        text = _as_text(spec.name, value, allow_none=spec.name != "instruction").strip()
        return text
    if spec.kind == "float":
        return _as_float(spec.name, value, spec.lo, spec.hi)
    if spec.kind in ("int", "seed"):
        return _as_int(spec.name, value, int(spec.lo), int(spec.hi))
    if spec.kind == "bool":
        return _as_bool(spec.name, value)
    if spec.kind == "resolution":
        return str(parse_working_resolution(value))
    if spec.kind == "cache":
        return _as_cache(value)
    raise AssertionError(f"field {spec.name!r} has an unknown kind {spec.kind!r}")  # a bug in FIELDS


def _as_cache(value: object) -> str:
    """ "default" or a canonical step-cache spec (hidream_ui.pipeline.speed.settings), else RequestError."""
    text = str(value).strip().lower() if value is not None else "default"
    if text in ("", "default"):
        return "default"
    try:
        spec = parse_cache(text)
    except ValueError:
        raise RequestError("cache", value, "default, " + CACHE_GRAMMAR) from None
    reason = cache_unavailable(spec)
    if reason:
        raise RequestError("cache", value, reason)
    return str(spec)


_FLAG_TYPES = {"float": float, "int": int, "seed": int, "text": str, "resolution": str}


def default_text(spec: FieldSpec) -> str:
    """A field's default as help texts and README show it: per variant where VARIANT_DEFAULTS differ."""
    per_variant = {variant: values[spec.name] for variant, values in VARIANT_DEFAULTS.items() if spec.name in values}
    if per_variant:
        return ", ".join(
            f"{value:g} ({variant})" for variant, value in {DEFAULT_VARIANT: spec.default, **per_variant}.items()
        )
    if spec.kind == "bool":
        return str(spec.default).lower()
    return "" if spec.default == "" else str(spec.default)


def flag_help(spec: FieldSpec) -> str:
    default = default_text(spec)
    return f"{spec.help} (default {default})" if default and spec.kind != "bool" else spec.help


def add_edit_arguments(parser) -> None:
    """The `edit` command's flags, one per field of FIELDS that has one (argparse's `dest` is the
    field name; a value left out is None, so the variant's default applies)."""
    for spec in FIELDS:
        if spec.flag is None:
            continue
        if spec.kind == "bool":
            parser.add_argument(
                spec.flag,
                dest=spec.name,
                action="store_const",
                const=spec.flag_value,
                default=None,
                help=flag_help(spec),
            )
        else:
            parser.add_argument(
                spec.flag,
                dest=spec.name,
                type=_FLAG_TYPES[spec.kind],
                required=spec.name == "instruction",
                help=flag_help(spec),
            )


EDIT_FLAGS_BEGIN = "<!-- edit-flags:begin -->"
EDIT_FLAGS_END = "<!-- edit-flags:end -->"


def edit_flags_table() -> str:
    """README's table of the `edit` command's flags (between EDIT_FLAGS_BEGIN and EDIT_FLAGS_END)."""
    lines = ["| flag | field | values | default | what it does |", "|---|---|---|---|---|"]
    for spec in FIELDS:
        if spec.flag is None:
            continue
        if spec.lo is not None:
            span = f"{spec.lo:g} to {spec.hi:g}" if spec.kind == "float" else f"{spec.lo:d} to {spec.hi:d}"
        elif spec.kind == "bool":
            span = f"sets `{spec.name}` {str(spec.flag_value).lower()}"
        else:
            span = "text"
        cells = (f"`{spec.flag}`", f"`{spec.name}`", span, default_text(spec) or "(required)", spec.help)
        lines.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
    return "\n".join(lines)


def with_edit_flags_table(text: str) -> str:
    """`text` (README) with the table between EDIT_FLAGS_BEGIN and EDIT_FLAGS_END rendered anew
    (`python -c "..."` to update README after a change to FIELDS; the test says how)."""
    begin, end = text.find(EDIT_FLAGS_BEGIN), text.find(EDIT_FLAGS_END)
    if begin < 0 or end < begin:
        raise ValueError(f"no {EDIT_FLAGS_BEGIN} ... {EDIT_FLAGS_END} markers in the text")
    return text[: begin + len(EDIT_FLAGS_BEGIN)] + "\n" + edit_flags_table() + "\n" + text[end:]
