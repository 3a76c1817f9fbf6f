"""`python -m hidream_ui bench soak [--json] [--edits N] [--sample-at K] [--every M] [--retention R] ...`.

A soak of the running app: launches it in this process (`cli.app.launch`, tiny model, CPU, a
free 127.0.0.1 port and a temporary --output-dir) and sends N
edits (default 200) one after another through its public API with `gradio_client`
(`/edit`, the bundled `assets/apple.png` uploaded with `handle_file`, 2 steps at the draft size).

Sampled at edit K (default 20, after the warm-up: model load, first allocations) and at the end,
and every M edits in between (a small series):
* RSS of the server process -- this process, since the app runs in it -- and its growth K -> end;
* files in the app's gradio cache folder that count against --cache-max-files (a folder of this
  process alone, see `gradio_internals.private_cache_folder`; the examples' copies do not count);
* files (and result PNGs) in --output-dir.
Before every sample the app's cache janitor is run once (it otherwise runs every 5 s, so a sample
would depend on timing) and the garbage collector too: both are said so in the report.
Also: failed edits (and the first error), seconds in all and per edit.

The targets (RSS growth <= 3 %, file counts flat from edit K to the end, no failures) are printed
beside the figures, not enforced, and nothing here is tuned to them. Note that a file count can
only be flat from edit K on when its limit is reached by then: with --retention above K the
output folder still fills up after edit K (see `plateau_from_edit` in the series).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from hidream_ui.bench import free_port
from hidream_ui.cli.app import launch
from hidream_ui.config import AppConfig
from hidream_ui.engine.pool import EnginePool
from hidream_ui.server import gradio_internals

TARGET_RSS_GROWTH_PERCENT = 3.0
INSTRUCTION = "Replace the red apple with a green pear"
FAST = {"num_inference_steps": 2, "working_resolution": "draft"}
_MB = 1024 * 1024


def _rss_mb() -> float:
    import psutil

    return psutil.Process().memory_info().rss / _MB


def _files_under(folder: Path) -> list[Path]:
    if not folder.is_dir():
        return []
    return [p for p in folder.rglob("*") if p.is_file()]


def _sample(edit: int, demo, output_dir: Path) -> dict:
    janitor = getattr(getattr(demo, "hidream_services", None), "janitor", None)
    pruned = janitor.run_once() if janitor is not None else None
    gc.collect()
    outputs = _files_under(output_dir)
    return {
        "edit": edit,
        "rss_mb": round(_rss_mb(), 1),
        "cache_files": len(gradio_internals.app_cache_files(demo, demo.hidream_services.cache_folder)),
        "output_files": len(outputs),
        "output_pngs": sum(1 for p in outputs if p.suffix.lower() == ".png"),
        "janitor_removed": pruned,
    }


def _plateau_from(series: list[dict], key: str) -> int | None:
    """The first sampled edit from which `key` never changed again (None with fewer than 2 samples)."""
    if len(series) < 2:
        return None
    last = series[-1][key]
    start = series[-1]["edit"]
    for sample in reversed(series):
        if sample[key] != last:
            break
        start = sample["edit"]
    return start


def _growth(before: float, after: float) -> float | None:
    return round((after - before) / before * 100.0, 2) if before else None


def run(
    edits: int = 200,
    sample_at: int = 20,
    every: int = 20,
    retention: int = 50,
    cache_max_files: int = 200,
    max_queue: int = 16,
    image: str | os.PathLike | None = None,
    seed: int = 0,
) -> dict:
    """Runs the soak and returns the report (a JSON-able dict). Nothing is left behind."""
    if edits < 1 or sample_at < 1 or every < 1:
        raise ValueError("edits, sample_at and every must be at least 1")
    sample_at = min(sample_at, edits)
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

    from gradio_client import Client, handle_file

    from hidream_ui.ui.layout import ASSETS_DIR  # lazy: gradio (the bench harness itself never needs it)

    picture = Path(image) if image is not None else ASSETS_DIR / "apple.png"
    tmp = Path(tempfile.mkdtemp(prefix="hidream-bench-soak-"))
    output_dir, downloads = tmp / "outputs", tmp / "client_downloads"
    downloads.mkdir()
    config = AppConfig(
        device="cpu",
        output_dir=output_dir,
        port=free_port(),
        retention=retention,
        cache_max_files=cache_max_files,
        max_queue=max_queue,
    )
    demo = client = None
    report: dict = {
        "benchmark": "soak",
        "model": "tiny",
        "device": "cpu",
        "edits": edits,
        "settings_per_edit": {**FAST, "api_name": "/edit", "image": picture.name, "instruction": INSTRUCTION},
        "retention": retention,
        "cache_max_files": cache_max_files,
        "sample_at_edit": sample_at,
        "sample_every": every,
        "cpu_count": os.cpu_count(),
    }
    try:
        t_launch = time.perf_counter()
        demo, url = launch(
            config, engine=EnginePool.for_config(config, hide_paths=True), prevent_thread_lock=True, quiet=True
        )
        report["launch_seconds"] = round(time.perf_counter() - t_launch, 3)
        report["janitor_forced_before_sample"] = getattr(demo.hidream_services, "janitor", None) is not None
        report["gc_collect_before_sample"] = True
        client = Client(url, verbose=False, download_files=str(downloads), analytics_enabled=False)

        series: list[dict] = []
        edit_seconds: list[float] = []
        failures, first_error, first_error_edit = 0, None, None
        t0 = time.perf_counter()
        for index in range(1, edits + 1):
            started = time.perf_counter()
            try:
                client.predict(
                    image=handle_file(str(picture)),
                    instruction=INSTRUCTION,
                    seed=seed + index,
                    randomize_seed=False,
                    **FAST,
                    api_name="/edit",
                )
            except Exception as exc:  # noqa: BLE001 - a failed edit is a figure, not the end of the soak
                failures += 1
                if first_error is None:
                    first_error, first_error_edit = f"{type(exc).__name__}: {exc}", index
            edit_seconds.append(time.perf_counter() - started)
            if index == sample_at or index == edits or index % every == 0:
                series.append(_sample(index, demo, output_dir))
        total = time.perf_counter() - t0
    finally:
        if client is not None:
            client.close()
        if demo is not None:
            with contextlib.redirect_stdout(sys.stderr):  # gradio prints "Closing server...": keep --json clean
                demo.close()
        shutil.rmtree(tmp, ignore_errors=True)

    warm = next(s for s in series if s["edit"] == sample_at)
    end = series[-1]
    growth = _growth(warm["rss_mb"], end["rss_mb"])

    def counts(key: str) -> dict:
        return {
            f"at_edit_{sample_at}": warm[key],
            "end": end[key],
            "flat_after_warmup": warm[key] == end[key],
            "plateau_from_edit": _plateau_from(series, key),
        }

    report.update(
        {
            "rss_mb": {
                f"at_edit_{sample_at}": warm["rss_mb"],
                "end": end["rss_mb"],
                "growth_percent": growth,
                "target_growth_percent_max": TARGET_RSS_GROWTH_PERCENT,
                "within_target": growth is not None and growth <= TARGET_RSS_GROWTH_PERCENT,
            },
            "cache_files": {
                **counts("cache_files"),
                "limit": cache_max_files,
                "target": "flat after warm-up",
                "within_target": warm["cache_files"] == end["cache_files"],
            },
            "output_files": {
                **counts("output_files"),
                "target": "flat after warm-up",
                "within_target": warm["output_files"] == end["output_files"],
            },
            "output_pngs": {**counts("output_pngs"), "limit": retention},
            "failures": {
                "count": failures,
                "first_error": first_error,
                "first_error_edit": first_error_edit,
                "target": 0,
                "within_target": failures == 0,
            },
            "seconds_total": round(total, 3),
            "seconds_per_edit": round(sum(edit_seconds) / len(edit_seconds), 4),
            "seconds_first_edit": round(edit_seconds[0], 3),
            "seconds_per_edit_after_first": (
                round(sum(edit_seconds[1:]) / (len(edit_seconds) - 1), 4) if len(edit_seconds) > 1 else None
            ),
            "series": series,
            "targets": {
                "rss_growth_percent_max": TARGET_RSS_GROWTH_PERCENT,
                "file_counts": f"flat from edit {sample_at} to the end",
                "failures": 0,
                "enforced": False,
            },
        }
    )
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m hidream_ui bench soak",
        description="N edits through the running app (tiny model, in this process): RSS growth, files kept "
        "in gradio's cache and in --output-dir, failures, seconds per edit.",
    )
    parser.add_argument("--edits", type=int, default=200, help="edits to send (default 200)")
    parser.add_argument(
        "--sample-at", type=int, default=20, help="edit after which to take the warm sample (default 20)"
    )
    parser.add_argument("--every", type=int, default=20, help="also sample every this many edits (default 20)")
    parser.add_argument(
        "--retention",
        type=int,
        default=50,
        help="the app's --retention: result PNGs kept in the output folder (default 50)",
    )
    parser.add_argument(
        "--cache-max-files",
        type=int,
        default=200,
        help="the app's --cache-max-files: files kept in gradio's cache (default 200)",
    )
    parser.add_argument("--max-queue", type=int, default=16, help="the app's --max-queue (default 16)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    if args.edits < 1 or args.sample_at < 1 or args.every < 1:
        parser.error("--edits, --sample-at and --every must be at least 1")
    if args.retention < 1 or args.cache_max_files < 1 or args.max_queue < 1:
        parser.error("--retention, --cache-max-files and --max-queue must be at least 1")
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    report = run(
        edits=args.edits,
        sample_at=args.sample_at,
        every=args.every,
        retention=args.retention,
        cache_max_files=args.cache_max_files,
        max_queue=args.max_queue,
    )
    failed = report["failures"]["count"]
    if args.json:
        print(json.dumps(report, indent=2))
        return 1 if failed else 0
    k = report["sample_at_edit"]
    rss = report["rss_mb"]
    print(
        f"{report['edits']} edits through /edit (tiny model, 2 steps, draft): {report['seconds_total']:.1f} s, "
        f"{report['seconds_per_edit']:.3f} s per edit (first {report['seconds_first_edit']:.2f} s)"
    )
    print(
        f"  {'RSS':13s}: {rss[f'at_edit_{k}']:.1f} MB at edit {k} -> {rss['end']:.1f} MB at the end "
        f"({rss['growth_percent']:+.2f} %; target <= {TARGET_RSS_GROWTH_PERCENT:.0f} %)"
    )
    for key, label in (
        ("cache_files", "gradio cache"),
        ("output_files", "output files"),
        ("output_pngs", "output PNGs"),
    ):
        c = report[key]
        print(
            f"  {label:13s}: {c[f'at_edit_{k}']} at edit {k} -> {c['end']} at the end "
            f"(flat from edit {c['plateau_from_edit']}; target: flat from edit {k})"
        )
    f = report["failures"]
    print(
        f"  {'failures':13s}: {f['count']}"
        + (f" (first, edit {f['first_error_edit']}: {f['first_error']})" if f["count"] else "")
    )
    print("  (the cache janitor and the garbage collector run before every sample)")
    return 1 if failed else 0


__all__ = ["main", "run", "TARGET_RSS_GROWTH_PERCENT"]
