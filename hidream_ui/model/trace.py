"""Full-scale memory traced on the `meta` device: `python -m hidream_ui plan --trace`.

The release-size parts are built on `meta` (shapes and dtypes, no data, no memory) and each phase of one
edit runs under `LiveBytes`, a TorchDispatchMode that counts every storage an operation creates (its
bytes are live from creation) and releases it when the storage dies (a weakref finalizer on the untyped
storage, which torch keeps as one Python object per storage, so views and in-place results count once).
Weights are built before the mode starts, so a phase's trace is its activations: inputs are made inside
the mode and count.

Phases: the four text encoders (one at a time, 128 tokens; the plans stream them one after another), the
transformer's 3-way guidance call at the working size (the collapsed-padding token layout the app uses),
the refine stage's 2-way call after the switch (square latents, no image conditioning), the VAE decode.

Attention kernels, modelled explicitly because meta tensors run no kernel:
- `fused` (flash / memory-efficient / NPU fused attention): the output plus the kernel's float32
  log-sum-exp (batch x heads x queries), never a score matrix;
- `math` (torch's reference path, what runs without a fused kernel): q.k^T scaled into a
  (batch x heads x queries x keys) score matrix, its softmax (a second one, both live at that instant),
  then the product with v, exactly as torch's math path allocates them.

Not traced: diffusers' HiDream MoE routing copies `bincount()` to the host, which meta tensors cannot; the
trace routes every expert the most tokens it can get (all of them: top-k picks distinct experts), the
worst case for the per-expert intermediates, which live one expert at a time. Weights a plan keeps on the
device (resident parts, the streamed groups in flight, fp8's one-layer compute copy) are counted from the
meta modules' parameters, as the planner counts them; the planner's weight counting and this trace share
that code, so plan-vs-trace differences are the activation model's.
"""

from __future__ import annotations

import contextlib
import math
import time
import types
import weakref
from dataclasses import asdict, dataclass, field
from typing import Any, Mapping

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

ATTENTION_STRATEGIES = ("fused", "math")


class LiveBytes(TorchDispatchMode):
    """Counts live bytes of the storages created while it is active: `current`, and `peak` since the last
    `reset_peak()`. Storages that existed before (weights) are not counted."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, int] = {}
        self.current = 0
        self.peak = 0
        self.outside: set[int] = set()  # storages made before the mode (never counted)
        self.dtypes: set = set()  # mixed (query, key, value) dtypes the math stand-in met

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # Storages an op reads that were made before the mode (weights, buffers, inputs) are not ours: a view
        # of one (a weight's transpose in every linear) must not count as a new allocation.
        for leaf in tree_leaves((args, kwargs)):
            if isinstance(leaf, torch.Tensor):
                self._external(leaf)
        out = func(*args, **(kwargs or {}))
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                self._track(leaf)
        return out

    def _external(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        key = storage._cdata
        if key not in self.live and key not in self.outside:
            self.outside.add(key)
            weakref.finalize(storage, self.outside.discard, key)

    def _track(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        key = storage._cdata
        if key in self.live or key in self.outside:
            return  # a view, or an in-place / out= result: its storage is counted already
        size = storage.nbytes()
        self.live[key] = size
        self.current += size
        self.peak = max(self.peak, self.current)
        weakref.finalize(storage, self._release, key)

    def _release(self, key: int) -> None:
        self.current -= self.live.pop(key, 0)

    def workspace(self, nbytes: int) -> None:
        """A kernel's transient workspace (live only inside the kernel): counts toward the peak."""
        self.peak = max(self.peak, self.current + int(nbytes))

    def reset_peak(self) -> None:
        self.peak = self.current


def _attention(strategy: str, mode: LiveBytes):
    """A stand-in for F.scaled_dot_product_attention allocating what `strategy`'s kernel allocates."""

    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if strategy == "fused":
            batch_heads = math.prod(query.shape[:-1])
            mode.workspace(batch_heads * 4)  # the float32 log-sum-exp per query
            return query.new_empty((*query.shape[:-1], value.shape[-1]))
        if key.dtype != query.dtype or value.dtype != query.dtype:
            mode.dtypes.add((query.dtype, key.dtype, value.dtype))
            key, value = key.to(query.dtype), value.to(query.dtype)
        if enable_gqa and key.shape[-3] != query.shape[-3]:
            repeat = query.shape[-3] // key.shape[-3]
            key, value = key.repeat_interleave(repeat, -3), value.repeat_interleave(repeat, -3)
        scale = 1 / math.sqrt(query.shape[-1]) if scale is None else scale
        scores = (query * scale) @ key.transpose(-2, -1)
        if attn_mask is not None:
            scores = scores + attn_mask if attn_mask.dtype != torch.bool else scores.masked_fill(~attn_mask, -1e4)
        probs = torch.softmax(scores, dim=-1)
        del scores
        return probs @ value

    return sdpa


def _moe_infer_meta(self, x, flat_expert_indices, flat_expert_weights):
    """diffusers' MOEFeedForwardSwiGLU.moe_infer without the host copy of the routing: every expert gets
    every token (the most it can), one expert at a time as there."""
    expert_cache = torch.zeros_like(x)
    idxs = flat_expert_indices.argsort()
    token_idxs = idxs // self.num_activated_experts
    tokens = x.shape[0]
    for expert in self.experts:
        exp_token_idx = token_idxs[:tokens]
        expert_out = expert(x[exp_token_idx])
        expert_out.mul_(flat_expert_weights[idxs[:tokens]])
        expert_cache = expert_cache.to(expert_out.dtype)
        expert_cache.scatter_reduce_(0, exp_token_idx.view(-1, 1).repeat(1, x.shape[-1]), expert_out, reduce="sum")
    return expert_cache


@contextlib.contextmanager
def traced(strategy: str):
    """A LiveBytes mode with `strategy`'s attention and the meta-safe MoE routing patched in."""
    import torch.nn.functional as F
    from diffusers.models.transformers import transformer_hidream_image as hidream

    if strategy not in ATTENTION_STRATEGIES:
        raise ValueError(f"attention strategy {strategy!r} must be one of {', '.join(ATTENTION_STRATEGIES)}")
    mode = LiveBytes()
    saved_sdpa, saved_moe = F.scaled_dot_product_attention, hidream.MOEFeedForwardSwiGLU.moe_infer
    F.scaled_dot_product_attention = _attention(strategy, mode)
    hidream.MOEFeedForwardSwiGLU.moe_infer = _moe_infer_meta
    try:
        with torch.no_grad(), mode:
            yield mode
    finally:
        F.scaled_dot_product_attention = saved_sdpa
        hidream.MOEFeedForwardSwiGLU.moe_infer = saved_moe


# ----------------------------------------------------------------------------------------------
# The phases of one edit


@dataclass
class Parts:
    transformer: Any
    encoders: dict[str, Any]
    vae: Any
    configs: Mapping[str, Mapping[str, Any]]


def build_parts(configs: Mapping[str, Mapping[str, Any]], dtype: torch.dtype, variant: str = "e1.1") -> Parts:
    """Every part from `configs` on meta, in `dtype` (the compute dtype: activations take it)."""
    from hidream_ui.model.geometry import geometry_for
    from hidream_ui.model.loading import BUILD_LOCK
    from hidream_ui.model.planner import ENCODER_PARTS
    from hidream_ui.model.tiny.in_memory import instantiate

    with BUILD_LOCK, torch.device("meta"):
        transformer = instantiate("transformer", configs["transformer"]).to(dtype).eval()
        encoders = {part: instantiate(part, configs[part]).to(dtype).eval() for part in ENCODER_PARTS}
        vae = instantiate("vae", configs["vae"]).to(dtype).eval()
    # The token budget the loader sets (model/loading.py): the edit input is H x 2W.
    transformer.max_seq = geometry_for(variant, configs["transformer"], configs["vae"]).max_seq
    return Parts(transformer=transformer, encoders=encoders, vae=vae, configs=configs)


def _encode(parts: Parts, mode: LiveBytes) -> int:
    """Peak over the four encoders run one at a time (Llama keeps every layer's hidden state)."""
    from hidream_ui.pipeline.prompts import PROMPT_TOKENS

    peak = 0
    for name, encoder in parts.encoders.items():
        mode.reset_peak()
        start = mode.current
        ids = torch.zeros((1, PROMPT_TOKENS), dtype=torch.long, device="meta")
        if name == "llama":
            out = encoder(input_ids=ids, output_hidden_states=True)  # no padding mask: .item() on meta
        else:
            out = encoder(input_ids=ids, output_hidden_states=name.startswith("clip"))
        del out
        peak = max(peak, mode.peak - start)
    return peak


def _embeds(parts: Parts, batch: int, dtype: torch.dtype):
    from hidream_ui.pipeline.edit_pipeline import PromptEmbeds
    from hidream_ui.pipeline.prompts import PROMPT_TOKENS

    t5 = parts.configs["t5"]["d_model"]
    llama = parts.configs["llama"]
    pooled = sum(int(parts.configs[c]["projection_dim"]) for c in ("clip_l", "clip_g"))
    return PromptEmbeds(
        t5=torch.empty((batch, PROMPT_TOKENS, t5), dtype=dtype, device="meta"),
        llama=torch.empty(
            (llama["num_hidden_layers"] + 1, batch, PROMPT_TOKENS, llama["hidden_size"]), dtype=dtype, device="meta"
        ),
        pooled=torch.empty((batch, pooled), dtype=dtype, device="meta"),
    )


def _predict(parts: Parts, hidden: torch.Tensor, text) -> torch.Tensor:
    from hidream_ui.pipeline.edit_pipeline import HiDreamEditPipeline, collapsed_tokens

    shim = types.SimpleNamespace(transformer=parts.transformer)
    shim._collapsed_tokens = lambda h: collapsed_tokens(
        h, parts.transformer.config.patch_size, parts.transformer.max_seq
    )
    timestep = torch.zeros((hidden.shape[0],), device="meta")
    # diffusers turns the image sizes into a tensor that unpatchify reads back (.item(): not on meta); the
    # sizes are known here, so unpatchify gets them as host ints.
    p = parts.transformer.config.patch_size
    known = [(hidden.shape[-2] // p, hidden.shape[-1] // p)] * hidden.shape[0]
    unpatchify = type(parts.transformer).unpatchify
    parts.transformer.unpatchify = lambda x, img_sizes, is_training: unpatchify(
        parts.transformer, x, known, is_training
    )
    try:
        return HiDreamEditPipeline.predict(shim, hidden, timestep, text, True)
    finally:
        del parts.transformer.unpatchify


def _denoise(parts: Parts, mode: LiveBytes, size: tuple[int, int], dtype: torch.dtype, refine: bool) -> int:
    width, height = size
    scale = 2 ** (len(parts.configs["vae"]["block_out_channels"]) - 1)
    channels = parts.transformer.config.in_channels
    start = mode.current
    mode.reset_peak()
    latents = torch.empty((1, channels, height // scale, width // scale), dtype=dtype, device="meta")
    if refine:  # after the switch: [uncond, target] on the latents alone
        hidden = torch.cat([latents] * 2)
        text = _embeds(parts, 2, dtype)
    else:  # [uncond, image-cond, full-cond], the source latents beside the noisy ones (H x 2W)
        source = torch.empty_like(latents)
        image = torch.cat([torch.zeros_like(source), source, source])
        hidden = torch.cat([torch.cat([latents] * 3), image], dim=-1)
        del image, source
        text = _embeds(parts, 3, dtype)
    out = _predict(parts, hidden, text)
    del out, hidden, text, latents
    return mode.peak - start


def _decode(parts: Parts, mode: LiveBytes, size: tuple[int, int], dtype: torch.dtype) -> int:
    width, height = size
    scale = 2 ** (len(parts.configs["vae"]["block_out_channels"]) - 1)
    start = mode.current
    mode.reset_peak()
    latents = torch.empty(
        (1, parts.vae.config.latent_channels, height // scale, width // scale), dtype=dtype, device="meta"
    )
    out = parts.vae.decode(latents, return_dict=False)[0]
    del out, latents
    return mode.peak - start


@dataclass
class PhaseTrace:
    """Traced activation peaks (bytes) of one edit's phases with one attention strategy."""

    attention: str
    encode: int
    denoise: int  # the guidance call before the switch
    refine: int  # the call after the refine switch
    decode: int
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def trace_phases(parts: Parts, size: tuple[int, int], dtype: torch.dtype, strategy: str) -> PhaseTrace:
    started = time.perf_counter()
    with traced(strategy) as mode:
        encode = _encode(parts, mode)
        denoise = _denoise(parts, mode, size, dtype, refine=False)
        refine = _denoise(parts, mode, size, dtype, refine=True)
        decode = _decode(parts, mode, size, dtype)
    return PhaseTrace(
        attention=strategy,
        encode=encode,
        denoise=denoise,
        refine=refine,
        decode=decode,
        seconds=time.perf_counter() - started,
    )


# ----------------------------------------------------------------------------------------------
# Per plan: the traced activations on top of the weights each plan keeps on the device


@dataclass
class PlanTrace:
    plan: str
    weights: str
    attention: str
    traced: dict[str, int]  # per phase: weights on the device + traced activations
    predicted: dict[str, int]  # the planner's phases
    traced_peak: int = 0
    predicted_peak: int = 0
    ratio: float = 0.0  # predicted / traced
    host: int = 0
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def plan_traces(
    sizes, phases: PhaseTrace, size: tuple[int, int], element: int, prefetch: bool = True, plans=None, weights=None
) -> list[PlanTrace]:
    """Every (plan, storage) with the traced activations of `phases` in place of the planner's model."""
    from hidream_ui.model.planner import activation_bytes, estimate
    from hidream_ui.model.plans import PLANS, WEIGHTS

    model = activation_bytes(sizes, size, element, attention=phases.attention)
    traced_act = {"encode": phases.encode, "denoise": max(phases.denoise, phases.refine), "decode": phases.decode}
    out = []
    for plan in plans or PLANS:
        for store in weights or WEIGHTS:
            row = estimate(sizes, plan, store, size, element, prefetch=prefetch, attention=phases.attention)
            traced = {k: v - model[k] + traced_act[k] for k, v in row.phases.items()}
            peak = max(traced.values())
            out.append(
                PlanTrace(
                    plan=plan,
                    weights=store,
                    attention=phases.attention,
                    traced=traced,
                    predicted=dict(row.phases),
                    traced_peak=peak,
                    predicted_peak=row.peak,
                    ratio=round(row.peak / peak, 4),
                    host=row.host,
                )
            )
    return out


def fitted_constants(sizes, traces: Mapping[tuple[int, int], Mapping[str, PhaseTrace]], element: int) -> dict:
    """The planner's activation constants fitted to the traces (what `planner.ACTIVATION_*` were set from):
    per-token-unit from the fused denoise traces, per-pixel-channel from the fused decodes, the math path's
    score-matrix copies and the encode factor. Returned per working size, so the spread shows."""
    from hidream_ui.model.planner import GUIDANCE_BATCH, activation_terms

    out = {}
    for size, by_strategy in traces.items():
        fused, plain = by_strategy.get("fused"), by_strategy.get("math")
        terms = activation_terms(sizes, size, element)
        row = {}
        if fused is not None:
            row["per_token_unit"] = fused.denoise / (GUIDANCE_BATCH * terms["tokens"] * sizes.inner_dim * element)
            row["per_pixel_channel"] = fused.decode / (size[0] * size[1] * sizes.vae_channels * element)
            row["encode_factor"] = fused.encode / terms["encode_unit"]
        if fused is not None and plain is not None:
            row["math_denoise_extra_per_score"] = (plain.denoise - fused.denoise) / terms["scores"]
            row["math_decode_extra_per_score"] = (plain.decode - fused.decode) / max(terms["vae_scores"], 1)
        out["x".join(map(str, size))] = row
    return out


__all__ = [
    "ATTENTION_STRATEGIES",
    "LiveBytes",
    "Parts",
    "PhaseTrace",
    "PlanTrace",
    "build_parts",
    "fitted_constants",
    "plan_traces",
    "trace_phases",
    "traced",
]
