"""`python -m hidream_ui bench pool [--profile tiny|bench] [--jobs 8] [--steps N] [--json]`.

The same N concurrent edits (default 8, one seed each) through the running app's queue, twice, side
by side: `--device cpu` (one engine) and `--devices cpu,cpu` (two engines, the cores split between
them). Each app is launched in this process (offline model of the profile, a free 127.0.0.1 port, a
temporary --output-dir); all its engines are loaded before the clock starts; the N jobs are
submitted at once with `gradio_client` (`/edit`, the bundled apple, distinct seeds).

Reported per run: every job's engine, start and end (seconds after the first submit, measured
around the engine's edit in the server), the wall time for all N, jobs per engine, the measured
overlap (seconds during which two or more jobs computed at once, and the most at once); then the
throughput ratio (one engine's wall time / the pool's) and, per seed, whether the two runs gave
identical pixels (and the largest difference when not).

On a machine with one CPU socket one engine already keeps every core busy, so expect a ratio near
1x there: the gain belongs to machines with several cards. Nothing here is tuned to a target.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

from hidream_ui.bench import free_port
from hidream_ui.cli.app import launch
from hidream_ui.config import AppConfig
from hidream_ui.engine.pool import EnginePool, host_cores

INSTRUCTION = "Replace the red apple with a green pear"


def time_edits(pool: EnginePool, records: list[dict]) -> None:
    """Records when each edit ran on each of the pool's workers (start/end around the worker's edit, in
    the computing thread, so waiting for a free worker is not counted), for the report only. The
    pool's workers are wrapped where they stand: the benchmark names no worker class."""
    for worker in pool.engines:
        label = worker.pool_label or worker.config.device

        def timed(request, on_step=None, *, _edit=worker.edit, _label=label, **options):
            start = time.perf_counter()
            try:
                return _edit(request, on_step, **options)
            finally:
                with _RECORDS_LOCK:
                    records.append(
                        {
                            "engine": _label,
                            "seed": request.params.seed,
                            "start": start,
                            "end": time.perf_counter(),
                            "thread": threading.current_thread().name,
                        }
                    )

        worker.edit = timed


_RECORDS_LOCK = threading.Lock()


def _overlap(records: list[dict]) -> tuple[float, int]:
    """(seconds with >= 2 jobs running, most jobs running at once)."""
    events = sorted([(r["start"], 1) for r in records] + [(r["end"], -1) for r in records])
    running, most, overlap, last = 0, 0, 0.0, None
    for moment, delta in events:
        if running >= 2 and last is not None:
            overlap += moment - last
        running += delta
        most = max(most, running)
        last = moment
    return overlap, most


def _run_app(label: str, config, engine, jobs: int, steps: int, picture: Path, downloads: Path) -> dict:
    from gradio_client import Client, handle_file
    from PIL import Image

    records: list[dict] = []
    time_edits(engine, records)
    demo = client = None
    try:
        t0 = time.perf_counter()
        demo, url = launch(config, engine=engine, prevent_thread_lock=True, quiet=True)
        launch_seconds = time.perf_counter() - t0
        t0 = time.perf_counter()
        for each in engine.engines:  # every engine loaded before the clock starts
            each.load()
        load_seconds = time.perf_counter() - t0
        # No downloads: the benchmark measures jobs, and it runs beside the server, so it reads each saved
        # result where the app wrote it (a download once failed mid-body in CI: "peer closed connection").
        client = Client(url, verbose=False, download_files=False, analytics_enabled=False)
        started = time.perf_counter()
        pending = [
            client.submit(
                image=handle_file(str(picture)),
                instruction=INSTRUCTION,
                seed=seed,
                randomize_seed=False,
                num_inference_steps=steps,
                working_resolution="draft",
                api_name="/edit",
            )
            for seed in range(jobs)
        ]
        outputs = [job.result(timeout=3600) for job in pending]
        wall = time.perf_counter() - started
        # Read before the app closes (its cache folder goes with it).
        images = {
            int(seed): Image.open(png["path"] if isinstance(png, dict) else png).convert("RGB")
            for (_, png, seed, _) in outputs
        }
    finally:
        if client is not None:
            client.close()
        if demo is not None:
            with contextlib.redirect_stdout(sys.stderr):  # "Closing server...": keep --json clean
                demo.close()
    overlap, most = _overlap(records)
    per_engine: dict[str, int] = {}
    for record in records:
        per_engine[record["engine"]] = per_engine.get(record["engine"], 0) + 1
    return {
        "label": label,
        "engines": len(engine.engines),
        "launch_seconds": round(launch_seconds, 3),
        "load_seconds_all_engines": round(load_seconds, 3),
        "wall_seconds": round(wall, 3),
        "jobs_per_second": round(jobs / wall, 4),
        "jobs_per_engine": per_engine,
        "overlap_seconds": round(overlap, 3),
        "max_concurrent_jobs": most,
        "two_jobs_ran_at_once": most >= 2,
        "jobs": [
            {
                "seed": r["seed"],
                "engine": r["engine"],
                "start": round(r["start"] - started, 3),
                "end": round(r["end"] - started, 3),
            }
            for r in sorted(records, key=lambda r: r["start"])
        ],
        "_images": images,
    }


def run(profile: str = "tiny", jobs: int = 8, steps: int = 4) -> dict:
    import numpy as np

    from hidream_ui.ui.layout import ASSETS_DIR  # lazy: gradio (the bench harness itself never needs it)

    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
    picture = ASSETS_DIR / "apple.png"
    tmp = Path(tempfile.mkdtemp(prefix="hidream-bench-pool-"))
    try:
        base = dict(tiny_profile=profile, max_queue=max(16, jobs), max_jobs_per_client=jobs, retention=0)
        single_config = AppConfig(device="cpu", output_dir=tmp / "single", port=free_port(), **base)
        single_pool = EnginePool.for_config(single_config, hide_paths=True)
        single = _run_app("device cpu", single_config, single_pool, jobs, steps, picture, tmp)
        pool_config = AppConfig(devices=("cpu", "cpu"), output_dir=tmp / "pool", port=free_port(), **base)
        pool = EnginePool.for_config(pool_config, hide_paths=True)
        threads = [slot.threads for slot in pool.slots]
        spread = _run_app("devices cpu,cpu", pool_config, pool, jobs, steps, picture, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    a, b = single.pop("_images"), spread.pop("_images")
    per_seed = []
    for seed in sorted(a):
        x, y = np.asarray(a[seed], dtype=np.int16), np.asarray(b[seed], dtype=np.int16)
        per_seed.append(
            {"seed": seed, "identical": bool(np.array_equal(x, y)), "max_abs_difference": int(np.abs(x - y).max())}
        )
    return {
        "benchmark": "pool",
        "profile": profile,
        "jobs": jobs,
        "settings_per_job": {
            "api_name": "/edit",
            "image": picture.name,
            "num_inference_steps": steps,
            "working_resolution": "draft",
        },
        "host_cores": host_cores(),
        "pool_threads_per_engine": threads,
        "single": single,
        "pool": spread,
        "throughput_ratio": round(single["wall_seconds"] / spread["wall_seconds"], 3),
        "identical_outputs": sum(1 for s in per_seed if s["identical"]),
        "outputs_per_seed": per_seed,
        "note": "one engine already uses every core of this CPU; the pool's gain belongs to machines with several "
        "cards. Images of a two-engine CPU pool can differ in the last bit from one engine's when the "
        "engines run on fewer threads each (fp32 sums in another order); with equal threads they are "
        "identical (tests/test_pool.py).",
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m hidream_ui bench pool",
        description="N concurrent edits through the app's queue: --device cpu vs "
        "--devices cpu,cpu (overlap, throughput, identical outputs).",
    )
    parser.add_argument("--profile", choices=("tiny", "bench"), default="tiny", help="offline model (default tiny)")
    parser.add_argument("--jobs", type=int, default=8, help="concurrent edits (default 8)")
    parser.add_argument("--steps", type=int, default=4, help="steps per edit (default 4)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    if args.jobs < 1 or args.steps < 1:
        parser.error("--jobs and --steps must be at least 1")
    report = run(profile=args.profile, jobs=args.jobs, steps=args.steps)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(
        f"{args.jobs} concurrent edits through /edit ({args.profile} model, {args.steps} steps, draft), "
        f"{report['host_cores']} cores"
    )
    for key in ("single", "pool"):
        run_ = report[key]
        print(
            f"  {run_['label']:16s}: {run_['wall_seconds']:.2f} s ({run_['jobs_per_second']:.2f} jobs/s), "
            f"jobs per engine {run_['jobs_per_engine']}, overlap {run_['overlap_seconds']:.2f} s, "
            f"at most {run_['max_concurrent_jobs']} at once"
        )
    print(
        f"  throughput ratio (pool / one engine): {report['throughput_ratio']:.2f}x; identical outputs "
        f"{report['identical_outputs']}/{args.jobs}"
    )
    return 0


__all__ = ["main", "run"]
