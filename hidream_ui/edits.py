"""Edit requests and results: the dataclasses that cross the UI / CLI / engine boundary.

Everything that reproduces an edit (except the source image) lives in :class:`EditParams`, so
that a result's metadata can be turned back into the exact same request (``outputs.load_settings``).
Values arrive from three places with different types: Python callers (already typed), Gradio
widgets (floats for integer sliders, ``None`` for cleared numbers) and the HTTP API / JSON
sidecars (anything, often strings). :meth:`EditParams.validated` is the single gate that coerces
and checks them; the engine only ever sees validated params.

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
from typing import TYPE_CHECKING, Any, Mapping

from PIL import Image

from hidream_ui.config import VARIANTS

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
    "EditRequest",
    "EditSettings",
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
STEPS_RANGE = (1, 200)
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
    return text if len(text) <= MAX_NAME_CHARS else "..." + text[-(MAX_NAME_CHARS - 3):]


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
        raise RequestError(
            name, value, f"at most {MAX_PROMPT_CHARS} characters (got {len(value)}); shorten it"
        )
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        # A lone surrogate (half of an emoji, from a broken paste or a raw API client): the
        # tokenizers cannot take it. Say where it is instead of failing mid-edit.
        raise RequestError(name, value, f"valid Unicode text (character {exc.start + 1} is an unpaired "
                                        "surrogate; re-type or paste that part again)") from None
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
    if (
        side is None
        or not WORKING_SIDE_MIN <= side <= WORKING_SIDE_MAX
        or side % WORKING_SIDE_MULTIPLE
    ):
        raise RequestError(name, value, expected)
    return side


def _as_int_or_none(value: object) -> int | None:
    try:
        return _as_int("working_resolution", value, -(2**63), 2**63)
    except RequestError:
        return None


# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class EditSettings:
    """What a batch or a comparison shares: every setting of an edit except the instruction and the
    seed. The one home of these fields' checks (`validated`); `EditParams` adds the two per-item fields.
    """

    negative_prompt: str = DEFAULT_NEGATIVE
    guidance_scale: float = 3.0
    image_guidance_scale: float = 1.5
    num_inference_steps: int = 28
    refine_strength: float = 0.3
    clip_cfg_norm: bool = True
    working_resolution: str = "auto"  # "auto" (variant rule), "draft", or a side such as "768"
    collapse_padding: bool = True  # exact padding collapse; False runs the padded tokens as upstream
    cache: str = "default"  # step cache: "default" (the app's --cache), none, interval:K, first-block:T, or a preset

    def validated(self) -> "EditSettings":
        """Return a copy with coerced types, or raise RequestError naming the field."""
        return EditSettings(
            negative_prompt=_as_text("negative_prompt", self.negative_prompt, allow_none=True).strip(),
            guidance_scale=_as_float("guidance_scale", self.guidance_scale, *GUIDANCE_RANGE),
            image_guidance_scale=_as_float(
                "image_guidance_scale", self.image_guidance_scale, *IMAGE_GUIDANCE_RANGE
            ),
            num_inference_steps=_as_int("num_inference_steps", self.num_inference_steps, *STEPS_RANGE),
            refine_strength=_as_float("refine_strength", self.refine_strength, *REFINE_RANGE),
            clip_cfg_norm=_as_bool("clip_cfg_norm", self.clip_cfg_norm),
            working_resolution=str(parse_working_resolution(self.working_resolution)),
            collapse_padding=_as_bool("collapse_padding", self.collapse_padding),
            cache=_as_cache(self.cache),
        )

    def params(self, instruction: str, seed: int) -> "EditParams":
        """The full parameters of one item (not validated: call `EditParams.validated`)."""
        return EditParams(instruction=instruction, seed=seed, **dataclasses.asdict(self))


def _as_cache(value: object) -> str:
    """"default" or a canonical step-cache spec (hidream_ui.pipeline.speed.settings), else RequestError."""
    from hidream_ui.pipeline.speed.settings import SPEED_PRESETS, parse_cache

    text = str(value).strip().lower() if value is not None else "default"
    if text in ("", "default"):
        return "default"
    try:
        return str(parse_cache(text))
    except ValueError:
        raise RequestError("cache", value, "default, none, interval:K, first-block:T or one of "
                           + ", ".join(SPEED_PRESETS)) from None


def validated_seed(value: object) -> int:
    """A seed from -1 (pick one) to SEED_MAX, or RequestError."""
    return _as_int("seed", value, -1, SEED_MAX)


def validated_flag(name: str, value: object) -> bool:
    """A yes/no field (a checkbox, or "true"/"false" from an API client), or RequestError naming it."""
    return _as_bool(name, value)


@dataclass(frozen=True)
class EditParams:
    """Everything that reproduces an edit except the source image.

    Construction does not validate (so the UI can build one from raw widget values and get a
    single, field-named error from :meth:`validated`). The engine must call :meth:`validated`
    (and :meth:`resolve_seed`) before use.
    """

    instruction: str
    negative_prompt: str = DEFAULT_NEGATIVE
    guidance_scale: float = 3.0
    image_guidance_scale: float = 1.5
    num_inference_steps: int = 28
    refine_strength: float = 0.3
    clip_cfg_norm: bool = True
    seed: int = 3  # -1 = pick a random seed; the seed actually used is recorded in the result
    working_resolution: str = "auto"  # "auto" (variant rule), "draft", or a side such as "768"
    collapse_padding: bool = True  # exact padding collapse; False runs the padded tokens as upstream
    cache: str = "default"  # step cache (see EditSettings.cache); results record the mode actually used

    @property
    def settings(self) -> EditSettings:
        """The settings part (everything but the instruction and the seed)."""
        fields = {f.name for f in dataclasses.fields(EditSettings)}
        return EditSettings(**{name: getattr(self, name) for name in fields})

    def validated(self) -> "EditParams":
        """Return a copy with coerced types and a stripped instruction, or raise RequestError."""
        instruction = _as_text("instruction", self.instruction, allow_none=False).strip()
        if not instruction:
            raise RequestError("instruction", self.instruction, "a non-empty editing instruction")
        if TARGET_MARKER in instruction and not _target_text(instruction):
            raise RequestError(
                "instruction",
                self.instruction,
                f'a description after "{TARGET_MARKER}" (or remove the marker)',
            )
        return self.settings.validated().params(instruction, validated_seed(self.seed))

    def resolve_seed(self, rng: random.Random | None = None) -> "EditParams":
        """Replace seed -1 by a concrete seed in [0, 2**32-1]; other seeds are kept.

        ``rng`` makes the choice reproducible in tests; without it the OS entropy source is used
        so that two processes started at the same moment do not pick the same "random" seed.
        """
        seed = validated_seed(self.seed)
        if seed == -1:
            seed = rng.randint(0, SEED_MAX) if rng is not None else secrets.randbelow(SEED_MAX + 1)
        return dataclasses.replace(self, seed=seed)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "EditParams":
        """Build validated params from a mapping (API payload, metadata). Unknown keys are ignored
        so that metadata written by a newer version still loads; missing keys take the defaults."""
        if not isinstance(d, Mapping):
            raise RequestError("params", d, "a mapping of parameter names to values")
        if "instruction" not in d:
            raise RequestError("instruction", None, "a non-empty editing instruction")
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known}).validated()

    @classmethod
    def defaults_for(cls, variant: str, instruction: str = "") -> "EditParams":
        """The upstream defaults of each variant (not validated: the instruction may be empty)."""
        if variant == "e1.1":
            return cls(instruction=instruction, guidance_scale=3.0, image_guidance_scale=1.5)
        if variant == "e1-full":
            return cls(instruction=instruction, guidance_scale=5.0, image_guidance_scale=4.0)
        raise RequestError("variant", variant, f"one of {', '.join(VARIANTS)}")

    def target_prompt(self) -> str:
        """The prompt for the refine stage (see the module function `target_prompt`)."""
        return target_prompt(self.instruction)


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

    def validated(self) -> "EditRequest":
        """Check the image type and validate the params (image content is checked by imaging)."""
        if not isinstance(self.image, Image.Image):
            raise RequestError("image", type(self.image).__name__, "a PIL image (use imaging.open_image)")
        return dataclasses.replace(self, params=self.params.validated())


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
        if self.rewrite is not None:
            composed = self.rewrite.compose(self.info.variant)
            core["rewrite"] = {**self.rewrite.to_dict(), "prompt": composed,
                               "edited": self.params.instruction != composed.strip()}
        for key, value in self.info.to_dict().items():
            core.setdefault(str(key), value)
        return _jsonable(core)


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
