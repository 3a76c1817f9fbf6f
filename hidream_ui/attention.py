"""Attention strategies for HiDream's transformer, switchable at runtime.

Why this exists: diffusers' `HiDreamAttnProcessor` calls `F.scaled_dot_product_attention`
directly, so `DIFFUSERS_ATTN_BACKEND` / `set_attention_backend` do nothing for HiDream, and the
CUDA flash-attn package does not exist on Ascend NPUs. Picking a kernel therefore means
installing another processor on every `HiDreamAttention` module (the `attn1` of each double- and
single-stream block). That is cheap and keeps the weights in place, so a 17B model never has to be
reloaded to compare kernels or to fall back.

Structure
---------
Every strategy shares one processor body (`HiDreamStrategyProcessor`) that reproduces diffusers'
projections exactly (RMS-normed q/k cast back to the hidden dtype, image and text projections
concatenated in double-stream blocks, rope on the full head or on its first half, the same split
of the output projections) and differs only in `attend(q, k, v, key_bias)`, which works on
(batch, seq, heads, head_dim) tensors. `key_bias` is None or a float32 (batch, seq) additive
logit bias per key.

Padding-collapse mask encoding (project convention, see the pipeline)
---------------------------------------------------------------------
`hidden_states_masks` is a float (batch, seq) tensor. 1: normal token. 0: padded token, key
multiplied by 0 (upstream semantics: the padded key still gets softmax weight exp(0) and its
value still contributes). -P (P >= 1): ONE token standing for P identical padded tokens; its key
is zeroed like a pad and its logit gets + log(P) for every query, which is exactly what P copies
would contribute. So the key multiplier is max(mask, 0) and the key bias is log(max(-mask, 1)).
A mask without negative entries needs no bias at all (kernels keep their fast mask-free path).

Strategies
----------
sdpa, math, chunked, npu_fusion, flash_attn, sdpa_flash, sdpa_efficient, sdpa_cudnn, sdpa_math and
auto (resolved per device and dtype by `resolve`). `list_strategies` says which run here and why
not; `apply` installs one on a transformer. See each processor's docstring for how it handles the
key bias.

Concurrency: `sdpa_*` strategies force a backend with `torch.nn.attention.sdpa_kernel`, which
flips process-global flags while the call runs; the engine therefore runs edits and `apply()`
under one lock, and nothing else in the process should run SDPA concurrently.
"""

from __future__ import annotations

import importlib.util
import logging
import math
import sys
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:  # pragma: no cover
    import torch

logger = logging.getLogger(__name__)

AUTO = "auto"

# Documented limits of torch_npu.npu_fusion_attention (Ascend "FlashAttentionScore"): head_dim up to
# 512 (MindSpore's wrapper of the same kernel also documents "a multiple of 16"), 1..256 heads.
NPU_FUSION_MAX_HEAD_DIM = 512
NPU_FUSION_MAX_HEADS = 256


# ---------------------------------------------------------------------------------------------
# Public types


class AttentionUnavailable(RuntimeError):
    """The strategy cannot run on this device / dtype / installation; `reason` says why."""

    def __init__(self, name: str, reason: str):
        super().__init__(f"attention strategy {name!r} is not available: {reason}")
        self.name = name
        self.reason = reason


@dataclass(frozen=True)
class AttentionStrategy:
    """One way of computing HiDream attention.

    `is_available(device, dtype)` takes anything with a `.type` ("cpu", "cuda", "npu", ...) such as
    `hidream_ui.devices.DeviceInfo` or `torch.device` (or a device string) and a torch dtype, and
    returns (available, reason). `make_processor(**options)` builds the processor to install.
    """

    name: str
    description: str
    is_available: Callable[[Any, Any], tuple[bool, str]]
    make_processor: Callable[..., "HiDreamStrategyProcessor"]


@dataclass(frozen=True)
class StrategyStatus:
    name: str
    description: str
    available: bool
    reason: str


# ---------------------------------------------------------------------------------------------
# Mask helpers


def key_terms(mask: "torch.Tensor") -> tuple["torch.Tensor", "torch.Tensor | None"]:
    """(key multiplier, key bias or None) for a collapse-encoded mask of shape (batch, seq).

    The multiplier keeps the mask's dtype; the bias is float32 log multiplicity, or None when no
    entry is negative (then every key has multiplicity 1 and the bias would be all zeros).
    """
    import torch

    multiplier = mask.clamp(min=0)
    # One host sync per mask; processors cache the result per mask tensor (see _IdentityCache).
    if not bool((mask < 0).any()):
        return multiplier, None
    bias = torch.log((-mask.float()).clamp(min=1.0))
    return multiplier, bias


def _version(tensor: "torch.Tensor") -> int | None:
    # Tensors made under torch.inference_mode() keep no version counter; identity is all we have.
    return None if tensor.is_inference() else tensor._version


class _IdentityCache:
    """Remembers f(tensor) for the last two tensors it saw.

    One processor instance is shared by every attention module of a transformer; a forward pass
    hands the same mask tensor to all double-stream blocks and another to all single-stream blocks,
    so two entries turn 2 x (number of blocks) host syncs into 2. Entries hold a strong reference to
    the tensor and compare identity plus its version counter, so a freed tensor whose memory is
    reused can never alias an entry and an in-place edit invalidates it (inference-mode tensors have
    no version counter: do not edit a mask in place after passing it to the model).
    """

    def __init__(self, fn: Callable[["torch.Tensor"], Any]) -> None:
        self._fn = fn
        self._entries: tuple = ()

    def get(self, tensor: "torch.Tensor"):
        for cached, version, value in self._entries:
            if cached is tensor and _version(cached) == version:
                return value
        value = self._fn(tensor)
        # Replace the whole tuple at once so concurrent readers see a consistent state.
        self._entries = ((tensor, _version(tensor), value),) + self._entries[:1]
        return value


# ---------------------------------------------------------------------------------------------
# The shared processor


def _apply_rotary(x: "torch.Tensor", freqs: "torch.Tensor") -> "torch.Tensor":
    """Rotates consecutive pairs of `x`'s last dim by HiDream's 2x2 rope matrices, in float32.

    `freqs` is HiDreamImageEmbedND's output, (batch, seq, 1, dim/2, 2, 2); the result has x's dtype.
    """
    pairs = x.float().unflatten(-1, (-1, 1, 2))  # (..., dim/2, 1, 2)
    rotated = freqs[..., 0] * pairs[..., 0] + freqs[..., 1] * pairs[..., 1]  # (..., dim/2, 2)
    return rotated.flatten(-2).to(x.dtype)


class HiDreamStrategyProcessor:
    """diffusers-compatible processor for `HiDreamAttention`; subclasses implement `attend`.

    Called as `processor(attn, hidden_states, hidden_states_masks, encoder_hidden_states,
    image_rotary_emb)` by `HiDreamAttention.forward`. Returns the image (and, in double-stream
    blocks, the text) output after the output projections, like diffusers' processor. Differences
    from diffusers' processor: the collapse encoding (-P mask entries) is understood, the mask's
    dtype may differ from the model's (the pipeline sends float32), and a missing
    `image_rotary_emb` means no rope instead of an error.
    """

    strategy_name: str = "?"

    def __init__(self) -> None:
        self._masks = _IdentityCache(key_terms)
        self._padded_bias = _IdentityCache(lambda bias: {})

    def __repr__(self) -> str:
        return f"{type(self).__name__}(strategy={self.strategy_name!r})"

    # -- kernel ------------------------------------------------------------------------------
    def attend(
        self, q: "torch.Tensor", k: "torch.Tensor", v: "torch.Tensor", key_bias: "torch.Tensor | None"
    ) -> "torch.Tensor":
        """softmax(q k^T / sqrt(d) + key_bias) v on (batch, seq, heads, head_dim) tensors."""
        raise NotImplementedError

    # -- projections -------------------------------------------------------------------------
    @staticmethod
    def _project(attn, hidden, to_q, to_k, to_v, q_norm, k_norm):
        dtype = hidden.dtype
        batch = hidden.shape[0]
        # RMSNorm may compute in float32; diffusers casts back so q/k match v's dtype.
        q = q_norm(to_q(hidden)).to(dtype=dtype)
        k = k_norm(to_k(hidden)).to(dtype=dtype)
        v = to_v(hidden)
        head_dim = k.shape[-1] // attn.heads
        shape = (batch, -1, attn.heads, head_dim)
        return q.view(shape), k.view(shape), v.view(shape)

    def __call__(
        self,
        attn,
        hidden_states: "torch.Tensor",
        hidden_states_masks: "torch.Tensor | None" = None,
        encoder_hidden_states: "torch.Tensor | None" = None,
        image_rotary_emb: "torch.Tensor | None" = None,
        *args,
        **kwargs,
    ):
        import torch
        import torch.nn.functional as F

        batch = hidden_states.shape[0]
        query, key, value = self._project(
            attn, hidden_states, attn.to_q, attn.to_k, attn.to_v, attn.q_rms_norm, attn.k_rms_norm
        )
        num_image_tokens = query.shape[1]

        key_bias = None
        if hidden_states_masks is not None:
            if hidden_states_masks.shape[-1] != num_image_tokens:
                raise ValueError(
                    f"hidden_states_masks has {hidden_states_masks.shape[-1]} entries per sample but the "
                    f"attention input has {num_image_tokens} tokens; the mask must cover every token of "
                    "`hidden_states` (the transformer appends ones for text tokens in single-stream blocks)"
                )
            multiplier, key_bias = self._masks.get(hidden_states_masks)
            # Cast the multiplier (float32 from the pipeline) to the key dtype: values are 0 or the
            # mask itself, so a bf16 key stays bf16 and 0/1 products stay exact.
            key = key * multiplier.view(batch, -1, 1, 1).to(key.dtype)

        if not attn.single:
            query_t, key_t, value_t = self._project(
                attn,
                encoder_hidden_states,
                attn.to_q_t,
                attn.to_k_t,
                attn.to_v_t,
                attn.q_rms_norm_t,
                attn.k_rms_norm_t,
            )
            num_text_tokens = query_t.shape[1]
            query = torch.cat([query, query_t], dim=1)
            key = torch.cat([key, key_t], dim=1)
            value = torch.cat([value, value_t], dim=1)
            if key_bias is not None:
                # Text tokens are never padded: multiplicity 1, bias 0. Cached so every double-stream
                # block of a forward sees the same padded tensor (kernels cache on its identity).
                by_length = self._padded_bias.get(key_bias)
                if num_text_tokens not in by_length:
                    by_length[num_text_tokens] = F.pad(key_bias, (0, num_text_tokens))
                key_bias = by_length[num_text_tokens]

        if image_rotary_emb is not None:
            # HiDream's rope covers the whole head when head_dim == 2 * (number of rotation
            # pairs), otherwise only the first half of each head (diffusers does the same).
            if query.shape[-1] == image_rotary_emb.shape[-3] * 2:
                query = _apply_rotary(query, image_rotary_emb)
                key = _apply_rotary(key, image_rotary_emb)
            else:
                half = query.shape[-1] // 2
                query = torch.cat([_apply_rotary(query[..., :half], image_rotary_emb), query[..., half:]], dim=-1)
                key = torch.cat([_apply_rotary(key[..., :half], image_rotary_emb), key[..., half:]], dim=-1)

        out = self.attend(query, key, value, key_bias)
        out = out.reshape(batch, -1, attn.heads * query.shape[-1]).to(query.dtype)

        if attn.single:
            return attn.to_out(out)
        out_i, out_t = torch.split(out, [num_image_tokens, num_text_tokens], dim=1)
        return attn.to_out(out_i), attn.to_out_t(out_t)


# ---------------------------------------------------------------------------------------------
# Kernels


def _default_accum(dtype: "torch.dtype") -> "torch.dtype":
    import torch

    # float32 accumulation for half inputs; never *lower* the precision of float64 inputs.
    return torch.float64 if dtype == torch.float64 else torch.float32


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
    """

    strategy_name = "npu_fusion"

    def __init__(
        self, fusion_fn: Callable | None = None, input_layout: str = "BSND", pse_layout: str = "BN1S"
    ):
        super().__init__()
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


class FlashAttnProcessor(HiDreamStrategyProcessor):
    """The flash-attn package's `flash_attn_func` (CUDA, float16/bfloat16, (B, S, H, D) layout).

    flash_attn_func has no additive bias. With a key bias we call it with
    `return_attn_probs=True` to get the softmax log-sum-exp, then add the missing exp(b) - 1
    copies of the few biased keys exactly in float32 (`add_key_multiplicity`): no extra pass over
    the sequence, the collapse keeps its savings, and the bias is not rounded to bf16. (Falling
    back to SDPA would work but drop flash for every E1.1 edit, since non-square edits always
    carry a collapsed pad; expanding the pad back to P copies would undo the collapse.)
    `flash_fn` replaces the real function (tests pass a fake).
    """

    strategy_name = "flash_attn"

    def __init__(self, flash_fn: Callable | None = None):
        super().__init__()
        self.flash_fn = flash_fn
        # The processor's mask cache hands the same bias tensor to every block of a forward, so
        # caching on identity avoids one host sync per block.
        self._biased_keys = _IdentityCache(biased_key_index)

    def _function(self) -> Callable:
        if self.flash_fn is not None:
            return self.flash_fn
        from flash_attn import flash_attn_func

        return flash_attn_func

    def attend(self, q, k, v, key_bias):
        # dtype: flash_attn_func itself rejects anything but fp16/bf16 with a clear error, and
        # is_available() keeps `apply` from installing this strategy for other dtypes.
        scale = q.shape[-1] ** -0.5
        fn = self._function()
        if key_bias is None:
            return fn(q, k, v, dropout_p=0.0, softmax_scale=scale, causal=False)
        out, lse, _ = fn(q, k, v, dropout_p=0.0, softmax_scale=scale, causal=False, return_attn_probs=True)
        index, valid = self._biased_keys.get(key_bias)
        return add_key_multiplicity(out, lse, q, k, v, key_bias, index, valid)


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


# ---------------------------------------------------------------------------------------------
# Availability


def _device_type(device: Any) -> str:
    if isinstance(device, str):
        return device.split(":", 1)[0]
    device_type = getattr(device, "type", None)
    if isinstance(device_type, str):
        return device_type
    raise TypeError(f"device must be a DeviceInfo, torch.device or device string, got {device!r}")


def _device_index(device: Any) -> int | None:
    if isinstance(device, str):
        return int(device.split(":", 1)[1]) if ":" in device else None
    return getattr(device, "index", None)


def _dtype_label(dtype: Any) -> str:
    return str(dtype).replace("torch.", "")


def _is_half(dtype: Any) -> bool:
    import torch

    return dtype in (torch.float16, torch.bfloat16)


def _always(device: Any, dtype: Any) -> tuple[bool, str]:
    _device_type(device)  # validates the argument
    return True, "pure torch: runs on every device and dtype"


def _sdpa_available(device: Any, dtype: Any) -> tuple[bool, str]:
    import torch

    kind = _device_type(device)
    return True, f"torch {torch.__version__} picks its fused kernel for {kind}/{_dtype_label(dtype)}"


def _npu_fusion_available(device: Any, dtype: Any) -> tuple[bool, str]:
    kind = _device_type(device)
    if kind != "npu":
        return False, f"needs an Ascend NPU (device is {kind})"
    if not _is_half(dtype):
        return False, f"npu_fusion_attention takes float16/bfloat16 only (dtype is {_dtype_label(dtype)})"
    if importlib.util.find_spec("torch_npu") is None:
        return False, "torch_npu is not installed (install the build matching your CANN and torch)"
    module = sys.modules.get("torch_npu")
    if module is not None and not hasattr(module, "npu_fusion_attention"):
        return False, "this torch_npu has no npu_fusion_attention (needs torch_npu >= 2.1 / CANN 7)"
    return True, (
        f"torch_npu.npu_fusion_attention, BSND, pse bias; limits: head_dim <= {NPU_FUSION_MAX_HEAD_DIM}, "
        f"<= {NPU_FUSION_MAX_HEADS} heads"
    )


def _flash_attn_available(device: Any, dtype: Any) -> tuple[bool, str]:
    kind = _device_type(device)
    if kind != "cuda":
        return False, f"flash-attn is a CUDA package (device is {kind})"
    if not _is_half(dtype):
        return False, f"flash-attn takes float16/bfloat16 only (dtype is {_dtype_label(dtype)})"
    if importlib.util.find_spec("flash_attn") is None:
        return False, "the flash-attn package is not installed (pip install flash-attn --no-build-isolation)"
    try:
        # A present but ABI-mismatched build is common: only an import tells.
        from flash_attn import flash_attn_func  # noqa: F401
    except (ImportError, OSError) as exc:
        return False, f"flash-attn is installed but does not import: {exc}"
    import torch

    if torch.cuda.is_available():
        index = _device_index(device)
        major, minor = torch.cuda.get_device_capability(0 if index is None else index)
        if major < 8:
            return False, f"flash-attn 2 needs compute capability >= 8.0 (this GPU is {major}.{minor})"
    return True, "flash_attn.flash_attn_func; collapsed padding added exactly from its log-sum-exp"


def _sdpa_backend_available(backend: str, cuda_only: bool, half_only: bool):
    def check(device: Any, dtype: Any) -> tuple[bool, str]:
        import torch

        kind = _device_type(device)
        allowed = ("cuda",) if cuda_only else ("cuda", "cpu")
        if kind not in allowed:
            return False, f"SDPA backend {backend} runs on {' / '.join(allowed)} only (device is {kind})"
        try:
            from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: F401
        except ImportError:
            return False, f"torch {torch.__version__} has no torch.nn.attention.sdpa_kernel (needs torch >= 2.3)"
        if not hasattr(SDPBackend, backend):
            return False, f"torch {torch.__version__} has no SDPA backend {backend}"
        if half_only and not _is_half(dtype):
            return False, f"SDPA backend {backend} takes float16/bfloat16 only (dtype is {_dtype_label(dtype)})"
        if kind == "cuda":
            if not torch.cuda.is_available():
                return False, "torch reports no CUDA device"
            if backend == "FLASH_ATTENTION" and not torch.backends.cuda.is_flash_attention_available():
                return False, "this torch build has no flash SDPA kernel"
            if backend == "CUDNN_ATTENTION" and not torch.backends.cudnn.is_available():
                return False, "cuDNN is not available to torch"
        return True, f"torch SDPA forced to {backend} (process-global while running)"

    return check


def _auto_available(device: Any, dtype: Any) -> tuple[bool, str]:
    return True, f"resolves to {resolve(AUTO, device, dtype).name!r} for {_device_type(device)}/{_dtype_label(dtype)}"


def _auto_processor(**options: Any) -> HiDreamStrategyProcessor:
    raise ValueError("'auto' is resolved per device and dtype: call resolve('auto', device, dtype) or apply()")


# ---------------------------------------------------------------------------------------------
# Registry


def _backend_factory(name: str, backend: str) -> Callable[[], SdpaBackendProcessor]:
    def make() -> SdpaBackendProcessor:
        return SdpaBackendProcessor(name, backend)

    return make


_STRATEGIES = (
    AttentionStrategy(
        AUTO,
        "best available here: npu_fusion on NPU, flash_attn (else sdpa) on CUDA, sdpa elsewhere",
        _auto_available,
        _auto_processor,
    ),
    AttentionStrategy(
        "sdpa",
        "torch scaled_dot_product_attention, torch picks the kernel; collapsed padding as a float mask",
        _sdpa_available,
        SdpaProcessor,
    ),
    AttentionStrategy(
        "math",
        "explicit softmax(QK^T/sqrt(d)+bias)V in float32: the reference ('vanilla'); O(S^2) memory",
        _always,
        MathProcessor,
    ),
    AttentionStrategy(
        "chunked",
        "exact float32 attention over query chunks (option chunk_size, default 1024): bounded memory",
        _always,
        ChunkedProcessor,
    ),
    AttentionStrategy(
        "npu_fusion",
        "Ascend torch_npu.npu_fusion_attention (fp16/bf16, BSND, scale 1/sqrt(d), bias via pse; "
        f"head_dim <= {NPU_FUSION_MAX_HEAD_DIM}, <= {NPU_FUSION_MAX_HEADS} heads)",
        _npu_fusion_available,
        NpuFusionProcessor,
    ),
    AttentionStrategy(
        "flash_attn",
        "flash-attn package flash_attn_func (CUDA sm80+, fp16/bf16); collapsed padding added via its LSE",
        _flash_attn_available,
        FlashAttnProcessor,
    ),
    AttentionStrategy(
        "sdpa_flash",
        "torch SDPA forced to FLASH_ATTENTION (CUDA, fp16/bf16; masked calls may use EFFICIENT)",
        _sdpa_backend_available("FLASH_ATTENTION", cuda_only=True, half_only=True),
        _backend_factory("sdpa_flash", "FLASH_ATTENTION"),
    ),
    AttentionStrategy(
        "sdpa_efficient",
        "torch SDPA forced to EFFICIENT_ATTENTION (CUDA)",
        _sdpa_backend_available("EFFICIENT_ATTENTION", cuda_only=True, half_only=False),
        _backend_factory("sdpa_efficient", "EFFICIENT_ATTENTION"),
    ),
    AttentionStrategy(
        "sdpa_cudnn",
        "torch SDPA forced to CUDNN_ATTENTION (CUDA, fp16/bf16)",
        _sdpa_backend_available("CUDNN_ATTENTION", cuda_only=True, half_only=True),
        _backend_factory("sdpa_cudnn", "CUDNN_ATTENTION"),
    ),
    AttentionStrategy(
        "sdpa_math",
        "torch SDPA forced to its MATH backend (CPU and CUDA); O(S^2) memory",
        _sdpa_backend_available("MATH", cuda_only=False, half_only=False),
        _backend_factory("sdpa_math", "MATH"),
    ),
)

_BY_NAME = MappingProxyType({strategy.name: strategy for strategy in _STRATEGIES})

# Per device type, in order of preference, what `auto` resolves to (first available wins).
_AUTO_PREFERENCES = MappingProxyType({"npu": ("npu_fusion", "sdpa"), "cuda": ("flash_attn", "sdpa")})


# ---------------------------------------------------------------------------------------------
# Public API


def strategy_names() -> tuple[str, ...]:
    """Every registered name, `auto` first (for CLI choices and config validation; no torch)."""
    return tuple(_BY_NAME)


def get_strategy(name: str) -> AttentionStrategy:
    """The strategy called `name`; ValueError listing the valid names otherwise."""
    strategy = _BY_NAME.get(name) if isinstance(name, str) else None
    if strategy is None:
        raise ValueError(f"unknown attention strategy {name!r}; choose one of: {', '.join(_BY_NAME)}")
    return strategy


def resolve(name: str, device: Any, dtype: "torch.dtype") -> AttentionStrategy:
    """`get_strategy(name)`, except that `auto` becomes the best available strategy here."""
    strategy = get_strategy(name)
    if strategy.name != AUTO:
        return strategy
    for candidate in _AUTO_PREFERENCES.get(_device_type(device), ()) + ("sdpa",):
        if _BY_NAME[candidate].is_available(device, dtype)[0]:
            return _BY_NAME[candidate]
    return _BY_NAME["math"]  # unreachable in practice: sdpa is always available


def list_strategies(device: Any, dtype: "torch.dtype") -> list[StrategyStatus]:
    """Every strategy with whether it runs on `device` / `dtype` and why (not)."""
    statuses = []
    for strategy in _STRATEGIES:
        available, reason = strategy.is_available(device, dtype)
        statuses.append(StrategyStatus(strategy.name, strategy.description, available, reason))
    return statuses


def hidream_attention_modules(transformer) -> list:
    """Every diffusers `HiDreamAttention` in `transformer` (double- and single-stream), in order."""
    from diffusers.models.transformers.transformer_hidream_image import HiDreamAttention

    return [module for module in transformer.modules() if isinstance(module, HiDreamAttention)]


def apply(transformer, name: str, device: Any, dtype: "torch.dtype", **options: Any) -> str:
    """Installs strategy `name` (options go to its processor) on every HiDreamAttention module.

    Returns the resolved name (what `auto` became). Raises ValueError for an unknown name or bad
    options and `AttentionUnavailable` when the strategy cannot run on `device` / `dtype`; in
    every error case the transformer is left untouched. Parameters and buffers are never touched:
    processors hold no weights. Not thread-safe with a running forward (see module docstring).
    """
    strategy = resolve(name, device, dtype)
    available, reason = strategy.is_available(device, dtype)
    if not available:
        raise AttentionUnavailable(strategy.name, reason)
    modules = hidream_attention_modules(transformer)
    if not modules:
        raise ValueError(
            f"{type(transformer).__name__} has no HiDreamAttention modules: pass the pipeline's transformer"
        )
    # Built before any module is touched, so bad options leave the transformer as it was. One
    # instance serves every module: it is stateless apart from caches keyed on the mask tensor.
    processor = strategy.make_processor(**options)
    for module in modules:
        module.set_processor(processor)
    return strategy.name


def current_strategy(transformer) -> str | None:
    """The strategy name shared by every HiDreamAttention processor of `transformer`.

    None when there are no such modules, when some processor is not one of ours (e.g. diffusers'
    default), or when modules disagree.
    """
    names = {getattr(module.processor, "strategy_name", None) for module in hidream_attention_modules(transformer)}
    return names.pop() if len(names) == 1 else None
