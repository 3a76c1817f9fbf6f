"""The offline examples of the trained tiny model: scenes of its synthetic world with instructions it knows.

The illustrated examples of assets/examples.json are photos for the real weights; the trained tiny model
knows only its world (model/tiny/world.py), so with it the Edit tab shows world scenes instead. They are
drawn from fixed held-out seeds (`world.example_cases`) and written once into the cache (generated files
stay out of git): the same pictures on every machine.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from hidream_ui.config import AppConfig

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
