"""`python -m hidream_ui bench attention [--json] [--profile tiny|bench] [--repeats N] [--sizes 512,1024]`.

For every attention strategy available on the device, at HiDream's real attention shapes, reports
time (median of `repeats` calls after one warm-up call; fewer calls when one call alone would
exceed the per-strategy time budget, as `chunked` at 1024 on a CPU), peak extra memory of the call, and the
error against a float64 reference; then one whole-transformer forward per strategy. Nothing is
asserted: the "checks" section only reports the issue's acceptance ratios.

Shapes (profile "bench" = the real model's attention geometry): batch 3 (E1.1's three-way
guidance), 20 heads x 128. An N x N edit feeds the transformer an N x 2N input (source and target
side by side): 2 * (N/16)^2 image tokens. Text tokens: the double-stream blocks attend to
T5 + last-Llama-layer tokens carried through the blocks plus the current block's Llama layer,
128 each at max_sequence_length 128, so 384. Inputs shorter than `max_seq` (4096 tokens) are padded
by upstream; here, as in the pipeline, the padding is collapsed into ONE token with multiplicity
P = max_seq - image_tokens (zeroed key, logit bias log P). 512x512 -> 2048 + 1 + 384 = 2433 tokens;
1024x1024 -> 8192 + 384 = 8576 tokens (no padding).

Peak memory on CPU: the kernel's own high-water mark of this process's resident set (VmHWM in
/proc/self/status), reset right before each call by writing "5" to /proc/self/clear_refs, minus
the RSS before the call; glibc's free heap is returned first (malloc_trim) so reused pages cannot
hide an allocation. torch's CPU allocator is plain malloc, so tracemalloc would not see tensors;
this measures what the OS actually had to provide. If /proc cannot be reset (non-Linux), a psutil
thread samples RSS every millisecond instead (can miss very short peaks; the method is reported).
On CUDA / NPU: the device allocator's max_memory_allocated after reset_peak_memory_stats.

Memory budget: a strategy whose estimated need (e.g. `math` at 1024: 3 x 20 x 8576^2 float32
scores = 17.6 GB, twice with the softmax) exceeds the budget is reported as skipped with both
numbers instead of being run.

Error: max |out - ref| / max |ref| over sampled query rows (all rows in the tiny profile). Each
query row of attention depends only on that row's scores, so a float64 reference over a subset of
rows is exact for those rows and keeps the 1024 reference affordable.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any, Sequence

from hidream_ui.model.layout import E11_DIR
from hidream_ui.model.tiny.build import ensure_tiny
from hidream_ui.model.tiny.profiles import PROFILES as TINY_PROFILES
from hidream_ui.pipeline.attention.kernels import math_attention
from hidream_ui.pipeline.attention.registry import AUTO, apply, get_strategy, list_strategies, resolve

GB = 1024**3
MB = 1024**2


@dataclass(frozen=True)
class AttentionProfile:
    batch: int
    heads: int
    head_dim: int
    max_seq: int  # image tokens the transformer pads to (max_resolution^2 / patch^2)
    text_tokens: int
    sides: tuple[int, ...]  # default edit sizes (square N x N edits)
    reference_rows: int | None  # None: every query row
    # whole-transformer forward
    transformer_side: int  # edit side in pixels (latents are side/8 x 2*side/8)
    transformer_batch: int
    text_len: int  # T5 and each Llama layer (text tokens = 3 x text_len)


PROFILES = {
    "bench": AttentionProfile(
        batch=3,
        heads=20,
        head_dim=128,
        max_seq=4096,
        text_tokens=384,
        sides=(512, 1024),
        reference_rows=128,
        transformer_side=256,
        transformer_batch=1,
        text_len=128,
    ),
    "tiny": AttentionProfile(
        batch=3,
        heads=2,
        head_dim=16,
        max_seq=64,
        text_tokens=24,
        sides=(64, 128),
        reference_rows=None,
        transformer_side=64,
        transformer_batch=2,
        text_len=8,
    ),
}


@dataclass(frozen=True)
class AttentionShape:
    label: str
    batch: int
    heads: int
    head_dim: int
    image_tokens: int
    pad_tokens: int  # collapsed into one token when > 0
    text_tokens: int

    @property
    def seq(self) -> int:
        return self.image_tokens + (1 if self.pad_tokens else 0) + self.text_tokens


def edit_shape(profile: AttentionProfile, side: int) -> AttentionShape:
    if side <= 0 or side % 16:
        raise ValueError(f"edit size {side} must be a positive multiple of 16 pixels")
    image = 2 * (side // 16) ** 2
    return AttentionShape(
        f"{side}x{side}",
        profile.batch,
        profile.heads,
        profile.head_dim,
        image,
        max(0, profile.max_seq - image),
        profile.text_tokens,
    )


# ---------------------------------------------------------------------------------------------
# Memory


def estimate_bytes(name: str, shape: AttentionShape, element_size: int, chunk_size: int = 1024) -> int:
    """Working memory a strategy needs beyond its inputs (upper-bound-ish estimates)."""
    b, h, s, d = shape.batch, shape.heads, shape.seq, shape.head_dim
    tokens = b * s * h * d
    if name == "math":  # float32 copies of q/k/v, scores and softmax (B, H, S, S)
        return 2 * b * h * s * s * 4 + 4 * tokens * 4
    if name == "sdpa_math":  # scores, masked scores, softmax in the compute dtype (>= float32 on CPU)
        return 3 * b * h * s * s * max(element_size, 4) + 4 * tokens * element_size
    if name == "chunked":  # per sample: scores + softmax of chunk x S per head
        return 2 * h * min(chunk_size, s) * s * 4 + 3 * s * h * d * 4 + tokens * element_size
    if name in ("sdpa", "sdpa_flash", "sdpa_efficient", "sdpa_cudnn", "flash_attn", "npu_fusion"):
        return 4 * tokens * max(element_size, 4)
    return 2 * b * h * s * s * 4  # unknown: assume a full score matrix


class _PeakMeter:
    """Peak extra memory of one call; see the module docstring for the CPU method."""

    def __init__(self, device_type: str):
        self.device_type = device_type
        self.method = "device-allocator"
        self._libc = None
        if device_type == "cpu":
            self.method = "vmhwm" if self._can_reset_hwm() else "rss-sampling"
            try:
                import ctypes

                self._libc = ctypes.CDLL("libc.so.6")
            except OSError:
                self._libc = None

    @staticmethod
    def _can_reset_hwm() -> bool:
        try:
            with open("/proc/self/clear_refs", "w") as handle:
                handle.write("5")
            return _read_status("VmHWM") is not None
        except OSError:
            return False

    def measure(self, fn):
        """(result, peak extra bytes) of calling fn()."""
        if self.device_type != "cpu":
            import torch

            module = getattr(torch, self.device_type)
            module.synchronize()
            module.reset_peak_memory_stats()
            before = module.memory_allocated()
            result = fn()
            module.synchronize()
            return result, max(0, module.max_memory_allocated() - before)
        if self._libc is not None:
            self._libc.malloc_trim(0)
        if self.method == "vmhwm":
            before = _read_status("VmRSS")
            with open("/proc/self/clear_refs", "w") as handle:
                handle.write("5")
            result = fn()
            return result, max(0, _read_status("VmHWM") - before)
        import psutil

        process = psutil.Process()
        before = process.memory_info().rss
        peak = [before]
        stop = threading.Event()

        def sample() -> None:
            while not stop.is_set():
                peak[0] = max(peak[0], process.memory_info().rss)
                time.sleep(0.001)

        thread = threading.Thread(target=sample, daemon=True)
        thread.start()
        try:
            result = fn()
        finally:
            stop.set()
            thread.join()
        peak[0] = max(peak[0], process.memory_info().rss)
        return result, peak[0] - before


def _read_status(field: str) -> int | None:
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return None


def default_budget_bytes(device_type: str) -> int:
    """70% of what the device has free now (host RAM for CPU)."""
    if device_type == "cpu":
        import psutil

        return int(psutil.virtual_memory().available * 0.7)
    import torch

    free, _total = getattr(torch, device_type).mem_get_info()
    return int(free * 0.7)


# ---------------------------------------------------------------------------------------------
# Kernel benchmark


def make_inputs(shape: AttentionShape, dtype, device: str, seed: int = 0):
    """Random q/k/v (B, S, H, D) and the key bias, laid out like a real collapsed edit.

    Token order follows the processor: image tokens, the collapsed padded token (zero key, bias
    log P), then text tokens. Returns (q, k, v, key_bias or None).
    """
    import torch

    gen = torch.Generator().manual_seed(seed)
    dims = (shape.batch, shape.seq, shape.heads, shape.head_dim)
    q, k, v = (torch.randn(dims, generator=gen, dtype=torch.float32) for _ in range(3))
    bias = None
    if shape.pad_tokens:
        # The collapse encoding as the pipeline sends it (mask -P), read by the processors' own helper.
        from hidream_ui.pipeline.attention.processor import key_terms

        mask = torch.ones(shape.batch, shape.seq, dtype=torch.float32)
        mask[:, shape.image_tokens] = -float(shape.pad_tokens)
        multiplier, bias = key_terms(mask)
        k = k * multiplier[:, :, None, None]  # padded keys are zeroed (the mask multiplies them)
        bias = bias.to(device)
    q, k, v = (t.to(device=device, dtype=dtype) for t in (q, k, v))
    return q, k, v, bias


def reference_rows(shape: AttentionShape, rows: int | None):
    """Query rows the float64 reference covers: all, or `rows` evenly spaced ones."""
    import torch

    if rows is None or rows >= shape.seq:
        return torch.arange(shape.seq)
    return torch.linspace(0, shape.seq - 1, rows).round().long().unique()


def reference_output(q, k, v, bias, rows):
    """float64 attention for the selected query rows, one sample at a time (bounded memory)."""
    import torch

    parts = []
    for b in range(q.shape[0]):
        qb = q[b : b + 1, rows.to(q.device)].cpu().double()
        kb, vb = k[b : b + 1].cpu().double(), v[b : b + 1].cpu().double()
        bb = None if bias is None else bias[b : b + 1].cpu().double()
        parts.append(math_attention(qb, kb, vb, bb, accum_dtype=torch.float64))
    return torch.cat(parts)


def _relative_error(out, ref, rows) -> tuple[float, float]:
    picked = out[:, rows.to(out.device)].detach().cpu().double()
    diff = float((picked - ref).abs().max())
    return diff, diff / max(float(ref.abs().max()), 1e-30)


def _sync(device_type: str) -> None:
    if device_type != "cpu":
        import torch

        getattr(torch, device_type).synchronize()


def bench_kernels(
    profile: AttentionProfile,
    sides: Sequence[int],
    strategies: Sequence[str],
    device: str,
    dtype,
    repeats: int,
    budget: int,
    chunk_size: int,
    progress,
    time_budget_s: float | None = None,
) -> list[dict]:
    import torch

    device_type = device.split(":")[0]
    meter = _PeakMeter(device_type)
    element_size = torch.empty((), dtype=dtype).element_size()
    results = []
    for side in sides:
        shape = edit_shape(profile, side)
        q, k, v, bias = make_inputs(shape, dtype, device)
        rows = reference_rows(shape, profile.reference_rows)
        t0 = time.perf_counter()
        ref = reference_output(q, k, v, bias, rows)
        size_row = {
            "size": shape.label,
            "shape": {**asdict(shape), "seq": shape.seq},
            "reference": {"dtype": "float64", "rows": int(rows.numel()), "seconds": round(time.perf_counter() - t0, 3)},
            "strategies": {},
        }
        progress(f"{shape.label}: seq {shape.seq}, float64 reference on {rows.numel()} rows done")
        for name in strategies:
            need = estimate_bytes(name, shape, element_size, chunk_size)
            if need > budget:
                size_row["strategies"][name] = {
                    "skipped": f"needs {need / GB:.1f} GB, budget {budget / GB:.1f} GB",
                    "estimate_bytes": need,
                }
                progress(f"  {name}: skipped (needs {need / GB:.1f} GB > budget {budget / GB:.1f} GB)")
                continue
            options = {"chunk_size": chunk_size} if name == "chunked" else {}
            processor = get_strategy(name).make_processor(**options)
            start = time.perf_counter()
            processor.attend(q, k, v, bias)  # warm-up: first-call dispatch and allocations
            _sync(device_type)
            warmup = time.perf_counter() - start
            # Keep long calls (1024 edits on a CPU) inside the time budget: fewer timed calls,
            # never fewer than one; the report lists every time measured.
            runs = max(1, min(repeats, int(time_budget_s // max(warmup, 1e-9)))) if time_budget_s else repeats
            times, peaks, out = [], [], None
            for _ in range(runs):
                del out
                start = time.perf_counter()
                out, peak = meter.measure(functools.partial(processor.attend, q, k, v, bias))
                times.append(time.perf_counter() - start)
                peaks.append(peak)
            abs_err, rel_err = _relative_error(out, ref, rows)
            del out
            size_row["strategies"][name] = {
                "median_s": statistics.median(times),
                "times_s": times,
                "warmup_s": warmup,
                "peak_bytes": max(peaks),
                "estimate_bytes": need,
                "max_abs_error": abs_err,
                "rel_error": rel_err,
            }
            progress(
                f"  {name}: {statistics.median(times):.3f} s, peak {max(peaks) / MB:.0f} MB, rel error {rel_err:.2e}"
            )
        results.append(size_row)
        del q, k, v, bias, ref
    return results


# ---------------------------------------------------------------------------------------------
# Whole-transformer forward


def build_transformer(profile_name: str, dtype, device: str):
    """(transformer, source): the tiny checkpoint's transformer when hidream_ui.model.tiny can provide it,
    else one built in-process with the same geometry and seeded random weights."""
    import torch
    from diffusers import HiDreamImageTransformer2DModel

    root = ensure_tiny(profile=profile_name)
    candidates = [root / E11_DIR / "transformer", root / "transformer"] if hasattr(root, "__truediv__") else []
    for path in candidates:
        if (path / "config.json").exists():
            model = HiDreamImageTransformer2DModel.from_pretrained(path, torch_dtype=dtype).to(device).eval()
            return model, f"tiny checkpoint {path}"
    torch.manual_seed(0)
    # The geometry of the tiny checkpoint's profile of the same name (one home: its transformer config).
    model = HiDreamImageTransformer2DModel(**TINY_PROFILES[profile_name].transformer_config())
    return model.to(device=device, dtype=dtype).eval(), "built in-process (seeded random weights)"


def transformer_inputs(transformer, profile: AttentionProfile, dtype, device: str):
    """Collapsed-padding inputs for one transformer call at `profile.transformer_side` (N x 2N edit)."""
    import torch

    from hidream_ui.pipeline.edit_pipeline import (
        collapsed_tokens,  # lazy: torch and diffusers, loaded only when this benchmark runs
    )

    config = transformer.config
    gen = torch.Generator().manual_seed(1)
    batch = profile.transformer_batch
    # A random N x 2N edit latent, collapsed exactly as the pipeline collapses it.
    latent = torch.randn(
        batch, config.in_channels, profile.transformer_side // 8, 2 * profile.transformer_side // 8, generator=gen
    )
    tokens, mask, sizes, ids = collapsed_tokens(latent, config.patch_size, transformer.max_seq)
    n = int(sizes[0, 0] * sizes[0, 1])
    pad = transformer.max_seq - n
    t5_dim, llama_dim = config.caption_channels
    llama_layers = max(config.llama_layers) + 1
    return {
        "hidden_states": tokens.to(device, dtype),
        "hidden_states_masks": mask.to(device),  # float32 so P is exact, as the pipeline sends it
        "img_ids": ids.to(device),
        "img_sizes": sizes.to(device),
        "timesteps": torch.full((batch,), 500.0, device=device),
        "encoder_hidden_states_t5": torch.randn(batch, profile.text_len, t5_dim, generator=gen).to(device, dtype),
        "encoder_hidden_states_llama3": torch.randn(llama_layers, batch, profile.text_len, llama_dim, generator=gen).to(
            device, dtype
        ),
        "pooled_embeds": torch.randn(batch, config.text_emb_dim, generator=gen).to(device, dtype),
        "return_dict": False,
    }, {"image_tokens": n, "pad_tokens": pad, "text_tokens": 3 * profile.text_len, "batch": batch}


def bench_transformer(
    profile_name: str,
    profile: AttentionProfile,
    strategies: Sequence[str],
    device: str,
    dtype,
    repeats: int,
    chunk_size: int,
    progress,
) -> dict:
    import torch

    t0 = time.perf_counter()
    transformer, source = build_transformer(profile_name, dtype, device)
    inputs, geometry = transformer_inputs(transformer, profile, dtype, device)
    report = {"source": source, "build_s": round(time.perf_counter() - t0, 2), "inputs": geometry, "strategies": {}}
    progress(f"transformer ({source}) ready in {report['build_s']} s")
    device_type = device.split(":")[0]
    outputs = {}
    with torch.inference_mode():
        warmed = False
        for name in strategies:
            options = {"chunk_size": chunk_size} if name == "chunked" else {}
            apply(transformer, name, device, dtype, **options)
            if not warmed:  # one warm-up for the whole model: later strategies reuse its allocations
                transformer(**inputs)
                warmed = True
            times = []
            for _ in range(repeats):
                _sync(device_type)
                start = time.perf_counter()
                out = transformer(**inputs)[0]
                _sync(device_type)
                times.append(time.perf_counter() - start)
            outputs[name] = out.float().cpu()
            report["strategies"][name] = {"median_s": statistics.median(times), "times_s": times}
            progress(f"  transformer / {name}: {statistics.median(times):.3f} s")
    base = outputs.get("sdpa")
    for name, out in outputs.items():
        if base is not None:
            report["strategies"][name]["max_abs_diff_vs_sdpa"] = float((out - base).abs().max())
            report["strategies"][name]["rel_diff_vs_sdpa"] = float(
                (out - base).abs().max() / max(float(base.abs().max()), 1e-30)
            )
    del transformer
    return report


# ---------------------------------------------------------------------------------------------
# Entry points


def _checks(kernels: list[dict]) -> dict:
    """The issue's acceptance ratios at the 512x512 size (or the first size benchmarked)."""
    if not kernels:
        return {}
    row = next((r for r in kernels if r["size"] == "512x512"), kernels[0])
    s = row["strategies"]
    checks: dict[str, Any] = {"size": row["size"]}
    if row["size"] != "512x512":
        checks["note"] = "the acceptance ratios are defined at the 512x512 size; tiny shapes measure noise"
    if "median_s" in s.get("math", {}) and "median_s" in s.get("chunked", {}):
        ratio = s["chunked"]["peak_bytes"] / max(1, s["math"]["peak_bytes"])
        checks["chunked_peak_over_math_peak"] = ratio
        checks["chunked_peak_at_most_quarter_of_math"] = ratio <= 0.25
    if "median_s" in s.get("math", {}) and "median_s" in s.get("sdpa", {}):
        ratio = s["sdpa"]["median_s"] / s["math"]["median_s"]
        checks["sdpa_time_over_math_time"] = ratio
        checks["sdpa_not_slower_than_math"] = ratio <= 1.0
    return checks


def run(
    profile: str = "tiny",
    repeats: int = 3,
    json_out: bool = False,
    sizes: Sequence[int] | None = None,
    device: str = "cpu",
    dtype: str = "fp32",
    strategies: Sequence[str] | None = None,
    memory_budget_gb: float | None = None,
    chunk_size: int = 1024,
    transformer: bool = True,
    transformer_repeats: int | None = None,
    time_budget_s: float | None = 90.0,
    verbose: bool = False,
) -> dict:
    """Runs the attention benchmark and returns its report (see the module docstring).

    `json_out=True` also prints the report as JSON on stdout (what `--json` does); `verbose`
    prints progress on stderr. `strategies` defaults to every strategy available on the device.
    `time_budget_s` caps the timed calls of one strategy at one size: when the warm-up call alone
    takes longer than budget / repeats, fewer calls are timed (at least one). The whole-transformer
    forward is timed `transformer_repeats` times (default min(repeats, 2)) after one shared warm-up.
    """
    import torch

    if profile not in PROFILES:
        raise ValueError(f"profile must be one of {', '.join(PROFILES)}, got {profile!r}")
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    if dtype not in dtypes:
        raise ValueError(f"dtype must be one of {', '.join(dtypes)}, got {dtype!r}")
    torch_dtype = dtypes[dtype]
    prof = PROFILES[profile]
    sides = tuple(sizes) if sizes else prof.sides
    device_type = device.split(":")[0]
    if device_type == "npu":
        import torch_npu  # noqa: F401  (registers torch.npu; only ever present on Ascend machines)
    statuses = list_strategies(device, torch_dtype)
    available = [s.name for s in statuses if s.available and s.name != AUTO]
    chosen = list(strategies) if strategies else available
    unknown = [n for n in chosen if n not in available]
    if unknown:
        raise ValueError(f"strategies {unknown} are not available on {device}/{dtype}; available: {available}")
    budget = int(memory_budget_gb * GB) if memory_budget_gb else default_budget_bytes(device_type)

    def progress(message: str) -> None:
        if verbose:
            print(message, file=sys.stderr, flush=True)

    started = time.perf_counter()
    report = {
        "benchmark": "attention",
        "profile": profile,
        "device": device,
        "dtype": dtype,
        "repeats": repeats,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "budget_bytes": budget,
        "memory_method": _PeakMeter(device_type).method,
        "chunk_size": chunk_size,
        "auto_resolves_to": resolve(AUTO, device, torch_dtype).name,
        "strategies": [asdict(s) for s in statuses],
    }
    report["kernels"] = bench_kernels(
        prof, sides, chosen, device, torch_dtype, repeats, budget, chunk_size, progress, time_budget_s
    )
    report["checks"] = _checks(report["kernels"])
    if transformer:
        report["transformer"] = bench_transformer(
            profile, prof, chosen, device, torch_dtype, transformer_repeats or min(repeats, 2), chunk_size, progress
        )
    report["total_s"] = round(time.perf_counter() - started, 2)
    if json_out:
        print(json.dumps(report, indent=2))
    return report


def format_table(report: dict) -> str:
    lines = [
        f"attention benchmark: profile {report['profile']}, {report['device']} {report['dtype']}, "
        f"torch {report['torch']} ({report['threads']} threads), repeats {report['repeats']}, "
        f"memory: {report['memory_method']}, budget {report['budget_bytes'] / GB:.1f} GB, "
        f"auto -> {report['auto_resolves_to']}"
    ]
    for row in report["kernels"]:
        shape = row["shape"]
        lines.append("")
        lines.append(
            f"{row['size']} edit: B={shape['batch']} H={shape['heads']} D={shape['head_dim']} "
            f"S={shape['seq']} (image {shape['image_tokens']}, collapsed pad "
            f"{shape['pad_tokens']}, text {shape['text_tokens']}); "
            f"float64 reference on {row['reference']['rows']} query rows"
        )
        lines.append(f"  {'strategy':16s} {'median s':>9s} {'calls':>5s} {'peak MB':>9s} {'rel error':>10s}")
        for name, r in row["strategies"].items():
            if "skipped" in r:
                lines.append(f"  {name:16s} skipped: {r['skipped']}")
            else:
                lines.append(
                    f"  {name:16s} {r['median_s']:9.3f} {len(r['times_s']):5d} {r['peak_bytes'] / MB:9.1f} "
                    f"{r['rel_error']:10.2e}"
                )
    if report.get("checks"):
        c = report["checks"]
        lines.append("")
        lines.append(f"checks at {c['size']}:" + (f" ({c['note']})" if "note" in c else ""))
        if "chunked_peak_over_math_peak" in c:
            lines.append(
                f"  chunked peak / math peak = {c['chunked_peak_over_math_peak']:.3f} (<= 0.25: "
                f"{c['chunked_peak_at_most_quarter_of_math']})"
            )
        if "sdpa_time_over_math_time" in c:
            lines.append(
                f"  sdpa time / math time    = {c['sdpa_time_over_math_time']:.3f} (<= 1: "
                f"{c['sdpa_not_slower_than_math']})"
            )
    if "transformer" in report:
        t = report["transformer"]
        g = t["inputs"]
        lines.append("")
        lines.append(
            f"whole transformer ({t['source']}): batch {g['batch']}, image {g['image_tokens']} + "
            f"collapsed pad {g['pad_tokens']} + text {g['text_tokens']} tokens"
        )
        lines.append(f"  {'strategy':16s} {'median s':>9s} {'max |diff| vs sdpa':>19s} {'relative':>9s}")
        for name, r in t["strategies"].items():
            diff, rel = r.get("max_abs_diff_vs_sdpa"), r.get("rel_diff_vs_sdpa")
            lines.append(
                f"  {name:16s} {r['median_s']:9.3f} {'-' if diff is None else f'{diff:.2e}':>19s} "
                f"{'-' if rel is None else f'{rel:.1e}':>9s}"
            )
    lines.append(f"\ntotal {report['total_s']} s")
    return "\n".join(lines)


def _sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"--sizes takes comma-separated edit sides in pixels, got {text!r}") from None
    if not sizes or any(s <= 0 or s % 16 for s in sizes):
        raise argparse.ArgumentTypeError(f"--sizes must be positive multiples of 16, got {text!r}")
    return sizes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m hidream_ui bench attention",
        description="time, peak memory and error of every attention strategy",
    )
    parser.add_argument(
        "--profile",
        default="bench",
        choices=tuple(PROFILES),
        help="bench: real HiDream attention shapes (default); tiny: seconds-long smoke run",
    )
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per strategy (median; plus 1 warm-up)")
    parser.add_argument(
        "--sizes",
        type=_sizes,
        default=None,
        help="comma-separated square edit sides, e.g. 512 (default: 512,1024 / tiny: 64,128)",
    )
    parser.add_argument("--strategies", default=None, help="comma-separated subset (default: all available)")
    parser.add_argument("--device", default="cpu", help="torch device string (default cpu)")
    parser.add_argument("--dtype", default="fp32", choices=("fp32", "bf16", "fp16"))
    parser.add_argument("--chunk-size", type=int, default=1024, help="queries per chunk for 'chunked'")
    parser.add_argument("--budget-gb", type=float, default=None, help="memory budget (default: 70%% of free memory)")
    parser.add_argument(
        "--time-budget",
        type=float,
        default=90.0,
        help="seconds of timed calls per strategy and size before repeats are reduced (0: off)",
    )
    parser.add_argument("--no-transformer", action="store_true", help="skip the whole-transformer forward")
    parser.add_argument("--json", action="store_true", help="print the report as JSON on stdout")
    args = parser.parse_args(argv)
    try:
        report = run(
            profile=args.profile,
            repeats=args.repeats,
            json_out=args.json,
            sizes=args.sizes,
            device=args.device,
            dtype=args.dtype,
            strategies=args.strategies.split(",") if args.strategies else None,
            memory_budget_gb=args.budget_gb,
            chunk_size=args.chunk_size,
            transformer=not args.no_transformer,
            time_budget_s=args.time_budget or None,
            verbose=True,
        )
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not args.json:
        print(format_table(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
