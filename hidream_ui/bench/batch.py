"""`python -m hidream_ui bench batch [--json] [--profile tiny|bench] [--images N] [--steps S] [--size PX]`.

N images with one instruction, two ways, side by side in one run:
1. `engine.run_batch` (items of one working size share transformer calls, up to the batch size);
2. a plain loop of `engine.edit`, one image at a time, with the same seeds.
Each way gets a fresh engine (so the prompt cache of one cannot help the other) that is loaded
and warmed up with a one-step edit of another instruction before the clock starts (first-call
costs -- kernel selection, allocator growth -- would otherwise land on whichever runs first).
Reported: wall time of each, their ratio, text-encoder and transformer calls of each, and the
largest pixel difference between the two sets of outputs (batched matmuls round differently, so
a few levels of 255 are expected; a wrong seed per item would show as a large difference).
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
import time
from pathlib import Path

from hidream_ui.config import AppConfig
from hidream_ui.engine.batch import BatchRequest, BatchSource
from hidream_ui.engine.pool import EnginePool

INSTRUCTION = "turn the scene into a snowy winter evening"
BASE_SEED = 1234


def _pictures(count: int, size: tuple[int, int]):
    import numpy as np
    from PIL import Image

    pictures = []
    for index in range(count):
        rng = np.random.default_rng(index)
        base = np.zeros((size[1], size[0], 3), dtype=np.uint8)
        base[..., 0] = np.linspace(0, 255, size[0], dtype=np.uint8)[None, :]
        base[..., 1] = np.linspace(255, 0, size[1], dtype=np.uint8)[:, None]
        base[..., 2] = rng.integers(0, 255, (size[1], size[0]), dtype=np.uint8)
        pictures.append(Image.fromarray(base))
    return pictures


def _engine(profile: str, dtype: str, output_dir: Path, attention: str):
    engine = EnginePool.for_config(
        AppConfig(tiny_profile=profile, device="cpu", dtype=dtype, attention=attention, output_dir=output_dir)
    )
    engine.load()
    return engine


def _params(steps: int, resolution: str, seed: int = BASE_SEED, instruction: str = INSTRUCTION):
    from hidream_ui.edits import EditParams

    defaults = EditParams.defaults_for("e1.1", instruction)
    return EditParams.from_dict(
        {**defaults.to_dict(), "num_inference_steps": steps, "working_resolution": resolution, "seed": seed}
    )


def _warm_up(engine, picture, resolution: str) -> None:
    from hidream_ui.edits import EditParams, EditRequest

    params = _params(1, resolution, instruction="warm-up")
    params = EditParams.from_dict({**params.to_dict(), "negative_prompt": "warm-up negative"})
    engine.edit(EditRequest(image=picture, params=params), save=False)


def _delta(after: dict, before: dict) -> dict:
    return {key: after[key] - before.get(key, 0) for key in ("edits", "text_encoder_calls", "transformer_calls")}


def run(
    profile: str = "tiny",
    images: int = 4,
    steps: int = 4,
    size: str | None = None,
    batch_size: int | None = None,
    dtype: str = "fp32",
    attention: str = "sdpa",
) -> dict:
    import numpy as np

    from hidream_ui.edits import EditRequest

    resolution = size or ("draft" if profile == "tiny" else "256")
    pictures = _pictures(images, (320, 240))
    params = _params(steps, resolution)
    report: dict = {
        "benchmark": "batch",
        "profile": profile,
        "dtype": dtype,
        "device": "cpu",
        "images": images,
        "steps": steps,
        "working_resolution": resolution,
        "attention": attention,
        "instruction_count": 1,
    }

    with tempfile.TemporaryDirectory(prefix="hidream-bench-batch-") as tmp:
        # 1. run_batch
        engine = _engine(profile, dtype, Path(tmp) / "batched", attention)
        _warm_up(engine, pictures[0], resolution)
        before = dict(engine.counters)
        request = BatchRequest(
            sources=tuple(BatchSource(f"image{i}.png", p) for i, p in enumerate(pictures)),
            instructions=(INSTRUCTION,),
            settings=params.settings,
            seed=params.seed,
            seed_policy="increment",
            batch_size=batch_size or images,
        )
        t0 = time.perf_counter()
        result = engine.run_batch(request)
        batched_seconds = time.perf_counter() - t0
        failed = [item.error for item in result.items if item.status != "ok"]
        if failed:
            raise RuntimeError(f"the batch failed: {failed[0]}")
        batched = [np.asarray(item.result.image, dtype=np.int16) for item in result.items]
        report["working_size"] = list(result.items[0].result.working_size)
        report["batched"] = {
            "seconds": round(batched_seconds, 3),
            **_delta(engine.counters, before),
            "batch_sizes": result.stats.get("batch_sizes"),
            "seeds": [item.seed for item in result.items],
        }
        del engine, result
        gc.collect()

        # 2. the plain loop, same seeds
        engine = _engine(profile, dtype, Path(tmp) / "loop", attention)
        _warm_up(engine, pictures[0], resolution)
        before = dict(engine.counters)
        t0 = time.perf_counter()
        singles = []
        for index, picture in enumerate(pictures):
            edit_params = _params(steps, resolution, seed=BASE_SEED + index)
            singles.append(engine.edit(EditRequest(image=picture, params=edit_params, source_name=f"image{index}.png")))
        loop_seconds = time.perf_counter() - t0
        report["loop"] = {
            "seconds": round(loop_seconds, 3),
            **_delta(engine.counters, before),
            "seeds": [r.params.seed for r in singles],
        }
        loop = [np.asarray(r.image, dtype=np.int16) for r in singles]
        del engine
        gc.collect()

    report["speedup"] = round(loop_seconds / batched_seconds, 3) if batched_seconds else None
    report["max_pixel_diff"] = int(max(np.abs(a - b).max() for a, b in zip(batched, loop)))
    report["unique_texts"] = 2  # the instruction and the negative prompt
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hidream_ui bench batch", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--profile",
        default="tiny",
        choices=("tiny", "bench"),
        help="tiny: toy geometry; bench: the real attention geometry (20 heads x 128), heavy",
    )
    parser.add_argument("--images", type=int, default=4, help="images in the batch (default 4)")
    parser.add_argument("--steps", type=int, default=4, help="denoising steps per edit (default 4)")
    parser.add_argument(
        "--size",
        default=None,
        help="working resolution: draft | auto | side in px (default: draft for tiny, 256 for bench)",
    )
    parser.add_argument("--batch-size", type=int, default=None, help="items per transformer call (default: all)")
    parser.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    if args.images < 1 or args.steps < 1:
        parser.error("--images and --steps must be at least 1")
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    report = run(args.profile, args.images, args.steps, args.size, args.batch_size, args.dtype)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    b, loop = report["batched"], report["loop"]
    size = "x".join(map(str, report["working_size"]))
    print(f"{report['images']} images x 1 instruction, {report['steps']} steps at {size} ({report['profile']} profile)")
    print(
        f"  run_batch : {b['seconds']:.2f} s · text encoder calls {b['text_encoder_calls']} · "
        f"transformer calls {b['transformer_calls']} · batch sizes {b['batch_sizes']}"
    )
    print(
        f"  edit loop : {loop['seconds']:.2f} s · text encoder calls {loop['text_encoder_calls']} · "
        f"transformer calls {loop['transformer_calls']}"
    )
    print(f"  loop / batch = {report['speedup']}x · max pixel difference {report['max_pixel_diff']}/255")
    return 0
