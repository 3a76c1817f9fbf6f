"""`python -m hidream_ui bench speed [--profile bench] [--cache-profile deep] [--json] ...`.

Three measurements, side by side in one run on the same inputs (README "Speed modes"):
1. MoE: diffusers' forward vs the sync-free one (grouped GEMMs): time per transformer call (runs
   alternating between the two), host syncs per call (all, and those of the MoE blocks), max relative
   difference, and how many MoE calls ran grouped vs dense (with the reason);
2. compile: eager vs `--compile blocks` (both with the sync-free MoE, which graph capture needs;
   the exact default is listed too): first-call time (trace + compile + run), steady time per
   call, max relative difference; the speedup is against the exact default (eager, diffusers' MoE);
3. step caching: a 28-step edit denoise with `none` and every mode of CACHE_MODES (our own hooks
   and the field's: diffusers' FirstBlockCache / TaylorSeer / MagCache, cache-dit's DBCache): wall time
   of the denoise, time inside the transformer and its speedup vs `none` (the exact default), fraction
   of block evaluations skipped, relative L2 of the final latent vs `none`. Default on the `deep` profile
   (the release's 16 + 32 blocks; the bench profile has 2, where nothing can be skipped).

On random weights the latent deviation says nothing about visual quality: judge a cache mode on
real weights in the Compare tab (axis "speed"). Timings on a shared machine are noisy.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from hidream_ui.bench import set_threads
from hidream_ui.config import AppConfig
from hidream_ui.device.detect import resolve_device, resolve_dtype
from hidream_ui.model import loading  # loading.load_model looked up per call: tests replace it
from hidream_ui.model.tiny.profiles import PROFILES
from hidream_ui.pipeline.attention.registry import apply
from hidream_ui.pipeline.speed.settings import MEASURED_CACHES

# Our own hooks, then the field's (docs/speed.md "The field's caches"): the list `bench quality` measures too.
# `dbcache` needs the optional cache-dit and is reported as skipped (with the reason) without it.
CACHE_MODES = ("none", *MEASURED_CACHES)


def _load(profile: str, dtype: str):
    import tempfile
    from pathlib import Path

    # AppConfig is built directly (not validated): the bench may name any tiny profile, `deep` included.
    config = AppConfig(
        tiny_profile=profile, device="cpu", dtype=dtype, output_dir=Path(tempfile.mkdtemp(prefix="hidream-bench-"))
    )
    device = resolve_device("cpu")
    model = loading.load_model(config, device, resolve_dtype(dtype, device))
    apply(model.pipeline.transformer, "sdpa", device, model.dtype)
    return model


def _edit_inputs(model, size: int):
    """One edit step's transformer input: 3 guidance branches, noise beside the source latent."""
    import torch

    # lazy: torch and diffusers, loaded only when this benchmark runs
    from hidream_ui.pipeline.edit_pipeline import PromptEmbeds

    pipe = model.pipeline
    side = size // pipe.vae_scale_factor
    hidden = torch.randn(
        3, pipe.transformer.config.in_channels, side, 2 * side, generator=torch.Generator().manual_seed(0)
    ).to(model.device.torch_device, model.dtype)
    text = PromptEmbeds.cat([pipe.encode_text("make the sky purple")] * 3)
    timestep = torch.full((3,), 500.0, device=model.device.torch_device)
    return hidden, timestep, text


def _timed(fn, repeats: int) -> tuple[float, list[float], object]:
    times, out = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), times, out


def _relative(a, b) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def _moe_section(model, size: int, repeats: int) -> dict:
    import torch

    # lazy: torch and diffusers, loaded only when this benchmark runs
    from hidream_ui.pipeline.speed.moe import apply_moe, grouped_state, moe_modules
    from hidream_ui.pipeline.speed.syncs import count_host_syncs

    pipe, transformer = model.pipeline, model.pipeline.transformer
    hidden, t, text = _edit_inputs(model, size)
    blocks = len(moe_modules(transformer))
    modes = ("diffusers", "sync-free")
    rows = {}
    with torch.no_grad():
        for mode in modes:
            apply_moe(transformer, mode)
            out, syncs = count_host_syncs(pipe.predict, hidden, t, text)  # also the warm-up
            moe_syncs = 0
            for module in moe_modules(transformer):  # the MoE blocks' own syncs, one block at a time
                x = torch.randn(3, 16, module.gate.gating_dim, dtype=model.dtype)
                moe_syncs += count_host_syncs(module, x)[1].total
            rows[mode] = {
                "runs": [],
                "host_syncs_per_call": syncs.total,
                "host_syncs_by_kind": dict(syncs.by_kind),
                "moe_host_syncs_per_call": moe_syncs,
                "out": out,
            }
        # Runs alternate between the modes, so a load change on a shared machine hits both alike.
        for _ in range(repeats):
            for mode in modes:
                apply_moe(transformer, mode)
                t0 = time.perf_counter()
                pipe.predict(hidden, t, text)
                rows[mode]["runs"].append(round(time.perf_counter() - t0, 4))
        grouped = grouped_state(transformer)
    apply_moe(transformer, "diffusers")
    diff = _relative(rows["sync-free"]["out"], rows["diffusers"]["out"])
    for row in rows.values():
        row.pop("out")
        row["seconds_per_call"] = round(statistics.median(row["runs"]), 4)
    rows["sync-free"]["grouped"] = grouped
    return {
        "moe_blocks": blocks,
        "image_tokens": hidden.shape[-2] * hidden.shape[-1] // 4,
        "batch": 3,
        **rows,
        "speedup": round(rows["diffusers"]["seconds_per_call"] / rows["sync-free"]["seconds_per_call"], 3),
        "max_relative_diff": diff,
    }


def _compile_section(model, size: int, repeats: int) -> dict:
    import torch

    # lazy: torch and diffusers, loaded only when this benchmark runs
    from hidream_ui.pipeline.speed.compile import compile_blocks, compiled_blocks, uncompile_blocks
    from hidream_ui.pipeline.speed.moe import apply_moe

    pipe, transformer = model.pipeline, model.pipeline.transformer
    hidden, t, text = _edit_inputs(model, size)
    rows = {}
    with torch.no_grad():
        exact = pipe.predict(hidden, t, text)
        rows["eager_exact"] = {"seconds_per_call": round(_timed(lambda: pipe.predict(hidden, t, text), repeats)[0], 4)}
        apply_moe(transformer, "sync-free")
        pipe.predict(hidden, t, text)
        seconds, runs, eager = _timed(lambda: pipe.predict(hidden, t, text), repeats)
        rows["eager_sync_free"] = {"seconds_per_call": round(seconds, 4), "runs": [round(r, 4) for r in runs]}
        state = compile_blocks(transformer, model.device.type)
        t0 = time.perf_counter()
        pipe.predict(hidden, t, text)
        first = time.perf_counter() - t0
        seconds, runs, compiled = _timed(lambda: pipe.predict(hidden, t, text), repeats)
        rows["compiled"] = {
            "first_call_seconds": round(first, 2),
            "seconds_per_call": round(seconds, 4),
            "runs": [round(r, 4) for r in runs],
            "compiled_blocks": compiled_blocks(transformer),
            "backend": state.backend,
            "error": state.error,
        }
    uncompile_blocks(transformer)
    apply_moe(transformer, "diffusers")
    return {
        **rows,
        "steady_speedup_vs_exact": round(rows["eager_exact"]["seconds_per_call"] / seconds, 3),
        "max_relative_diff_vs_eager": _relative(compiled, eager),
        "max_relative_diff_vs_exact": _relative(compiled, exact),
    }


def _cache_section(model, steps: int, size: int, modes: tuple[str, ...] = CACHE_MODES) -> dict:
    import torch
    from PIL import Image

    # lazy: torch and diffusers, loaded only when this benchmark runs
    from hidream_ui.pipeline.speed.cache import apply_step_cache
    from hidream_ui.pipeline.speed.settings import cache_unavailable, parse_cache

    pipe, transformer = model.pipeline, model.pipeline.transformer
    inside = [0.0]
    started = {}

    def pre(module, args, kwargs):
        started["t"] = time.perf_counter()

    def post(module, args, kwargs, output):
        inside[0] += time.perf_counter() - started["t"]

    handles = [
        transformer.register_forward_pre_hook(pre, with_kwargs=True),
        transformer.register_forward_hook(post, with_kwargs=True),
    ]
    texts = {}

    def embeds(text):  # encoded once per text, as the engine's prompt cache does
        if text not in texts:
            texts[text] = pipe.encode_text(text)
        return texts[text]

    image = Image.effect_mandelbrot((size, size), (-2.0, -1.5, 1.0, 1.5), 100).convert("RGB")
    rows, exact = {}, None
    try:
        for mode in ("none", "none", *(m for m in modes if m != "none")):  # the first "none" is a warm-up
            reason = cache_unavailable(parse_cache(mode))
            if reason:
                rows[mode] = {"skipped": reason}
                continue
            apply_step_cache(transformer, mode)
            inside[0] = 0.0
            t0 = time.perf_counter()
            latent = pipe(
                image=image,
                prompt="make the sky purple",
                num_inference_steps=steps,
                generator=torch.Generator().manual_seed(0),
                output_type="latent",
                prompt_embeds_fn=embeds,
            ).images
            wall = time.perf_counter() - t0
            stats = pipe.step_cache_stats
            if mode == "none":
                exact = latent
            rows[mode] = {
                "wall_seconds": round(wall, 3),
                "transformer_seconds": round(inside[0], 3),
                "skipped_fraction": round(stats.skipped_fraction, 4) if stats else 0.0,
                "full_calls": stats.full_calls if stats else steps,
                "relative_l2_vs_exact": ((latent - exact).norm() / exact.norm()).item(),
            }
    finally:
        for handle in handles:
            handle.remove()
        apply_step_cache(transformer, "none")
    base = rows["none"]["transformer_seconds"]
    for row in rows.values():
        if "skipped" not in row:
            row["transformer_speedup"] = round(base / row["transformer_seconds"], 3)
    blocks = len(transformer.double_stream_blocks) + len(transformer.single_stream_blocks)
    return {"steps": steps, "blocks": blocks, "edit_size": f"{size}x{size}", "modes": rows}


def run(
    profile: str = "bench",
    cache_profile: str = "deep",
    size: int = 256,
    cache_size: int | None = None,
    steps: int = 28,
    repeats: int = 3,
    dtype: str = "fp32",
    compile_: bool = True,
    caches: tuple[str, ...] = CACHE_MODES,
) -> dict:
    import torch

    report = {
        "benchmark": "speed",
        "device": "cpu",
        "dtype": dtype,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "profile": profile,
        "cache_profile": cache_profile,
    }
    model = _load(profile, dtype)
    report["moe"] = _moe_section(model, size, repeats)
    report["compile"] = _compile_section(model, size, repeats) if compile_ else None
    del model
    model = _load(cache_profile, dtype)
    cache_size = cache_size or model.geometry.image_size // 2
    report["cache"] = _cache_section(model, steps, cache_size, caches)
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hidream_ui bench speed", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--profile",
        default="bench",
        choices=sorted(PROFILES),
        help="model of the MoE and compile sections (default bench)",
    )
    parser.add_argument(
        "--cache-profile",
        default="deep",
        choices=sorted(PROFILES),
        help="model of the step-caching section (default deep: the release's block count)",
    )
    parser.add_argument("--size", type=int, default=256, help="edit side in pixels of the MoE/compile sections")
    parser.add_argument("--cache-size", type=int, help="edit side of the caching section (default: half the max)")
    parser.add_argument("--steps", type=int, default=28)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-compile", action="store_true", help="skip the compile section (it takes minutes)")
    parser.add_argument(
        "--threads", type=int, help="torch threads (default: torch's; 1 avoids thrashing on a machine other jobs share)"
    )
    parser.add_argument(
        "--caches",
        help="comma-separated step caches of the caching section, any `--cache` value "
        "(default: the list bench quality measures)",
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    caches = CACHE_MODES
    if args.caches:
        from hidream_ui.bench.quality import cache_specs

        try:
            caches = ("none", *cache_specs(args.caches.split(",")))
        except ValueError as exc:
            parser.error(str(exc))
    set_threads(parser, args.threads)
    for name in ("size", "steps", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1 (got {getattr(args, name)})")
    report = run(
        args.profile,
        args.cache_profile,
        args.size,
        args.cache_size,
        args.steps,
        args.repeats,
        compile_=not args.no_compile,
        caches=caches,
    )
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    m = report["moe"]
    grouped_calls = m["sync-free"]["grouped"]["grouped_calls"]
    print(
        f"MoE ({report['profile']}, {grouped_calls} grouped MoE calls): "
        f"diffusers {m['diffusers']['seconds_per_call']:.3f} s/call, "
        f"{m['diffusers']['host_syncs_per_call']} host syncs ({m['diffusers']['moe_host_syncs_per_call']} in MoE) vs "
        f"sync-free {m['sync-free']['seconds_per_call']:.3f} s/call, {m['sync-free']['host_syncs_per_call']} "
        f"({m['sync-free']['moe_host_syncs_per_call']} in MoE); max rel diff {m['max_relative_diff']:.2g}"
    )
    c = report["compile"]
    if c:
        print(
            f"compile: first call {c['compiled']['first_call_seconds']} s, steady {c['compiled']['seconds_per_call']}"
            f" s/call vs exact eager {c['eager_exact']['seconds_per_call']} s/call "
            f"({c['steady_speedup_vs_exact']}x); max rel diff {c['max_relative_diff_vs_exact']:.2g}"
        )
    k = report["cache"]
    for mode, row in k["modes"].items():
        if "skipped" in row:
            print(f"cache {mode:>17}: skipped ({row['skipped']})")
            continue
        print(
            f"cache {mode:>17} ({k['steps']} steps, {k['blocks']} blocks): "
            f"transformer {row['transformer_seconds']} s "
            f"({row['transformer_speedup']}x), skipped {row['skipped_fraction']:.1%}, "
            f"rel L2 {row['relative_l2_vs_exact']:.3g}"
        )
    return 0
