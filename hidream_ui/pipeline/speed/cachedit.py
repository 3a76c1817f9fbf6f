"""`dbcache:T`: cache-dit's DBCache with its TaylorSeer calibrator, through cache-dit's HiDream block
adapter (the optional extra `cache-dit`: `pip install 'hidream_ui[cache-dit]'`; imported here only).

cache-dit adapts HiDream by *patching* forwards (its `HiDreamPatchFunctor`): the transformer's and
every block's `forward` become cache-dit's copies, which move the per-block Llama concatenation into
the blocks so each block maps a same-shaped stream; then its `CachedBlocks` stand in for both block
lists during a call. Consequences, each handled here or refused:
* Instance `forward` replacement drops any diffusers `ModelHook` already on those modules (hooks
  live in `forward` too): with `--compile blocks` (the compile guard is a hook on the transformer)
  or a memory plan that offloads the transformer (group-offloading hooks on the blocks; cache-dit
  itself says it is "not fully compatible with group offloading") it is refused, naming the reason.
* Removing it (another `--cache`) restores every patched `forward` and attribute, so `none` after
  `dbcache` is diffusers' own forward again, bit for bit (tested).
* Its state is a "persistent context" on the transformer (no pipeline `__call__` patch: that one
  would be class-wide, shared by every engine of a pool); `reset_step_cache` rebuilds it
  (`cache_dit.refresh_context`) with the stage's number of calls: every edit and the refine switch.
* The guidance branches and images of a batch are rows of one batch: cached residuals and Taylor
  factors are per row; the skip decision (Fn blocks' residual change vs T) is one per call for the
  whole batch, as FirstBlockCache's.
Settings: F1B0 (the first block of each list computes, decides; none after), 3 warm-up calls per stage
(as TaylorSeer's), TaylorSeer order 1 on residuals.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hidream_ui.pipeline.speed.cache_state import ROOT_HOOK as _ROOT
from hidream_ui.pipeline.speed.cache_state import CacheStats
from hidream_ui.pipeline.speed.settings import CACHE_DIT_HINT, CacheSpec

FN_BLOCKS, BN_BLOCKS, WARMUP_CALLS, TAYLORSEER_ORDER = 1, 0, 3, 1
DEFAULT_STAGE_CALLS = 28
_COUNT = "hidream_ui_cachedit_count"
_PATCHED = ("forward", "_block_id", "_is_patched")  # what cache-dit's HiDream patch sets on instances


class CacheDitMissing(ImportError):
    """cache-dit is not installed (the message says how to install it)."""


def import_cache_dit():
    """cache_dit, or CacheDitMissing naming the extra that installs it."""
    try:
        import cache_dit
    except ImportError as exc:
        raise CacheDitMissing(f"cache=dbcache needs the optional package cache-dit ({exc}): {CACHE_DIT_HINT}") from exc
    # cache-dit's log handler writes to stdout, where `edit` prints its JSON summary: moved to stderr
    # (its level follows CACHE_DIT_LOG_LEVEL, which the quiet CLI sets to error).
    import logging

    from cache_dit import logger as cache_dit_logger

    handler = getattr(cache_dit_logger, "_default_handler", None)  # its console handler (a file one is apart)
    if isinstance(handler, logging.StreamHandler) and not isinstance(handler.stream, _CurrentStderr):
        handler.setStream(_CurrentStderr())
    return cache_dit


class _CurrentStderr:
    """Writes to whatever `sys.stderr` is at the time of writing (not the object it was at import:
    a replaced stderr, a captured one in tests, must receive the lines too)."""

    def write(self, text: str) -> int:
        import sys

        return sys.stderr.write(text)

    def flush(self) -> None:
        import sys

        sys.stderr.flush()


def _refusal(transformer) -> str | None:
    modules = [("the transformer", transformer)] + [
        (f"block {i}", m)
        for i, m in enumerate(list(transformer.double_stream_blocks) + list(transformer.single_stream_blocks))
    ]
    for where, module in modules:
        registry = getattr(module, "_diffusers_hook", None)
        names = list(registry.hooks) if registry is not None else []
        if names:
            reason = (
                "--compile blocks"
                if any("compile" in n for n in names)
                else "a memory plan that offloads the transformer"
                if any("offload" in n for n in names)
                else "diffusers hooks"
            )
            return (
                f"cache=dbcache cannot run with {reason}: cache-dit replaces the forward of {where}, which "
                f"would drop its hooks ({', '.join(names)}); use another --cache"
            )
    return None


@dataclass
class CacheDitState:
    """The root's state (as cache.StepCacheState): stats, invalidation, and what to restore."""

    spec: CacheSpec
    blocks: int
    cache_dit: Any
    saved: list[tuple[Any, dict]] = field(default_factory=list)  # (module, its patched attributes before)
    hooks: list[tuple[Any, str]] = field(default_factory=list)
    stats: CacheStats = field(default_factory=CacheStats)
    signature: tuple | None = None
    stage_calls: int = DEFAULT_STAGE_CALLS
    run_at_call_start: int = 0
    transformer: Any = None

    def configs(self):
        cd = self.cache_dit
        return (
            cd.DBCacheConfig(
                residual_diff_threshold=self.spec.threshold,
                Fn_compute_blocks=FN_BLOCKS,
                Bn_compute_blocks=BN_BLOCKS,
                max_warmup_steps=WARMUP_CALLS,
                num_inference_steps=self.stage_calls,
                enable_separate_cfg=False,
            ),
            cd.TaylorSeerCalibratorConfig(taylorseer_order=TAYLORSEER_ORDER),
        )

    def reset(self, calls: int | None = None, stage: str | None = None) -> None:
        self.signature = None
        if calls is not None:
            self.stage_calls = max(1, calls)
        cache_config, calibrator_config = self.configs()
        self.cache_dit.refresh_context(
            self.transformer, cache_config=cache_config, calibrator_config=calibrator_config, verbose=False
        )


def install(transformer, spec: CacheSpec) -> CacheDitState:
    cache_dit = import_cache_dit()
    reason = _refusal(transformer)
    if reason:
        raise ValueError(reason)
    from cache_dit import BlockAdapter, ForwardPattern
    from cache_dit.caching.patch_functors import HiDreamPatchFunctor
    from diffusers.hooks import HookRegistry

    blocks = list(transformer.double_stream_blocks) + list(transformer.single_stream_blocks)
    state = CacheDitState(spec, blocks=len(blocks), cache_dit=cache_dit, transformer=transformer)
    for module in [transformer] + blocks + [b.block for b in blocks]:
        state.saved.append((module, {k: vars(module)[k] for k in _PATCHED if k in vars(module)}))
    cache_config, calibrator_config = state.configs()
    adapter = BlockAdapter(
        transformer=transformer,
        blocks=[transformer.double_stream_blocks, transformer.single_stream_blocks],
        forward_pattern=[ForwardPattern.Pattern_0, ForwardPattern.Pattern_3],
        patch_functor=HiDreamPatchFunctor(),
        check_forward_pattern=True,
        check_num_outputs=True,
    )
    cache_dit.enable_cache(adapter, cache_config=cache_config, calibrator_config=calibrator_config)
    from hidream_ui.pipeline.speed.library import BlockCounter, CallHook  # diffusers' hooks: with the model

    # Registered after cache-dit's patch, so they wrap its forwards (and are removed before it is).
    for block in blocks:
        HookRegistry.check_if_exists_or_initialize(block).register_hook(BlockCounter(state), _COUNT)
        state.hooks.append((block, _COUNT))
    HookRegistry.check_if_exists_or_initialize(transformer).register_hook(CallHook(state, reset_on_first=False), _ROOT)
    state.hooks.append((transformer, _ROOT))
    return state


def uninstall(transformer, state: CacheDitState) -> None:
    for module, name in reversed(state.hooks):
        module._diffusers_hook.remove_hook(name, recurse=False)
    state.hooks.clear()
    # cache-dit's release rebinds its saved forward with `.__get__`; we restore every patched
    # attribute ourselves afterwards (its release leaves its HiDream patch in place).
    state.cache_dit.disable_cache(transformer)
    for module, before in state.saved:
        for key in _PATCHED:
            if key in before:
                setattr(module, key, before[key])
            elif key in vars(module):
                delattr(module, key)
    state.saved.clear()
