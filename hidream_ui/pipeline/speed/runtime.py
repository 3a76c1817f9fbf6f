"""The speed modes of one loaded model: applied at load, per call, and reported.

The engine owns one `SpeedRuntime`; it keeps the engine's edits to a few calls:
`at_load` (MoE mode, compile + warm-up), `before_call` (the step cache of this call) and
`call_info` (what the result's metadata records).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from hidream_ui.pipeline.speed.settings import CacheSpec, effective_moe, parse_cache

logger = logging.getLogger(__name__)


@dataclass
class SpeedRuntime:
    moe: str = "auto"  # as configured
    compile: str = "none"
    cache: str = "none"  # the default step cache of a call whose params say "default"
    moe_active: str = "diffusers"  # what the MoE blocks run
    compile_state: Any = None  # pipeline.speed.compile.CompileState once compiled
    last_cache: str = "none"
    notes: list[str] = field(default_factory=list)

    @classmethod
    def from_config(cls, config) -> "SpeedRuntime":
        return cls(moe=config.moe, compile=config.compile, cache=str(parse_cache(config.cache)))

    @property
    def exact(self) -> bool:
        """Everything as diffusers computes it (the bit-identical default)."""
        return self.moe_active == "diffusers" and self.compile == "none"

    def at_load(
        self, transformer, device_type: str, warm_up: Callable[[], None] | None = None, *, torchair: Any = None
    ) -> None:
        """MoE mode, then `--compile blocks` with `warm_up()` (one forward) run while compiled."""
        from hidream_ui.pipeline.speed.moe import apply_moe  # lazy: torch and diffusers, only once a model loads

        self.moe_active = effective_moe(self.moe, self.compile)
        apply_moe(transformer, self.moe_active)
        if self.compile != "blocks":
            return
        from hidream_ui.pipeline.speed.compile import compile_blocks  # lazy: torch, only for --compile blocks

        self.compile_state = compile_blocks(transformer, device_type, torchair=torchair)
        if self.compile_state.active and warm_up is not None:
            start = time.perf_counter()
            warm_up()  # the guard hook falls back to eager (and says why) if the compiler fails
            logger.info(
                "compiled blocks warmed up in %.1f s (%s)",
                time.perf_counter() - start,
                self.compile_state.error or self.compile_state.backend,
            )
        if self.compile_state.error:
            logger.warning(self.compile_state.error)

    def resolve_cache(self, requested: str) -> CacheSpec:
        return parse_cache(self.cache if requested in ("", "default", None) else requested)

    def before_call(self, transformer, requested: str) -> CacheSpec:
        """Installs the step cache of this call (params.cache; "default": --cache)."""
        from hidream_ui.pipeline.speed.cache import apply_step_cache  # lazy: torch and diffusers (see at_load)

        spec = self.resolve_cache(requested)
        apply_step_cache(transformer, spec.cache_only)  # the hooks; the step cap is the engine's (steps_for)
        self.last_cache = str(spec)
        return spec

    def call_info(self, pipeline, spec: CacheSpec) -> dict[str, Any] | None:
        """The speed facts of the last call for RunInfo.speed (None when everything was exact)."""
        stats = getattr(pipeline, "step_cache_stats", None)
        if self.exact and not spec.active and spec.max_steps is None:
            return None
        return {
            "moe": self.moe_active,
            "compile": self.compile_label,
            "cache": str(spec),
            "skipped_fraction": round(stats.skipped_fraction, 4) if stats is not None else 0.0,
        }

    @property
    def compile_label(self) -> str:
        state = self.compile_state
        if self.compile == "none" or state is None:
            return "none"
        return f"blocks ({state.backend})" if state.active else "blocks (eager fallback)"

    def status(self) -> dict[str, Any]:
        """The `speed` entry of /status."""
        state = self.compile_state
        return {
            "moe": self.moe_active,
            "compile": self.compile,
            "compiled": bool(state is not None and state.active),
            "compile_backend": None if state is None else state.backend,
            "compile_error": None if state is None else state.error,
            "warmup_seconds": None if state is None else state.warmup_seconds,
            "cache_default": self.cache,
            "last_cache": self.last_cache,
        }


def warm_up_call(pipeline, text, working_size: tuple[int, int]) -> None:
    """One transformer call shaped like an edit step (3 guidance branches, source beside noise) at
    `working_size`, to compile the blocks before the first visitor waits for it."""
    import torch

    from hidream_ui.pipeline.edit_pipeline import PromptEmbeds  # lazy: torch, diffusers, transformers

    transformer = pipeline.transformer
    width, height = working_size
    scale = pipeline.vae_scale_factor
    device = torch.device(pipeline.compute_device or pipeline._execution_device)
    hidden = torch.randn(
        3,
        transformer.config.in_channels,
        height // scale,
        2 * width // scale,
        generator=torch.Generator().manual_seed(0),
    ).to(device, transformer.dtype)
    timestep = torch.full((3,), 999.0, device=device)
    with torch.no_grad():
        pipeline.predict(hidden, timestep, PromptEmbeds.cat([text] * 3))
