"""MagCache's magnitude ratios measured on the checkpoint itself, one curve per stage.

MagCache (`magcache:T`) skips a call while the accumulated error of the per-call ratios
``mean |residual_t| / |residual_t-1|`` (the residual: last block's image output minus the first block's
input) stays under T. The ratios belong to the checkpoint and its schedule; HiDream has none published, so
without a calibration the cache uses the one set diffusers ships (Flux's 28 steps, squeezed into each
stage's calls). A calibration runs real edits with MagCache in diffusers' calibrate mode (nothing skipped),
collects the ratios of each stage (the edit stage and the refine stage are different forwards: [x_t | source]
with three guidance branches, then x_t alone with two) and averages them over the edits.

Home of the ratios: ``RATIOS_FILE`` in the E1.1 transformer folder (next to its config.json). The loader
attaches it to the transformer (``ATTRIBUTE``), where the cache install finds it. mag_calibrate.py measures
one; `train-tiny OUT --eval-only --calibrate-magcache N` records one in the trained tiny model's trained.json;
a tiny build writes the file from there. (The trained weights shipped since 2026-11-29 evening carry one: on
them it measured better than Flux's curve; the ones before carried none, docs/speed.md.)
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

RATIOS_FILE = "hidream_ui_mag_ratios.json"
ATTRIBUTE = "hidream_ui_mag_ratios"  # on the transformer module: the MagRatios the loader found (or absent)
STAGES = ("edit", "refine")


@dataclass(frozen=True)
class MagRatios:
    """Per-stage ratio curves (one value per transformer call of the stage), from `cases` edits of `steps`
    steps with refine strength `refine_strength`."""

    edit: tuple[float, ...]
    refine: tuple[float, ...]
    steps: int
    refine_strength: float
    cases: int

    def __post_init__(self):
        for stage in STAGES:
            curve = getattr(self, stage)
            if not curve or any(not (0 < value < 100) for value in curve):
                raise ValueError(
                    f"MagCache ratios for the {stage} stage must be a non-empty list of positive "
                    f"numbers below 100, got {list(curve)[:8]}"
                )

    def for_stage(self, stage: str | None) -> tuple[float, ...]:
        return self.refine if stage == "refine" else self.edit

    def to_json(self) -> dict[str, Any]:
        return {
            "edit": [round(v, 5) for v in self.edit],
            "refine": [round(v, 5) for v in self.refine],
            "steps": self.steps,
            "refine_strength": self.refine_strength,
            "cases": self.cases,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any], where: str = "ratios") -> MagRatios:
        try:
            return cls(
                edit=tuple(float(v) for v in data["edit"]),
                refine=tuple(float(v) for v in data["refine"]),
                steps=int(data["steps"]),
                refine_strength=float(data["refine_strength"]),
                cases=int(data["cases"]),
            )
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(f"{where}: not a MagCache calibration ({error})") from error


def read(folder: Path) -> MagRatios | None:
    """The calibration in `folder` (a transformer folder), or None when it has none."""
    path = Path(folder) / RATIOS_FILE
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"{path}: unreadable MagCache calibration ({error})") from error
    return MagRatios.from_json(data, str(path))


def write(folder: Path, ratios: MagRatios) -> Path:
    path = Path(folder) / RATIOS_FILE
    path.write_text(json.dumps(ratios.to_json(), indent=1) + "\n", encoding="utf-8")
    return path
