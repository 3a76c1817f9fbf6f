"""FlashAttention 2 on CUDA (the flash_attn package), imported lazily."""

from __future__ import annotations

from typing import Callable

from hidream_ui.pipeline.attention.kernels import add_key_multiplicity, biased_key_index
from hidream_ui.pipeline.attention.processor import HiDreamStrategyProcessor, _IdentityCache


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
