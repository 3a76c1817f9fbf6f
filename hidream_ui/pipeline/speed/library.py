"""diffusers' own step caches on HiDream's blocks: `fbcache:T`, `taylorseer:N`, `magcache:T`.

diffusers ships FirstBlockCache, TaylorSeerCache and MagCache as `ModelHook`s, but
`enable_cache` / `apply_*_cache` do not reach HiDream (docs/speed.md "The field's caches"):
* the block lists are `double_stream_blocks` / `single_stream_blocks`, not in the hooks' block
  identifiers (`_common._ALL_TRANSFORMER_BLOCK_IDENTIFIERS`, TaylorSeer's `^blocks.*attn` patterns),
  and the transformer has no `CacheMixin` (no `enable_cache`, no `cache_context`);
* both block kinds are the same wrapper class (`HiDreamBlock`), while `TransformerBlockRegistry` is
  keyed by class: a double block returns (image, text), a single block one fused tensor;
* the tail (last single block) returns `[image, initial text, llama]`, not the head's image stream:
  FirstBlockCache's tail subtracts the head's (image, text) output from it (a tensor minus a list),
  and MagCache's tail takes the *last* tokens as the image ("image at the end, as Flux2"), while
  HiDream's image tokens come first.
So the library's hook classes are applied to the block lists directly, with:
* per-block metadata picked by the wrapped block's kind (`_BlockMetadata`, no global registration);
* FirstBlockCache: a tail subclass that stores the image-token residual (the text stream leaves the
  model unused, so its residual is 0), and a per-row decision (see `_FBCHead`);
* MagCache: an adapter inside the tail that returns only the image tokens (exactly what the model
  keeps of the last block), and the ratios of each stage: the checkpoint's calibration when it has one
  (mag_ratios.py), else Flux's, spread over the stage's calls (see `_mag_config`);
* TaylorSeer: diffusers' own "lite" layout (blocks skipped, the output projection extrapolated),
  with HiDream's names: `final_layer` for `proj_out`. `apply_taylorseer_cache` runs as is.

Around them, as for our own hooks (cache.py): a root hook on the transformer sets the hooks' cache
context (the library needs one; without `CacheMixin` nobody else sets it), drops every state when the
call's signature changes, and counts block evaluations (`CacheStats`) with a counting hook inside every
block's cache hook. `reset_step_cache` drops all states (every edit, the refine switch).

The guidance branches and the images of a batch sit in one batch: the states hold whole-batch
tensors, so each row reuses only its own residual / Taylor factors (per-branch state). TaylorSeer and
MagCache decide from the step index alone, so a batch equals its items run alone; FirstBlockCache
decides once per call for the whole batch (see `_FBCHead`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from diffusers.hooks import HookRegistry, ModelHook
from diffusers.hooks._helpers import TransformerBlockMetadata
from diffusers.hooks.first_block_cache import FBCBlockHook, FBCHeadBlockHook, FBCSharedBlockState
from diffusers.hooks.hooks import CacheContext, StateManager
from diffusers.hooks.mag_cache import (
    FLUX_MAG_RATIOS,
    MagCacheBlockHook,
    MagCacheConfig,
    MagCacheHeadHook,
    MagCacheState,
)
from diffusers.hooks.taylorseer_cache import _TAYLORSEER_CACHE_HOOK, TaylorSeerCacheConfig, apply_taylorseer_cache
from diffusers.models.transformers.transformer_hidream_image import HiDreamBlock, HiDreamImageTransformerBlock

from hidream_ui.pipeline.speed.cache_state import ROOT_HOOK as _ROOT
from hidream_ui.pipeline.speed.cache_state import CacheStats, begin_call, end_call
from hidream_ui.pipeline.speed.mag_ratios import ATTRIBUTE as RATIOS_ATTRIBUTE
from hidream_ui.pipeline.speed.mag_ratios import MagRatios
from hidream_ui.pipeline.speed.settings import CacheSpec

LIBRARY_KINDS = ("fbcache", "taylorseer", "magcache")
_PREFIX = "hidream_ui_library_cache_"
_COUNT, _HEAD, _BLOCK, _TAIL, _TOKENS, _IMAGE_ONLY = (
    _PREFIX + part for part in ("count", "head", "block", "tail", "tokens", "image_only")
)
_CONTEXT = CacheContext("hidream_ui")  # one context: the branches are rows of one batch (module docstring)
# MagCache's stage length when the caller does not say (direct transformer calls): the library's default.
DEFAULT_STAGE_CALLS = 28
# TaylorSeer: full calls before the first prediction (diffusers' default) and the order of the expansion
# (diffusers' default); factors kept in float32 (the library's default bfloat16 would round fp32 models).
TAYLORSEER_WARMUP, TAYLORSEER_ORDER = 3, 1
# diffusers' "lite" TaylorSeer, HiDream's names: every block returns zeros on predicted calls, the
# final layer (HiDream's proj_out) is extrapolated. The full layout (every attention module) would keep
# the MoE feed-forwards running on every call: little to skip.
TAYLORSEER_SKIPPED = (r"^(double|single)_stream_blocks\.\d+$",)
TAYLORSEER_EXTRAPOLATED = (r"^final_layer$",)


def _metadata(block) -> TransformerBlockMetadata:
    double = isinstance(block.block, HiDreamImageTransformerBlock)
    # A double block returns (image, text + llama); a single block one tensor [image, text, llama].
    meta = TransformerBlockMetadata(
        return_hidden_states_index=0, return_encoder_hidden_states_index=1 if double else None
    )
    meta._cls = HiDreamBlock  # positional arguments are looked up in HiDreamBlock.forward's signature
    return meta


class _BlockMetadata:
    """Mixin for the library's block hooks: metadata by the wrapped block's kind, not by the class
    registry (both kinds are `HiDreamBlock`)."""

    def initialize_hook(self, module):
        self._metadata = _metadata(module)
        return module


class _FBCHead(_BlockMetadata, FBCHeadBlockHook):
    """FirstBlockCache's head; the decision is the largest per-row change instead of the batch mean,
    so one image or guidance branch that changed a lot is not averaged away by the others. Still one
    decision (one host read) per call: the rows of a batch skip together."""

    @torch.compiler.disable
    def _should_compute_remaining_blocks(self, hidden_states_residual: torch.Tensor) -> bool:
        previous = self.state_manager.get_state().head_block_residual
        if previous is None or previous.shape != hidden_states_residual.shape:
            return True
        # The floor keeps an all-zero previous residual from making 0/0 = nan, which compares False (a skip).
        scale = previous.abs().flatten(1).mean(1).clamp_min(torch.finfo(previous.dtype).tiny)
        change = (hidden_states_residual - previous).abs().flatten(1).mean(1) / scale
        return bool(change.max() > self.threshold)


class _FBCBlock(_BlockMetadata, FBCBlockHook):
    pass


class _FBCTail(_FBCBlock):
    """FirstBlockCache's tail: the residual of the blocks after the head, image tokens only (the
    text stream is dropped by the model after the last block, so its residual is 0)."""

    def new_forward(self, module, *args, **kwargs):
        state = self.state_manager.get_state()
        if not state.should_compute:
            return super().new_forward(module, *args, **kwargs)  # passes the input through
        output = self.fn_ref.original_forward(*args, **kwargs)
        head_image = state.head_block_output[0]
        state.tail_block_residuals = (
            output[:, : head_image.shape[1]] - head_image,
            torch.zeros((), dtype=output.dtype, device=output.device),
        )
        return output


class _MagHead(_BlockMetadata, MagCacheHeadHook):
    pass


class _MagBlock(_BlockMetadata, MagCacheBlockHook):
    """MagCache's block hook; the tail also hands each calibration ratio to the root's state (diffusers
    keeps a stage's curve only until the stage ends, and prints it)."""

    def __init__(self, manager, is_tail: bool, config: MagCacheConfig, owner: LibraryCacheState):
        super().__init__(manager, is_tail=is_tail, config=config)
        self.owner = owner

    def _perform_calibration_step(self, state, current_residual):
        super()._perform_calibration_step(state, current_residual)
        self.owner.calibration.setdefault(self.owner.stage or "edit", []).append(state.calibration_ratios[-1])


@dataclass
class LibraryCacheState:
    """The root's state: what `reset_step_cache` / `step_cache_stats` see (as cache.StepCacheState)."""

    spec: CacheSpec
    blocks: int
    managers: list[StateManager] = field(default_factory=list)
    mag_hooks: list[Any] = field(default_factory=list)
    hooks: list[tuple[Any, str]] = field(default_factory=list)  # (module, hook name), for removal
    stats: CacheStats = field(default_factory=CacheStats)
    signature: tuple | None = None
    image_tokens: int = 0
    stage_calls: int = DEFAULT_STAGE_CALLS
    stage: str | None = None
    run_at_call_start: int = 0
    ratios: MagRatios | None = None  # the checkpoint's calibration (MagCache), if the loader found one
    calibrating: bool = False
    calibration: dict[str, list[float]] = field(default_factory=dict)  # stage -> ratios, while calibrating

    def reset(self, calls: int | None = None, stage: str | None = None) -> None:
        """Drops every hook's state; `calls`: transformer calls of the stage that starts, `stage`: which
        one (MagCache's ratios)."""
        self.signature = None
        for manager in self.managers:
            manager.reset()  # also clears its context
            manager.set_context(_CONTEXT)
        if calls is not None:
            self.stage_calls = max(1, calls)
        if stage is not None:
            self.stage = stage
        if self.mag_hooks:
            config = _mag_config(self.spec, self.stage_calls, self.ratios, self.stage, self.calibrating)
            for hook in self.mag_hooks:
                hook.config = config

    def start_calibration(self) -> None:
        """MagCache only: the next edits run every block and record each call's ratio per stage."""
        if not self.mag_hooks:
            raise ValueError(f"cache={self.spec} cannot calibrate: only magcache has ratios")
        self.calibrating, self.calibration = True, {}
        self.reset()

    def take_calibration(self) -> dict[str, list[float]]:
        taken, self.calibration, self.calibrating = self.calibration, {}, False
        self.reset()
        return taken


def _mag_config(
    spec: CacheSpec, calls: int, ratios: MagRatios | None = None, stage: str | None = None, calibrating: bool = False
) -> MagCacheConfig:
    """MagCache needs per-step magnitude ratios of the model's residual; HiDream has none published.
    A checkpoint's own calibration (mag_ratios.py) gives one curve per stage; without one, the one set
    diffusers ships is Flux's (also a flow-matching MMDiT with a shifted schedule). MagCacheConfig
    interpolates either to the stage's number of calls."""
    if calibrating:
        return MagCacheConfig(threshold=spec.threshold, num_inference_steps=calls, calibrate=True)
    curve = torch.tensor(ratios.for_stage(stage)) if ratios is not None else FLUX_MAG_RATIOS.clone()
    return MagCacheConfig(threshold=spec.threshold, num_inference_steps=calls, mag_ratios=curve)


def calibration_state(transformer) -> LibraryCacheState:
    """The MagCache state installed on `transformer` (mag_calibrate.calibrate drives it)."""
    registry = getattr(transformer, "_diffusers_hook", None)
    hook = registry.get_hook(_ROOT) if registry is not None else None
    state = getattr(hook, "state", None)  # the step cache's and cache-dit's roots hold other states
    if not isinstance(state, LibraryCacheState) or not state.mag_hooks:
        raise ValueError("MagCache calibration needs cache=magcache:T installed on the transformer")
    return state


class CallHook(ModelHook):
    """On the transformer: context, invalidation and the per-call counts (`begin_call`/`end_call`).
    cache-dit's install uses it too, with `reset_on_first=False` (cache-dit sets its context up first)."""

    def __init__(self, state: Any, *, reset_on_first: bool = True):
        super().__init__()
        self.state = state
        self.reset_on_first = reset_on_first

    def pre_forward(self, module, *args, **kwargs):
        begin_call(self.state, args, kwargs, reset_on_first=self.reset_on_first)
        return args, kwargs

    def post_forward(self, module, output):
        end_call(self.state)
        return output


class BlockCounter(ModelHook):
    """Innermost on every block: runs only when the block is evaluated (`stats.blocks_run`)."""

    def __init__(self, state: Any):
        super().__init__()
        self.state = state

    def pre_forward(self, module, *args, **kwargs):
        self.state.stats.blocks_run += 1
        return args, kwargs


class _ImageTokens(ModelHook):
    """Outermost on the first block: how many image tokens this call has (MagCache's tail adapter)."""

    def __init__(self, state: LibraryCacheState):
        super().__init__()
        self.state = state

    def pre_forward(self, module, *args, **kwargs):
        hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        self.state.image_tokens = hidden.shape[1]
        return args, kwargs


class _ImageOnly(ModelHook):
    """Inside MagCache's tail hook on the last block: returns the image tokens only, which is all the
    model keeps of the last block's output, so MagCache's tail sees the head's stream shape."""

    def __init__(self, state: LibraryCacheState):
        super().__init__()
        self.state = state

    def post_forward(self, module, output):
        return output[:, : self.state.image_tokens]


def _register(state: LibraryCacheState, module, hook: ModelHook, name: str) -> None:
    HookRegistry.check_if_exists_or_initialize(module).register_hook(hook, name)
    state.hooks.append((module, name))


def install(transformer, spec: CacheSpec) -> LibraryCacheState:
    """Installs the library cache `spec` (the caller removed any other cache first)."""
    doubles, singles = list(transformer.double_stream_blocks), list(transformer.single_stream_blocks)
    if not doubles or not singles:
        raise ValueError(
            f"cache={spec} needs at least one double-stream and one single-stream block "
            f"(this transformer has {len(doubles)} and {len(singles)})"
        )
    blocks = doubles + singles
    state = LibraryCacheState(spec, blocks=len(blocks), ratios=getattr(transformer, RATIOS_ATTRIBUTE, None))
    for block in blocks:  # first: innermost
        _register(state, block, BlockCounter(state), _COUNT)
    if spec.kind == "fbcache":
        manager = StateManager(FBCSharedBlockState, (), {})
        state.managers.append(manager)
        _register(state, blocks[0], _FBCHead(manager, spec.threshold), _HEAD)
        for block in blocks[1:-1]:
            _register(state, block, _FBCBlock(manager), _BLOCK)
        _register(state, blocks[-1], _FBCTail(manager, is_tail=True), _TAIL)
    elif spec.kind == "magcache":
        manager = StateManager(MagCacheState, (), {})
        state.managers.append(manager)
        config = _mag_config(spec, state.stage_calls, state.ratios)
        _register(state, blocks[-1], _ImageOnly(state), _IMAGE_ONLY)
        head = _MagHead(manager, config)
        _register(state, blocks[0], head, _HEAD)
        state.mag_hooks.append(head)
        for index, block in enumerate(blocks[1:], start=1):
            hook = _MagBlock(manager, is_tail=index == len(blocks) - 1, config=config, owner=state)
            _register(state, block, hook, _TAIL if hook.is_tail else _BLOCK)
            state.mag_hooks.append(hook)
        _register(state, blocks[0], _ImageTokens(state), _TOKENS)  # last: outermost, runs on every call
    elif spec.kind == "taylorseer":
        apply_taylorseer_cache(
            transformer,
            TaylorSeerCacheConfig(
                cache_interval=spec.interval,
                disable_cache_before_step=TAYLORSEER_WARMUP,
                max_order=TAYLORSEER_ORDER,
                taylor_factors_dtype=torch.float32,
                skip_predict_identifiers=list(TAYLORSEER_SKIPPED),
                cache_identifiers=list(TAYLORSEER_EXTRAPOLATED),
            ),
        )
        for module in transformer.modules():
            hook = (
                module._diffusers_hook.get_hook(_TAYLORSEER_CACHE_HOOK) if hasattr(module, "_diffusers_hook") else None
            )
            if hook is not None:
                state.managers.append(hook.state_manager)
                state.hooks.append((module, _TAYLORSEER_CACHE_HOOK))
        if len(state.hooks) != 2 * len(blocks) + 1:  # a count hook and a TaylorSeer hook per block, the final layer
            raise RuntimeError(
                f"cache={spec}: TaylorSeer hooked {len(state.hooks) - len(blocks)} modules, expected "
                f"{len(blocks) + 1} (every block and final_layer): diffusers' HiDream changed"
            )
    else:
        raise ValueError(f"cache={spec} is not one of diffusers' caches ({', '.join(LIBRARY_KINDS)})")
    _register(state, transformer, CallHook(state), _ROOT)
    state.reset()
    return state


def uninstall(transformer, state: LibraryCacheState) -> None:
    for module, name in reversed(state.hooks):
        module._diffusers_hook.remove_hook(name, recurse=False)
    state.hooks.clear()
