"""`python -m hidream_ui bench <load|edit|attention|batch|app|soak|pool|memory|speed|abuse|quality|cluster|preview>
[--json]`.

Benchmarks print numbers measured side by side in one run (and ratios between them); they are
not tests and assert nothing. Each kind lives in its own module, imported only when asked for.
"""

from __future__ import annotations

import sys

from hidream_ui.cli.commands import dispatch

KINDS = {
    "load": ("hidream_ui.bench.load", "peak host RAM over weight bytes while loading (bench profile)"),
    "edit": ("hidream_ui.bench.edit", "padded vs collapsed forward, weight copies per edit, text-encoder calls"),
    "attention": ("hidream_ui.bench.attention", "every attention strategy: time, peak memory, error"),
    "batch": ("hidream_ui.bench.batch", "run_batch vs a loop of single edits"),
    "app": ("hidream_ui.bench.app", "cold start of `python app.py` to serving"),
    "soak": ("hidream_ui.bench.soak", "N edits through the running app: RSS growth, cached/output files, failures"),
    "pool": ("hidream_ui.bench.pool", "N concurrent edits through the app: --device cpu vs --devices cpu,cpu"),
    "memory": ("hidream_ui.bench.memory", "every memory plan and storage: peaks, speed, error vs full, prediction"),
    "speed": ("hidream_ui.bench.speed", "sync-free MoE, --compile blocks, step caching: time, syncs, deviation"),
    "abuse": ("hidream_ui.bench.abuse", "issue 19's attacks on a local app: RSS, cache, /status, honest client"),
    "quality": (
        "hidream_ui.bench.quality",
        "held-out synthetic edits under every speed/memory/attention mode: success, PSNR, speedup",
    ),
    "cluster": (
        "hidream_ui.bench.cluster",
        "Ray Serve replicas vs the local pool: per-job overhead, 1 vs 2 replicas, replacing a killed one",
    ),
    "preview": ("hidream_ui.bench.preview", "a live preview's cost next to a denoising step (fit, per preview)"),
}


def free_port() -> int:
    """A free TCP port on the loopback interface (for apps the benchmarks and tests launch)."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def set_threads(parser, threads: int | None) -> None:
    """A benchmark's `--threads N`: torch's intra-op threads (None: torch's default); N < 1 is a usage error."""
    if threads is None:
        return
    if threads < 1:
        parser.error(f"--threads must be at least 1 (got {threads})")
    import torch

    torch.set_num_threads(threads)


def main(argv: list[str] | None = None) -> int:
    return dispatch(
        KINDS,
        sys.argv[1:] if argv is None else argv,
        prog="python -m hidream_ui bench",
        description="Benchmarks: figures measured side by side in one run (add --json for JSON).",
        what="benchmark",
    )
