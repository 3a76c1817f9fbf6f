"""What every step cache shares (cache.py: ours; library.py: diffusers'; cachedit.py: cache-dit's):
the root hook's name on the transformer (`reset_step_cache`, `step_cache_stats` find any kind's state
there), the counters, and the call signature that invalidates a cache. No torch import.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

ROOT_HOOK = "hidream_ui_step_cache_root"


@dataclass
class CacheStats:
    calls: int = 0
    full_calls: int = 0
    blocks_run: int = 0
    blocks_skipped: int = 0

    @property
    def skipped_fraction(self) -> float:
        total = self.blocks_run + self.blocks_skipped
        return self.blocks_skipped / total if total else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "skipped_fraction": round(self.skipped_fraction, 4)}


def call_signature(kwargs: dict) -> tuple:
    """What a cached tensor depends on besides the step: batch, token count, dtype, which text embeddings."""

    def key(t):
        return None if t is None else (tuple(t.shape), t.dtype, t.device, t.data_ptr())

    hidden = kwargs.get("hidden_states")
    return (
        None if hidden is None else (tuple(hidden.shape), hidden.dtype),
        key(kwargs.get("encoder_hidden_states_t5")),
        key(kwargs.get("encoder_hidden_states_llama3")),
        key(kwargs.get("pooled_embeds")),
        None if kwargs.get("hidden_states_masks") is None else tuple(kwargs["hidden_states_masks"].shape),
    )


def begin_call(state: Any, args: tuple, kwargs: dict, *, reset_on_first: bool = True) -> None:
    """A root hook's pre-forward: a call of another shape or text starts the cache afresh (the first
    call too, unless `reset_on_first`: cache-dit sets its context up before it), then the call is counted.
    `state` has `signature`, `stats`, `run_at_call_start` and `reset()`."""
    signature = call_signature({"hidden_states": args[0], **kwargs} if args else kwargs)
    if signature != state.signature:
        if reset_on_first or state.signature is not None:
            state.reset()
        state.signature = signature
    state.stats.calls += 1
    state.run_at_call_start = state.stats.blocks_run


def end_call(state: Any) -> None:
    """A root hook's post-forward: the blocks this call did not run count as skipped."""
    run = state.stats.blocks_run - state.run_at_call_start
    state.stats.blocks_skipped += state.blocks - run
    state.stats.full_calls += run == state.blocks
