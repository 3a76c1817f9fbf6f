"""`bench quality`'s verdicts on a report: issue 22's targets, the Speed presets chosen by the rules of
pipeline/speed/preset_rules.py (`presets` key), and the table printed without `--json`."""

from __future__ import annotations

import math

from hidream_ui.pipeline.speed.preset_rules import (
    PRESET_GROUPS,
    PRESET_RULES,
    PRESET_TARGETS,
    configuration_for,
    psnr_median,
    rule_misses,
    speed_value,
)
from hidream_ui.pipeline.speed.settings import SPEED_PRESETS, parse_cache

# Issue 22's "done when" for the trained model, reported beside the figures (a benchmark asserts nothing).
TARGETS = {"cases_min": 96, "exact_success_rate_min": 0.85, "untouched_psnr_median_min_db": 28.0}


def targets(report: dict) -> dict:
    """Issue 22's targets with what this run missed of them (`missed` empty: all met)."""
    exact = report["configurations"]["exact"]
    missed = []
    if report["cases"] < TARGETS["cases_min"]:
        missed.append(f"{report['cases']} cases < {TARGETS['cases_min']}")
    if exact["success_rate"] < TARGETS["exact_success_rate_min"]:
        missed.append(f"exact success {exact['success_rate']:.1%} < {TARGETS['exact_success_rate_min']:.0%}")
    if exact["untouched_psnr_median_db"] < TARGETS["untouched_psnr_median_min_db"]:
        missed.append(
            f"untouched PSNR median {exact['untouched_psnr_median_db']} dB < "
            f"{TARGETS['untouched_psnr_median_min_db']:g} dB"
        )
    if not report["exact_modes_equal_exact"]:
        missed.append("an exact mode disagreed with exact on some case")
    return {**TARGETS, "met": not missed, "missed": missed}


def presets(report: dict) -> dict:
    """For each Speed preset: its rule, what the app uses now (`current`) and whether it keeps the rule in this
    run (`current_keeps_rule`, `current_misses`), the cache and step configurations that keep it (`qualifying`,
    fastest first) and `best`: the fastest of them, or, when none is fast enough, the fastest that keeps the
    quality parts of the rule (`meets_rule` false: the best trade-off reached); `targets`: issue 54's speed
    targets, and whether `best` reaches them."""
    configurations = report["configurations"]
    exact = configurations["exact"]["success_rate"]
    candidates = [(name, r) for name, r in configurations.items() if r["group"] in PRESET_GROUPS and "error" not in r]
    result = {}
    for preset, rule in PRESET_RULES.items():
        kept = [(name, r) for name, r in candidates if not rule_misses(preset, r, exact, speed=False)]
        kept.sort(key=lambda item: item[1]["transformer_speedup_vs_exact"] or 0.0, reverse=True)
        qualifying = [name for name, r in kept if not rule_misses(preset, r, exact)]
        best = qualifying[0] if qualifying else (kept[0][0] if kept else None)
        best_row = configurations[best] if best else {}
        current = str(parse_cache(SPEED_PRESETS[preset]))
        found = configuration_for(configurations, current)
        current_misses = rule_misses(preset, found[1], exact) if found else None
        target = PRESET_TARGETS[preset]["min_transformer_speedup"]
        result[preset] = {
            **rule,
            "current": current,
            "qualifying": qualifying,
            "best": best,
            "meets_rule": bool(qualifying),
            "best_speed_value": speed_value(best_row["settings"]) if best else None,
            "best_success_rate": best_row.get("success_rate"),
            "best_transformer_speedup": best_row.get("transformer_speedup_vs_exact"),
            "best_psnr_vs_exact_db": psnr_median(best_row) if best else None,
            "current_keeps_rule": None if current_misses is None else not current_misses,
            "current_misses": current_misses,
            "targets": {
                "min_transformer_speedup": target,
                "met": bool(
                    best and (best_row.get("transformer_speedup_vs_exact") or 0.0) >= target and best in qualifying
                ),
            },
        }
    return result


def _pct(value: float | None) -> str:
    return "—" if value is None else f"{100 * value:.0f}%"


def _num(value: float | None, fmt: str) -> str:
    return "—" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, fmt)


def format_table(report: dict) -> str:
    weights = "random weights: success is expected near 0" if report["random_weights"] else "trained weights"
    edit = report["edit"]
    lines = [
        f"bench quality · profile {report['profile']} ({weights}) · {report['device']} {report['dtype']} · "
        f"{report['cases']} held-out cases {report['cases_by_kind']} · {edit['num_inference_steps']} steps · "
        f"working size {report['working_size'][0]}x{report['working_size'][1]} · {report['model_loads']} loads",
        f"{'configuration':24s} {'success':>7s} {'recol':>6s} {'remove':>6s} {'bkgd':>6s} {'PSNR':>6s} "
        f"{'s/edit':>7s} {'speedup':>7s} {'tf s':>7s} {'tf spd':>7s} {'skip':>5s} {'=exact':>7s} {'max diff':>8s} "
        f"{'PSNR>ex':>7s} {'p5':>5s} {'SSIM>ex':>7s}",
    ]
    for name, r in report["configurations"].items():
        if "error" in r:
            lines.append(f"{name:24s} {r['error']}")
            continue
        k, fid = r["success_by_kind"], r["fidelity_vs_exact"]
        mark = "" if not r["exact_mode"] or r["equal_to_exact_cases"] == r["cases"] else " !"
        lines.append(
            f"{name:24s} {_pct(r['success_rate']):>7s} {_pct(k['recolour']):>6s} {_pct(k['remove']):>6s} "
            f"{_pct(k['background']):>6s} {r['untouched_psnr_median_db']:6.1f} {r['seconds_per_edit']:7.3f} "
            f"{_num(r['speedup_vs_exact'], '.2f'):>6s}x {r['transformer_seconds_per_edit']:7.3f} "
            f"{_num(r['transformer_speedup_vs_exact'], '.2f'):>6s}x {_pct(r['skipped_fraction']):>5s} "
            f"{r['equal_to_exact_cases']:>3d}/{r['cases']:<3d} {r['max_abs_diff_vs_exact']:8d} "
            f"{_num(fid['psnr_db']['median'], '7.1f')} {_num(fid['psnr_db']['p5'], '5.1f')} "
            f"{_num(fid['ssim']['median'], '7.4f')}{mark}"
        )
    for name, reason in report["unavailable"].items():
        lines.append(f"{name:24s} not run here: {reason}")
    if "padded" in report["configurations"] and report["image_tokens"] >= report["max_seq"]:
        lines.append(
            f"padded: this working size fills the model's {report['max_seq']} tokens, so there is no "
            "padding to collapse: equal to exact by construction here"
        )
    for preset, choice in report.get("presets", {}).items():
        rule = (
            f"success within {choice['max_success_drop']:.0%} of exact, PSNR to exact >= "
            f"{choice['min_psnr_vs_exact_db']:g} dB, transformer >= {choice['min_transformer_speedup']:g}x"
        )
        now = choice["current"]
        if choice["current_keeps_rule"] is not None:
            kept = choice["current_keeps_rule"]
            now += " (keeps it)" if kept else f" (misses: {'; '.join(choice['current_misses'])})"
        if choice["best"] is None:
            lines.append(f"preset {preset} ({rule}): nothing here keeps the quality; now {now}")
            continue
        verdict = "meets the rule" if choice["meets_rule"] else "best trade-off, misses the speed-up"
        lines.append(
            f"preset {preset} ({rule}): best {choice['best']} ({verdict}: "
            f"{_pct(choice['best_success_rate'])}, {_num(choice['best_transformer_speedup'], '.2f')}x, "
            f"{_num(choice['best_psnr_vs_exact_db'], '.1f')} dB); now {now}"
        )
    goal = report["targets"]
    lines.append("issue 22 targets: " + ("met" if goal["met"] else "missed: " + "; ".join(goal["missed"])))
    lines.append(
        "PSNR: median untouched-region PSNR in dB (capped at 100); tf: transformer time; =exact: cases with "
        "exact's success verdict; max diff: largest pixel difference from exact's output (0..255); "
        "PSNR>ex / p5 / SSIM>ex: median and 5th-percentile PSNR (dB), median SSIM of the output against "
        "exact's; '!': an exact mode that disagreed with exact"
    )
    return "\n".join(lines)
