"""The measuring half of `bench attention` (attention.py runs it and reports): HiDream's attention
geometry per profile and edit size, the memory each strategy needs and the peak it takes, the
kernel timings against a float64 reference, and one whole-transformer forward per strategy. The
shapes, the peak-memory method and the error measure are described in attention.py's docstring."""

from __future__ import annotations

import functools
import statistics
import threading
import time
from dataclasses import asdict, dataclass
from typing import Sequence

from hidream_ui.model.layout import E11_DIR
from hidream_ui.model.tiny.build import ensure_tiny
from hidream_ui.model.tiny.profiles import PROFILES as TINY_PROFILES
from hidream_ui.pipeline.attention.kernels import math_attention
from hidream_ui.pipeline.attention.registry import apply, get_strategy

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


class PeakMeter:
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
    meter = PeakMeter(device_type)
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
