"""The attention strategies: names, availability on a device, `auto`, and switching them on a loaded
transformer (`set_processor` on every HiDreamAttention). Cheap to import: no torch.
"""

from __future__ import annotations

import importlib.util
import sys
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from hidream_ui.pipeline.attention.flash import FlashAttnProcessor
from hidream_ui.pipeline.attention.kernels import ChunkedProcessor, MathProcessor, SdpaBackendProcessor, SdpaProcessor
from hidream_ui.pipeline.attention.npu import NPU_FUSION_MAX_HEAD_DIM, NPU_FUSION_MAX_HEADS, NpuFusionProcessor
from hidream_ui.pipeline.attention.processor import (
    AttentionStrategy,
    AttentionUnavailable,
    HiDreamStrategyProcessor,
    StrategyStatus,
)

if TYPE_CHECKING:  # pragma: no cover
    import torch


AUTO = "auto"


# ---------------------------------------------------------------------------------------------
# Availability


def _device_type(device: Any) -> str:
    if isinstance(device, str):
        return device.split(":", 1)[0]
    device_type = getattr(device, "type", None)
    if isinstance(device_type, str):
        return device_type
    raise TypeError(f"device must be a DeviceInfo, torch.device or device string, got {device!r}")


def _device_index(device: Any) -> int | None:
    if isinstance(device, str):
        return int(device.split(":", 1)[1]) if ":" in device else None
    return getattr(device, "index", None)


def _dtype_label(dtype: Any) -> str:
    return str(dtype).replace("torch.", "")


def _is_half(dtype: Any) -> bool:
    import torch

    return dtype in (torch.float16, torch.bfloat16)


def _always(device: Any, dtype: Any) -> tuple[bool, str]:
    _device_type(device)  # validates the argument
    return True, "pure torch: runs on every device and dtype"


def _sdpa_available(device: Any, dtype: Any) -> tuple[bool, str]:
    import torch

    kind = _device_type(device)
    return True, f"torch {torch.__version__} picks its fused kernel for {kind}/{_dtype_label(dtype)}"


def _half_kernel_refused(device: Any, dtype: Any, kind: str, wrong_device: str, name: str, package: str, missing: str):
    """Why a fused half-precision kernel of `package` cannot run here (None: it may): the device is not
    `kind`, the dtype is not float16/bfloat16, or the package is not installed."""
    found = _device_type(device)
    if found != kind:
        return False, f"{wrong_device} (device is {found})"
    if not _is_half(dtype):
        return False, f"{name} takes float16/bfloat16 only (dtype is {_dtype_label(dtype)})"
    if importlib.util.find_spec(package) is None:
        return False, missing
    return None


def _npu_fusion_available(device: Any, dtype: Any) -> tuple[bool, str]:
    refused = _half_kernel_refused(
        device,
        dtype,
        "npu",
        "needs an Ascend NPU",
        "npu_fusion_attention",
        "torch_npu",
        "torch_npu is not installed (install the build matching your CANN and torch)",
    )
    if refused:
        return refused
    module = sys.modules.get("torch_npu")
    if module is not None and not hasattr(module, "npu_fusion_attention"):
        return False, "this torch_npu has no npu_fusion_attention (needs torch_npu >= 2.1 / CANN 7)"
    return True, (
        f"torch_npu.npu_fusion_attention, BSND, pse bias; limits: head_dim <= {NPU_FUSION_MAX_HEAD_DIM}, "
        f"<= {NPU_FUSION_MAX_HEADS} heads"
    )


def _flash_attn_available(device: Any, dtype: Any) -> tuple[bool, str]:
    refused = _half_kernel_refused(
        device,
        dtype,
        "cuda",
        "flash-attn is a CUDA package",
        "flash-attn",
        "flash_attn",
        "the flash-attn package is not installed (pip install flash-attn --no-build-isolation)",
    )
    if refused:
        return refused
    try:
        # A present but ABI-mismatched build is common: only an import tells.
        from flash_attn import flash_attn_func  # noqa: F401
    except (ImportError, OSError) as exc:
        return False, f"flash-attn is installed but does not import: {exc}"
    import torch

    if torch.cuda.is_available():
        index = _device_index(device)
        major, minor = torch.cuda.get_device_capability(0 if index is None else index)
        if major < 8:
            return False, f"flash-attn 2 needs compute capability >= 8.0 (this GPU is {major}.{minor})"
    return True, "flash_attn.flash_attn_func; collapsed padding added exactly from its log-sum-exp"


def _sdpa_backend_available(backend: str, cuda_only: bool, half_only: bool):
    def check(device: Any, dtype: Any) -> tuple[bool, str]:
        import torch

        kind = _device_type(device)
        allowed = ("cuda",) if cuda_only else ("cuda", "cpu")
        if kind not in allowed:
            return False, f"SDPA backend {backend} runs on {' / '.join(allowed)} only (device is {kind})"
        try:
            from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: F401
        except ImportError:
            return False, f"torch {torch.__version__} has no torch.nn.attention.sdpa_kernel (needs torch >= 2.3)"
        if not hasattr(SDPBackend, backend):
            return False, f"torch {torch.__version__} has no SDPA backend {backend}"
        if half_only and not _is_half(dtype):
            return False, f"SDPA backend {backend} takes float16/bfloat16 only (dtype is {_dtype_label(dtype)})"
        if kind == "cuda":
            if not torch.cuda.is_available():
                return False, "torch reports no CUDA device"
            if backend == "FLASH_ATTENTION" and not torch.backends.cuda.is_flash_attention_available():
                return False, "this torch build has no flash SDPA kernel"
            if backend == "CUDNN_ATTENTION" and not torch.backends.cudnn.is_available():
                return False, "cuDNN is not available to torch"
        return True, f"torch SDPA forced to {backend} (process-global while running)"

    return check


def _auto_available(device: Any, dtype: Any) -> tuple[bool, str]:
    return True, f"resolves to {resolve(AUTO, device, dtype).name!r} for {_device_type(device)}/{_dtype_label(dtype)}"


def _auto_processor(**options: Any) -> HiDreamStrategyProcessor:
    raise ValueError("'auto' is resolved per device and dtype: call resolve('auto', device, dtype) or apply()")


# ---------------------------------------------------------------------------------------------
# Registry


def _forced_sdpa(name: str, backend: str, description: str, *, cuda_only: bool, half_only: bool) -> AttentionStrategy:
    """A strategy that forces torch SDPA onto one backend: its check and its processor name the same backend."""

    def make() -> SdpaBackendProcessor:
        return SdpaBackendProcessor(name, backend)

    return AttentionStrategy(name, description, _sdpa_backend_available(backend, cuda_only, half_only), make)


_STRATEGIES = (
    AttentionStrategy(
        AUTO,
        "best available here: npu_fusion on NPU, flash_attn (else sdpa) on CUDA, sdpa elsewhere",
        _auto_available,
        _auto_processor,
    ),
    AttentionStrategy(
        "sdpa",
        "torch scaled_dot_product_attention, torch picks the kernel; collapsed padding as a float mask",
        _sdpa_available,
        SdpaProcessor,
    ),
    AttentionStrategy(
        "math",
        "explicit softmax(QK^T/sqrt(d)+bias)V in float32: the reference ('vanilla'); O(S^2) memory",
        _always,
        MathProcessor,
    ),
    AttentionStrategy(
        "chunked",
        "exact float32 attention over query chunks (option chunk_size, default 1024): bounded memory",
        _always,
        ChunkedProcessor,
    ),
    AttentionStrategy(
        "npu_fusion",
        "Ascend torch_npu.npu_fusion_attention (fp16/bf16, BSND, scale 1/sqrt(d), bias via pse; "
        f"head_dim <= {NPU_FUSION_MAX_HEAD_DIM}, <= {NPU_FUSION_MAX_HEADS} heads)",
        _npu_fusion_available,
        NpuFusionProcessor,
    ),
    AttentionStrategy(
        "flash_attn",
        "flash-attn package flash_attn_func (CUDA sm80+, fp16/bf16); collapsed padding added via its LSE",
        _flash_attn_available,
        FlashAttnProcessor,
    ),
    _forced_sdpa(
        "sdpa_flash",
        "FLASH_ATTENTION",
        "torch SDPA forced to FLASH_ATTENTION (CUDA, fp16/bf16; masked calls may use EFFICIENT)",
        cuda_only=True,
        half_only=True,
    ),
    _forced_sdpa(
        "sdpa_efficient",
        "EFFICIENT_ATTENTION",
        "torch SDPA forced to EFFICIENT_ATTENTION (CUDA)",
        cuda_only=True,
        half_only=False,
    ),
    _forced_sdpa(
        "sdpa_cudnn",
        "CUDNN_ATTENTION",
        "torch SDPA forced to CUDNN_ATTENTION (CUDA, fp16/bf16)",
        cuda_only=True,
        half_only=True,
    ),
    _forced_sdpa(
        "sdpa_math",
        "MATH",
        "torch SDPA forced to its MATH backend (CPU and CUDA); O(S^2) memory",
        cuda_only=False,
        half_only=False,
    ),
)

_BY_NAME = MappingProxyType({strategy.name: strategy for strategy in _STRATEGIES})

# Per device type, in order of preference, what `auto` resolves to (first available wins).
_AUTO_PREFERENCES = MappingProxyType({"npu": ("npu_fusion", "sdpa"), "cuda": ("flash_attn", "sdpa")})


# ---------------------------------------------------------------------------------------------
# Public API


def strategy_names() -> tuple[str, ...]:
    """Every registered name, `auto` first (for CLI choices and config validation; no torch)."""
    return tuple(_BY_NAME)


def get_strategy(name: str) -> AttentionStrategy:
    """The strategy called `name`; ValueError listing the valid names otherwise."""
    strategy = _BY_NAME.get(name) if isinstance(name, str) else None
    if strategy is None:
        raise ValueError(f"unknown attention strategy {name!r}; choose one of: {', '.join(_BY_NAME)}")
    return strategy


def resolve(name: str, device: Any, dtype: "torch.dtype") -> AttentionStrategy:
    """`get_strategy(name)`, except that `auto` becomes the best available strategy here."""
    strategy = get_strategy(name)
    if strategy.name != AUTO:
        return strategy
    for candidate in _AUTO_PREFERENCES.get(_device_type(device), ()) + ("sdpa",):
        if _BY_NAME[candidate].is_available(device, dtype)[0]:
            return _BY_NAME[candidate]
    return _BY_NAME["math"]  # unreachable in practice: sdpa is always available


def list_strategies(device: Any, dtype: "torch.dtype") -> list[StrategyStatus]:
    """Every strategy with whether it runs on `device` / `dtype` and why (not)."""
    statuses = []
    for strategy in _STRATEGIES:
        available, reason = strategy.is_available(device, dtype)
        statuses.append(StrategyStatus(strategy.name, strategy.description, available, reason))
    return statuses


def hidream_attention_modules(transformer) -> list:
    """Every diffusers `HiDreamAttention` in `transformer` (double- and single-stream), in order."""
    from diffusers.models.transformers.transformer_hidream_image import HiDreamAttention

    return [module for module in transformer.modules() if isinstance(module, HiDreamAttention)]


def apply(transformer, name: str, device: Any, dtype: "torch.dtype", **options: Any) -> str:
    """Installs strategy `name` (options go to its processor) on every HiDreamAttention module.

    Returns the resolved name (what `auto` became). Raises ValueError for an unknown name or bad
    options and `AttentionUnavailable` when the strategy cannot run on `device` / `dtype`; in
    every error case the transformer is left untouched. Parameters and buffers are never touched:
    processors hold no weights. Not thread-safe with a running forward (see module docstring).
    """
    strategy = resolve(name, device, dtype)
    available, reason = strategy.is_available(device, dtype)
    if not available:
        raise AttentionUnavailable(strategy.name, reason)
    modules = hidream_attention_modules(transformer)
    if not modules:
        raise ValueError(
            f"{type(transformer).__name__} has no HiDreamAttention modules: pass the pipeline's transformer"
        )
    # Built before any module is touched, so bad options leave the transformer as it was. One
    # instance serves every module: it is stateless apart from caches keyed on the mask tensor.
    processor = strategy.make_processor(**options)
    for module in modules:
        module.set_processor(processor)
    return strategy.name


def current_strategy(transformer) -> str | None:
    """The strategy name shared by every HiDreamAttention processor of `transformer`.

    None when there are no such modules, when some processor is not one of ours (e.g. diffusers'
    default), or when modules disagree.
    """
    names = {getattr(module.processor, "strategy_name", None) for module in hidream_attention_modules(transformer)}
    return names.pop() if len(names) == 1 else None
