"""The recorded `bench quality` run of the shipped offline weights, and what the Speed presets cost by it.

`python -m hidream_ui bench quality --record` writes the run's report into the weights' folder
(assets/tiny_trained/quality.json) with the command and the digest of the weights it measured. The Speed
presets (pipeline/speed/settings.py SPEED_PRESETS) are set from that record by its rules (preset_rules.py
PRESET_RULES; tests/test_speed_presets.py re-applies them), and the Speed setting and docs/speed.md quote
its figures through `preset_words`, so the words and the record cannot drift apart.

Reading the record is a small JSON read, done when the Speed setting is built (never at import).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

RECORD_FILE = "quality.json"
DIGEST_KEY = "weights_digest"  # trained.asset_digest of the weights the run measured
COMMAND_KEY = "command"


def default_folder() -> Path:
    from hidream_ui.model.tiny import trained
    from hidream_ui.model.tiny.profiles import PROFILES

    return trained.asset_dir(PROFILES["trained"].weights_asset)


def write(report: Mapping[str, Any], command: str, folder: Path | None = None) -> Path:
    """Writes `report` (a `bench quality` report of the trained profile) as the weights' record."""
    from hidream_ui.model.tiny import trained

    folder = folder or default_folder()
    if report.get("profile") != "trained":
        raise ValueError(f"the record is of the shipped trained weights; this run measured {report.get('profile')!r}")
    record = {
        COMMAND_KEY: command,
        DIGEST_KEY: trained.asset_digest(folder),
        **{k: v for k, v in report.items() if k != "per_case"},
    }
    path = folder / RECORD_FILE
    path.write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
    return path


def read(folder: Path | None = None) -> dict[str, Any] | None:
    """The record, or None when the folder has none (or it cannot be read)."""
    path = (folder or default_folder()) / RECORD_FILE
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def configuration_of(record: Mapping[str, Any], value: str) -> tuple[str, dict[str, Any]] | None:
    """(name, row) of the record's configuration that `value` (a `--cache` value, presets included) runs."""
    from hidream_ui.pipeline.speed.preset_rules import configuration_for

    return configuration_for(record.get("configurations", {}), value)


def preset_figures(preset: str, record: Mapping[str, Any] | None = None) -> dict[str, Any] | None:
    """What `preset` costs by the record: its value, transformer speedup, success and exact's, the change in
    points, median PSNR to exact, the cases, and what it misses of its rule (empty: keeps it). None without a
    record or when the record did not measure the preset's value."""
    from hidream_ui.pipeline.speed.preset_rules import rule_misses
    from hidream_ui.pipeline.speed.settings import SPEED_PRESETS

    record = read() if record is None else record
    if not record or preset not in SPEED_PRESETS:
        return None
    value = SPEED_PRESETS[preset]
    found = configuration_of(record, value)
    if found is None:
        return None
    name, row = found
    exact = record["configurations"]["exact"]["success_rate"]
    return {
        "value": value,
        "configuration": name,
        "cases": row["cases"],
        "transformer_speedup": row["transformer_speedup_vs_exact"],
        "success_rate": row["success_rate"],
        "exact_success_rate": exact,
        "success_change_points": round(100 * (row["success_rate"] - exact), 1),
        "psnr_vs_exact_db": row["fidelity_vs_exact"]["psnr_db"]["median"],
        "misses": rule_misses(preset, row, exact),
    }


def preset_words(preset: str, record: Mapping[str, Any] | None = None) -> str | None:
    """One line in plain words: what `preset` buys and costs on the offline model (None: no figures)."""
    figures = preset_figures(preset, record)
    if figures is None:
        return None
    change = figures["success_change_points"]
    success = (
        "the same success as exact"
        if change == 0
        else f"{abs(change):g} points {'more' if change > 0 else 'fewer'} edits right than exact"
    )
    words = (
        f"`{preset}` = `{figures['value']}`: transformer {figures['transformer_speedup']:.2f}x as fast as exact, "
        f"{success} ({100 * figures['success_rate']:.1f} % against {100 * figures['exact_success_rate']:.1f} %), "
        f"pictures {figures['psnr_vs_exact_db']:.1f} dB PSNR from exact's (median, "
        f"{figures['cases']} offline-model edits)"
    )
    if figures["misses"]:
        words += f"; misses its rule: {'; '.join(figures['misses'])}"
    return words
