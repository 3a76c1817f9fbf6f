"""`python -m hidream_ui bench cluster [--ray local|ADDRESS] [--ray-token-file PATH] [--jobs 8] [--repeats 10]
[--steps 2] [--json]`.

The Ray path next to the local pool, on the same tiny edit (offline tiny model, the bundled
apple, `--steps` steps at the draft size, CPU), measured in one run:

* per-job overhead: the median wall time of `--repeats` edits one after another through the local
  pool and through a one-replica `RayEngine` (both loaded and warmed first, interleaved, one torch
  thread each as a CPU replica has), and the difference in ms;
* throughput: `--jobs` edits submitted at once to one replica and to two replicas (jobs per second);
* replacement: one replica of the two killed (`ray.kill` of its actor) -> seconds until Ray Serve has
  a new replica reporting with its model loaded, and until the next job succeeded.

`--ray local` (the default) starts a cluster of this process's own, bound to 127.0.0.1, and stops
it at the end; an address uses that cluster (its replicas are deleted at the end), a head from
`ray start` with token authentication too (`--ray-token-file`, or Ray's own places: docs/cluster.md). On a machine
with few cores two CPU replicas share them: expect little gain there; the gain belongs to
several cards or nodes. Nothing here is tuned to a target.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

from hidream_ui.config_table import add_ray_token_argument

INSTRUCTION = "Replace the red apple with a green pear"


def _request(seed: int, steps: int):
    from hidream_ui.edits import EditParams, EditRequest
    from hidream_ui.imaging import open_image
    from hidream_ui.ui.layout import ASSETS_DIR

    values = {
        **EditParams.defaults_for("e1.1").to_dict(),
        "instruction": INSTRUCTION,
        "seed": seed,
        "num_inference_steps": steps,
        "working_resolution": "draft",
    }
    return EditRequest(
        image=open_image(ASSETS_DIR / "apple.png"), params=EditParams.from_dict(values), source_name="apple.png"
    )


def _sequential_ms(engine, repeats: int, steps: int) -> list[float]:
    times = []
    for seed in range(repeats):
        start = time.perf_counter()
        engine.edit(_request(seed, steps), save=False)
        times.append((time.perf_counter() - start) * 1000)
    return times


def _throughput(engine, jobs: int, steps: int) -> dict:
    errors: list[str] = []
    labels: list[str] = []

    def run(seed: int) -> None:
        try:
            labels.append(engine.edit(_request(seed, steps), save=False).info.engine or "local")
        except Exception as exc:  # noqa: BLE001 - counted in the report
            errors.append(f"{type(exc).__name__}: {exc}")

    start = time.perf_counter()
    threads = [threading.Thread(target=run, args=(seed,)) for seed in range(jobs)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - start
    return {
        "jobs": jobs,
        "wall_seconds": round(wall, 3),
        "jobs_per_second": round(jobs / wall, 3),
        "jobs_per_replica": {label: labels.count(label) for label in sorted(set(labels))},
        "errors": errors,
    }


def _replace_seconds(engine, steps: int, timeout: float = 300.0) -> dict:
    """Kills one replica's actor; times until a new one reports loaded, and the next job's success."""
    import ray

    before = {row.engine for row in engine.device_rows()}
    victim = sorted(before)[0]
    tag = victim.removeprefix("ray:")
    name = next(
        actor["name"] for actor in ray.util.list_named_actors(all_namespaces=True) if actor["name"].endswith(f"#{tag}")
    )
    killed = time.perf_counter()
    ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
    next_job = None
    try:
        engine.edit(_request(99, steps), save=False)
        next_job = round(time.perf_counter() - killed, 3)
    except Exception as exc:  # noqa: BLE001 - reported
        next_job = f"failed: {exc}"
    replaced = None
    while time.perf_counter() - killed < timeout:
        rows = [row for row in engine.device_rows(fresh=True) if row.state != "unreachable" and row.loaded]
        if any(row.engine not in before for row in rows):
            replaced = round(time.perf_counter() - killed, 3)
            break
        time.sleep(0.1)
    return {"killed": victim, "new_replica_loaded_seconds": replaced, "next_job_ok_seconds": next_job}


def run(
    address: str = "local", jobs: int = 8, repeats: int = 10, steps: int = 2, token_file: Path | None = None
) -> dict:
    from hidream_ui.engine.ray_env import connect, disconnect
    from hidream_ui.engine.ray_serve import RayEngine

    owned = connect(address, token_file=token_file)  # before the engines: they reuse this connection
    import ray

    from hidream_ui.config import AppConfig
    from hidream_ui.engine.pool import EnginePool, host_cores

    out = Path(tempfile.mkdtemp(prefix="hidream-bench-cluster-"))
    config = AppConfig(device="cpu", output_dir=out, ray_token_file=token_file)
    report: dict = {
        "address": address,
        "host_cores": host_cores(),
        "steps": steps,
        "repeats": repeats,
        "cluster_cpus": ray.cluster_resources().get("CPU"),
    }
    try:
        import torch

        # A CPU replica computes with one thread (Ray sets OMP_NUM_THREADS to its one CPU): the local
        # pool does too here, so the difference is the Ray path's, not a thread count's.
        torch.set_num_threads(1)
        local = EnginePool.for_config(config)
        local.edit(_request(0, steps), save=False)  # load + warm up
        one = RayEngine(config, address, replicas=1)
        started = time.perf_counter()
        one.load()
        report["deploy_one_replica_seconds"] = round(time.perf_counter() - started, 3)
        one.edit(_request(0, steps), save=False)  # warm up
        local_ms, ray_ms = [], []
        for _ in range(repeats):  # interleaved: a busy moment of the host hits both alike
            local_ms += _sequential_ms(local, 1, steps)
            ray_ms += _sequential_ms(one, 1, steps)
        report["per_job_ms"] = {
            "local_pool": round(statistics.median(local_ms), 2),
            "ray_one_replica": round(statistics.median(ray_ms), 2),
            "overhead": round(statistics.median(ray_ms) - statistics.median(local_ms), 2),
            "statistic": "median",
            "torch_threads": 1,
            "local_samples": [round(t, 2) for t in local_ms],
            "ray_samples": [round(t, 2) for t in ray_ms],
        }
        report["throughput_one_replica"] = _throughput(one, jobs, steps)
        one.shutdown()
        two = RayEngine(config, address, replicas=2)
        started = time.perf_counter()
        two.load()
        report["deploy_two_replicas_seconds"] = round(time.perf_counter() - started, 3)
        _throughput(two, 2, steps)  # warm up both
        report["throughput_two_replicas"] = _throughput(two, jobs, steps)
        report["throughput_ratio"] = round(
            report["throughput_two_replicas"]["jobs_per_second"] / report["throughput_one_replica"]["jobs_per_second"],
            3,
        )
        report["replace_killed_replica"] = _replace_seconds(two, steps)
        two.shutdown()
    finally:
        if owned:
            disconnect(serve_too=address == "local")  # Serve of a shared cluster stays
    return report


def format_text(report: dict, jobs: int) -> str:
    """The report in three lines: per-job overhead, throughput, replacing a killed replica."""
    per_job, replaced = report["per_job_ms"], report["replace_killed_replica"]
    return "\n".join(
        [
            f"per job ({report['steps']} steps, draft, tiny): local pool {per_job['local_pool']} ms, Ray replica "
            f"{per_job['ray_one_replica']} ms, overhead {per_job['overhead']} ms",
            f"throughput ({jobs} jobs): 1 replica {report['throughput_one_replica']['jobs_per_second']} jobs/s, "
            f"2 replicas {report['throughput_two_replicas']['jobs_per_second']} jobs/s "
            f"({report['throughput_ratio']}x; {report['host_cores']} host cores)",
            f"killed replica replaced (loaded) after {replaced['new_replica_loaded_seconds']} s; next job ok after "
            f"{replaced['next_job_ok_seconds']} s",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m hidream_ui bench cluster",
        description="Ray Serve replicas vs the local pool: per-job overhead, throughput "
        "with 1 and 2 replicas, time to replace a killed replica.",
    )
    parser.add_argument(
        "--ray",
        default="local",
        metavar="ADDRESS",
        help="cluster address (default local: one of this process's own on 127.0.0.1)",
    )
    add_ray_token_argument(parser)
    parser.add_argument("--jobs", type=int, default=8, help="concurrent edits for the throughput runs (default 8)")
    parser.add_argument("--repeats", type=int, default=10, help="sequential edits for the overhead (default 10)")
    parser.add_argument("--steps", type=int, default=2, help="steps per edit (default 2)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    if min(args.jobs, args.repeats, args.steps) < 1:
        parser.error("--jobs, --repeats and --steps must be at least 1")
    from hidream_ui.config import ConfigError, from_namespace
    from hidream_ui.engine.ray_env import RayUnavailable, check_cluster, require_ray

    try:
        # The token file from the flag or HIDREAM_RAY_TOKEN_FILE, read as the app reads it.
        token_file = from_namespace(argparse.Namespace(ray_token_file=args.ray_token_file)).ray_token_file
        require_ray(args.ray, token_file)
        check_cluster(args.ray, token_file)  # a refusing head: one line, before anything starts
        # Ray's driver prints its cluster's log lines on stdout: stdout is for the report alone.
        with contextlib.redirect_stdout(sys.stderr):
            report = run(args.ray, args.jobs, args.repeats, args.steps, token_file)
    except (RayUnavailable, ConfigError) as exc:
        print(f"error: {exc}")
        return 1
    print(json.dumps(report, indent=2) if args.json else format_text(report, args.jobs))
    return 0


__all__ = ["format_text", "main", "run"]
