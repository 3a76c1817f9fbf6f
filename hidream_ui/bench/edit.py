"""`python -m hidream_ui bench edit [--json] [--profile tiny|bench] [--size 512] [--edits N]`.

Three measurements, side by side in one run:
1. padded vs collapsed transformer forward at one edit size (time and max difference);
2. weight copies per edit: upstream's demo (`load_state_dict` of a weight set at the start of
   every edit and at the refine switch) vs this engine's stage handling;
3. text-encoder calls for N edits with one instruction (the prompt cache).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from hidream_ui.config import AppConfig
from hidream_ui.device.detect import resolve_device, resolve_dtype
from hidream_ui.engine.pool import EnginePool
from hidream_ui.model import loading  # loading.load_model looked up per call: tests replace it
from hidream_ui.pipeline.attention.registry import apply


def _forward_comparison(model, size: int, batch: int, repeats: int) -> dict:
    import torch

    pipe = model.pipeline
    vae_scale = pipe.vae_scale_factor
    side = size // vae_scale
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(batch, pipe.transformer.config.in_channels, side, 2 * side, generator=gen).to(
        model.device.torch_device, model.dtype
    )
    text = pipe.encode_text("make the sky purple")
    from hidream_ui.pipeline.edit_pipeline import (
        PromptEmbeds,  # lazy: torch and diffusers, loaded only when this benchmark runs
    )

    text = PromptEmbeds.cat([text] * batch)
    timestep = torch.full((batch,), 500.0, device=model.device.torch_device)
    results = {}
    pipe.predict(hidden, timestep, text, collapse_padding=True)  # warm-up (allocator, kernels), not timed
    for label, collapse in (("collapsed", True), ("padded", False)):
        times = []
        out = None
        for _ in range(repeats):
            t0 = time.perf_counter()
            out = pipe.predict(hidden, timestep, text, collapse_padding=collapse)
            times.append(time.perf_counter() - t0)
        results[label] = {"seconds": statistics.median(times), "runs": [round(t, 3) for t in times], "out": out}
    diff = (results["collapsed"]["out"].float() - results["padded"]["out"].float()).abs().max().item()
    scale = results["padded"]["out"].float().abs().max().item()
    patch = pipe.transformer.config.patch_size
    tokens = (side // patch) * (2 * side // patch)
    return {
        "edit_size": f"{size}x{size}",
        "batch": batch,
        "image_tokens": tokens,
        "max_seq": pipe.transformer.max_seq,
        "padded_tokens": pipe.transformer.max_seq,
        "collapsed_tokens": tokens + (1 if tokens < pipe.transformer.max_seq else 0),
        "padded_seconds": round(results["padded"]["seconds"], 4),
        "collapsed_seconds": round(results["collapsed"]["seconds"], 4),
        "speedup": round(results["padded"]["seconds"] / results["collapsed"]["seconds"], 2),
        "max_abs_diff": diff,
        "max_abs_output": scale,
    }


def _weight_copies(model) -> dict:
    """Runs the stage switches of one edit both ways and counts what is copied."""
    import torch

    transformer = model.pipeline.transformer
    # Upstream-style: the demo snapshots transformer.state_dict() (which aliases the parameters) before
    # loading the E1.1 weights, so both "sets" end up holding the E1.1 values; then `pipe.to(device)`
    # moves the parameters away, leaving the sets as separate host copies of the same values. We model
    # that state with owned clones and `load_state_dict` them at the edit start and at the refine switch.
    live = transformer.state_dict()
    aliased = all(live[k].data_ptr() == p.data_ptr() for k, p in transformer.named_parameters() if k in live)
    sets = {"edit": {k: v.detach().clone() for k, v in live.items()}}
    sets["refine"] = sets["edit"]
    copied = {"tensors": 0, "bytes": 0}
    t0 = time.perf_counter()
    for stage in ("edit", "refine"):
        state = sets[stage]
        transformer.load_state_dict(state, strict=False)
        copied["tensors"] += len(state)
        copied["bytes"] += sum(t.numel() * t.element_size() for t in state.values())
    upstream_seconds = time.perf_counter() - t0
    changed = any(not torch.equal(sets["edit"][k], v) for k, v in transformer.state_dict().items())
    del sets
    swaps_before = model.swap.swaps if model.swap else 0
    copied_before = model.swap.bytes_copied if model.swap else 0
    t0 = time.perf_counter()
    for stage in ("edit", "refine", "edit"):
        model.use_stage_weights(stage)
    ours_seconds = time.perf_counter() - t0
    return {
        "upstream_style": {
            "tensors_copied": copied["tensors"],
            "bytes_copied": copied["bytes"],
            "seconds": round(upstream_seconds, 4),
            "state_dict_aliases_parameters": aliased,
            "weights_changed_by_the_copies": changed,
        },
        "ours": {
            "refiner": model.refiner,
            "bytes_copied": (model.swap.bytes_copied if model.swap else 0) - copied_before,
            "swaps": (model.swap.swaps if model.swap else 0) - swaps_before,
            "swap_on_device": model.swap.on_device if model.swap else None,
            "seconds": round(ours_seconds, 6),
        },
    }


def _text_encoder_calls(config, edits: int) -> dict:
    from PIL import Image

    from hidream_ui.edits import EditParams, EditRequest

    engine = EnginePool.for_config(config)
    image = Image.new("RGB", (64, 48), (120, 80, 200))
    params = EditParams.defaults_for(config.variant, "make it brighter")
    params = EditParams.from_dict({**params.to_dict(), "num_inference_steps": 2, "working_resolution": "draft"})
    t0 = time.perf_counter()
    for seed in range(edits):
        engine.edit(
            EditRequest(image=image, params=EditParams.from_dict({**params.to_dict(), "seed": seed})), save=False
        )
    texts = [params.instruction, params.negative_prompt, params.target_prompt()]
    # Upstream encodes every text of every call again; we encode each unique text once.
    return {
        "edits": edits,
        "texts_per_edit": len(texts),
        "unique_texts": len(set(texts)),
        "text_encoder_calls": engine.counters["text_encoder_calls"],
        "upstream_text_encoder_calls": edits * len(texts),
        "seconds": round(time.perf_counter() - t0, 3),
    }


def run(
    profile: str = "tiny",
    size: int | None = None,
    batch: int = 1,
    repeats: int = 1,
    edits: int = 4,
    dtype: str = "fp32",
) -> dict:
    import tempfile
    from pathlib import Path

    config = AppConfig(
        tiny_profile=profile, device="cpu", dtype=dtype, output_dir=Path(tempfile.mkdtemp(prefix="hidream-bench-"))
    )
    device = resolve_device("cpu")
    model = loading.load_model(config, device, resolve_dtype(dtype, device))
    apply(model.pipeline.transformer, "sdpa", device, model.dtype)
    size = size or model.geometry.image_size // 2
    report = {
        "benchmark": "edit",
        "profile": profile,
        "dtype": dtype,
        "device": device.torch_device,
        "forward": _forward_comparison(model, size, batch, repeats),
        "weight_copies_per_edit": _weight_copies(model),
    }
    del model
    # Counting calls needs no big model: the tiny profile runs the same engine and cache.
    report["text_encoders"] = _text_encoder_calls(config.replace(tiny_profile="tiny"), edits)
    return report


def format_text(report: dict) -> str:
    """The report in three lines: the forward, the weight copies, the text-encoder calls."""
    f, w, t = report["forward"], report["weight_copies_per_edit"], report["text_encoders"]
    return "\n".join(
        [
            f"forward {f['edit_size']} edit, batch {f['batch']}: padded {f['padded_seconds']:.3f} s "
            f"({f['padded_tokens']} tokens) vs collapsed {f['collapsed_seconds']:.3f} s ({f['collapsed_tokens']} "
            f"tokens) = {f['speedup']}x, max |diff| {f['max_abs_diff']:.3g} (outputs up to {f['max_abs_output']:.3g})",
            f"weight copies per edit: upstream-style {w['upstream_style']['bytes_copied'] / 2**20:.1f} MiB "
            f"({w['upstream_style']['seconds']:.3f} s, changed nothing: "
            f"{not w['upstream_style']['weights_changed_by_the_copies']}) vs ours {w['ours']['bytes_copied']} bytes",
            f"text encoders: {t['text_encoder_calls']} calls for {t['edits']} edits with one instruction "
            f"(upstream: {t['upstream_text_encoder_calls']})",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hidream_ui bench edit", description=__doc__.splitlines()[0])
    parser.add_argument("--profile", default="tiny", choices=("tiny", "bench"))
    parser.add_argument("--size", type=int, help="edit working side in pixels (default: half the model's max)")
    parser.add_argument("--batch", type=int, default=1, help="transformer batch for the forward comparison")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--edits", type=int, default=4)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    report = run(args.profile, args.size, args.batch, args.repeats, args.edits)
    print(json.dumps(report, indent=2) if args.json else format_text(report))
    return 0
