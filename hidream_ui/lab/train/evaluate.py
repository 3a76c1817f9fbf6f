"""Held-out evaluation of trained weights through the real loader and pipeline (`--eval`, `--grid`), where
sampling loses the edit (`--oracle`), and MagCache's calibration of the weights (`--calibrate-magcache`)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

import numpy as np

from hidream_ui.lab import world
from hidream_ui.lab.scoring import eval_pipeline, pixels, summarize


def evaluate(weights: Path, cases: int, log: Callable[[str], None] = print, grid: Path | None = None, **call) -> dict:
    """Held-out success through the real loader and pipeline: `weights` (an asset folder) laid over a fresh
    build, loaded by `load_model` (fp32 on the CPU), one edit per case with the default E1.1 settings at the
    world's 128 x 128 (the model's `auto` working size), scored by world.score. With `grid`, the first
    GRID_ROWS cases are drawn there too (`write_grid`)."""
    shots: list | None = [] if grid is not None else None
    with eval_pipeline(weights) as pipeline:
        summary = _score(pipeline, cases, log, call, shots=shots)
    if grid is not None:
        write_grid(shots, grid)
        log(f"wrote {grid} ({len(shots)} cases: source | target | result, the strip green where it succeeded)")
    return summary


GRID_ROWS = 24  # cases a --grid image shows (one row each)


GRID_STRIP = 8  # px: the strip right of a row, green for a success, red for a failure


def write_grid(shots: list[tuple], path: Path) -> None:
    """One row per (case, image, score): the source, the true target and the model's result side by side at
    the world's size, then a strip that says whether the edit succeeded. Failures are seen, not guessed at."""
    from PIL import Image

    rows = []
    for case, image, score in shots:
        result = np.asarray(image.convert("RGB").resize((world.SIZE, world.SIZE), Image.Resampling.NEAREST))
        strip = np.zeros((world.SIZE, GRID_STRIP, 3), np.uint8)
        strip[:] = (40, 170, 60) if score["success"] else (220, 40, 40)
        rows.append(np.concatenate([case.source, case.target, result, strip], axis=1))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.concatenate(rows, axis=0)).save(path)


def oracle(
    weights: Path, cases: int, at_steps: list[int], log: Callable[[str], None] = print, **call
) -> dict[int, dict]:
    """Where sampling loses the edit: for each step index k, every held-out edit runs with its latents put,
    after step k, exactly on the true target's noised point (``(1 - s) x0 + s e`` at the next noise level
    s); the model samples on from there as usual. k = -1 puts nothing. The sampler is first order (UniPC of
    order 1 without its corrector, which is Euler for flow matching): a multistep sampler's history would
    still carry the replaced trajectory. One load for every k. Returns {k: summary}."""
    from diffusers import UniPCMultistepScheduler

    with eval_pipeline(weights) as pipeline:
        pipeline.scheduler = UniPCMultistepScheduler.from_config(
            pipeline.scheduler.config, solver_order=1, disable_corrector=list(range(1000))
        )
        return {
            k: _score(pipeline, cases, lambda line, k=k: log(f"oracle after step {k}: {line}"), call, k)
            for k in at_steps
        }


def calibrate_magcache(weights: Path, cases: int, log: Callable[[str], None] = print) -> dict:
    """MagCache's per-stage ratios of `weights` (pipeline/speed/mag_ratios.py), from `cases` edits of the
    training seed range (never a held-out case that `bench quality` scores) with the E1.1 defaults."""
    import torch
    from PIL import Image

    from hidream_ui.edits import EditSettings
    from hidream_ui.pipeline.speed import mag_calibrate

    defaults = EditSettings()
    steps, strength = defaults.num_inference_steps, defaults.refine_strength

    def edit(case):
        return lambda: pipeline(
            Image.fromarray(case.source),
            case.instruction,
            num_inference_steps=steps,
            refine_strength=strength,
            generator=torch.Generator().manual_seed(case.seed),
        )

    with eval_pipeline(weights) as pipeline:
        started = time.perf_counter()
        ratios = mag_calibrate.calibrate(
            pipeline, (edit(world.make_case(seed)) for seed in range(cases)), steps, strength
        )
    log(
        f"MagCache calibration ({cases} edits, {time.perf_counter() - started:.0f} s): edit "
        f"{[round(v, 3) for v in ratios.edit]}, refine {[round(v, 3) for v in ratios.refine]}"
    )
    return ratios.to_json()


def _score(
    pipeline,
    cases: int,
    log: Callable[[str], None],
    call: dict,
    oracle_step: int | None = None,
    shots: list | None = None,
) -> dict:
    import torch
    from PIL import Image

    scores = []
    started = time.perf_counter()
    for case in world.held_out_cases(cases):
        extra = {}
        if oracle_step is not None:
            extra["callback_on_step_end"] = _oracle_callback(pipeline, case, oracle_step, torch)
        image = pipeline(
            Image.fromarray(case.source),
            case.instruction,
            generator=torch.Generator().manual_seed(case.seed % (2**31)),
            **call,
            **extra,
        ).images[0]
        scores.append(world.score(case, image))
        if shots is not None and len(shots) < GRID_ROWS:
            shots.append((case, image, scores[-1]))
    seconds = (time.perf_counter() - started) / max(1, cases)
    summary = summarize(scores)
    summary["seconds_per_edit"] = round(seconds, 3)
    log(f"held-out ({cases} cases): " + ", ".join(f"{k} {v}" for k, v in summary.items() if k != "psnr_db"))
    return summary


def _oracle_callback(pipeline, case, step: int, torch):
    vae = pipeline.vae
    with torch.no_grad():
        x0 = vae.encode(pixels([case.target], torch)).latent_dist.mode()
    x0 = (x0 - vae.config.shift_factor) * vae.config.scaling_factor

    def callback(pipe, i, t, tensors):
        if i != step:
            return tensors
        s = pipe.scheduler.sigmas[i + 1]
        noise = torch.randn(x0.shape, generator=torch.Generator().manual_seed(case.seed % (2**31) + i))
        return {"latents": (1 - s) * x0 + s * noise}

    return callback
