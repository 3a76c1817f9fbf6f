"""`python -m hidream_ui bench memory [--profile tiny|bench|full] [--device ...] [--size 256] [--steps 2]
[--calibrate] [--json]`.

For every memory plan and transformer storage that can run, in a fresh subprocess each (clean
peaks): peak device memory (the allocator's peak on CUDA/NPU; None on CPU, which has no device
allocator), peak host RSS growth, load seconds, seconds per step and per edit (a new instruction,
then the same instruction again: cached embeddings), the max difference of the final latents
against `full` (offload plans must be 0; fp8 reports its own error), and the planner's predicted
device peak beside each measured one. On CPU everything lives in host memory, so the predicted
peak is compared with the measured host growth instead (the planner's calibration check).

Also: the streaming load of the transformer alone in bf16 and fp8 storage (peak and resident RSS
growth), the figure behind "fp8 halves the transformer's resident bytes".
"""

from __future__ import annotations

import argparse
import functools
import json
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

from hidream_ui.bench.attention_measure import PeakMeter
from hidream_ui.config import AppConfig
from hidream_ui.device.detect import resolve_device, resolve_dtype
from hidream_ui.model.layout import PROMPT_TOKENS
from hidream_ui.model.planner import ACTIVATION_PER_PIXEL_CHANNEL, ACTIVATION_PER_TOKEN_UNIT, GUIDANCE_BATCH, plan_for
from hidream_ui.model.plans import PLANS, WEIGHTS
from hidream_ui.model.sources import resolve_sources
from hidream_ui.model.tiny import profiles as tiny_profiles  # attributes looked up per call: tests replace them
from hidream_ui.pipeline.attention.registry import apply

# One (plan, weights) run in a child process. argv: profile device plan weights working_resolution steps latents.
_EDIT_CHILD = textwrap.dedent("""
    import json, sys, time
    import torch, diffusers, transformers  # imports are the baseline
    from hidream_ui.bench.rss import PeakRSS
    from hidream_ui.config import AppConfig
    from hidream_ui.engine.pool import EnginePool
    from hidream_ui.edits import EditRequest, EditParams
    from PIL import Image
    import numpy as np
    rss = PeakRSS()
    profile, device, plan, weights, size, steps, latents_path = sys.argv[1:8]
    config = AppConfig(tiny_profile=profile, device=device, memory=plan, weights=weights, output_dir="/tmp")
    engine = EnginePool.for_config(config)
    t0 = time.perf_counter(); engine.load(); load_s = time.perf_counter() - t0
    load_peak = rss.peak
    pipe = engine.run_exclusive("bench", lambda model: model.pipeline)
    captured = {}
    step = pipe.scheduler.step
    def recording(*a, **k):
        out = step(*a, **k); captured["latents"] = out[0].detach().float().cpu(); return out
    pipe.scheduler.step = recording
    rng = np.random.default_rng(0)
    side = int(size) if size.isdigit() else 512
    image = Image.fromarray(rng.integers(0, 256, (side, side, 3), dtype=np.uint8))
    values = {**EditParams.defaults_for("e1.1").to_dict(), "instruction": "make the sky purple",
              "num_inference_steps": int(steps), "working_resolution": size, "seed": 3}
    runs = []
    for label in ("new_instruction", "cached_instruction"):
        t0 = time.perf_counter()
        result = engine.edit(EditRequest(image=image, params=EditParams.from_dict(values)), save=False)
        runs.append({"label": label, "seconds": time.perf_counter() - t0, "per_step": result.timings.per_step,
                     "text_encode": result.timings.text_encode, "device_peak": result.peak_memory_bytes})
    peak = rss.stop()
    torch.save(captured["latents"], latents_path)
    print(json.dumps({"plan": engine.model_facts().plan.to_dict(), "load_seconds": load_s, "baseline_rss": rss.baseline,
                      "load_peak_rss": load_peak, "peak_rss": peak, "runs": runs,
                      "working_size": list(result.working_size)}))
""")

# The transformer alone, streamed into bf16 or fp8 storage. argv: folder fp8(0/1).
_LOAD_CHILD = textwrap.dedent("""
    import json, sys, time
    import torch, diffusers, accelerate, safetensors
    from pathlib import Path
    from accelerate.utils import set_module_tensor_to_device
    from diffusers import HiDreamImageTransformer2DModel  # imports are the baseline, not the load
    from hidream_ui.bench.rss import PeakRSS
    from hidream_ui.model.fp8 import load_streamed, weight_files
    folder = Path(sys.argv[1]); fp8 = sys.argv[2] == "1"
    config = json.loads((folder / "config.json").read_text())
    rss = PeakRSS(interval=0.002)
    t0 = time.perf_counter()
    model = load_streamed(config, weight_files(folder), torch.bfloat16, fp8=fp8)
    seconds = time.perf_counter() - t0
    peak = rss.stop()
    resident = rss.now()
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    print(json.dumps({"fp8": fp8, "seconds": seconds, "peak_growth": peak - rss.baseline,
                      "resident_growth": resident - rss.baseline, "param_bytes": params}))
""")


def _child(code: str, *args: str) -> dict:
    out = subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"benchmark child failed: {out.stderr.strip().splitlines()[-1:]}\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def transformer_load(folder: Path) -> dict:
    """Streaming load of one transformer folder in bf16 and in fp8 storage, each in a fresh process."""
    bf16 = _child(_LOAD_CHILD, folder, "0")
    fp8 = _child(_LOAD_CHILD, folder, "1")
    return {
        "bf16": bf16,
        "fp8": fp8,
        "resident_ratio": round(fp8["resident_growth"] / max(1, bf16["resident_growth"]), 3),
        "param_ratio": round(fp8["param_bytes"] / max(1, bf16["param_bytes"]), 3),
        "peak_ratio": round(fp8["peak_growth"] / max(1, bf16["peak_growth"]), 3),
    }


def calibrate(sides=(256, 384)) -> dict:
    """Measures the planner's activation constants on CPU (fp32): the bench profile's transformer (the real
    hidden width, heads and MoE shape; 1 double + 1 single block) for one guidance-batch call, and the
    release-size VAE decoding, at each side; each figure divided by the unit the planner multiplies it by."""
    import torch
    from diffusers import AutoencoderKL, HiDreamImageTransformer2DModel

    from hidream_ui.pipeline.edit_pipeline import (
        collapsed_tokens,  # lazy: torch and diffusers, loaded only when this benchmark runs
    )

    meter = PeakMeter("cpu")
    torch.manual_seed(0)
    transformer = HiDreamImageTransformer2DModel(**tiny_profiles.PROFILES["bench"].transformer_config()).eval()
    apply(transformer, "sdpa", "cpu", torch.float32)
    config = transformer.config
    inner = config.num_attention_heads * config.attention_head_dim
    vae = AutoencoderKL.from_config(dict(tiny_profiles.RELEASE_CONFIGS["vae"])).eval()
    channels = tiny_profiles.RELEASE_CONFIGS["vae"]["block_out_channels"][0]
    rows = []
    batch = GUIDANCE_BATCH
    for side in sides:
        latent = torch.randn(batch, config.in_channels, side // 8, 2 * side // 8)
        tokens, mask, sizes, ids = collapsed_tokens(latent, config.patch_size, 2 * transformer.max_seq)
        t5_dim, llama_dim = config.caption_channels
        inputs = dict(
            hidden_states=tokens,
            hidden_states_masks=mask,
            img_sizes=sizes,
            img_ids=ids,
            timesteps=torch.full((batch,), 500.0),
            encoder_hidden_states_t5=torch.randn(batch, PROMPT_TOKENS, t5_dim),
            encoder_hidden_states_llama3=torch.randn(max(config.llama_layers) + 1, batch, PROMPT_TOKENS, llama_dim),
            pooled_embeds=torch.randn(batch, config.text_emb_dim),
            return_dict=False,
        )
        n_tokens = tokens.shape[1] + 2 * PROMPT_TOKENS
        with torch.inference_mode():
            _, peak = meter.measure(functools.partial(transformer, **inputs))
            _, vae_peak = meter.measure(functools.partial(vae.decode, torch.randn(1, 16, side // 8, side // 8)))
        rows.append(
            {
                "side": side,
                "tokens": n_tokens,
                "transformer_peak": peak,
                "per_token_unit": round(peak / (batch * n_tokens * inner * 4), 2),
                "vae_decode_peak": vae_peak,
                "per_pixel_channel": round(vae_peak / (side * side * channels * 4), 2),
            }
        )
    return {
        "method": meter.method,
        "rows": rows,
        "planner_per_token_unit": ACTIVATION_PER_TOKEN_UNIT,
        "planner_per_pixel_channel": ACTIVATION_PER_PIXEL_CHANNEL,
    }


def run(
    profile: str,
    device: str,
    size: str,
    steps: int,
    combos: list[tuple[str, str]],
    *,
    transformer_load_too: bool = True,
) -> dict:
    import torch

    config = AppConfig(tiny_profile=profile, device=device)
    sources = resolve_sources(config)  # builds the tiny checkpoint outside the measured processes
    dev = resolve_device(device)
    dtype = resolve_dtype("auto", dev)
    rows, reference = [], None
    with tempfile.TemporaryDirectory() as tmp:
        for plan, weights in combos:
            notes = plan_for(config.replace(memory=plan, weights=weights), dev, dtype)
            note = next(r.note for r in notes.rows if r.plan == plan and r.weights == weights)
            row = {"plan": plan, "weights": weights}
            if note:
                rows.append({**row, "skipped": note})
                continue
            latents_path = Path(tmp) / f"{plan}-{weights}.pt"
            try:
                measured = _child(_EDIT_CHILD, profile, device, plan, weights, size, steps, latents_path)
            except RuntimeError as exc:
                rows.append({**row, "error": str(exc).splitlines()[0]})
                continue
            working = tuple(measured["working_size"])
            planned = plan_for(config.replace(memory=plan, weights=weights), dev, dtype, working_size=working)
            predicted = next(r for r in planned.rows if r.plan == plan and r.weights == weights)
            row.update(predicted_peak=predicted.peak, predicted_host=predicted.host, predicted_phases=predicted.phases)
            latents = torch.load(latents_path)
            if reference is None and plan == "full" and weights == "bf16":
                reference = latents
            runs = {r["label"]: r for r in measured["runs"]}
            host_growth = measured["peak_rss"] - measured["baseline_rss"]
            device_peak = runs["new_instruction"]["device_peak"]
            row.update(
                load_seconds=round(measured["load_seconds"], 3),
                seconds_new_instruction=round(runs["new_instruction"]["seconds"], 3),
                seconds_cached_instruction=round(runs["cached_instruction"]["seconds"], 3),
                seconds_per_step=runs["cached_instruction"]["per_step"],
                device_peak=device_peak,
                host_peak_growth=host_growth,
                # On CPU the "device" is the host: compare the prediction with the host growth.
                predicted_over_measured=round(predicted.peak / max(1, device_peak if device_peak else host_growth), 3),
                max_abs_diff_vs_full=None if reference is None else (latents - reference).abs().max().item(),
                working_size=list(working),
            )
            rows.append(row)
        load = transformer_load(Path(sources.e1) / "transformer") if transformer_load_too else None
    return {
        "benchmark": "memory",
        "profile": profile,
        "device": dev.torch_device,
        "dtype": str(dtype),
        "size": size,
        "steps": steps,
        "rows": rows,
        "transformer_load": load,
        "note": "CPU: no device allocator; predicted_over_measured compares with the host RSS growth"
        if dev.type == "cpu"
        else "device peaks from the allocator",
    }


def format_table(report: dict) -> str:
    gb = 1e9
    lines = [
        f"bench memory · profile {report['profile']} · {report['device']} {report['dtype']} · "
        f"working resolution {report['size']}, {report['steps']} steps",
        f"{'plan':17s} {'weights':7s} {'predicted':>10s} {'device pk':>10s} {'host grow':>10s} {'s/step':>7s} "
        f"{'s new':>7s} {'s cached':>8s} {'diff vs full':>12s}",
    ]
    for r in report["rows"]:
        if "skipped" in r or "error" in r:
            lines.append(f"{r['plan']:17s} {r['weights']:7s} {r.get('skipped') or r.get('error')}")
            continue
        device = "—" if r["device_peak"] is None else f"{r['device_peak'] / gb:.2f}G"
        lines.append(
            f"{r['plan']:17s} {r['weights']:7s} {r['predicted_peak'] / gb:9.2f}G {device:>10s} "
            f"{r['host_peak_growth'] / gb:9.2f}G {r['seconds_per_step']:7.2f} "
            f"{r['seconds_new_instruction']:7.2f} {r['seconds_cached_instruction']:8.2f} "
            f"{r['max_abs_diff_vs_full']:12.3g}"
        )
    for c in report.get("calibration", {}).get("rows", []):
        lines.append(
            f"calibration {c['side']}px: transformer {c['per_token_unit']} per token unit (planner "
            f"{report['calibration']['planner_per_token_unit']}), VAE {c['per_pixel_channel']} per pixel "
            f"channel (planner {report['calibration']['planner_per_pixel_channel']})"
        )
    load = report["transformer_load"]
    if load is None:
        return "\n".join(lines)
    lines.append(
        f"transformer load: bf16 resident {load['bf16']['resident_growth'] / 2**20:.0f} MiB, fp8 "
        f"{load['fp8']['resident_growth'] / 2**20:.0f} MiB (x{load['resident_ratio']}); peak growth x"
        f"{load['peak_ratio']}"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hidream_ui bench memory", description=__doc__.splitlines()[0])
    parser.add_argument("--profile", default="bench", choices=("tiny", "bench", "full"))
    parser.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N | npu | npu:N (default cpu)")
    parser.add_argument(
        "--size", default=None, help="working resolution: auto | draft | a side in pixels (default 256; tiny: auto)"
    )
    parser.add_argument("--steps", type=int, default=2, help="denoising steps per edit (default 2)")
    parser.add_argument(
        "--calibrate",
        action="store_true",
        help="also measure the planner's activation constants on CPU (bench geometry; minutes)",
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    size = args.size or ("auto" if args.profile == "tiny" else "256")
    if not (size in ("auto", "draft") or (size.isdigit() and int(size) >= 256 and int(size) % 16 == 0)):
        parser.error(f"--size {size!r} must be auto, draft or a multiple of 16 from 256 up")
    if args.steps < 1:
        parser.error(f"--steps {args.steps} must be at least 1")
    combos = [(plan, weights) for weights in WEIGHTS for plan in PLANS]
    try:
        report = run(args.profile, args.device, size, args.steps, combos)
        if args.calibrate:
            report["calibration"] = calibrate()
    except (RuntimeError, ValueError) as exc:
        print(f"bench memory: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(report, indent=2) if args.json else format_table(report))
    return 0
