"""The rules that choose the Speed presets, as plain functions over `bench quality` report rows (no torch).

`bench quality` applies them to its own run (`presets` key); tests/test_speed_presets.py applies them to the
recorded run of the shipped weights (model/tiny/quality_record.py), so a preset that no longer keeps its
rule fails a test.
"""

from __future__ import annotations

from typing import Any, Mapping

from hidream_ui.pipeline.speed.settings import CacheSpec, parse_cache

# The rules for the Speed presets, applied to the cache and step configurations of one run (`presets` key):
# `fast` = no visible loss, `faster` = a small loss; each the fastest transformer that keeps its rule. Issue 23
# set the success and speed parts; issue 54 added fidelity: the median PSNR of the output against exact's.
PRESET_RULES = {
    "fast": {"max_success_drop": 0.03, "min_transformer_speedup": 1.8, "min_psnr_vs_exact_db": 30.0},
    "faster": {"max_success_drop": 0.10, "min_transformer_speedup": 2.5, "min_psnr_vs_exact_db": 25.0},
}
# Issue 54's targets for the chosen presets (reported beside the rule's verdict, `presets.*.targets`).
PRESET_TARGETS = {"fast": {"min_transformer_speedup": 2.0}, "faster": {"min_transformer_speedup": 3.0}}

# The configurations a Speed preset may be: a step cache, fewer steps, or both.
PRESET_GROUPS = ("cache", "steps")


def speed_value(settings: Mapping[str, Any]) -> str:
    """The `--cache` value (a Speed preset's value) that runs a configuration in the app, from its
    `settings`: its step cache, with `@S` when it runs S steps instead of exact's."""
    spec = parse_cache(settings.get("cache", "none"))
    steps = settings.get("steps")
    return str(CacheSpec(spec.kind, spec.interval, spec.threshold, steps) if steps is not None else spec)


def psnr_median(row: Mapping[str, Any]) -> float | None:
    return ((row.get("fidelity_vs_exact") or {}).get("psnr_db") or {}).get("median")


def rule_misses(preset: str, row: Mapping[str, Any], exact_success: float, speed: bool = True) -> list[str]:
    """What `row` (one configuration of a report) misses of `preset`'s rule (PRESET_RULES), in words;
    empty when it keeps the rule (`speed` False: its quality parts only)."""
    rule = PRESET_RULES[preset]
    misses = []
    drop = exact_success - row["success_rate"]
    if drop > rule["max_success_drop"] + 1e-9:
        misses.append(f"success {100 * drop:.1f} points below exact (at most {100 * rule['max_success_drop']:g})")
    psnr = psnr_median(row)
    if psnr is None or psnr < rule["min_psnr_vs_exact_db"]:
        shown = "unknown" if psnr is None else f"{psnr:.1f}"
        misses.append(f"median PSNR to exact {shown} dB (at least {rule['min_psnr_vs_exact_db']:g})")
    speedup = row.get("transformer_speedup_vs_exact") or 0.0
    if speed and speedup < rule["min_transformer_speedup"]:
        misses.append(f"transformer {speedup:.2f}x (at least {rule['min_transformer_speedup']:g}x)")
    return misses


def configuration_for(
    configurations: Mapping[str, Mapping[str, Any]], value: str
) -> tuple[str, Mapping[str, Any]] | None:
    """(name, row) of the cache or steps configuration (that did not fail) that `value` (a `--cache` value,
    presets included) runs; None when the report has none."""
    wanted = str(parse_cache(value))
    for name, row in configurations.items():
        if row.get("group") in PRESET_GROUPS and "error" not in row and speed_value(row["settings"]) == wanted:
            return name, row
    return None
