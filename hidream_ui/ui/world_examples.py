"""What the Edit and Batch tabs suggest for the model in use: the offline examples of the trained tiny model
(scenes of its synthetic world with instructions it knows), the instruction placeholders and hint, and the note
on an instruction whose words that model has never seen.

The illustrated examples of assets/examples.json are photos for the real weights; the trained tiny model
knows only its world (model/tiny/world.py), so with it the Edit tab shows world scenes instead. They are
drawn from fixed held-out seeds (`world.example_cases`) and written once into the cache (generated files
stay out of git): the same pictures on every machine. Its words come from the same module (one home for the
vocabulary); real weights get the variant's own wording (E1.1: a plain instruction; E1-Full: `Editing
Instruction: ... Target Image Description: ...`).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from hidream_ui.config import AppConfig
from hidream_ui.edits import TARGET_MARKER

logger = logging.getLogger(__name__)

FOLDER = "world-examples-v1"  # bump when world.example_cases or the file layout changes


def examples_folder(cache_root: Path | None = None) -> Path:
    """Where the world examples are written (the app serves and accepts the files in it as its own)."""
    from hidream_ui.model.tiny.build import default_cache_root

    return (Path(cache_root) if cache_root is not None else default_cache_root()).absolute() / FOLDER


def world_examples(config: AppConfig, cache_root: Path | None = None) -> list[list[str]]:
    """[[image path, instruction], ...] for the trained offline model; [] for any other model."""
    if not config.uses_trained_tiny_model:
        return []
    from PIL import Image

    from hidream_ui.model.tiny import world

    folder = examples_folder(cache_root)
    examples = []
    try:
        folder.mkdir(parents=True, exist_ok=True)
        for case in world.example_cases():
            path = folder / f"{case.edit.kind}-{case.seed}.png"
            if not path.is_file():  # written under a temporary name: a reader never sees half a file
                partial = path.with_name(f".{path.name}.{os.getpid()}.tmp")
                Image.fromarray(case.source).save(partial, format="PNG")
                os.replace(partial, path)
            examples.append([str(path), case.instruction])
    except OSError as exc:  # a read-only cache: the app still runs, without examples
        logger.warning("no offline examples (%s): %s", folder, exc)
        return []
    return examples


# Real weights' Batch list: one instruction per line, as the variant takes it.
E11_BATCH_PLACEHOLDER = "Turn the sky into a sunset\nMake it snow"
E1_FULL_BATCH_PLACEHOLDER = (
    f"Editing Instruction: Turn the sky into a sunset. {TARGET_MARKER} A beach under an orange sunset sky.\n"
    f"Editing Instruction: Make it snow. {TARGET_MARKER} The same street covered in fresh snow."
)


def world_placeholder(config: AppConfig) -> str | None:
    """The Edit tab's instruction placeholder for the trained offline model (one of its instructions); None for
    other models (the tab uses the variant's, ui/common.py)."""
    if not config.uses_trained_tiny_model:
        return None
    from hidream_ui.model.tiny import world

    return world.example_instructions()[0]


def world_hint(config: AppConfig) -> str | None:
    """The hint under Edit (Markdown) for the trained offline model: the three instructions it knows; None for
    other models (the tab says the variant's format, ui/common.py)."""
    if not config.uses_trained_tiny_model:
        return None
    from hidream_ui.model.tiny import world

    return (
        f"**The offline model** knows three instructions: {world.instruction_forms()}. "
        "Other words are new to it: it still edits, but guesses."
    )


def batch_placeholder(config: AppConfig) -> str:
    """The Batch tab's instruction list placeholder, one instruction per line."""
    if config.uses_trained_tiny_model:
        from hidream_ui.model.tiny import world

        return "\n".join(world.example_instructions())
    return E1_FULL_BATCH_PLACEHOLDER if config.variant == "e1-full" else E11_BATCH_PLACEHOLDER


def instruction_note(config: AppConfig, instruction: str) -> str | None:
    """The friendly note for an instruction outside the offline model's vocabulary (naming the words it knows);
    None with real weights, the random offline profiles (their output is noise whatever the words) or an
    instruction of its world."""
    if not config.uses_trained_tiny_model:
        return None
    from hidream_ui.model.tiny import world

    return world.vocabulary_note(instruction)


def instructions_note(config: AppConfig, instructions) -> str | None:
    """One note for a list of instructions (a batch): the words the offline model has never seen in any of
    them, each named once; None when every line is of its world (or the model is not the offline one)."""
    outside = [line for line in instructions if instruction_note(config, line)]
    return instruction_note(config, "\n".join(outside)) if outside else None
