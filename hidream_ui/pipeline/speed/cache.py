"""Step caching for HiDream's transformer: skip the deep blocks on some denoising steps.

Two modes (`--cache`, README "Speed modes"):

* `interval:K` (DeepCache-like): every K-th call runs all blocks; the calls in between run only
  the first double-stream block and the last single-stream block, and add the cached residual of
  the blocks in between (input of the last block minus output of the first, from the last full
  call) to the first block's output before the last block.
* `first-block:T` (first-block residual cache, as diffusers' FirstBlockCache): every call runs the
  first block; if its residual (output minus input, image tokens) changed by less than T (mean
  relative L1, per batch row, the largest row decides) since the last full call, every other block
  is skipped and the cached residual of the rest (output of the last block minus output of the
  first) is added. That decision reads one number on the host: one sync per call, by design.

The field's caches (diffusers' FirstBlockCache, TaylorSeer and MagCache: library.py; cache-dit's
DBCache: cachedit.py) install under the same root hook name, so `reset_step_cache`,
`step_cache_stats` and `remove_step_cache` serve every kind.

Why these hooks do not use diffusers' block registry: they need the block classes registered in
`TransformerBlockRegistry`, and HiDream's blocks do not fit its contract: each double block gets
`initial text + llama[k]` and returns the text stream with `llama[k]` still appended (the model
slices it off), and each single block gets the stream with another `llama[k]` appended, so a
block's output is not a same-shaped residual of the stream. These hooks are diffusers `ModelHook`s
in the same style (one shared state, a head, skippable middles, a tail) that know those shapes:
the stream compared and cached is `[image tokens, initial text tokens]`, which is what flows from
the first block to the last one.

Correctness rules:
* The batch carries the guidance branches side by side (edit: 3 per image, refine: 2), and the
  cache holds whole-batch tensors, so each branch reuses its own residual (per-branch cache).
* The cache is dropped when the call's signature changes (batch, token count, dtype, or which text
  embeddings are passed) and explicitly at the start of every edit and at the refine switch
  (`reset_step_cache`), so a residual never crosses stages, images or prompts.
* `interval:1` runs every block on every call: the output equals the uncached one to the bit.
* Statistics (`CacheStats`) count block evaluations run and skipped; the pipeline reports the
  skipped fraction with every result.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from diffusers.hooks import HookRegistry, ModelHook

from hidream_ui.pipeline.speed.cache_state import ROOT_HOOK as _ROOT
from hidream_ui.pipeline.speed.cache_state import CacheStats
from hidream_ui.pipeline.speed.cache_state import call_signature as _signature
from hidream_ui.pipeline.speed.settings import CacheSpec, parse_cache

OWN_KINDS = ("interval", "first-block")  # these hooks; the other kinds live in library.py / cachedit.py
_HEAD, _MIDDLE, _TAIL = (f"hidream_ui_step_cache_{part}" for part in ("head", "middle", "tail"))


@dataclass
class StepCacheState:
    """Shared by the hooks of one transformer."""

    spec: CacheSpec
    stats: CacheStats = field(default_factory=CacheStats)
    signature: tuple | None = None
    calls_since_reset: int = 0
    compute: bool = True
    llama_len: int = 0
    head_state: Any = None  # [image, initial text] after the first block
    residual: Any = None  # what the skipped blocks add to head_state
    head_residual: Any = None  # first-block mode: the first block's residual at the last full call

    def reset(self, calls: int | None = None, stage: str | None = None) -> None:
        """Drops the cached tensors (`calls`, the next stage's length, is for MagCache: unused here)."""
        self.signature = None
        self.calls_since_reset = 0
        self.compute = True
        self.head_state = self.residual = self.head_residual = None


class _StateHook(ModelHook):
    """A hook of the step cache: all of one transformer's hooks share one `StepCacheState`."""

    def __init__(self, state: StepCacheState):
        super().__init__()
        self.state = state


class _RootHook(_StateHook):
    """On the transformer: invalidation and, for interval mode, the per-call decision."""

    def pre_forward(self, module, *args, **kwargs):
        state = self.state
        if args:  # the pipeline passes keywords; positional calls name hidden_states first
            kwargs = {"hidden_states": args[0], **kwargs}
            args = ()
        signature = _signature(kwargs)
        if signature != state.signature:
            state.reset()
            state.signature = signature
        llama = kwargs.get("encoder_hidden_states_llama3")
        state.llama_len = llama.shape[2] if llama is not None else 0
        if state.spec.kind == "interval":
            state.compute = state.calls_since_reset % state.spec.interval == 0 or state.residual is None
        else:  # first-block: the head decides
            state.compute = True
        state.calls_since_reset += 1
        state.stats.calls += 1
        return args, kwargs

    def post_forward(self, module, output):
        if self.state.compute:
            self.state.stats.full_calls += 1
        return output


class _HeadHook(_StateHook):
    """On the first double-stream block: records the stream after it; first-block mode decides."""

    def new_forward(self, module, *args, **kwargs):
        import torch

        state = self.state
        kwargs = _as_kwargs(args, kwargs)
        img, enc = self.fn_ref.original_forward(**kwargs)
        state.stats.blocks_run += 1
        initial = enc[:, : enc.shape[1] - state.llama_len]
        state.head_state = torch.cat([img, initial], dim=1)
        if state.spec.kind == "first-block":
            residual = img - kwargs["hidden_states"]
            previous = state.head_residual
            if previous is None or state.residual is None or previous.shape != residual.shape:
                state.compute = True
            else:
                change = (residual - previous).abs().flatten(1).mean(1) / previous.abs().flatten(1).mean(1).clamp_min(
                    torch.finfo(previous.dtype).tiny
                )
                state.compute = bool(change.max() >= state.spec.threshold)  # the one host read of this mode
            if state.compute:
                state.head_residual = residual
        return img, enc


class _MiddleHook(_StateHook):
    """On every block between the first and the last: runs, or passes its input through."""

    def __init__(self, state: StepCacheState, double: bool):
        super().__init__(state)
        self.double = double

    def new_forward(self, module, *args, **kwargs):
        kwargs = _as_kwargs(args, kwargs)
        if self.state.compute:
            self.state.stats.blocks_run += 1
            return self.fn_ref.original_forward(**kwargs)
        self.state.stats.blocks_skipped += 1
        # The model slices the appended llama tokens off after each block, so passing the input
        # through is the identity on the stream.
        if self.double:
            return kwargs["hidden_states"], kwargs["encoder_hidden_states"]
        return kwargs["hidden_states"]


class _TailHook(_StateHook):
    """On the last single-stream block: stores the residual on full calls, applies it otherwise."""

    def new_forward(self, module, *args, **kwargs):
        import torch

        state = self.state
        kwargs = _as_kwargs(args, kwargs)
        hidden = kwargs["hidden_states"]
        seq = state.head_state.shape[1]
        if state.compute:
            out = self.fn_ref.original_forward(**kwargs)
            state.stats.blocks_run += 1
            source = hidden if state.spec.kind == "interval" else out
            state.residual = source[:, :seq] - state.head_state
            return out
        if state.spec.kind == "interval":
            kwargs["hidden_states"] = torch.cat([hidden[:, :seq] + state.residual, hidden[:, seq:]], dim=1)
            state.stats.blocks_run += 1
            return self.fn_ref.original_forward(**kwargs)
        state.stats.blocks_skipped += 1
        return hidden[:, :seq] + state.residual


_BLOCK_ARGS = ("hidden_states", "hidden_states_masks", "encoder_hidden_states", "temb", "image_rotary_emb")


def _as_kwargs(args: tuple, kwargs: dict) -> dict:
    return {**dict(zip(_BLOCK_ARGS, args)), **kwargs}


def _blocks(transformer):
    doubles, singles = list(transformer.double_stream_blocks), list(transformer.single_stream_blocks)
    if not doubles or not singles:
        raise ValueError(
            "step caching needs at least one double-stream and one single-stream block "
            f"(this transformer has {len(doubles)} and {len(singles)})"
        )
    return doubles, singles


def _library_module(spec: CacheSpec):
    """The module that installs a library cache (lazy: diffusers' cache hooks, or cache-dit)."""
    if spec.kind == "dbcache":
        from hidream_ui.pipeline.speed import cachedit

        return cachedit
    from hidream_ui.pipeline.speed import library

    return library


def _state(transformer) -> StepCacheState | None:
    registry = getattr(transformer, "_diffusers_hook", None)
    hook = registry.get_hook(_ROOT) if registry is not None else None
    return hook.state if hook is not None else None


def remove_step_cache(transformer) -> None:
    state = _state(transformer)
    if state is None:
        return
    if state.spec.kind not in OWN_KINDS:  # a library cache: it knows its hooks
        _library_module(state.spec).uninstall(transformer, state)
        return
    doubles, singles = _blocks(transformer)
    for module, name in [(transformer, _ROOT), (doubles[0], _HEAD), (singles[-1], _TAIL)] + [
        (m, _MIDDLE) for m in doubles[1:] + singles[:-1]
    ]:
        module._diffusers_hook.remove_hook(name, recurse=False)


def apply_step_cache(transformer, spec: CacheSpec | str) -> CacheSpec:
    """Installs `spec` on `transformer` (replacing any cache it had; `none` removes it)."""
    spec = parse_cache(spec) if isinstance(spec, str) else spec
    current = _state(transformer)
    if current is not None and current.spec == spec:
        return spec
    remove_step_cache(transformer)
    if not spec.active:
        return spec
    if spec.kind not in OWN_KINDS:
        _library_module(spec).install(transformer, spec)
        return spec
    doubles, singles = _blocks(transformer)
    state = StepCacheState(spec)
    HookRegistry.check_if_exists_or_initialize(transformer).register_hook(_RootHook(state), _ROOT)
    HookRegistry.check_if_exists_or_initialize(doubles[0]).register_hook(_HeadHook(state), _HEAD)
    for module in doubles[1:]:
        HookRegistry.check_if_exists_or_initialize(module).register_hook(_MiddleHook(state, double=True), _MIDDLE)
    for module in singles[:-1]:
        HookRegistry.check_if_exists_or_initialize(module).register_hook(_MiddleHook(state, double=False), _MIDDLE)
    HookRegistry.check_if_exists_or_initialize(singles[-1]).register_hook(_TailHook(state), _TAIL)
    return spec


def step_cache_spec(transformer) -> CacheSpec:
    state = _state(transformer)
    return state.spec if state is not None else CacheSpec()


def reset_step_cache(transformer, *, stats: bool = False, calls: int | None = None, stage: str | None = None) -> None:
    """Drops the cached tensors (refine switch, new edit); with `stats` also zeroes the counters;
    `calls`: how many transformer calls the stage that starts makes and `stage` which one ("edit",
    "refine"): MagCache takes that stage's ratios and spreads them over the calls. A no-op without a cache."""
    state = _state(transformer)
    if state is not None:
        state.reset(calls, stage)
        if stats:
            state.stats = CacheStats()


def step_cache_stats(transformer) -> CacheStats | None:
    state = _state(transformer)
    return None if state is None else state.stats
