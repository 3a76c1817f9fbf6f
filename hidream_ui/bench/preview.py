"""`python -m hidream_ui bench preview [--json] [--profile tiny|bench] [--steps N] [--every K]`.

What a live preview costs next to a denoising step, side by side in one run:
1. the fit of the latent -> RGB map to the model's VAE (once per loaded model);
2. one preview (the map on the step's x0 estimate, the copy to the host, the PIL image) at the
   edit's latent size and at the latent size of a 1024 x 1024 release edit (128 x 128 x 16);
3. a step of the same edit, timed by the engine with previews off and every K steps;
and the preview's cost as a percentage of a step (per preview, and spread over its K steps).

The tiny profiles' steps are far shorter than the release's (2 to 4 blocks instead of 48, at a
fraction of the width), so the percentages here are upper bounds of the release's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from hidream_ui.config import AppConfig
from hidream_ui.engine.pool import EnginePool


def _time(fn, repeats: int) -> float:
    fn()  # warm-up, not timed
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def measure(profile: str, steps: int, every: int, side: int, repeats: int) -> dict:
    import numpy as np
    import torch
    from PIL import Image

    from hidream_ui.edits import EditParams, EditRequest

    config = AppConfig(tiny_profile=profile, device="cpu", output_dir="outputs/bench-preview", preview_every=every)
    pool = EnginePool.for_config(config, limit=1)
    pool.load()
    engine = pool.primary
    rng = np.random.default_rng(0)
    source = Image.fromarray(rng.integers(0, 256, (side, side, 3), dtype=np.uint8))
    params = EditParams("make it blue", seed=1, num_inference_steps=steps, working_resolution="auto").validated()
    request = EditRequest(source, params)

    started = time.perf_counter()
    previewer = engine.preview_map()  # the fit (first use) is one of the figures
    fit_seconds = time.perf_counter() - started

    def edit(on_preview=None):
        return pool.edit(request, save=False, on_preview=on_preview)

    working = edit().working_size  # warm-up (allocator, kernels, text-encoder cache); "auto": the model's size
    plain = [edit().timings.per_step for _ in range(repeats)]
    shots: list = []
    shown = [edit(shots.append).timings.per_step for _ in range(repeats)]
    per_step = statistics.median(plain)

    channels = engine.model.pipeline.transformer.config.in_channels
    scale = engine.model.pipeline.vae_scale_factor
    latent = (channels, working[1] // scale, working[0] // scale)
    here = torch.randn(*latent)
    release = torch.randn(channels, 128, 128)
    preview_here = _time(lambda: previewer.image(here), repeats * 5)
    preview_release = _time(lambda: previewer.image(release), repeats * 5)
    return {
        "profile": profile,
        "device": engine.device.torch_device,
        "source_size": f"{side}x{side}",
        "working_size": f"{working[0]}x{working[1]}",
        "latent": list(latent),
        "steps": steps,
        "every": every,
        "previews_per_edit": len(shots) // repeats,
        "fit_seconds": round(fit_seconds, 4),
        "fit_rms": round(previewer.residual, 4),
        "step_seconds": round(per_step, 5),
        "step_seconds_with_previews": round(statistics.median(shown), 5),
        "preview_seconds": round(preview_here, 6),
        "preview_seconds_1024": round(preview_release, 6),
        "preview_pct_of_step": round(100 * preview_here / per_step, 3),
        "preview_pct_of_step_spread": round(100 * preview_here / every / per_step, 3),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hidream_ui bench preview", description=__doc__.splitlines()[0])
    parser.add_argument("--profile", default="tiny", choices=("tiny", "bench"))
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--every", type=int, default=4, help="preview every K steps (default 4, the app's)")
    parser.add_argument("--size", type=int, default=512, help="side of the square source (edited at the model's size)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    row = measure(args.profile, args.steps, max(1, args.every), args.size, max(1, args.repeats))
    if args.json:
        print(json.dumps({"benchmark": "preview", "rows": [row]}, indent=2))
        return 0
    print(f"profile {row['profile']} on {row['device']}, working size {row['working_size']}, {row['steps']} steps")
    print(f"  fit of the latent->RGB map: {row['fit_seconds']:.3f} s (RMS error {row['fit_rms']:.3f})")
    print(
        f"  step: {row['step_seconds'] * 1000:.1f} ms; with a preview every {row['every']}: "
        f"{row['step_seconds_with_previews'] * 1000:.1f} ms"
    )
    print(
        f"  one preview: {row['preview_seconds'] * 1000:.3f} ms ({row['preview_pct_of_step']:.2f} % of a step; "
        f"{row['preview_pct_of_step_spread']:.2f} % spread over {row['every']} steps); "
        f"at a 1024x1024 edit's latent: {row['preview_seconds_1024'] * 1000:.3f} ms"
    )
    return 0
