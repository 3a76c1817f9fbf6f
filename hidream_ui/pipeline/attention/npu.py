"""Ascend's fused attention (torch_npu.npu_fusion_attention), imported lazily."""

from __future__ import annotations

import math
from typing import Callable

from hidream_ui.pipeline.attention.processor import HiDreamStrategyProcessor, _IdentityCache

# Documented limits of torch_npu.npu_fusion_attention (Ascend "FlashAttentionScore"): head_dim up to
# 512 (MindSpore's wrapper of the same kernel also documents "a multiple of 16"), 1..256 heads.
NPU_FUSION_MAX_HEAD_DIM = 512
NPU_FUSION_MAX_HEADS = 256


class NpuFusionProcessor(HiDreamStrategyProcessor):
    """`torch_npu.npu_fusion_attention` (Ascend FlashAttentionScore), float16/bfloat16 only.

    * `scale` is passed as 1/sqrt(head_dim): the kernel's default is 1.0.
    * Layout "BSND" (our native layout, no copy) or "BNSD"; `head_num` = heads.
    * Key bias: through `pse`. The documented formula is softmax(scale * (pse + q k^T)) with the
      default pse_type, so pse = bias / scale; its shape is (B, N, 1, S_kv) ("BN1Skv", O(S) memory,
      documented since torch_npu 6.0) or, for older torch_npu that only documents BNSS / 1NSS,
      `pse_layout="BNSS"` materialises (B, N, S, S). `atten_mask` is NOT used: it is a boolean
      "drop this logit" mask, which can neither express a multiplicity nor HiDream's zeroed-but-
      attended padded keys. Splitting the collapsed token back into P copies would be exact too
      but undoes the collapse (upstream cost); pse keeps it, at the precision of the dtype
      (bf16: bias rounded to ~3 significant digits, like SDPA's bf16 mask).
    * `fusion_fn` replaces the real function (tests pass a fake that checks the arguments).

    Fused q/k norms and rope (`fused_ops`; by default on where torch_npu is installed, or when both
    fakes below are given; the pure-torch processor stays the reference they are tested against):
    * RMSNorm of q and k: `torch_npu.npu_rms_norm(x, gamma, epsilon)` (returns (y, rstd); y is used)
      with the module's own weight and eps.
    * Rope: `torch_npu.npu_rotary_mul(x, r1, r2, "interleave")` (rotary_mode) computes
      x * r1 + rotate(x) * r2 with rotate(x) = (-x1, x0) per consecutive pair, which is HiDream's
      rope (pairs, not halves) when r1 = cos and r2 = sin, each repeated per pair: HiDream's
      freqs are the 2x2 matrices [[cos, -sin], [sin, cos]]. x is (batch, seq, heads, head_dim), r1/r2
      (batch, seq, 1, head_dim), float32 like the reference (which rotates in float32 too); the
      tables are built once per freqs tensor (every block of a call shares it).
    * `rms_norm_fn` / `rotary_mul_fn` replace the real functions (tests pass fakes).
    """

    strategy_name = "npu_fusion"

    def __init__(
        self,
        fusion_fn: Callable | None = None,
        input_layout: str = "BSND",
        pse_layout: str = "BN1S",
        rms_norm_fn: Callable | None = None,
        rotary_mul_fn: Callable | None = None,
        fused_ops: bool | None = None,
    ):
        super().__init__()
        self.rms_norm_fn = rms_norm_fn
        self.rotary_mul_fn = rotary_mul_fn
        if fused_ops is None:  # on where torch_npu is installed (found, not imported) or both ops are given
            import importlib.util

            fused_ops = (rms_norm_fn is not None and rotary_mul_fn is not None) or (
                importlib.util.find_spec("torch_npu") is not None
            )
        self.fused_ops = fused_ops
        self._rope_tables = _IdentityCache(_rope_tables)
        if input_layout not in ("BSND", "BNSD"):
            raise ValueError(f"input_layout must be 'BSND' or 'BNSD', got {input_layout!r}")
        if pse_layout not in ("BN1S", "BNSS"):
            raise ValueError(f"pse_layout must be 'BN1S' or 'BNSS', got {pse_layout!r}")
        self.fusion_fn = fusion_fn
        self.input_layout = input_layout
        self.pse_layout = pse_layout

    def _function(self) -> Callable:
        if self.fusion_fn is not None:
            return self.fusion_fn
        import torch_npu  # lazy: only on Ascend machines, never installed by this project

        return torch_npu.npu_fusion_attention

    def _rms_norm_function(self) -> Callable:
        if self.rms_norm_fn is not None:
            return self.rms_norm_fn
        import torch_npu  # lazy, as above

        return torch_npu.npu_rms_norm

    def _rotary_mul_function(self) -> Callable:
        if self.rotary_mul_fn is not None:
            return self.rotary_mul_fn
        import torch_npu  # lazy, as above

        return torch_npu.npu_rotary_mul

    def _rms_norm(self, norm, x):
        if not self.fused_ops or getattr(norm, "weight", None) is None:
            return super()._rms_norm(norm, x)
        import torch

        eps = norm.eps if norm.eps is not None else torch.finfo(x.dtype).eps
        return self._rms_norm_function()(x, norm.weight, epsilon=eps)[0]

    def _rotary(self, x, freqs):
        if not self.fused_ops:
            return super()._rotary(x, freqs)
        r1, r2 = self._rope_tables.get(freqs)
        # All positional: the release's meta function names the 4th parameter `mode`, its schema
        # `rotary_mode` (tests/test_npu_contract.py); positions agree in both.
        return self._rotary_mul_function()(x.float(), r1, r2, "interleave").to(x.dtype)

    def attend(self, q, k, v, key_bias):
        import torch

        batch, seq, heads, head_dim = q.shape
        if q.dtype not in (torch.float16, torch.bfloat16):
            raise TypeError(f"npu_fusion_attention takes float16/bfloat16, got {q.dtype}: use the 'sdpa' strategy")
        if head_dim > NPU_FUSION_MAX_HEAD_DIM or heads > NPU_FUSION_MAX_HEADS:
            raise ValueError(
                f"npu_fusion_attention supports head_dim <= {NPU_FUSION_MAX_HEAD_DIM} and <= "
                f"{NPU_FUSION_MAX_HEADS} heads, got {head_dim} x {heads}: use the 'sdpa' strategy"
            )
        scale = 1.0 / math.sqrt(head_dim)
        pse = None
        if key_bias is not None:
            pse = (key_bias.float() / scale).to(q.dtype)[:, None, None, :]
            rows = seq if self.pse_layout == "BNSS" else 1
            pse = pse.expand(batch, heads, rows, key_bias.shape[-1]).contiguous()
        if self.input_layout == "BNSD":
            q, k, v = (t.transpose(1, 2).contiguous() for t in (q, k, v))
        else:
            q, k, v = (t.contiguous() for t in (q, k, v))
        result = self._function()(q, k, v, heads, self.input_layout, pse=pse, scale=scale, keep_prob=1.0)
        out = result[0]
        return out.transpose(1, 2) if self.input_layout == "BNSD" else out


def _rope_tables(freqs):
    """(r1, r2) of `npu_rotary_mul`'s interleave mode from HiDream's (B, S, 1, D/2, 2, 2) rope matrices:
    cos and sin, each repeated for both members of its pair: (B, S, 1, D), float32."""
    cos = freqs[..., 0, 0].float()
    sin = freqs[..., 1, 0].float()
    return cos.repeat_interleave(2, dim=-1).contiguous(), sin.repeat_interleave(2, dim=-1).contiguous()
