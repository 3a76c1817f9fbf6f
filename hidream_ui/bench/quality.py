"""`python -m hidream_ui bench quality [--cases N] [--json] [--tiny-profile P] [--only NAMES] ...`.

What each speed and memory mode costs in quality, on edits whose right answer is known: N fresh cases
of the synthetic world (lab/world.py, seeds from `HELD_OUT_SEED_START` on, never used in
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

The configurations are bench/quality_configs.py's, the targets, presets and table bench/quality_report.py's; this
module runs the edits and sums them up.
"""

from __future__ import annotations

import argparse
import json
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
from hidream_ui.bench.quality_configs import (
    CACHE_MODES,
    EXACT,
    GROUPS,
    TRAINED_PROFILE,
    Configuration,
    all_configurations,
    cache_specs,
    default_profile,
    profile_choices,
    select,
    step_counts,
)
from hidream_ui.bench.quality_report import format_table, presets, targets
from hidream_ui.cli.quiet import add_verbose_argument, quiet_libraries
from hidream_ui.config import AppConfig
from hidream_ui.device.detect import resolve_device, resolve_dtype
from hidream_ui.edits import EditParams, EditRequest
from hidream_ui.engine.errors import EngineError
from hidream_ui.engine.pool import EnginePool
from hidream_ui.lab import world

DEFAULT_CASES = 96

# The world's scenes are drawn with the held-out start; warm-up edits use a seed below it (a training
# seed: never scored), so the first, slower edit of each configuration is not one of the measured ones.
WARM_UP_SEED = world.HELD_OUT_SEED_START - 1


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
        self.clock = self.pool.run_exclusive("timing", lambda model: _TransformerClock(model.pipeline.transformer))

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
    status=None,
) -> dict:
    """Runs the benchmark; returns the report (keys: docs/benchmarks.md "bench quality").
    `progress(done, total, text)` is called after each case; `params`: edit settings other than the defaults;
    `steps_grid`: other step counts to measure (`steps:N`), `cross`: step caches run at each of them too.
    `status(text)` is told what happens before the first case (the loads and warm-up edits: minutes on a CPU)."""
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
            keys = list(dict.fromkeys(config.engine_key for config in configs))
            for config in configs:
                key = config.engine_key
                if key in engines or rows[config.name].error:
                    continue
                if status is not None:
                    status(
                        f"loading the {profile} model {keys.index(key) + 1}/{len(keys)} (memory {key[0]}, weights "
                        f"{key[1]}; the first load may build it: minutes)"
                    )
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
            if status is not None:
                status(f"one warm-up edit for each of {len(configs)} configurations, then {cases} case(s)")
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
            geometry = exact_engine.pool.model_facts().geometry
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

    def status(text: str) -> None:  # stderr: --json keeps stdout for the report
        print(f"bench quality: {text}", file=sys.stderr, flush=True)

    status(f"{args.cases} held-out case(s) on {args.device}: importing torch, then the model loads")
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
            status,
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
