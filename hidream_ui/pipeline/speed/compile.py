"""`--compile blocks`: regional compilation of HiDream's repeated transformer blocks.

Only the two block classes are compiled (diffusers' `compile_repeated_blocks`, which HiDream's
class does not enable by itself: it has no `_repeated_blocks`), so the 16 double-stream blocks
share one compiled graph and the 32 single-stream blocks another (the parameters are graph inputs),
and the glue around them (embeddings, the per-block llama concatenation, the step-cache hooks,
which sit on the `HiDreamBlock` wrappers outside the compiled region) stays eager.

Backends: inductor on CPU and CUDA; on Ascend NPU torchair's `get_npu_backend` with a
`CompilerConfig`, imported lazily (tests inject a fake module with the same two names).

Graph capture needs the sync-free MoE (`effective_moe`): diffusers' MoE reads expert counts on the
host in every block, a graph break per block.

Failure is never fatal: a `CompileGuardHook` on the transformer catches a compiler error (at the
warm-up or at any later call that triggers a recompile: a new size or batch, another attention
strategy), turns compilation off for every block, records the reason, and re-runs the call
eagerly. Attention switching therefore just works: dynamo's guards see the new processor and
recompile (the next call pays the compile time again); if that fails, eager.
Memory plans that put offloading hooks on the blocks: dynamo traces the hooks' `forward`; where
it cannot, the guard falls back to eager with the reason shown.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any

from diffusers.hooks import HookRegistry, ModelHook

from hidream_ui.pipeline.speed.cache import reset_step_cache

COMPILED_BLOCKS = ("HiDreamImageTransformerBlock", "HiDreamImageSingleTransformerBlock")
GUARD_HOOK = "hidream_ui_compile_guard"


@dataclass
class CompileState:
    """What `--compile` did; shown in the status panel."""

    mode: str = "none"  # what was asked: "none" | "blocks"
    backend: str | None = None  # "inductor" | "torchair"
    active: bool = False  # compiled blocks are in use
    error: str | None = None  # why it fell back to eager
    warmup_seconds: float | None = None  # first call (trace + compile + run)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)  # every field, as the status panel and /status show them


def compiler_backend(device_type: str, torchair: Any = None) -> tuple[Any, str]:
    """(backend for torch.compile, its label) for a device type; `torchair` replaces the real module."""
    if device_type == "npu":
        if torchair is None:
            import torchair  # lazy: only on Ascend machines, never installed by this project
        config = torchair.CompilerConfig()
        return torchair.get_npu_backend(compiler_config=config), "torchair"
    return "inductor", "inductor"


def is_compile_error(exc: BaseException) -> bool:
    """An error of the compiler stack (dynamo, inductor, torchair), as opposed to the model's own."""
    import torch._dynamo.exc as dynamo_exc

    try:
        from torch._inductor.exc import CppCompileError, InductorError

        inductor = (InductorError, CppCompileError)
    except ImportError:  # pragma: no cover - older torch
        inductor = ()
    if isinstance(exc, (dynamo_exc.TorchDynamoException, *inductor)):
        return True
    module = type(exc).__module__ or ""
    return module.startswith(("torchair", "torch._dynamo", "torch._inductor"))


def failure_reason(exc: BaseException) -> str:
    """One line: the compiler's error and, where it wraps one (BackendCompilerFailed), the root cause."""
    parts = []
    seen = set()
    while exc is not None and id(exc) not in seen and len(parts) < 3:
        seen.add(id(exc))
        lines = [line for line in str(exc).splitlines() if line.strip()]
        parts.append(f"{type(exc).__name__}: {lines[0].strip()[:200]}" if lines else type(exc).__name__)
        exc = getattr(exc, "inner_exception", None) or exc.__cause__
    return " <- ".join(parts)


def _blocks(transformer) -> list:
    return [m for m in transformer.modules() if type(m).__name__ in COMPILED_BLOCKS]


class CompileGuardHook(ModelHook):
    """On the transformer: a compiler error switches every block back to eager and retries."""

    def __init__(self, state: CompileState):
        super().__init__()
        self.state = state

    def new_forward(self, module, *args, **kwargs):
        if not self.state.active:
            return self.fn_ref.original_forward(*args, **kwargs)
        first = self.state.warmup_seconds is None
        start = time.perf_counter()
        try:
            out = self.fn_ref.original_forward(*args, **kwargs)
        except Exception as exc:
            if not is_compile_error(exc):
                raise
            self.state.error = f"compile failed, running eager: {failure_reason(exc)}"
            uncompile_blocks(module)
            self.state.active = False
            # The failed attempt may have left a step cache's residuals half-written: the eager retry
            # starts this call's cache afresh.
            reset_step_cache(module)
            return self.fn_ref.original_forward(*args, **kwargs)
        if first:
            self.state.warmup_seconds = round(time.perf_counter() - start, 3)
        return out


def compile_blocks(transformer, device_type: str, *, torchair: Any = None) -> CompileState:
    """Compiles the repeated blocks of `transformer` for `device_type`; never raises for a
    backend that cannot be set up (the state says why, the model stays eager)."""
    state = CompileState(mode="blocks")
    try:
        backend, state.backend = compiler_backend(device_type, torchair)
    except (ImportError, AttributeError, RuntimeError) as exc:
        state.error = f"no compiler backend for {device_type}, running eager: {type(exc).__name__}: {exc}"
        return state
    transformer._repeated_blocks = COMPILED_BLOCKS  # diffusers' hook for regional compilation
    transformer.compile_repeated_blocks(backend=backend)
    state.active = True
    registry = HookRegistry.check_if_exists_or_initialize(transformer)
    if registry.get_hook(GUARD_HOOK) is not None:
        registry.remove_hook(GUARD_HOOK, recurse=False)
    registry.register_hook(CompileGuardHook(state), GUARD_HOOK)
    return state


def uncompile_blocks(transformer) -> None:
    """Back to eager: `nn.Module.compile` only sets `_compiled_call_impl`, so clearing it is enough."""
    for block in _blocks(transformer):
        block._compiled_call_impl = None


def compiled_blocks(transformer) -> int:
    """How many blocks run compiled now."""
    return sum(1 for b in _blocks(transformer) if getattr(b, "_compiled_call_impl", None) is not None)
