"""Sync-free MoE: HiDream's routed feed-forward without a device-to-host transfer.

diffusers' `MOEFeedForwardSwiGLU.moe_infer` sorts the routed tokens by expert and reads the
per-expert counts with `bincount().cpu()`: one device-to-host sync per MoE block per transformer
call (16 double + 32 single blocks = 48 per call on the real model). On NPU/GPU that drains the
launch queue every block, and it makes graph capture (`--compile blocks`, torchair) break the
graph at every block.

The sync-free forward groups the routed tokens by expert on the device and runs the three SwiGLU
matmuls as grouped GEMMs (`torch._grouped_mm`): one matmul per weight kind over the tokens sorted by
expert, the group boundaries given as a device tensor of offsets, so no shape depends on the routing
and nothing is read back to the host. Its cost is the routed FLOPs, as diffusers' `moe_infer`, plus
one gather and one `index_add_`. The grouped GEMM needs each weight kind of the experts as one
(E, out, in) tensor: at `apply_moe` the expert weights are re-homed, one MoE module at a time, into one
stacked buffer per kind, each expert's `weight.data` becoming a view of it (one copy at load, no
second copy kept; diffusers' own path computes on the same views, bit for bit).

Where the grouped GEMM cannot run, the same hook computes the dense form instead (every routed
expert on every token, its output weighted by the token's gate weight for that expert, which is
exactly 0 where the token did not pick it: E/k = 2x the routed FLOPs, still no host read):
- an expert linear carries a hook or is wrapped (LoRA adapters, layerwise casting for fp8 storage,
  leaf-level offloading): calling the expert modules keeps those working;
- the weights move between calls (block-level group offloading re-homes `param.data` at every
  onload), seen as two calls in a row whose weights are not the stacked views;
- the device or dtype has no grouped GEMM (`torch._grouped_mm` raises: CUDA before sm90, NPU; the
  reason is kept in `GroupedExperts.dense_reason`);
- inside a `torch.compile` graph (`--compile blocks`), whose guards would not see a weight swap.
E1-Full's refine-stage weight swap exchanges `param.data` of these linears: the hook then re-homes
the other weight set once into its own stacked buffer and keeps both (2 at most), so a swap back
finds its views again.

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
    """The dense form: same result as `MOEFeedForwardSwiGLU.forward` in inference, every routed expert
    on every token (routing-independent shapes, 2x the routed FLOPs)."""
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
        routed = routed + out * dense[:, e : e + 1].to(out.dtype)
    return routed.view(*orig_shape) + module.shared_experts(x)


_KINDS = ("w1", "w3", "w2")
_MAX_STACKS = 2  # the edit and refine weight sets of E1-Full
_STACKS_ATTR = "_hidream_ui_grouped_experts"


def _plain_linear(linear) -> bool:
    import torch

    return (
        type(linear) is torch.nn.Linear
        and linear.bias is None
        and getattr(linear, "_diffusers_hook", None) is None
        and getattr(linear, "_hf_hook", None) is None
        and linear.weight.device.type != "meta"
    )


class GroupedExperts:
    """The stacked expert weights of one MoE module and the decision grouped / dense."""

    def __init__(self):
        self.stacks: dict[tuple[int, ...], dict[str, "torch.Tensor"]] = {}
        self.misses_in_a_row = 0
        self.dense_reason: str | None = None
        self.grouped_calls = 0
        self.dense_calls = 0

    @staticmethod
    def _linears(module) -> list | None:
        experts = list(module.experts)
        linears = [getattr(expert, kind, None) for expert in experts for kind in _KINDS]
        return linears if all(_plain_linear(linear) for linear in linears) else None

    @staticmethod
    def _key(module) -> tuple[int, ...]:
        return tuple(getattr(expert, kind).weight.data_ptr() for expert in module.experts for kind in _KINDS)

    def rehome(self, module) -> dict[str, "torch.Tensor"] | None:
        """Moves the current expert weights into one buffer per kind, each weight a view of it."""
        import torch

        if self._linears(module) is None:
            self.dense_reason = "an expert linear is wrapped or hooked (LoRA, fp8 casting or offloading)"
            return None
        stack = {}
        with torch.no_grad():
            for kind in _KINDS:
                params = [getattr(expert, kind).weight for expert in module.experts]
                first = params[0]
                if any(p.shape != first.shape or p.dtype != first.dtype or p.device != first.device for p in params):
                    self.dense_reason = f"the experts' {kind} weights differ in shape, dtype or device"
                    return None
                buffer = torch.empty((len(params), *first.shape), dtype=first.dtype, device=first.device)
                for e, param in enumerate(params):
                    buffer[e].copy_(param.data)
                    param.data = buffer[e]  # the old storage is freed here: one buffer, no second copy
                stack[kind] = buffer
        if len(self.stacks) >= _MAX_STACKS:
            self.stacks.pop(next(iter(self.stacks)))
        self.stacks[self._key(module)] = stack
        return stack

    def current(self, module) -> dict[str, "torch.Tensor"] | None:
        """The stack whose views the expert weights are now, re-homing once after a weight swap."""
        if self.dense_reason is not None:
            return None
        stack = self.stacks.get(self._key(module))
        if stack is not None:
            self.misses_in_a_row = 0
            return stack
        self.misses_in_a_row += 1
        if self.misses_in_a_row > 1:  # a swap happens between calls; moving weights happen at every call
            self.dense_reason = "the expert weights move between calls (offloading)"
            self.stacks.clear()
            return None
        return self.rehome(module)


def grouped_moe(module, x: "torch.Tensor", stack: dict[str, "torch.Tensor"]) -> "torch.Tensor":
    """diffusers' `moe_infer` as three grouped GEMMs over the tokens sorted by expert, offsets on the device."""
    import torch

    orig_shape = x.shape
    topk_idx, topk_weight, _ = module.gate(x)
    flat = x.reshape(-1, orig_shape[-1])
    flat_idx = topk_idx.reshape(-1)
    order = flat_idx.argsort(stable=True)  # diffusers' order within an expert: ascending (token, slot)
    token = order // topk_idx.shape[1]
    offsets = torch.bincount(flat_idx, minlength=len(module.experts)).cumsum(0).to(torch.int32)
    routed = flat[token]
    w1, w3, w2 = (stack[kind].transpose(1, 2) for kind in _KINDS)
    hidden = torch.nn.functional.silu(torch._grouped_mm(routed, w1, offs=offsets))
    hidden = hidden * torch._grouped_mm(routed, w3, offs=offsets)
    out = torch._grouped_mm(hidden, w2, offs=offsets)
    out = out * topk_weight.reshape(-1, 1)[order].to(out.dtype)
    y = torch.zeros(flat.shape, dtype=out.dtype, device=x.device).index_add_(0, token, out)
    return y.view(*orig_shape) + module.shared_experts(x)


class SyncFreeMoEHook(ModelHook):
    """Replaces a `MOEFeedForwardSwiGLU` forward in inference; training keeps diffusers' path."""

    def __init__(self):
        super().__init__()
        self.experts = GroupedExperts()

    def initialize_hook(self, module):
        # The stacks live on the module, so switching the mode off and on again re-homes nothing.
        self.experts = module.__dict__.setdefault(_STACKS_ATTR, self.experts)
        if self.experts.dense_reason is None and self.experts._key(module) not in self.experts.stacks:
            self.experts.rehome(module)
        return module

    def new_forward(self, module, x):
        import torch

        if module.training and not module._force_inference_output:
            return self.fn_ref.original_forward(x)
        stack = None if torch.compiler.is_compiling() else self.experts.current(module)
        if stack is not None:
            try:
                out = grouped_moe(module, x, stack)
            except (RuntimeError, NotImplementedError) as exc:  # no grouped GEMM for this device/dtype
                self.experts.dense_reason = f"torch._grouped_mm: {str(exc).splitlines()[0]}"
            else:
                self.experts.grouped_calls += 1
                return out
        self.experts.dense_calls += 1
        return sync_free_moe(module, x)


def moe_modules(transformer) -> list:
    from diffusers.models.transformers.transformer_hidream_image import MOEFeedForwardSwiGLU

    return [m for m in transformer.modules() if isinstance(m, MOEFeedForwardSwiGLU)]


def apply_moe(transformer, mode: str) -> int:
    """Puts every MoE block of `transformer` in `mode` ("diffusers" or "sync-free"); returns how
    many MoE modules the mode applies to. Idempotent. The first switch to "sync-free" re-homes each
    module's expert weights into stacked buffers (see the module docstring); values never change."""
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


def grouped_state(transformer) -> dict[str, object]:
    """How the sync-free MoE modules ran: grouped / dense call counts and why any went dense."""
    grouped = dense = 0
    reasons: list[str] = []
    for module in moe_modules(transformer):
        registry = getattr(module, "_diffusers_hook", None)
        hook = registry.get_hook(HOOK_NAME) if registry is not None else None
        if hook is None:
            continue
        grouped += hook.experts.grouped_calls
        dense += hook.experts.dense_calls
        if hook.experts.dense_reason and hook.experts.dense_reason not in reasons:
            reasons.append(hook.experts.dense_reason)
    return {"grouped_calls": grouped, "dense_calls": dense, "dense_reasons": reasons}


def moe_mode(transformer) -> str:
    """The mode the MoE blocks of `transformer` are in ("diffusers" when it has none)."""
    for module in moe_modules(transformer):
        registry = getattr(module, "_diffusers_hook", None)
        return "sync-free" if registry is not None and registry.get_hook(HOOK_NAME) is not None else "diffusers"
    return "diffusers"
