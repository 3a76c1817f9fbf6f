"""What the model package reads from the app's settings, as a protocol: `hidream_ui.config.AppConfig`
has these fields (a test checks it), and the loader, the planner and the sources take any object that
does. The model package so never imports the configuration (the config imports the model's choice
lists), and code that loads a model without an app (benchmarks, the lab) can pass its own.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol


class ModelSettings(Protocol):
    """The settings that choose, place and store a model (README "Memory plans", "Several devices")."""

    # Where the weights come from; none of the four set: the offline model `tiny_profile`.
    model_dir: Path | None
    llama: str | None
    i1: str | None
    e1: str | None
    variant: str
    tiny_profile: str
    tiny_seed: int
    refiner: str
    transformer_file: Path | None
    # Where and how it is kept (model/plans.py).
    text_encoders: str
    memory: str
    weights: str
    placement: tuple[tuple[str, str], ...]

    @property
    def uses_tiny_model(self) -> bool: ...


# The names a settings object must have (tests/test_config.py checks AppConfig against them).
MODEL_SETTING_NAMES = (
    "model_dir",
    "llama",
    "i1",
    "e1",
    "variant",
    "tiny_profile",
    "tiny_seed",
    "refiner",
    "transformer_file",
    "text_encoders",
    "memory",
    "weights",
    "placement",
    "uses_tiny_model",
)
