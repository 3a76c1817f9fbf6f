"""The pipeline's text rules: how many tokens a prompt is encoded to, and which text conditions the
refine stage. Plain Python (no torch): the app's edit schema (hidream_ui.edits) re-exports them and
checks instructions against the same marker, so the pipeline never imports the app.
"""

from __future__ import annotations

# Tokens per text encoder as HiDream's pipeline encodes a prompt (T5 and Llama; CLIP caps at 77).
PROMPT_TOKENS = 128

# The E1-Full prompt format. Matched exactly (case-sensitive), as the upstream pipeline does, so the
# same prompt is split the same way here and there.
TARGET_MARKER = "Target Image Description:"


def target_text(instruction: str) -> str:
    """The description after TARGET_MARKER (up to a second marker, if any), or "" without one."""
    parts = instruction.split(TARGET_MARKER)
    return parts[1].strip() if len(parts) > 1 else ""


def target_prompt(instruction: str) -> str:
    """The prompt for the refine stage: the one home of this rule.

    E1-Full prompts have the form "Editing Instruction: ... Target Image Description: ...";
    the refine stage is conditioned on the description only. Like upstream, the marker is
    matched exactly and the text up to a second marker (if any) is used. Instructions
    without the marker are used as they are (E1.1 takes plain instructions).
    """
    text = target_text(instruction)
    return text if text else instruction.strip()
