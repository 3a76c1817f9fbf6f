"""What we ask a rewriter, how its answer is read, and what comes out (`RewriteResult`).

The answer format is three labelled lines (two for the text-only local rewriter, which cannot see
the image and so cannot describe it). Parsing is strict on purpose: a rewritten prompt silently
built from half an answer (a refusal, a truncated reply, a chatty preamble) would edit the image
with something the user never saw. Whatever does not fit is a `RewriteError` that quotes the answer.

Standard library only (plus `requests` for the E1-Full marker and the length limit).
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from typing import Any, Mapping

from hidream_ui.edits import MAX_PROMPT_CHARS, TARGET_MARKER, RequestError

# What the vision-language model is asked (system message). Written for this project.
VISION_SYSTEM_PROMPT = """\
You prepare prompts for an instruction-based image editing model. You are given one image and a \
short editing request that a user typed.

Reply with exactly three lines and nothing else:
SOURCE: one or two sentences describing the image as it is now: the main subjects, where they \
are, their colours, the setting and the style.
INSTRUCTION: the request rewritten as one clear imperative sentence. If it could refer to more \
than one thing in the image, say which one (for example "the car on the left" or "the smaller \
dog"). Keep everything the user asked for and add no change they did not ask for.
TARGET: one or two sentences describing the whole image after the edit, as if it already existed.

Write in English, also when the request is in another language. No markdown, no lists, no \
quotes, no blank lines, no other text."""

# What the local, text-only rewriter is asked: it never sees the image, so it is not asked to
# describe it (it would invent a picture); it only states the change clearly and imagines the result.
TEXT_SYSTEM_PROMPT = """\
You prepare prompts for an instruction-based image editing model. You are given a short editing \
request that a user typed; you cannot see the image.

Reply with exactly two lines and nothing else:
INSTRUCTION: the request rewritten as one clear imperative sentence. Keep everything the user \
asked for and add no change they did not ask for.
TARGET: one or two sentences describing the edited image, using only what the request says about it.

Write in English. No markdown, no lists, no quotes, no blank lines, no other text."""


def user_message(instruction: str) -> str:
    """The user turn that carries the request (the image, if any, travels beside it)."""
    return f"Editing request: {instruction.strip()}"


VISION_LABELS = ("SOURCE", "INSTRUCTION", "TARGET")
TEXT_LABELS = ("INSTRUCTION", "TARGET")
# Labels a model may write instead of ours (the E1 training format, spelled-out names): accepted
# on the line they belong to, and only there.
_LABEL_ALIASES = {
    "SOURCE": ("source image description", "source description", "source image", "source"),
    "INSTRUCTION": ("editing instruction", "refined instruction", "instruction"),
    "TARGET": ("target image description", "target description", "target image", "target"),
}
_ANY_LABEL = re.compile(
    r"^("
    + "|".join(sorted({re.escape(a) for aliases in _LABEL_ALIASES.values() for a in aliases}, key=len, reverse=True))
    + r")\s*[:：]\s*",
    re.IGNORECASE,
)
# List markers and emphasis a chat model likes to add in front of a line.
_DECORATION = re.compile(r"^(?:[-*•]\s+|\d+[.)]\s+|\*\*|__)+")
_QUOTES = "\"'“”‘’`"
# One line may take at most this much, so that the composed E1-Full prompt stays far inside the
# request limit (MAX_PROMPT_CHARS) and the text encoders' useful length.
MAX_LINE_CHARS = 1000
_REFUSAL = re.compile(
    r"^(?:i'?m sorry|i am sorry|sorry|i can(?:no|')t|i cannot|i am unable|i'm unable|"
    r"as an ai|i won'?t)\b",
    re.IGNORECASE,
)


class RewriteError(ValueError):
    """Rewriting failed (timeout, HTTP error, refusal, unusable answer); the message says which and
    is written for users. Never fatal: the caller can always edit with the original instruction.

    `unreachable` marks failures of the server rather than of one answer (no answer in time, no
    connection): a batch stops asking after the first of those instead of waiting out each item.
    """

    def __init__(self, message: str, *, unreachable: bool = False):
        super().__init__(message)
        self.unreachable = unreachable


def _short(text: str, limit: int = 160) -> str:
    flat = " ".join(str(text).split())
    return repr(flat if len(flat) <= limit else flat[: limit - 3] + "...")


def parse_answer(answer: str, labels: tuple[str, ...] = VISION_LABELS) -> tuple[str, ...]:
    """The texts of the `labels` lines of `answer`, in order, or RewriteError saying what is wrong.

    Rules: blank lines and a surrounding ``` fence are ignored; then there must be exactly
    ``len(labels)`` lines. Each may start with a list marker or ``**`` (dropped) and with its own
    label (``SOURCE:``, ``INSTRUCTION:``, ``TARGET:`` or a spelled-out variant such as
    ``Target Image Description:``); a label that belongs to another line is an error, no label means
    "by position". Every text must hold a letter, be at most MAX_LINE_CHARS long, not be a
    ``<placeholder>``, and not contain the E1-Full marker (it would split the prompt in the wrong place).
    """
    if not isinstance(answer, str) or not answer.strip():
        raise RewriteError("the rewriter returned an empty answer")
    lines = [line.strip() for line in answer.strip().splitlines() if line.strip()]
    if len(lines) >= 2 and lines[0].startswith("```") and lines[-1] == "```":
        lines = lines[1:-1]
    names = ", ".join(labels)
    if len(lines) != len(labels):
        if _REFUSAL.match(lines[0] if lines else ""):
            raise RewriteError(f"the rewriter declined: {_short(answer)}")
        raise RewriteError(
            f"the rewriter's answer is not {len(labels)} lines ({names}): it has {len(lines)}: {_short(answer)}"
        )
    texts = []
    for number, (line, label) in enumerate(zip(lines, labels), start=1):
        text = _DECORATION.sub("", line).strip()
        match = _ANY_LABEL.match(text)
        if match:
            written = match.group(1).lower()
            if written not in _LABEL_ALIASES[label]:
                raise RewriteError(
                    f"line {number} of the rewriter's answer is labelled {match.group(1)!r}; "
                    f"expected {label}: {_short(answer)}"
                )
            text = text[match.end() :]
        # "**SOURCE:** text" leaves the closing "**" after the label.
        text = text.strip().strip("*").strip().strip(_QUOTES).strip()
        if not any(ch.isalpha() for ch in text):
            raise RewriteError(f"line {number} ({label}) of the rewriter's answer is empty: {_short(answer)}")
        if text.startswith("<") and text.endswith(">"):
            raise RewriteError(f"line {number} ({label}) of the rewriter's answer is a placeholder: {_short(text)}")
        if len(text) > MAX_LINE_CHARS:
            raise RewriteError(
                f"line {number} ({label}) of the rewriter's answer is {len(text)} characters long "
                f"(at most {MAX_LINE_CHARS})"
            )
        if TARGET_MARKER in text:
            raise RewriteError(
                f"line {number} ({label}) of the rewriter's answer contains {TARGET_MARKER!r}: {_short(text)}"
            )
        texts.append(text)
    return tuple(texts)


@dataclass(frozen=True)
class RewriteResult:
    """One rewrite: the user's request and the rewriter's lines (`source` is None for the text-only
    local rewriter). `compose(variant)` is the prompt the model gets."""

    original: str
    source: str | None
    instruction: str
    target: str
    backend: str  # "openai" | "local"
    model: str  # the model name the server was asked for, or the Llama folder's name
    seconds: float = 0.0

    def compose(self, variant: str) -> str:
        """E1.1: the refined instruction as is. E1-Full: its two-part training format, whose
        description after the marker also drives the refine stage (`edits.target_prompt`)."""
        if variant == "e1-full":
            return f"Editing Instruction: {self.instruction.rstrip(' .')}. {TARGET_MARKER} {self.target}"
        return self.instruction

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Any) -> "RewriteResult":
        """From `to_dict()` output coming back from a client (the Edit tab's "Edit with this").
        Checked field by field: it ends up in result metadata."""
        if not isinstance(data, Mapping):
            raise RequestError("rewrite", data, "the rewriter's answer as returned by /rewrite (a mapping)")
        values: dict[str, Any] = {}
        for name in ("original", "instruction", "target", "backend", "model"):
            value = data.get(name)
            if not isinstance(value, str) or not value.strip() or len(value) > MAX_PROMPT_CHARS:
                raise RequestError(f"rewrite.{name}", value, f"text of 1 to {MAX_PROMPT_CHARS} characters")
            values[name] = value.strip()
        source = data.get("source")
        if source is not None and (not isinstance(source, str) or len(source) > MAX_PROMPT_CHARS):
            raise RequestError("rewrite.source", source, f"text of at most {MAX_PROMPT_CHARS} characters, or null")
        seconds = data.get("seconds", 0.0)
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 <= seconds < 1e6:
            seconds = 0.0  # informational only
        return cls(source=source, seconds=float(seconds), **values)


__all__ = [
    "VISION_SYSTEM_PROMPT",
    "TEXT_SYSTEM_PROMPT",
    "VISION_LABELS",
    "TEXT_LABELS",
    "MAX_LINE_CHARS",
    "RewriteError",
    "RewriteResult",
    "parse_answer",
    "user_message",
]
