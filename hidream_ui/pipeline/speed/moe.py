"""Sync-free MoE: HiDream's routed feed-forward without a device-to-host transfer.

diffusers' `MOEFeedForwardSwiGLU.moe_infer` sorts the routed tokens by expert and reads the
per-expert counts with `bincount().cpu()`: one device-to-host sync per MoE block per transformer
call (16 double + 32 single blocks = 48 per call on the real model). On NPU/GPU that drains the
launch queue every block, and it makes graph capture (`--compile blocks`, torchair) break the
graph at every block.

`sync_free_moe` computes the same sum with shapes that do not depend on the routing: every routed
expert runs on every token and its output is weighted by the token's gate weight for that expert,
which is exactly 0 where the token did not pick it. Adding an exact 0 changes nothing, so the
result equals diffusers' up to the matmul's own rounding of a differently blocked GEMM (measured:
fp32 max relative error ~1e-7, see `bench speed`). The cost is E/k times the routed FLOPs (4/2 = 2x
for HiDream), which is why this is a mode (`--moe sync-free`) and not the default: on CPU, where a
"sync" is free, it is slower; on accelerators it removes 48 host round trips per call and is what
graph capture needs.

Why not a grouped GEMM (`torch._grouped_mm`, NPU `npu_grouped_matmul`): on CUDA/CPU it needs the
expert weights stacked into one (E, in, out) tensor, i.e. a copy of every expert weight (or
re-homing the parameters into a shared buffer), which conflicts with "weights untouched", with
E1-Full's refine-stage weight swap (it exchanges `param.data` of these very linears) and with
hooks that live on the expert linears (LoRA, layerwise casting, offloading). Calling the expert
modules keeps all of those working.

Installed as a diffusers `ModelHook` (`new_forward`) on each `MOEFeedForwardSwiGLU`, so it composes
with other hooks in the same `HookRegistry` and comes off again with `remove_sync_free_moe`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from diffusers.hooks import HookRegistry, ModelHook

from hidream_ui.pipeline.attention.processor import SYNC_FREE_MASK_ATTR
from hidream_ui.pipeline.attention.registry import hidream_attention_modules

if TYPE_CHECKING:  # pragma: no cover
    import torch

MOE_MODES = ("diffusers", "sync-free")
HOOK_NAME = "hidream_ui_sync_free_moe"


def sync_free_moe(module, x: "torch.Tensor") -> "torch.Tensor":
    """Same result as `MOEFeedForwardSwiGLU.forward` in inference, with routing-independent shapes."""
    import torch

    orig_shape = x.shape
    topk_idx, topk_weight, _ = module.gate(x)
    flat = x.reshape(-1, orig_shape[-1])
    # (tokens, experts) gate weights: the token's top-k weights in their experts' columns, 0 elsewhere.
    dense = torch.zeros(flat.shape[0], len(module.experts), dtype=topk_weight.dtype, device=x.device)
    dense.scatter_(1, topk_idx, topk_weight)
    routed = torch.zeros_like(flat)
    # Experts in index order, each output multiplied by its weight before the sum: the order and the
    # rounding steps of diffusers' moe_infer (expert_out.mul_(weight), then a sum into zeros).
    for e, expert in enumerate(module.experts):
        out = expert(flat)
        routed = routed.to(out.dtype)
        routed = routed + out * dense[:, e:e + 1].to(out.dtype)
    return routed.view(*orig_shape) + module.shared_experts(x)


class SyncFreeMoEHook(ModelHook):
    """Replaces a `MOEFeedForwardSwiGLU` forward in inference; training keeps diffusers' path."""

    def new_forward(self, module, x):
        if module.training and not module._force_inference_output:
            return self.fn_ref.original_forward(x)
        return sync_free_moe(module, x)


def moe_modules(transformer) -> list:
    from diffusers.models.transformers.transformer_hidream_image import MOEFeedForwardSwiGLU

    return [m for m in transformer.modules() if isinstance(m, MOEFeedForwardSwiGLU)]


def apply_moe(transformer, mode: str) -> int:
    """Puts every MoE block of `transformer` in `mode` ("diffusers" or "sync-free"); returns how
    many MoE modules the mode applies to. Idempotent; no weight is read or copied."""
    if mode not in MOE_MODES:
        raise ValueError(f"moe={mode!r} is not one of: {', '.join(MOE_MODES)}")

    # The forward's other host read is the attention's "is anything padded?" check: the sync-free mode
    # makes the padding bias unconditionally instead (pipeline/attention/processor.py).
    for attention in hidream_attention_modules(transformer):
        setattr(attention, SYNC_FREE_MASK_ATTR, mode == "sync-free")
    modules = moe_modules(transformer)
    for module in modules:
        registry = getattr(module, "_diffusers_hook", None)  # exact mode leaves untouched modules untouched
        has = registry is not None and registry.get_hook(HOOK_NAME) is not None
        if mode == "sync-free" and not has:
            HookRegistry.check_if_exists_or_initialize(module).register_hook(SyncFreeMoEHook(), HOOK_NAME)
        elif mode == "diffusers" and has:
            registry.remove_hook(HOOK_NAME, recurse=False)
    return len(modules)


def moe_mode(transformer) -> str:
    """The mode the MoE blocks of `transformer` are in ("diffusers" when it has none)."""
    for module in moe_modules(transformer):
        registry = getattr(module, "_diffusers_hook", None)
        return "sync-free" if registry is not None and registry.get_hook(HOOK_NAME) is not None else "diffusers"
    return "diffusers"
