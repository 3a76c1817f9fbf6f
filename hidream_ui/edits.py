"""The edit schema: the dataclasses that cross the UI / CLI / engine boundary.

Everything that reproduces an edit (except the source image) lives in :class:`EditParams`, so
that a result's metadata can be turned back into the exact same request (``outputs.load_settings``).
Values arrive from three places with different types: Python callers (already typed), Gradio
widgets (floats for integer sliders, ``None`` for cleared numbers) and the HTTP API / JSON
sidecars (anything, often strings). :meth:`EditParams.validated` is the single gate that coerces
and checks them, at the boundary (a handler, the CLI, `from_dict`); validated params carry a mark,
so inner layers that call it again get the same object back without a second check.

`FIELDS` is the one list of an edit's fields: widgets, handler inputs, the form round trip, the
CLI flags and README's flag table are derived from it.

The schema is four modules, this one their face: `edit_values` (limits, `RequestError`, coercions),
`edit_fields` (`FIELDS` and what derives from it alone: flags, README's table), this one (settings,
params, masks, requests, the form round trip) and `edit_results` (timings, run facts, results). Every
public name is importable from here. Only PIL, the standard library and the pipeline's plain-Python
rules are imported: this module is loaded by the CLI and the UI before any model is, and it reads no
configuration (the variants come from hidream_ui.variants).
"""

from __future__ import annotations

import dataclasses
import random
import secrets
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping

from PIL import Image

from hidream_ui.edit_fields import (  # noqa: F401  re-exported: the schema's public (and tested) names
    DEFAULT_NEGATIVE,
    EDIT_FLAGS_BEGIN,
    EDIT_FLAGS_END,
    EDIT_FORM,
    FIELD_SPECS,
    FIELDS,
    GUIDANCE_RANGE,
    IMAGE_GUIDANCE_RANGE,
    REFINE_RANGE,
    SETTING_NAMES,
    SHARED_FORM,
    STEPS_RANGE,
    VARIANT_DEFAULTS,
    FieldSpec,
    _check_field,
    add_edit_arguments,
    default_text,
    edit_flags_table,
    flag_help,
    with_edit_flags_table,
)
from hidream_ui.edit_results import EditResult, RunInfo, Timings  # noqa: F401  re-exported
from hidream_ui.edit_values import (  # noqa: F401  re-exported
    MAX_NAME_CHARS,
    MAX_PROMPT_CHARS,
    NO_FILE,
    NO_INSTRUCTION,
    SEED_MAX,
    WORKING_RESOLUTION_WORDS,
    WORKING_SIDE_MAX,
    WORKING_SIDE_MIN,
    WORKING_SIDE_MULTIPLE,
    RequestError,
    cap_name,
    parse_working_resolution,
    validated_flag,
)
from hidream_ui.pipeline.prompts import TARGET_MARKER, target_prompt
from hidream_ui.pipeline.prompts import target_text as _target_text
from hidream_ui.variants import DEFAULT_VARIANT, VARIANTS  # noqa: F401  re-exported

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


def validated_seed(value: object) -> int:
    """A seed from -1 (pick one) to SEED_MAX, or RequestError."""
    return _check_field(FIELD_SPECS["seed"], value)


# Validated instances carry this mark (not a field: equality and the dict form ignore it). A copy
# made by `dataclasses.replace` has none, so changed values are checked again.
_VALID = "_validated"


def _mark(value):
    object.__setattr__(value, _VALID, True)
    return value


def _is_valid(value) -> bool:
    return value.__dict__.get(_VALID, False)


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
