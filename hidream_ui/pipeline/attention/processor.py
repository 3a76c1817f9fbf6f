"""The attention processor every strategy shares: HiDream's q/k/v, rope and the collapse encoding;
a strategy only brings the kernel.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:  # pragma: no cover
    import torch


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
    `hidream_ui.device.backends.DeviceInfo` or `torch.device` (or a device string) and a torch dtype, and
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


# Set on each HiDreamAttention module by the sync-free mode (pipeline/speed/moe.py `apply_moe`); on the
# module, not the processor, so it survives attention switches (each switch installs a new processor).
SYNC_FREE_MASK_ATTR = "hidream_ui_sync_free_mask"


def key_terms_without_sync(mask: "torch.Tensor") -> tuple["torch.Tensor", "torch.Tensor"]:
    """`key_terms` without its host read: the bias is always made (all zeros where nothing is padded).

    Same values (log 1 = 0 exactly), but the kernel then always takes the biased path, which may round
    differently from the unbiased one: hence only in the sync-free mode, never in exact mode.
    """
    import torch

    return mask.clamp(min=0), torch.log((-mask.float()).clamp(min=1.0))


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
        self._masks_without_sync = _IdentityCache(key_terms_without_sync)
        self._padded_bias = _IdentityCache(lambda bias: {})

    def __repr__(self) -> str:
        return f"{type(self).__name__}(strategy={self.strategy_name!r})"

    # -- kernel ------------------------------------------------------------------------------
    def attend(
        self, q: "torch.Tensor", k: "torch.Tensor", v: "torch.Tensor", key_bias: "torch.Tensor | None"
    ) -> "torch.Tensor":
        """softmax(q k^T / sqrt(d) + key_bias) v on (batch, seq, heads, head_dim) tensors."""
        raise NotImplementedError

    # -- norms and rope (the pure-torch reference; `npu_fusion` overrides them with fused ops) --
    def _rms_norm(self, norm, x: "torch.Tensor") -> "torch.Tensor":
        return norm(x)

    def _rotary(self, x: "torch.Tensor", freqs: "torch.Tensor") -> "torch.Tensor":
        return _apply_rotary(x, freqs)

    # -- projections -------------------------------------------------------------------------
    def _project(self, attn, hidden, to_q, to_k, to_v, q_norm, k_norm):
        dtype = hidden.dtype
        batch = hidden.shape[0]
        # RMSNorm may compute in float32; diffusers casts back so q/k match v's dtype.
        q = self._rms_norm(q_norm, to_q(hidden)).to(dtype=dtype)
        k = self._rms_norm(k_norm, to_k(hidden)).to(dtype=dtype)
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
            masks = self._masks_without_sync if getattr(attn, SYNC_FREE_MASK_ATTR, False) else self._masks
            multiplier, key_bias = masks.get(hidden_states_masks)
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
                query = self._rotary(query, image_rotary_emb)
                key = self._rotary(key, image_rotary_emb)
            else:
                half = query.shape[-1] // 2
                query = torch.cat([self._rotary(query[..., :half], image_rotary_emb), query[..., half:]], dim=-1)
                key = torch.cat([self._rotary(key[..., :half], image_rotary_emb), key[..., half:]], dim=-1)

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
