"""`python -m hidream_ui bench quality [--cases N] [--json] [--tiny-profile P] [--only NAMES] ...`.

What each speed and memory mode costs in quality, on edits whose right answer is known: N fresh cases
of the synthetic world (model/tiny/world.py, seeds from `HELD_OUT_SEED_START` on, never used in
training), each edited under every configuration and scored by the world's rule (the named region got
the named colour, the untouched region kept >= 22 dB PSNR against the source), and compared with exact's
output for the same case (PSNR and SSIM, bench/fidelity.py). Configurations: `exact` (the default exact
path), each step cache (MEASURED_CACHES or `--caches`), fewer steps (`--steps-grid`: `steps:N`, and with
`--cross` a cache at N steps: `CACHE@N`), fp8 weights, each other memory plan, each available attention
strategy, padding collapse off. The Speed presets are chosen from the cache and steps rows by the rules of
pipeline/speed/preset_rules.py (`presets` key); `--record` keeps the run as the shipped weights' record.

Measured side by side in one run: the cases are the outer loop and the configurations the inner one
(their order turning by one per case), so a slow minute on a shared machine costs every configuration
alike, and every speedup is against `exact` in the same run. Configurations that share a model share
one loaded engine (cache, attention and padding switch per edit); fp8 and each memory plan need their
own load (one each).

On the random `tiny` profile every success rate is ~0 (the model was never trained): the figures are
computed all the same, which is what the tests check. The JSON keys are documented in
docs/benchmarks.md ("bench quality"): they are a contract.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping

import numpy as np  # already loaded by the world (model/tiny/world.py)
from PIL import Image  # already loaded by the edit schema (edits.py)

from hidream_ui.bench import set_threads
from hidream_ui.bench.fidelity import PSNR_CAP_DB, compare, spread
from hidream_ui.cli.quiet import add_verbose_argument, quiet_libraries
from hidream_ui.config import TINY_PROFILES, AppConfig
from hidream_ui.device.detect import resolve_device, resolve_dtype
from hidream_ui.edits import EditParams, EditRequest
from hidream_ui.engine.errors import EngineError
from hidream_ui.engine.pool import EnginePool
from hidream_ui.model.planner import plan_for
from hidream_ui.model.plans import PLANS
from hidream_ui.model.tiny import world
from hidream_ui.model.tiny.profiles import FULL_PROFILE_NAME
from hidream_ui.pipeline.speed.preset_rules import (
    PRESET_GROUPS,
    PRESET_RULES,
    PRESET_TARGETS,
    configuration_for,
    psnr_median,
    rule_misses,
    speed_value,
)
from hidream_ui.pipeline.speed.settings import (
    MAX_STEPS_RANGE,
    MEASURED_CACHES,
    SPEED_PRESETS,
    cache_unavailable,
    parse_cache,
)

# The trained offline model (issue 22) when this checkout has it, else the random one.
TRAINED_PROFILE = "trained"
FIRST_BLOCK_THRESHOLDS = (0.05, 0.1, 0.2)
# The step caches measured by default (`--caches` replaces the list with any `--cache` values).
CACHE_MODES = MEASURED_CACHES
DEFAULT_CASES = 96
# Issue 22's "done when" for the trained model, reported beside the figures (a benchmark asserts nothing).
TARGETS = {"cases_min": 96, "exact_success_rate_min": 0.85, "untouched_psnr_median_min_db": 28.0}
GROUPS = ("exact", "cache", "steps", "weights", "memory", "attention", "padding")
# The world's scenes are drawn with the held-out start; warm-up edits use a seed below it (a training
# seed: never scored), so the first, slower edit of each configuration is not one of the measured ones.
WARM_UP_SEED = world.HELD_OUT_SEED_START - 1


def default_profile() -> str:
    return TRAINED_PROFILE if TRAINED_PROFILE in TINY_PROFILES else "tiny"


def profile_choices() -> list[str]:
    # `full` is the release's size with random weights: hours per case on a CPU and nothing to learn.
    return [p for p in TINY_PROFILES if p != FULL_PROFILE_NAME]


@dataclass(frozen=True)
class Configuration:
    """One way to run an edit. `memory` / `weights` decide the engine (a load each); `cache`, `attention`
    and `collapse_padding` switch per edit on a loaded engine."""

    name: str
    group: str  # one of GROUPS
    exact_mode: bool  # must give exact's success verdict on every case (no approximation involved)
    cache: str = "none"
    attention: str | None = None  # None: the strategy the engine picked at load (auto), as exact uses
    memory: str = "full"
    weights: str = "bf16"
    collapse_padding: bool = True
    steps: int | None = None  # None: the run's step count (exact's); a step count of `--steps-grid` otherwise

    @property
    def engine_key(self) -> tuple[str, str]:
        return (self.memory, self.weights)

    def settings(self) -> dict[str, Any]:
        return {
            "cache": self.cache,
            "attention": self.attention or "auto",
            "memory": self.memory,
            "weights": self.weights,
            "collapse_padding": self.collapse_padding,
            "steps": self.steps,
        }


EXACT = Configuration("exact", "exact", True)


def cache_specs(values: Iterable[str]) -> list[str]:
    """Canonical `--cache` spellings of `values` (presets resolved, `none` dropped: that is exact), in order,
    once each. Raises ValueError naming a value that is not a step cache."""
    specs: list[str] = []
    for value in values:
        spec = str(parse_cache(value.strip(), "--caches"))
        if spec != "none" and spec not in specs:
            specs.append(spec)
    return specs


def steps_name(cache: str, steps: int) -> str:
    """The name of a step-count configuration: `steps:N` alone, `CACHE@N` crossed with a step cache."""
    return f"steps:{steps}" if cache == "none" else f"{cache}@{steps}"


def step_counts(values: Iterable[str | int], name: str = "--steps-grid") -> list[int]:
    """The step counts of `values`, in order, once each. Raises ValueError naming a value that is not a
    step count (MAX_STEPS_RANGE)."""
    low, high = MAX_STEPS_RANGE
    counts: list[int] = []
    for value in values:
        text = str(value).strip()
        try:
            n = int(text)
        except ValueError:
            n = 0
        if not low <= n <= high:
            raise ValueError(f"{name}: {text!r} is not a step count (an integer from {low} to {high})")
        if n not in counts:
            counts.append(n)
    return counts


def all_configurations(
    device,
    dtype,
    profile: str,
    caches: Iterable[str] = CACHE_MODES,
    steps_grid: Iterable[int] = (),
    cross: Iterable[str] = (),
    steps: int | None = None,
) -> tuple[list[Configuration], dict[Configuration, str]]:
    """Every configuration this device can run, exact first; and {configuration: reason} for those it cannot.
    `steps_grid`: step counts measured beside exact's `steps` (`steps:N`); `cross`: step caches also run at
    each of them (`CACHE@N`)."""
    from hidream_ui.pipeline.attention.registry import AUTO, list_strategies

    configs = [EXACT]
    unavailable: dict[Configuration, str] = {}
    exact_steps = steps or EditParams.defaults_for("e1.1").num_inference_steps
    grid = [n for n in step_counts(steps_grid) if n != exact_steps]
    crossed = cache_specs(cross)
    for spec in cache_specs(caches):  # an optional library that is not installed: listed with its hint
        config, missing = Configuration(spec, "cache", False, cache=spec), cache_unavailable(parse_cache(spec))
        if missing:
            unavailable[config] = missing
        else:
            configs.append(config)
    for n in grid:  # fewer (or more) steps alone, then each crossed cache at that count
        configs.append(Configuration(steps_name("none", n), "steps", False, steps=n))
        for spec in crossed:
            config = Configuration(steps_name(spec, n), "cache", False, cache=spec, steps=n)
            missing = cache_unavailable(parse_cache(spec))
            if missing:
                unavailable[config] = missing
            else:
                configs.append(config)
    rows = plan_for(AppConfig(tiny_profile=profile, device=device.torch_device), device, dtype).rows
    notes = {(r.plan, r.weights): r.note for r in rows}
    candidates = [Configuration("fp8", "weights", False, weights="fp8")]
    candidates += [Configuration(f"memory:{plan}", "memory", True, memory=plan) for plan in PLANS if plan != "full"]
    for config in candidates:
        note = notes.get(config.engine_key, "the planner does not list it")
        if note:
            unavailable[config] = note
        else:
            configs.append(config)
    # Every available strategy, the one `auto` resolves to included: run again, it is exact-against-exact.
    for status in list_strategies(device, dtype):
        if status.name == AUTO:
            continue
        config = Configuration(f"attention:{status.name}", "attention", True, attention=status.name)
        if status.available:
            configs.append(config)
        else:
            unavailable[config] = status.reason
    configs.append(Configuration("padded", "padding", True, collapse_padding=False))
    return configs, unavailable


def select(
    configs: list[Configuration], only: Iterable[str] | None, unavailable: dict[Configuration, str] | None = None
) -> tuple[list[Configuration], dict[str, str]]:
    """The configurations named (by name or group) in `only`, exact always (every figure is against
    it); and {name: reason} of the unavailable ones it names. Raises ValueError naming an unknown word."""
    unavailable = unavailable or {}
    words = [w.strip() for w in only or () if w.strip()]
    known = {c.name for c in (*configs, *unavailable)} | set(GROUPS)
    unknown = [w for w in words if w not in known]
    if unknown:
        raise ValueError(
            f"--only: unknown configuration(s) {', '.join(map(repr, unknown))}; "
            f"choose from: {', '.join(GROUPS)}, {', '.join(c.name for c in configs)}"
        )

    def chosen(c: Configuration) -> bool:
        return not words or c.name in words or c.group in words

    return (
        [c for c in configs if c is EXACT or chosen(c)],
        {c.name: why for c, why in unavailable.items() if chosen(c)},
    )


@dataclass
class _Row:
    """What one configuration collected over the cases."""

    config: Configuration
    scores: list[dict] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    transformer_seconds: list[float] = field(default_factory=list)
    skipped: list[float] = field(default_factory=list)
    equal_verdicts: int = 0
    identical: int = 0
    max_abs_diff: int = 0
    fidelity: list[dict[str, float]] = field(default_factory=list)  # fidelity.compare against exact, per case
    error: str | None = None


class _TransformerClock:
    """Seconds spent inside one transformer's forward (all steps of an edit, both stages)."""

    def __init__(self, transformer):
        self.seconds = 0.0
        self._started = 0.0

        def pre(module, args, kwargs):
            self._started = time.perf_counter()

        def post(module, args, kwargs, output):
            self.seconds += time.perf_counter() - self._started

        self._handles = [
            transformer.register_forward_pre_hook(pre, with_kwargs=True),
            transformer.register_forward_hook(post, with_kwargs=True),
        ]

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()


class _Engine:
    """One loaded pool of one (the engine interface the app holds) with its transformer clock and the
    attention strategy it runs now (tracked here: switched only when a configuration needs another)."""

    def __init__(self, profile: str, device: str, memory: str, weights: str, output_dir: Path):
        config = AppConfig(tiny_profile=profile, device=device, memory=memory, weights=weights, output_dir=output_dir)
        self.pool = EnginePool.for_config(config)
        t0 = time.perf_counter()
        self.pool.load()
        self.load_seconds = time.perf_counter() - t0
        self.attention = self.pool.attention_of()  # what `auto` resolved to at load
        self.clock = _TransformerClock(self.pool.model.pipeline.transformer)

    def edit(self, image, params: EditParams, attention: str):
        """One edit with `attention`: (result, seconds without text encoding, transformer seconds)."""
        if self.attention != attention:
            self.attention = self.pool.set_attention(attention)
        self.clock.seconds = 0.0
        result = self.pool.edit(EditRequest(image=image, params=params), save=False)
        # The engine encodes each text once and caches it; whichever configuration meets an instruction
        # first pays for the encoders. Left out so that configurations sharing an engine compare on the edit.
        seconds = result.timings.total - result.timings.text_encode
        return result, seconds, self.clock.seconds


def _params(base: dict, case_instruction: str, seed: int, config: Configuration) -> EditParams:
    steps = {"num_inference_steps": config.steps} if config.steps is not None else {}
    return EditParams.from_dict(
        {
            **base,
            **steps,
            "instruction": case_instruction,
            "seed": seed,
            "randomize_seed": False,
            "cache": config.cache,
            "collapse_padding": config.collapse_padding,
        }
    )


# What `fidelity_vs_exact` holds per configuration: fidelity.compare's figures, each as {median, p5}.
FIDELITY_KEYS = ("psnr_db", "ssim", "untouched_psnr_db", "untouched_ssim")


def _fidelity(row: _Row) -> dict[str, dict[str, float | None]]:
    out = {}
    for key in FIDELITY_KEYS:
        figures = spread([case[key] for case in row.fidelity])
        digits = 2 if key.endswith("_db") else 4
        out[key] = {k: (round(v, digits) if v is not None else None) for k, v in figures.items()}
    return out


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


def _summary(row: _Row, exact: _Row) -> dict:
    c = row.config
    out: dict[str, Any] = {"group": c.group, "exact_mode": c.exact_mode, "settings": c.settings()}
    if row.error is not None:
        return {**out, "error": row.error}
    n = len(row.scores)
    by_kind = {}
    for kind in world.EDIT_KINDS:
        hits = [s["success"] for s in row.scores if s["kind"] == kind]
        by_kind[kind] = round(sum(hits) / len(hits), 4) if hits else None
    psnrs = [min(s["untouched_psnr_db"], PSNR_CAP_DB) for s in row.scores]
    seconds, tf_seconds = _median(row.seconds), _median(row.transformer_seconds)
    return {
        **out,
        "cases": n,
        "success_rate": round(sum(s["success"] for s in row.scores) / n, 4),
        "success_by_kind": by_kind,
        "colour_rate": round(sum(s["colour_ok"] for s in row.scores) / n, 4),
        "untouched_psnr_median_db": round(statistics.median(psnrs), 2),
        "seconds_per_edit": round(seconds, 4),
        "transformer_seconds_per_edit": round(tf_seconds, 4),
        "speedup_vs_exact": _ratio(_median(exact.seconds), seconds),
        "transformer_speedup_vs_exact": _ratio(_median(exact.transformer_seconds), tf_seconds),
        "skipped_fraction": round(statistics.fmean(row.skipped), 4) if row.skipped else 0.0,
        "equal_to_exact_cases": row.equal_verdicts,
        "identical_to_exact_cases": row.identical,
        "max_abs_diff_vs_exact": row.max_abs_diff,
        "fidelity_vs_exact": _fidelity(row),
    }


# Set per case (instruction, seed) or per configuration (cache, collapse_padding): not for --param.
PER_EDIT_FIELDS = ("instruction", "seed", "randomize_seed", "cache", "collapse_padding")


def edit_base(steps: int | None = None, params: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The settings every edit shares: E1.1's defaults, `steps`, then `params` (field -> value, as
    `--param` gives them). Raises ValueError naming a field set per edit or a bad value."""
    base = EditParams.defaults_for("e1.1").to_dict()
    if steps is not None:
        base["num_inference_steps"] = steps
    params = dict(params or {})
    unknown = sorted(set(params) - set(base))
    if unknown:
        raise ValueError(
            f"--param {', '.join(unknown)}: not an edit setting; choose from: "
            f"{', '.join(k for k in base if k not in PER_EDIT_FIELDS)}"
        )
    fixed = sorted(set(params) & set(PER_EDIT_FIELDS))
    if fixed:
        raise ValueError(f"--param {', '.join(fixed)}: set by the benchmark per case or configuration")
    base.update(params)
    # The validation gate coerces ("2.5" -> 2.5) and names a bad field; what it returns is what edits use.
    checked = EditParams.from_dict({**base, "instruction": "make the square red"}).to_dict()
    return {k: checked[k] for k in base}


def _run_case(
    case,
    index: int,
    configs: list[Configuration],
    rows: dict[str, _Row],
    engines: dict[tuple[str, str], _Engine],
    base: dict,
    attention: str,
) -> dict:
    """Edits one case under every configuration still running, records each row's figures and returns
    the case's per-configuration record. The order turns by one configuration per case, so no
    configuration always runs right after a new image or right before the next load of work."""
    image = Image.fromarray(case.source)
    live = [c for c in configs if rows[c.name].error is None]
    shift = index % len(live)
    outputs = {}
    for config in live[shift:] + live[:shift]:
        try:
            outputs[config.name] = engines[config.engine_key].edit(
                image, _params(base, case.instruction, case.seed, config), config.attention or attention
            )
        except (EngineError, RuntimeError, ValueError) as exc:
            if config is EXACT:  # every other figure is against exact's output
                raise RuntimeError(f"exact failed on seed {case.seed}: {exc}") from exc
            rows[config.name].error = f"edit failed on seed {case.seed}: {exc}"
    exact_out = world.as_canvas(outputs["exact"][0].image.convert("RGB"))
    exact_ok = world.score(case, exact_out)["success"]
    untouched = world.untouched_mask(case)
    record = {"seed": case.seed, "kind": case.edit.kind, "instruction": case.instruction, "configurations": {}}
    for config in live:  # recorded in the report's order, exact first
        if config.name not in outputs:
            continue
        result, seconds, tf_seconds = outputs[config.name]
        row = rows[config.name]
        out = world.as_canvas(result.image.convert("RGB"))  # the canvas exact's output and the masks are on
        score = world.score(case, out)
        diff = int(np.abs(out.astype(np.int16) - exact_out.astype(np.int16)).max())
        row.scores.append(score)
        row.seconds.append(seconds)
        row.transformer_seconds.append(tf_seconds)
        row.skipped.append(float((result.info.speed or {}).get("skipped_fraction", 0.0)))
        row.equal_verdicts += int(score["success"] == exact_ok)
        row.identical += int(diff == 0)
        row.max_abs_diff = max(row.max_abs_diff, diff)
        close = compare(out, exact_out, untouched)
        row.fidelity.append(close)
        record["configurations"][config.name] = {
            "success": score["success"],
            "colour_ok": score["colour_ok"],
            "got": score["got"],
            "untouched_psnr_db": round(min(score["untouched_psnr_db"], PSNR_CAP_DB), 2),
            "seconds": round(seconds, 4),
            "max_abs_diff_vs_exact": diff,
            "fidelity_vs_exact": {k: round(v, 4) for k, v in close.items()},
        }
    return record


def run(
    cases: int = DEFAULT_CASES,
    profile: str | None = None,
    device: str = "cpu",
    steps: int | None = None,
    only: Iterable[str] | None = None,
    per_case: bool = False,
    progress=None,
    caches: Iterable[str] = CACHE_MODES,
    params: Mapping[str, Any] | None = None,
    steps_grid: Iterable[int] = (),
    cross: Iterable[str] = (),
) -> dict:
    """Runs the benchmark; returns the report (keys: docs/benchmarks.md "bench quality").
    `progress(done, total, text)` is called after each case; `params`: edit settings other than the defaults;
    `steps_grid`: other step counts to measure (`steps:N`), `cross`: step caches run at each of them too."""
    import torch

    if cases < 1:
        raise ValueError(f"cases must be at least 1, got {cases}")
    profile = profile or default_profile()
    dev = resolve_device(device)
    dtype = resolve_dtype("auto", dev)
    base = edit_base(steps, params)
    everything, unavailable = all_configurations(
        dev, dtype, profile, caches, steps_grid, cross, base["num_inference_steps"]
    )
    configs, unavailable = select(everything, only, unavailable)
    held_out = world.held_out_cases(cases)
    rows = {c.name: _Row(c) for c in configs}
    engines: dict[tuple[str, str], _Engine] = {}
    attention = None
    per_case_rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="hidream-bench-quality-") as tmp:
        try:
            # Every engine loaded once, up front (the world's models are a few MB): the configurations
            # then interleave per case, and each load is counted once.
            for config in configs:
                key = config.engine_key
                if key in engines or rows[config.name].error:
                    continue
                try:
                    engines[key] = _Engine(profile, dev.torch_device, *key, Path(tmp))
                except (EngineError, RuntimeError, ValueError) as exc:
                    for other in configs:
                        if other.engine_key == key:
                            rows[other.name].error = f"load failed: {exc}"
            if EXACT.engine_key not in engines:
                raise RuntimeError(f"the exact configuration could not load: {rows['exact'].error}")
            exact_engine = engines[EXACT.engine_key]
            attention = exact_engine.attention  # what `auto` resolved to: exact's strategy
            warm = world.make_case(WARM_UP_SEED)
            for config in configs:  # one unmeasured edit each: first-call costs are not the mode's
                row = rows[config.name]
                if row.error is None:
                    try:
                        engines[config.engine_key].edit(
                            Image.fromarray(warm.source),
                            _params(base, warm.instruction, warm.seed, config),
                            config.attention or attention,
                        )
                    except (EngineError, RuntimeError, ValueError) as exc:
                        row.error = f"edit failed: {exc}"
            if rows["exact"].error:
                raise RuntimeError(f"the exact configuration failed: {rows['exact'].error}")
            for index, case in enumerate(held_out):
                case_row = _run_case(case, index, configs, rows, engines, base, attention)
                if per_case:
                    per_case_rows.append(case_row)
                if progress is not None:
                    ok = case_row["configurations"]["exact"]["success"]
                    progress(
                        index + 1, len(held_out), f"seed {case.seed} {case.edit.kind}: exact {'ok' if ok else 'failed'}"
                    )
            geometry = exact_engine.pool.model.geometry
            plan = exact_engine.pool.working_plan((world.SIZE, world.SIZE), base["working_resolution"])
            width, height = plan.working_size
        finally:
            for engine in engines.values():
                engine.clock.close()
    load_seconds = {f"{key[0]} {key[1]}": round(engine.load_seconds, 3) for key, engine in engines.items()}
    kinds = {kind: sum(1 for c in held_out if c.edit.kind == kind) for kind in world.EDIT_KINDS}
    exact_row = rows["exact"]
    summaries = {name: _summary(row, exact_row) for name, row in rows.items()}
    image_tokens = (height // geometry.multiple) * (2 * width // geometry.multiple)
    exact_modes = [s for s in summaries.values() if s["exact_mode"] and "error" not in s]
    report = {
        "benchmark": "quality",
        "profile": profile,
        "random_weights": profile != TRAINED_PROFILE,
        "device": dev.torch_device,
        "dtype": str(dtype).replace("torch.", ""),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cases": len(held_out),
        "seed_start": world.HELD_OUT_SEED_START,
        "cases_by_kind": kinds,
        "untouched_min_psnr_db": world.UNTOUCHED_MIN_PSNR_DB,
        "edit": {k: v for k, v in base.items() if k not in PER_EDIT_FIELDS},
        "working_size": [width, height],
        "image_tokens": image_tokens,
        "max_seq": geometry.max_seq,
        "exact_attention": attention,
        "model_loads": len(engines),
        "load_seconds": load_seconds,
        "steps_grid": sorted({c.steps for c in configs if c.steps is not None}, reverse=True),
        "exact_modes_equal_exact": all(s["equal_to_exact_cases"] == len(held_out) for s in exact_modes),
        "configurations": summaries,
        "unavailable": unavailable,
    }
    report["targets"] = targets(report)
    report["presets"] = presets(report)
    if per_case:
        report["per_case"] = per_case_rows
    return report


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hidream_ui bench quality", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--cases",
        type=int,
        default=DEFAULT_CASES,
        help=f"held-out cases of the synthetic world (default {DEFAULT_CASES})",
    )
    parser.add_argument(
        "--tiny-profile",
        default=default_profile(),
        choices=profile_choices(),
        help=f"offline model (default {default_profile()}; `tiny` has random weights)",
    )
    parser.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N | npu | npu:N (default cpu)")
    parser.add_argument("--steps", type=int, help="denoising steps per edit (default: the edit default)")
    parser.add_argument(
        "--only",
        help="comma-separated configurations or groups to run beside exact "
        f"(groups: {', '.join(GROUPS)}; names as in the table)",
    )
    parser.add_argument(
        "--caches",
        help=f"comma-separated step caches to measure, any `--cache` value (default {','.join(CACHE_MODES)})",
    )
    parser.add_argument(
        "--param",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="an edit setting for every edit, e.g. guidance_scale=2.5 (repeatable; default: the edit defaults)",
    )
    parser.add_argument(
        "--steps-grid",
        metavar="N,N,...",
        help="comma-separated step counts to measure beside exact's (e.g. 28,20,14,10,8): each "
        "runs as `steps:N`; every speedup stays against exact at --steps",
    )
    parser.add_argument(
        "--cross",
        metavar="CACHES",
        help="comma-separated step caches (any `--cache` value) to run at each --steps-grid count "
        "too, as `CACHE@N`; `all`: every cache of --caches",
    )
    parser.add_argument("--per-case", action="store_true", help="add every case's verdicts to the JSON")
    parser.add_argument(
        "--threads", type=int, help="torch threads (default torch's; 1 leaves a shared machine its other core)"
    )
    parser.add_argument("--json", action="store_true")
    parser.add_argument(
        "--record",
        action="store_true",
        help="write the report as the shipped weights' record (assets/tiny_trained/quality.json, "
        "with this command and the weights' digest): the Speed presets are set from it",
    )
    add_verbose_argument(parser)
    args = parser.parse_args(argv)
    quiet_libraries(args.verbose)  # before torch and the loaders are imported: they read it then
    if args.cases < 1:
        parser.error(f"--cases must be at least 1 (got {args.cases})")
    if args.steps is not None and args.steps < 1:
        parser.error(f"--steps must be at least 1 (got {args.steps})")
    caches = args.caches.split(",") if args.caches else CACHE_MODES
    params = {}
    for item in args.param:
        field_name, sep, value = item.partition("=")
        if not sep or not field_name.strip():
            parser.error(f"--param {item!r}: expected FIELD=VALUE, e.g. guidance_scale=2.5")
        params[field_name.strip()] = value.strip()
    cross = (caches if args.cross.strip() == "all" else args.cross.split(",")) if args.cross else []
    try:
        cache_specs(caches)
        cache_specs(cross)
        grid = step_counts(args.steps_grid.split(",")) if args.steps_grid else []
        edit_base(args.steps, params)
    except ValueError as exc:
        parser.error(str(exc))
    if cross and not grid:
        parser.error("--cross needs --steps-grid (the step counts to run the caches at)")
    if args.record and args.tiny_profile != TRAINED_PROFILE:
        parser.error(f"--record writes the shipped weights' record: it needs --tiny-profile {TRAINED_PROFILE}")
    set_threads(parser, args.threads)

    def progress(done: int, total: int, text: str) -> None:
        print(f"bench quality: case {done}/{total} ({text})", file=sys.stderr, flush=True)

    try:
        report = run(
            args.cases,
            args.tiny_profile,
            args.device,
            args.steps,
            args.only.split(",") if args.only else None,
            args.per_case,
            progress,
            caches,
            params,
            grid,
            cross,
        )
    except (RuntimeError, ValueError, OSError) as exc:  # OSError: model files missing (say which, no traceback)
        print(f"bench quality: {exc}", file=sys.stderr)
        return 1
    if args.record:
        from hidream_ui.model.tiny import quality_record

        words = sys.argv[1:] if argv is None else ["bench", "quality", *argv]
        path = quality_record.write(report, " ".join(["python -m hidream_ui", *words]))
        print(f"bench quality: recorded as {path}", file=sys.stderr)
    print(json.dumps(report, indent=2) if args.json else format_table(report))
    return 0
