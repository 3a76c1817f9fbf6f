"""`python -m hidream_ui bench load [--json] [--profile tiny|bench] [--dtype bf16|fp32]`.

Loads the model through the real loader in a fresh subprocess (so the numbers are not polluted
by this process) and reports the peak host RSS over the bytes of the weight files read. The
upstream demo materialises the 17B transformer in fp32 (about 4x its bf16 bytes); loading
straight into the target dtype keeps the ratio near 1 plus the Python/torch baseline.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import textwrap

from hidream_ui.model.tiny.build import ensure_tiny

_CHILD = textwrap.dedent("""
    import json, sys, time
    import torch, diffusers, transformers  # baseline: imports only
    from hidream_ui.bench.rss import PeakRSS
    rss = PeakRSS(interval=0.01)
    from hidream_ui.config import AppConfig
    from hidream_ui.device.detect import resolve_device, resolve_dtype
    from hidream_ui.model.loading import load_model
    config = AppConfig(tiny_profile=sys.argv[1], dtype=sys.argv[2], device="cpu", refiner=sys.argv[3],
                       variant=sys.argv[4])
    device = resolve_device("cpu"); dtype = resolve_dtype(config.dtype, device)
    t0 = time.perf_counter()
    model = load_model(config, device, dtype)
    seconds = time.perf_counter() - t0
    peak = rss.stop()
    # CPU weights may still be lazily mapped from the safetensors files: read every parameter once so
    # the resident size is the real cost, not the part touched so far.
    with torch.no_grad():
        for c in model.pipeline.components.values():
            if isinstance(c, torch.nn.Module):
                for p in c.parameters():
                    p.float().sum()
    touched = rss.now()
    params = sum(p.numel() * p.element_size() for c in model.pipeline.components.values()
                 if isinstance(c, torch.nn.Module) for p in c.parameters())
    print(json.dumps({"seconds": seconds, "baseline_rss": rss.baseline, "peak_rss": peak,
                      "final_rss": rss.now(), "touched_rss": touched,
                      "weight_file_bytes": model.weight_bytes,
                      "resident_param_bytes": params}))
""")


def measure(profile: str, dtype: str, refiner: str = "e1", variant: str = "e1.1") -> dict:
    ensure_tiny(profile=profile)  # build outside the measured process
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, profile, dtype, refiner, variant], capture_output=True, text=True, check=False
    )
    if out.returncode != 0:
        raise RuntimeError(f"load benchmark child failed:\n{out.stderr[-3000:]}")
    row = json.loads(out.stdout.strip().splitlines()[-1])
    row.update(profile=profile, dtype=dtype, refiner=refiner, variant=variant)
    growth = max(row["peak_rss"], row["touched_rss"]) - row["baseline_rss"]
    row["peak_over_weights"] = round(growth / max(1, row["weight_file_bytes"]), 3)
    row["peak_over_resident_params"] = round(growth / max(1, row["resident_param_bytes"]), 3)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hidream_ui bench load", description=__doc__.splitlines()[0])
    parser.add_argument("--profile", default="bench", choices=("tiny", "bench"))
    parser.add_argument("--dtype", action="append", choices=("bf16", "fp32"), help="repeatable; default: bf16 and fp32")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    rows = [measure(args.profile, dtype) for dtype in (args.dtype or ["bf16", "fp32"])]
    if args.json:
        print(json.dumps({"benchmark": "load", "rows": rows}, indent=2))
        return 0
    print(
        f"{'profile':8s} {'dtype':5s} {'seconds':>8s} {'files read MB':>14s} {'params MB':>10s} "
        f"{'RSS growth MB':>14s} {'/files':>7s} {'/params':>8s}"
    )
    for r in rows:
        growth = max(r["peak_rss"], r["touched_rss"]) - r["baseline_rss"]
        print(
            f"{r['profile']:8s} {r['dtype']:5s} {r['seconds']:8.2f} {r['weight_file_bytes'] / 2**20:14.1f} "
            f"{r['resident_param_bytes'] / 2**20:10.1f} {growth / 2**20:14.1f} {r['peak_over_weights']:7.2f} "
            f"{r['peak_over_resident_params']:8.2f}"
        )
    return 0
