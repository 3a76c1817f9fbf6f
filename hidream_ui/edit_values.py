"""An edit's values as they arrive: the limits, the one error type (`RequestError`, naming the field)
and the coercions every field check is made of. Values come from Python callers (typed), Gradio
widgets (floats for integer sliders, None for cleared numbers) and the HTTP API / JSON sidecars
(anything, often strings); these turn them into the types the schema holds, or say which field is bad.

Standard library only: part of the edit schema (hidream_ui.edits re-exports every name).
"""

from __future__ import annotations

import math

SEED_MAX = 2**32 - 1
# Long enough for E1-Full's "Editing Instruction: ... Target Image Description: ..." prompts with a
# detailed description; the text encoders truncate far earlier (T5 128 tokens, Llama 128 tokens), so
# anything longer is almost certainly a paste accident rather than a prompt.
MAX_PROMPT_CHARS = 4000
# A client's file name (a FileData's `orig_name`, a zip member) is kept to this many characters
# before it reaches metadata: a 68 M-character name once became a 68 MB PNG text chunk.
MAX_NAME_CHARS = 255


# Explicit working resolutions: a side length on the 16-px grid the VAE (8x) and the transformer's
# 2x2 patches need. Below 256 the models produce mush; above 4096 the attention cost is absurd.
WORKING_SIDE_MIN = 256
WORKING_SIDE_MAX = 4096
WORKING_SIDE_MULTIPLE = 16
WORKING_RESOLUTION_WORDS = ("auto", "draft")

# What a missing instruction / file is refused with (the UI says it for people: ui/common.people_message).
NO_INSTRUCTION = "a non-empty editing instruction"
NO_FILE = "a file: upload one"

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


def validated_flag(name: str, value: object) -> bool:
    """A yes/no field (a checkbox, or "true"/"false" from an API client), or RequestError naming it."""
    return _as_bool(name, value)
