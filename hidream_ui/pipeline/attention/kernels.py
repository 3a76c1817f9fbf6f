"""Pure-torch attention kernels (sdpa, math, chunked) and their processors."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from hidream_ui.pipeline.attention.processor import HiDreamStrategyProcessor, _default_accum

if TYPE_CHECKING:  # pragma: no cover
    import torch

logger = logging.getLogger(__name__)


def math_attention(
    q: "torch.Tensor",
    k: "torch.Tensor",
    v: "torch.Tensor",
    key_bias: "torch.Tensor | None",
    accum_dtype: "torch.dtype | None" = None,
) -> "torch.Tensor":
    """Explicit softmax(q k^T / sqrt(d) + bias) v, every step in `accum_dtype` (default float32,
    float64 for float64 inputs).

    (batch, seq, heads, head_dim) in and out; the output has q's dtype. Materialises the full
    (batch, heads, seq, seq) score matrix: this is the reference, not a fast path. The benchmark
    and tests call it with float64 as the ground truth.
    """
    import torch

    accum_dtype = accum_dtype or _default_accum(q.dtype)
    scale = q.shape[-1] ** -0.5
    qf, kf, vf = (t.to(accum_dtype).transpose(1, 2) for t in (q, k, v))  # (B, H, S, D)
    scores = torch.matmul(qf, kf.transpose(-1, -2)).mul_(scale)
    if key_bias is not None:
        scores.add_(key_bias.to(accum_dtype)[:, None, None, :])
    probs = torch.softmax(scores, dim=-1)
    del scores
    return torch.matmul(probs, vf).transpose(1, 2).to(q.dtype)


def chunked_attention(
    q: "torch.Tensor",
    k: "torch.Tensor",
    v: "torch.Tensor",
    key_bias: "torch.Tensor | None",
    chunk_size: int = 1024,
    accum_dtype: "torch.dtype | None" = None,
) -> "torch.Tensor":
    """Exact attention, one sample and `chunk_size` queries at a time.

    Each query row's softmax only needs that row's scores, so splitting queries is exact. The
    working set is heads x chunk_size x seq scores (plus their softmax), independent of the batch
    size and linear in the sequence length: 20 x 1024 x 2433 x 4 B = 200 MB per buffer for a
    512x512 E1.1 edit, versus 1.4 GB per buffer for `math` with batch 3.
    """
    import torch

    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1 query, got {chunk_size}")
    accum_dtype = accum_dtype or _default_accum(q.dtype)
    batch, seq_q = q.shape[0], q.shape[1]
    scale = q.shape[-1] ** -0.5
    out = torch.empty_like(q)
    for b in range(batch):
        kb = k[b].to(accum_dtype).transpose(0, 1)  # (H, S, D)
        vb = v[b].to(accum_dtype).transpose(0, 1)
        bias_b = None if key_bias is None else key_bias[b].to(accum_dtype)
        for start in range(0, seq_q, chunk_size):
            stop = min(start + chunk_size, seq_q)
            qc = q[b, start:stop].to(accum_dtype).transpose(0, 1)  # (H, c, D)
            scores = torch.matmul(qc, kb.transpose(-1, -2)).mul_(scale)  # (H, c, S)
            if bias_b is not None:
                scores.add_(bias_b)
            probs = torch.softmax(scores, dim=-1)
            del scores
            out[b, start:stop] = torch.matmul(probs, vb).transpose(0, 1).to(q.dtype)
            del probs
    return out


def _sdpa(q, k, v, key_bias):
    import torch.nn.functional as F

    # An additive float mask broadcast over heads and queries: (B, 1, 1, S). SDPA wants the mask
    # in the query dtype (or bool); the bias is small (log P <= ~9), so bf16 keeps ~3 digits.
    mask = None if key_bias is None else key_bias.to(q.dtype)[:, None, None, :]
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, dropout_p=0.0, is_causal=False
    )
    return out.transpose(1, 2)


def add_key_multiplicity(
    out: "torch.Tensor",
    lse: "torch.Tensor",
    q: "torch.Tensor",
    k: "torch.Tensor",
    v: "torch.Tensor",
    key_bias: "torch.Tensor",
    index: "torch.Tensor",
    valid: "torch.Tensor",
) -> "torch.Tensor":
    """Turns an unbiased attention result into the one with per-key bias, exactly.

    `out` (B, S, H, D) and `lse` (B, H, S, natural-log sum of exp(scaled logits)) come from a kernel
    that attended every key once. For the few keys c with a bias b_c (gathered by `index`, (B, C),
    with `valid` marking real entries), the biased result is
        (out + sum_c w_c v_c) / (1 + sum_c w_c),  w_c = (exp(b_c) - 1) * exp(s_c - lse),
    with s_c = q.k_c / sqrt(d): the kernel already counted each key once, so only the extra
    exp(b_c) - 1 copies are added. s_c <= lse, so nothing overflows; all of it runs in float32.
    """
    import torch

    scale = q.shape[-1] ** -0.5
    gather = index[:, :, None, None].expand(-1, -1, k.shape[2], k.shape[3])
    k_c = torch.gather(k, 1, gather).float()  # (B, C, H, D)
    v_c = torch.gather(v, 1, gather).float()
    extra = torch.expm1(torch.gather(key_bias.float(), 1, index)) * valid  # (B, C): P_c - 1, 0 if unused
    s_c = torch.einsum("bshd,bchd->bhsc", q.float(), k_c) * scale
    w = extra[:, None, None, :] * torch.exp(s_c - lse.float()[..., None])  # (B, H, S, C)
    numerator = out.float() + torch.einsum("bhsc,bchd->bshd", w, v_c)
    denominator = 1.0 + w.sum(-1).transpose(1, 2)[..., None]  # (B, S, H, 1)
    return (numerator / denominator).to(out.dtype)


def biased_key_index(key_bias: "torch.Tensor") -> tuple["torch.Tensor", "torch.Tensor"]:
    """(index (B, C), valid (B, C) float) of the keys whose bias is non-zero, padded per sample."""
    import torch

    nonzero = key_bias != 0
    counts = nonzero.sum(dim=1)
    width = max(int(counts.max()), 1)
    # Stable descending sort puts the biased keys first, in order; the rest are padding (valid 0).
    order = torch.sort(nonzero.to(torch.int8), dim=1, descending=True, stable=True).indices[:, :width]
    valid = (torch.arange(width, device=key_bias.device)[None, :] < counts[:, None]).float()
    return order, valid


# ---------------------------------------------------------------------------------------------
# Processors


class SdpaProcessor(HiDreamStrategyProcessor):
    """torch SDPA; the key bias goes in as a float attn_mask broadcast to (B, 1, 1, S)."""

    strategy_name = "sdpa"

    def attend(self, q, k, v, key_bias):
        return _sdpa(q, k, v, key_bias)


class MathProcessor(HiDreamStrategyProcessor):
    """Explicit softmax attention with float32 accumulation (the reference; "vanilla" on NPU)."""

    strategy_name = "math"

    def __init__(self, accum_dtype: "torch.dtype | None" = None):
        super().__init__()
        self.accum_dtype = accum_dtype

    def attend(self, q, k, v, key_bias):
        return math_attention(q, k, v, key_bias, accum_dtype=self.accum_dtype)


class ChunkedProcessor(HiDreamStrategyProcessor):
    """Exact attention over query chunks (per sample): bounded peak memory, float32 accumulation."""

    strategy_name = "chunked"

    def __init__(self, chunk_size: int = 1024, accum_dtype: "torch.dtype | None" = None):
        super().__init__()
        if not isinstance(chunk_size, int) or chunk_size < 1:
            raise ValueError(f"chunk_size must be a positive number of queries, got {chunk_size!r}")
        self.chunk_size = chunk_size
        self.accum_dtype = accum_dtype

    def attend(self, q, k, v, key_bias):
        return chunked_attention(q, k, v, key_bias, chunk_size=self.chunk_size, accum_dtype=self.accum_dtype)


class SdpaBackendProcessor(HiDreamStrategyProcessor):
    """torch SDPA with one backend forced through `torch.nn.attention.sdpa_kernel`.

    sdpa_kernel flips process-global backend flags for the duration of the call: the engine must
    not run another SDPA user concurrently (it serialises edits and strategy switches under one
    lock). torch's FLASH_ATTENTION backend on CUDA takes no attention mask, so calls that carry a
    key bias (collapsed padding) are allowed to use EFFICIENT_ATTENTION as well (logged once).
    """

    def __init__(self, strategy_name: str, backend: str):
        super().__init__()
        self.strategy_name = strategy_name
        self.backend = backend
        self._warned = False

    def attend(self, q, k, v, key_bias):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backends = [getattr(SDPBackend, self.backend)]
        if key_bias is not None and self.backend == "FLASH_ATTENTION" and q.device.type == "cuda":
            if not self._warned:
                logger.warning(
                    "%s: torch's flash SDPA backend takes no attention mask; calls with collapsed padding "
                    "may use the memory-efficient backend",
                    self.strategy_name,
                )
                self._warned = True
            backends.append(SDPBackend.EFFICIENT_ATTENTION)
        with sdpa_kernel(backends):
            return _sdpa(q, k, v, key_bias)
