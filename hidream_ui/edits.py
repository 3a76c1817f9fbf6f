"""Edit requests and results: the dataclasses that cross the UI / CLI / engine boundary.

Everything that reproduces an edit (except the source image) lives in :class:`EditParams`, so
that a result's metadata can be turned back into the exact same request (``outputs.load_settings``).
Values arrive from three places with different types: Python callers (already typed), Gradio
widgets (floats for integer sliders, ``None`` for cleared numbers) and the HTTP API / JSON
sidecars (anything, often strings). :meth:`EditParams.validated` is the single gate that coerces
and checks them, at the boundary (a handler, the CLI, `from_dict`); validated params carry a mark,
so inner layers that call it again get the same object back without a second check.

`FIELDS` is the one list of an edit's fields: widgets, handler inputs, the form round trip, the
CLI flags and README's flag table are derived from it.

Only PIL and the standard library are imported here: this module is loaded by the CLI and the UI
before any model is.
"""

from __future__ import annotations

import dataclasses
import math
import random
import secrets
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Mapping

from PIL import Image

from hidream_ui.config import VARIANTS
from hidream_ui.pipeline.speed.settings import CACHE_GRAMMAR, MAX_STEPS_RANGE, cache_unavailable, parse_cache

if TYPE_CHECKING:  # pragma: no cover
    from hidream_ui.rewrite.prompt import RewriteResult

__all__ = [
    "VARIANTS",
    "SEED_MAX",
    "MAX_PROMPT_CHARS",
    "MAX_NAME_CHARS",
    "cap_name",
    "WORKING_SIDE_MIN",
    "WORKING_SIDE_MAX",
    "WORKING_SIDE_MULTIPLE",
    "TARGET_MARKER",
    "RequestError",
    "EditParams",
    "EditMask",
    "validated_mask",
    "EditRequest",
    "EditSettings",
    "FieldSpec",
    "FIELDS",
    "FIELD_SPECS",
    "EDIT_FORM",
    "SHARED_FORM",
    "SETTING_NAMES",
    "VARIANT_DEFAULTS",
    "params_from_form",
    "settings_from_form",
    "seed_from_form",
    "form_values",
    "add_edit_arguments",
    "params_from_args",
    "edit_flags_table",
    "with_edit_flags_table",
    "Timings",
    "RunInfo",
    "validated_seed",
    "validated_flag",
    "target_prompt",
    "DEFAULT_NEGATIVE",
    "EditResult",
    "parse_working_resolution",
]

SEED_MAX = 2**32 - 1
# Long enough for E1-Full's "Editing Instruction: ... Target Image Description: ..." prompts with a
# detailed description; the text encoders truncate far earlier (T5 128 tokens, Llama 128 tokens), so
# anything longer is almost certainly a paste accident rather than a prompt.
MAX_PROMPT_CHARS = 4000
# A client's file name (a FileData's `orig_name`, a zip member) is kept to this many characters
# before it reaches metadata: a 68 M-character name once became a 68 MB PNG text chunk.
MAX_NAME_CHARS = 255
GUIDANCE_RANGE = (0.0, 30.0)
IMAGE_GUIDANCE_RANGE = (0.0, 30.0)
STEPS_RANGE = MAX_STEPS_RANGE  # one home: a cache's `@S` cap takes the same range
REFINE_RANGE = (0.0, 1.0)

# Explicit working resolutions: a side length on the 16-px grid the VAE (8x) and the transformer's
# 2x2 patches need. Below 256 the models produce mush; above 4096 the attention cost is absurd.
WORKING_SIDE_MIN = 256
WORKING_SIDE_MAX = 4096
WORKING_SIDE_MULTIPLE = 16
WORKING_RESOLUTION_WORDS = ("auto", "draft")

# The E1-Full prompt format. Matched exactly (case-sensitive), as the upstream pipeline does, so the
# same prompt is split the same way here and there.
TARGET_MARKER = "Target Image Description:"
# What a missing instruction / file is refused with (the UI says it for people: ui/common.people_message).
NO_INSTRUCTION = "a non-empty editing instruction"
NO_FILE = "a file: upload one"
# Upstream's negative prompt (both variants).
DEFAULT_NEGATIVE = "low resolution, blur"

_TRUE_WORDS = frozenset({"true", "1", "yes", "on", "y", "t"})
_FALSE_WORDS = frozenset({"false", "0", "no", "off", "n", "f"})


class RequestError(ValueError):
    """A request field has a bad value. ``field`` and ``value`` let the UI highlight the widget."""

    def __init__(self, field: str, value: object, expected: str):
        self.field = field
        self.value = value
        self.expected = expected
        super().__init__(f"{field}: got {_short_repr(value)}; expected {expected}")

    def __reduce__(self):  # keep the three-argument constructor picklable (worker processes)
        return (type(self), (self.field, self.value, self.expected))


def cap_name(name: object) -> str | None:
    """A client-given file name cut to MAX_NAME_CHARS (the end is kept: it holds the extension)."""
    if name is None:
        return None
    text = str(name)
    return text if len(text) <= MAX_NAME_CHARS else "..." + text[-(MAX_NAME_CHARS - 3) :]


def _short_repr(value: object, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# ---------------------------------------------------------------------------------------------
# Coercion helpers. Each takes the field name so that every error names the field it is about.
# ---------------------------------------------------------------------------------------------


def _as_float(name: str, value: object, lo: float, hi: float) -> float:
    expected = f"a number from {lo:g} to {hi:g}"
    # bool is an int subclass; True as a guidance scale is a wiring bug, not a number.
    if isinstance(value, bool) or value is None:
        raise RequestError(name, value, expected)
    # OverflowError: a JSON integer of 400 digits does not fit a float (a string of them becomes inf).
    if isinstance(value, (int, float)):
        try:
            number = float(value)
        except OverflowError:
            raise RequestError(name, value, expected) from None
    elif isinstance(value, str):
        try:
            number = float(value.strip())
        except ValueError:
            raise RequestError(name, value, expected) from None
    else:
        try:
            number = float(value)  # numpy scalars, Decimal
        except (TypeError, ValueError, OverflowError):
            raise RequestError(name, value, expected) from None
    if not math.isfinite(number) or not lo <= number <= hi:
        raise RequestError(name, value, expected)
    return number


def _as_int(name: str, value: object, lo: int, hi: int) -> int:
    expected = f"a whole number from {lo} to {hi}"
    if isinstance(value, bool) or value is None:
        raise RequestError(name, value, expected)
    if isinstance(value, int):
        number = value
    else:
        # Gradio number widgets and JSON clients send 28.0 for 28; accept that, but never round
        # 1.5 silently: a seed or step count that is not what the user typed is not reproducible.
        if isinstance(value, str):
            text = value.strip()
            try:
                number = int(text)
            except ValueError:
                try:
                    as_float = float(text)
                except ValueError:
                    raise RequestError(name, value, expected) from None
                number = _exact_int(name, value, as_float, expected)
        else:
            try:
                as_float = float(value)
            except (TypeError, ValueError, OverflowError):
                raise RequestError(name, value, expected) from None
            number = _exact_int(name, value, as_float, expected)
    if not lo <= number <= hi:
        raise RequestError(name, value, expected)
    return number


def _exact_int(name: str, original: object, number: float, expected: str) -> int:
    if not math.isfinite(number) or not number.is_integer():
        raise RequestError(name, original, expected)
    return int(number)


def _as_bool(name: str, value: object) -> bool:
    expected = "true or false"
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str):
        word = value.strip().lower()
        if word in _TRUE_WORDS:
            return True
        if word in _FALSE_WORDS:
            return False
    raise RequestError(name, value, expected)


def _as_text(name: str, value: object, *, allow_none: bool) -> str:
    if value is None and allow_none:
        return ""
    if not isinstance(value, str):
        raise RequestError(name, value, "text")
    if len(value) > MAX_PROMPT_CHARS:
        raise RequestError(name, value, f"at most {MAX_PROMPT_CHARS} characters (got {len(value)}); shorten it")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        # A lone surrogate (half of an emoji, from a broken paste or a raw API client): the
        # tokenizers cannot take it. Say where it is instead of failing mid-edit.
        raise RequestError(
            name,
            value,
            f"valid Unicode text (character {exc.start + 1} is an unpaired "
            "surrogate; re-type or paste that part again)",
        ) from None
    return value


def parse_working_resolution(value: object) -> str | int:
    """Parse a working-resolution setting: ``"auto"``, ``"draft"`` or a side length.

    Returns the word (lower case) or the side as an ``int``. Raises :class:`RequestError` for
    anything else, naming the allowed values.
    """
    expected = (
        f'"auto", "draft" or a side length that is a multiple of {WORKING_SIDE_MULTIPLE} '
        f"from {WORKING_SIDE_MIN} to {WORKING_SIDE_MAX}"
    )
    name = "working_resolution"
    if isinstance(value, bool) or value is None:
        raise RequestError(name, value, expected)
    if isinstance(value, str):
        word = value.strip().lower()
        if word in WORKING_RESOLUTION_WORDS:
            return word
        word = word.removesuffix("px").strip()
        side = _as_int_or_none(word)
    else:
        side = _as_int_or_none(value)
    if side is None or not WORKING_SIDE_MIN <= side <= WORKING_SIDE_MAX or side % WORKING_SIDE_MULTIPLE:
        raise RequestError(name, value, expected)
    return side


def _as_int_or_none(value: object) -> int | None:
    try:
        return _as_int("working_resolution", value, -(2**63), 2**63)
    except RequestError:
        return None


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
        3.0,
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
        1.5,
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
        28,
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
        0.3,
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
        True,
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
        True,
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
DEFAULT_VARIANT = "e1.1"
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


@dataclass(frozen=True)
class EditSettings:
    """What a batch or a comparison shares: every setting of an edit except the instruction and the
    seed (defaults and checks from FIELDS); `EditParams` holds one beside the two per-item fields."""

    negative_prompt: str = FIELD_SPECS["negative_prompt"].default
    guidance_scale: float = FIELD_SPECS["guidance_scale"].default
    image_guidance_scale: float = FIELD_SPECS["image_guidance_scale"].default
    num_inference_steps: int = FIELD_SPECS["num_inference_steps"].default
    refine_strength: float = FIELD_SPECS["refine_strength"].default
    clip_cfg_norm: bool = FIELD_SPECS["clip_cfg_norm"].default
    working_resolution: str = FIELD_SPECS["working_resolution"].default  # "auto", "draft", or a side such as "768"
    collapse_padding: bool = FIELD_SPECS["collapse_padding"].default  # False runs the padded tokens as upstream
    # Step cache: "default" (the app's --cache), a --cache spec (pipeline.speed.settings.CACHE_GRAMMAR), or a preset.
    cache: str = FIELD_SPECS["cache"].default

    def validated(self) -> "EditSettings":
        """Return a copy with coerced types, or raise RequestError naming the field. A copy that is
        already validated is returned as it is (so passing one on costs nothing)."""
        if _is_valid(self):
            return self
        return _mark(
            EditSettings(**{name: _check_field(FIELD_SPECS[name], getattr(self, name)) for name in SETTING_NAMES})
        )

    def params(self, instruction: str, seed: int) -> "EditParams":
        """The full parameters of one item (not validated: call `EditParams.validated`)."""
        return EditParams(instruction=instruction, seed=seed, settings=self)

    @classmethod
    def defaults_for(cls, variant: str) -> "EditSettings":
        """Upstream's settings of `variant` (VARIANT_DEFAULTS over the spec's defaults)."""
        if variant not in VARIANT_DEFAULTS:
            raise RequestError("variant", variant, f"one of {', '.join(VARIANTS)}")
        return cls(**VARIANT_DEFAULTS[variant])


# Validated instances carry this mark (not a field: equality and the dict form ignore it). A copy
# made by `dataclasses.replace` has none, so changed values are checked again.
_VALID = "_validated"


def _mark(value):
    object.__setattr__(value, _VALID, True)
    return value


def _is_valid(value) -> bool:
    return value.__dict__.get(_VALID, False)


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


def validated_seed(value: object) -> int:
    """A seed from -1 (pick one) to SEED_MAX, or RequestError."""
    return _check_field(FIELD_SPECS["seed"], value)


def validated_flag(name: str, value: object) -> bool:
    """A yes/no field (a checkbox, or "true"/"false" from an API client), or RequestError naming it."""
    return _as_bool(name, value)


# A region edit's mask: white = may change, black = keep (grey is split at the middle). Its aspect must
# be the source's (it is stretched to the source's size): up to this relative difference, for masks
# painted on a resized copy of the source.
MASK_ASPECT_TOLERANCE = 0.02
NO_MASK_AREA = "a mask with some white (the part the edit may change); an all-black mask keeps everything"


@dataclass(frozen=True)
class EditMask:
    """Where a region edit may change the source (see `validated_mask`, the one way to make one).

    `image` is mode "L" with only 0 (keep) and 255 (may change); `png` its PNG bytes as saved
    beside the result and `sha256` their hash (what the metadata names). Equal masks are equal by
    hash: comparing two results' params never compares pixels."""

    image: Image.Image = dataclasses.field(compare=False, repr=False)
    png: bytes = dataclasses.field(compare=False, repr=False)
    sha256: str
    name: str | None = None  # the client's file name, if any (capped like a source name)

    @property
    def file_name(self) -> str:
        """The file it is saved as, beside the results (content-addressed: one file per mask)."""
        return f"mask-{self.sha256[:16]}.png"

    def to_dict(self) -> dict[str, Any]:
        return {
            "file": self.file_name,
            "sha256": self.sha256,
            "size": list(self.image.size),
            "name": cap_name(self.name),
        }


def validated_mask(value: object, name: str | None = None) -> "EditMask | None":
    """The one check of a mask: None (no mask: the whole image may change), an EditMask as it is, or
    a decoded PIL image (`imaging.open_image` opened it like any upload) binarised to 0 / 255.
    RequestError("mask", ...) for anything else, or a mask that keeps everything."""
    import hashlib
    import io

    if value is None or isinstance(value, EditMask):
        return value
    if not isinstance(value, Image.Image):
        raise RequestError("mask", type(value).__name__, "an image (white = may change, black = keep), or none")
    grey = value.convert("L")
    binary = grey.point(lambda v: 255 if v >= 128 else 0)
    if binary.getbbox() is None:
        raise RequestError("mask", f"an all-black {binary.width}x{binary.height} image", NO_MASK_AREA)
    buffer = io.BytesIO()
    binary.save(buffer, format="PNG", optimize=False)
    png = buffer.getvalue()
    return EditMask(image=binary, png=png, sha256=hashlib.sha256(png).hexdigest(), name=cap_name(name))


def _check_mask_shape(mask: EditMask, size: tuple[int, int]) -> None:
    (mw, mh), (w, h) = mask.image.size, size
    if abs((mw / mh) / (w / h) - 1) > MASK_ASPECT_TOLERANCE:
        raise RequestError(
            "mask", f"a {mw}x{mh} image", f"a mask of the source image's shape ({w}x{h}, or a scaled copy of it)"
        )


@dataclass(frozen=True, init=False)
class EditParams:
    """Everything that reproduces an edit except the source image: the instruction, the seed and the
    settings (composition: `params.settings` is an `EditSettings`; its fields read through, e.g.
    `params.guidance_scale`).

    A region edit adds `mask` (an `EditMask`; None: the whole image may change). It is not a
    setting: `to_dict` (the form, `params` in metadata) leaves it out; the metadata names it apart.

    Built as ``EditParams(instruction, seed=..., settings=...)`` or with the settings' fields as
    keywords (``EditParams(instruction="x", guidance_scale=4)``; with `settings` too they replace its
    fields, which is how ``dataclasses.replace(params, cache=...)`` works). Construction does not
    validate (the UI builds one from raw widget values and gets one field-named error from
    :meth:`validated`, at the boundary); inner layers take validated params.
    """

    instruction: str
    seed: int
    settings: EditSettings
    mask: EditMask | None = None

    def __init__(
        self,
        instruction: str,
        seed: int = FIELD_SPECS["seed"].default,
        settings: EditSettings | None = None,
        mask: EditMask | None = None,
        **setting_values: Any,
    ):
        unknown = set(setting_values) - set(SETTING_NAMES)
        if unknown:
            raise TypeError(f"EditParams got unknown fields {sorted(unknown)}; settings are {SETTING_NAMES}")
        base = settings if settings is not None else EditSettings()
        if setting_values:
            base = dataclasses.replace(base, **setting_values)
        object.__setattr__(self, "instruction", instruction)
        object.__setattr__(self, "seed", seed)
        object.__setattr__(self, "settings", base)
        object.__setattr__(self, "mask", mask)

    def validated(self) -> "EditParams":
        """Return a copy with coerced types and a stripped instruction, or raise RequestError. The
        one gate: validated params pass through it again without another check."""
        if _is_valid(self):
            return self
        instruction = _check_field(FIELD_SPECS["instruction"], self.instruction)
        if not instruction:
            raise RequestError("instruction", self.instruction, NO_INSTRUCTION)
        if TARGET_MARKER in instruction and not _target_text(instruction):
            raise RequestError(
                "instruction",
                self.instruction,
                f'a description after "{TARGET_MARKER}" (or remove the marker)',
            )
        return _mark(
            EditParams(
                instruction, validated_seed(self.seed), self.settings.validated(), mask=validated_mask(self.mask)
            )
        )

    @property
    def is_validated(self) -> bool:
        return _is_valid(self)

    def resolve_seed(self, rng: random.Random | None = None) -> "EditParams":
        """Replace seed -1 by a concrete seed in [0, 2**32-1]; other seeds are kept.

        ``rng`` makes the choice reproducible in tests; without it the OS entropy source is used
        so that two processes started at the same moment do not pick the same "random" seed.
        """
        seed = self.seed if _is_valid(self) else validated_seed(self.seed)
        if seed == -1:
            seed = rng.randint(0, SEED_MAX) if rng is not None else secrets.randbelow(SEED_MAX + 1)
        resolved = EditParams(self.instruction, seed, self.settings, mask=self.mask)
        return _mark(resolved) if _is_valid(self) else resolved

    def to_dict(self) -> dict[str, Any]:
        """The flat form metadata and API clients use: instruction, seed and every setting."""
        values = {"instruction": self.instruction, "seed": self.seed, **dataclasses.asdict(self.settings)}
        return {spec.name: values[spec.name] for spec in FIELDS if spec.name in values}  # in FIELDS order

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "EditParams":
        """Build validated params from a mapping (API payload, metadata). Unknown keys are ignored
        so that metadata written by a newer version still loads; missing keys take the defaults."""
        if not isinstance(d, Mapping):
            raise RequestError("params", d, "a mapping of parameter names to values")
        if "instruction" not in d:
            raise RequestError("instruction", None, NO_INSTRUCTION)
        settings = {k: v for k, v in d.items() if k in SETTING_NAMES}
        seed = d.get("seed", FIELD_SPECS["seed"].default)
        return cls(d["instruction"], seed, **settings).validated()

    @classmethod
    def defaults_for(cls, variant: str, instruction: str = "") -> "EditParams":
        """The upstream defaults of each variant (not validated: the instruction may be empty)."""
        return cls(instruction, settings=EditSettings.defaults_for(variant))

    def target_prompt(self) -> str:
        """The prompt for the refine stage (see the module function `target_prompt`)."""
        return target_prompt(self.instruction)


def _read_setting(name: str) -> property:
    return property(lambda self: getattr(self.settings, name), doc=f"settings.{name}")


for _name in SETTING_NAMES:  # params.guidance_scale reads params.settings.guidance_scale
    setattr(EditParams, _name, _read_setting(_name))
del _name


# ---------------------------------------------------------------------------------------------
# Derived from FIELDS: the form round trip, the CLI flags, README's flag table
# ---------------------------------------------------------------------------------------------


def seed_from_form(seed: Any, randomize_seed: Any = False) -> Any:
    """The seed a form asks for: -1 (pick one) when "random" is ticked or the box was cleared, else
    the value as given (checked with the other fields, by `EditParams.validated` or the batch plan)."""
    if randomize_seed is True or str(randomize_seed).strip().lower() in ("true", "1"):
        return -1
    if seed is None or (isinstance(seed, str) and not seed.strip()):
        return -1  # a cleared seed box means "pick one", not an error
    return seed


def settings_from_form(values: Mapping[str, Any]) -> EditSettings:
    """Validated settings from raw widget / API values keyed by field name (the names of FIELDS a
    form has; the others keep their defaults). RequestError names the bad field."""
    fields = {name: values[name] for name in SETTING_NAMES if name in values}
    if fields.get("working_resolution") in (None, ""):
        fields.pop("working_resolution", None)  # a cleared dropdown means "auto"
    return EditSettings(**fields).validated()


def params_from_form(values: Mapping[str, Any]) -> EditParams:
    """Validated params from the Edit form's raw values keyed by field name (a handler passes its
    arguments); RequestError names the bad field."""
    instruction = values.get("instruction")
    seed = seed_from_form(values.get("seed"), values.get("randomize_seed", False))
    return settings_from_form(values).params("" if instruction is None else instruction, seed).validated()


def form_values(params: EditParams) -> tuple:
    """Values for the Edit form's widgets, in EDIT_FORM order (randomize is switched off so the
    loaded seed is the one used)."""
    values = {**params.to_dict(), "randomize_seed": False, "working_resolution": str(params.working_resolution)}
    return tuple(values[name] for name in EDIT_FORM)


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


def params_from_args(args, variant: str) -> EditParams:
    """Validated params from parsed `edit` flags: the variant's defaults, then every flag given."""
    values = EditParams.defaults_for(variant).to_dict()
    values.update(
        {
            spec.name: getattr(args, spec.name)
            for spec in FIELDS
            if spec.flag is not None and getattr(args, spec.name, None) is not None
        }
    )
    return EditParams.from_dict(values)


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


def target_prompt(instruction: str) -> str:
    """The prompt for the refine stage: the one home of this rule (the pipeline uses it too).

    E1-Full prompts have the form "Editing Instruction: ... Target Image Description: ...";
    the refine stage is conditioned on the description only. Like upstream, the marker is
    matched exactly and the text up to a second marker (if any) is used. Instructions
    without the marker are used as they are (E1.1 takes plain instructions).
    """
    text = _target_text(instruction)
    return text if text else instruction.strip()


def _target_text(instruction: str) -> str:
    parts = instruction.split(TARGET_MARKER)
    return parts[1].strip() if len(parts) > 1 else ""


@dataclass(frozen=True)
class EditRequest:
    image: Image.Image
    params: EditParams
    source_name: str | None = None
    # When the instruction came from the rewriter: its answer, recorded in the result's metadata.
    # `params.instruction` is what the model gets either way (the rewritten, perhaps hand-edited, text).
    rewrite: "RewriteResult | None" = None
    # sha256 of the source file's bytes when the source came from a file (the result's `parent`,
    # results.py); None: the result store hashes the decoded pixels instead.
    source_sha256: str | None = None

    def validated(self) -> "EditRequest":
        """Check the image type and validate the params (image content is checked by imaging); a
        mask must have the source's shape."""
        if not isinstance(self.image, Image.Image):
            raise RequestError("image", type(self.image).__name__, "a PIL image (use imaging.open_image)")
        params = self.params.validated()
        if params.mask is not None:
            _check_mask_shape(params.mask, self.image.size)
        return dataclasses.replace(self, params=params)


@dataclass(frozen=True)
class Timings:
    """Seconds spent in each phase of one pipeline call (shared by the items of a batch call)."""

    load: float = 0.0  # model load this call waited for
    text_encode: float = 0.0  # text encoders (0 when every text came from the prompt cache)
    prepare: float = 0.0  # resizing, latents, scheduler
    denoise: float = 0.0  # first to last denoising step
    per_step: float = 0.0
    decode: float = 0.0  # VAE decode and post-processing
    total: float = 0.0

    def to_dict(self) -> dict[str, float]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class RunInfo:
    """Engine facts saved with every result: which model, where, how. Metadata keys as named here."""

    variant: str
    model_source: str  # "tiny" | "real"
    model_paths: dict[str, Any] | None
    device: str
    device_name: str
    dtype: str
    attention: str | None
    refiner: str
    versions: dict[str, str]
    batch_size: int = 1  # items in the pipeline call that produced the result
    engine: str | None = None  # the pool's engine that ran it ("npu:1", "cpu#2"), with --devices
    memory_plan: dict[str, Any] | None = None  # MemoryPlan.to_dict(): plan, weights, prediction (model/plans.py)
    # Speed modes of the call (README "Speed modes"): moe, compile, cache, skipped_fraction; None: exact.
    speed: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class EditResult:
    image: Image.Image  # the edited image at source_size
    source_image: Image.Image  # the source after EXIF transpose and mode conversion
    params: EditParams  # validated, seed resolved
    working_size: tuple[int, int]
    source_size: tuple[int, int]
    timings: Timings
    peak_memory_bytes: int | None
    info: RunInfo  # engine facts: variant, model_source, model paths, device, dtype, ...
    saved_png: Path | None = None
    saved_json: Path | None = None
    source_name: str | None = None
    rewrite: "RewriteResult | None" = None  # the rewriter's answer the instruction came from, if any
    # What `metadata()` returned when the result was saved (results.py): built once, read by the UI.
    saved_metadata: dict[str, Any] | None = None
    # The image this result was made from: {"file", "sha256", "of"} (results.py `parent_of` defines
    # it; set by the result store before saving). A source that is an earlier result names that PNG.
    parent: dict[str, Any] | None = None
    source_sha256: str | None = None  # from the request (EditRequest.source_sha256)
    # A region edit: the feather (source pixels) of the pixel composite; the mask is `params.mask`.
    mask_feather: int | None = None

    METADATA_FORMAT = "hidream_ui/1"

    def metadata(self) -> dict[str, Any]:
        """JSON-ready description of this result (written into the PNG and the sidecar).

        The core keys come first and win over an ``info`` entry of the same name, so an engine
        fact can never disguise the params that reproduce the image. A rewritten instruction adds
        ``rewrite``: the user's request (``original``), the rewriter's lines, the prompt it composed
        and whether the user changed that prompt before editing (``edited``); ``params.instruction``
        stays the text actually used, so ``EditParams.from_dict(metadata["params"])`` reproduces the edit.
        """
        core: dict[str, Any] = {
            "format": self.METADATA_FORMAT,
            "params": self.params.to_dict(),
            "working_size": list(self.working_size),
            "source_size": list(self.source_size),
            "source_name": cap_name(self.source_name),
            "timings": self.timings.to_dict(),
            "peak_memory_bytes": self.peak_memory_bytes,
        }
        if self.parent is not None:
            core["parent"] = dict(self.parent)
        if self.params.mask is not None:
            core["mask"] = {**self.params.mask.to_dict(), "feather": self.mask_feather}
        if self.rewrite is not None:
            composed = self.rewrite.compose(self.info.variant)
            core["rewrite"] = {
                **self.rewrite.to_dict(),
                "prompt": composed,
                "edited": self.params.instruction != composed.strip(),
            }
        for key, value in self.info.to_dict().items():
            core.setdefault(str(key), value)
        return _jsonable(core)


def with_edit_flags_table(text: str) -> str:
    """`text` (README) with the table between EDIT_FLAGS_BEGIN and EDIT_FLAGS_END rendered anew
    (`python -c "..."` to update README after a change to FIELDS; the test says how)."""
    begin, end = text.find(EDIT_FLAGS_BEGIN), text.find(EDIT_FLAGS_END)
    if begin < 0 or end < begin:
        raise ValueError(f"no {EDIT_FLAGS_BEGIN} ... {EDIT_FLAGS_END} markers in the text")
    return text[: begin + len(EDIT_FLAGS_BEGIN)] + "\n" + edit_flags_table() + "\n" + text[end:]


def _jsonable(value: Any) -> Any:
    """Convert to JSON-native types so that write -> read gives back an equal dict."""
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        # NaN/inf would make the JSON invalid for strict readers (browsers, jq).
        return value if math.isfinite(value) else None
    if isinstance(value, Path):
        return str(value)
    return str(value)  # torch.dtype, torch.device, versions: their str() is the useful form
