"""One backend per device type (NPU, CUDA, CPU) behind one protocol, plus the dtype probe they run.

NPU code imports torch_npu lazily (never at import time) and is tested against fakes with the
same surface (tests/fakes.py, checked against the real release by tests/test_npu_contract.py).
"""

from __future__ import annotations

import importlib
import importlib.util
import platform
import threading
import time
from dataclasses import asdict, dataclass
from types import MappingProxyType, ModuleType
from typing import TYPE_CHECKING, Any, Callable, Mapping, Protocol

if TYPE_CHECKING:
    import torch


# Priority of `auto`. CPU is last and always available.
DETECTION_ORDER: tuple[str, ...] = ("npu", "cuda", "cpu")
DEVICE_SPEC_HELP = "auto, npu, npu:N, cuda, cuda:N or cpu"

# The variables that hide and renumber accelerators: with ASCEND_RT_VISIBLE_DEVICES=4,5 the
# process sees two NPUs, npu:0 (physical 4) and npu:1 (physical 5).
VISIBLE_DEVICES_ENV: Mapping[str, str] = MappingProxyType(
    {"npu": "ASCEND_RT_VISIBLE_DEVICES", "cuda": "CUDA_VISIBLE_DEVICES"}
)

DTYPE_SPECS: tuple[str, ...] = ("auto", "bf16", "fp16", "fp32")
# `auto` tries these in order: bf16 keeps fp32's range (no overflow in the 17B transformer's
# activations) at half the memory; fp16 is the fallback for accelerators without bf16 (e.g.
# Ascend 910A, pre-Ampere GPUs); fp32 always works.
AUTO_DTYPE_ORDER: tuple[str, ...] = ("bf16", "fp16", "fp32")
_DTYPE_ALIASES: Mapping[str, str] = MappingProxyType(
    {
        "auto": "auto",
        "bf16": "bf16",
        "bfloat16": "bf16",
        "fp16": "fp16",
        "float16": "fp16",
        "half": "fp16",
        "fp32": "fp32",
        "float32": "fp32",
        "float": "fp32",
    }
)
_TORCH_DTYPE_ATTR: Mapping[str, str] = MappingProxyType({"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"})
# Max |probe - fp32 reference| allowed, relative to max(|reference|, 1). Loose enough for the
# dtype's own rounding (bf16 has 8 mantissa bits) yet far below what a broken kernel produces.
_PROBE_TOLERANCE: Mapping[str, float] = MappingProxyType({"bf16": 0.05, "fp16": 0.01, "fp32": 1e-3})
_PROBE_SIZE = 16


class DeviceError(RuntimeError):
    """A device or dtype was asked for but cannot be used; the message says why and what to do.

    ``report`` holds the `DetectionReport` when the error comes from device resolution.
    """

    def __init__(self, message: str, report: "DetectionReport | None" = None):
        super().__init__(message)
        self.report = report


# --------------------------------------------------------------------------------------------
# Public data types
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DeviceInfo:
    """A resolved compute device.

    ``index`` is the *visible* index (what torch calls the device; None for CPU) and
    ``physical_index`` the id on the machine, which differs when ``visible_env`` (the
    ``NAME=value`` of ASCEND_RT_VISIBLE_DEVICES / CUDA_VISIBLE_DEVICES) renumbers devices;
    it is None when the variable names the device by something other than an integer id
    (e.g. a CUDA UUID). ``total_memory`` is the device memory (host RAM for CPU) in bytes.
    """

    type: str
    index: int | None
    torch_device: str
    name: str
    physical_index: int | None = None
    visible_env: str | None = None
    total_memory: int | None = None
    bf16_supported: bool | None = None

    @property
    def torch(self) -> "torch.device":
        # Built lazily: torch.device("npu:0") only parses once torch_npu has been imported.
        import torch as _torch

        return _torch.device(self.torch_device)

    @property
    def label(self) -> str:
        """Human-readable one-liner for logs and the status panel."""
        text = f"{self.torch_device} ({self.name})"
        if self.visible_env is not None and self.physical_index is not None:
            text += f", physical {self.type}{self.physical_index} via {self.visible_env}"
        return text

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class BackendStatus:
    """What one backend said when asked whether it can be used."""

    type: str
    available: bool
    reason: str  # why it is unusable, or a short summary such as "2 device(s) visible"
    device_count: int  # visible devices; 0 when unavailable
    visible_env: str | None = None  # "NAME=value" when the visibility variable is set


@dataclass(frozen=True)
class DetectionReport:
    """The outcome of device resolution, for ``doctor`` and for error messages.

    ``backends`` lists every backend that was asked, in the order asked. ``skipped`` lists, for
    ``auto`` only, the higher-priority backends that were passed over and why.
    """

    spec: str
    device: DeviceInfo | None
    error: str | None
    backends: tuple[BackendStatus, ...]
    skipped: tuple[tuple[str, str], ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """Plain dicts and lists only, so ``json.loads(json.dumps(d)) == d``."""
        return {
            "spec": self.spec,
            "device": None if self.device is None else self.device.to_dict(),
            "error": self.error,
            "backends": [asdict(status) for status in self.backends],
            "skipped": [[kind, why] for kind, why in self.skipped],
        }


# --------------------------------------------------------------------------------------------
# Backends
# --------------------------------------------------------------------------------------------


class Backend(Protocol):
    """What `devices` and `memory` need from a device type. Indices are visible indices.

    ``index`` is None for CPU. Memory figures are bytes; ``utilization`` is a percentage
    (0-100) or None when unknown. ``probe_dtype`` takes a dtype name ("bf16", "fp16",
    "fp32") and runs a real op on the device: it returns (ok, reason) and never raises.
    ``availability`` returns (usable, reason) and never raises either.
    """

    type: str

    def availability(self) -> tuple[bool, str]: ...
    def is_available(self) -> bool: ...
    def device_count(self) -> int: ...
    def set_device(self, index: int | None) -> None: ...
    def current_device(self) -> int | None: ...
    def mem_get_info(self, index: int | None) -> tuple[int, int]: ...
    def memory_stats(self, index: int | None) -> dict[str, int]: ...
    def memory_allocated(self, index: int | None) -> int | None: ...
    def memory_reserved(self, index: int | None) -> int | None: ...
    def max_memory_allocated(self, index: int | None) -> int | None: ...
    def reset_peak_memory_stats(self, index: int | None) -> None: ...
    def empty_cache(self) -> None: ...
    def synchronize(self, index: int | None) -> None: ...
    def get_device_name(self, index: int | None) -> str: ...
    def is_bf16_supported(self) -> bool | None: ...
    def utilization(self, index: int | None) -> float | None: ...
    def probe_dtype(self, index: int | None, dtype: str) -> tuple[bool, str]: ...


class _TorchAcceleratorBackend:
    """Shared body of the NPU and CUDA backends: ``torch.npu`` mirrors the ``torch.cuda`` API."""

    type = ""

    def _module(self) -> Any:  # pragma: no cover - overridden
        raise NotImplementedError

    def is_available(self) -> bool:
        return self.availability()[0]

    def availability(self) -> tuple[bool, str]:  # pragma: no cover - overridden
        raise NotImplementedError

    def device_count(self) -> int:
        return int(self._module().device_count())

    def set_device(self, index: int | None) -> None:
        if index is not None:
            self._module().set_device(index)

    def current_device(self) -> int | None:
        return int(self._module().current_device())

    def mem_get_info(self, index: int | None) -> tuple[int, int]:
        free, total = self._module().mem_get_info(index)
        return int(free), int(total)

    def memory_stats(self, index: int | None) -> dict[str, int]:
        return dict(self._module().memory_stats(index))

    def memory_allocated(self, index: int | None) -> int | None:
        return int(self._module().memory_allocated(index))

    def memory_reserved(self, index: int | None) -> int | None:
        return int(self._module().memory_reserved(index))

    def max_memory_allocated(self, index: int | None) -> int | None:
        return int(self._module().max_memory_allocated(index))

    def reset_peak_memory_stats(self, index: int | None) -> None:
        self._module().reset_peak_memory_stats(index)

    def empty_cache(self) -> None:
        self._module().empty_cache()

    def synchronize(self, index: int | None) -> None:
        self._module().synchronize(index)

    def get_device_name(self, index: int | None) -> str:
        return str(self._module().get_device_name(index))

    def is_bf16_supported(self) -> bool | None:
        return bool(self._module().is_bf16_supported())

    def utilization(self, index: int | None) -> float | None:
        return float(self._module().utilization(index))

    def probe_dtype(self, index: int | None, dtype: str) -> tuple[bool, str]:
        return run_dtype_probe(f"{self.type}:{index or 0}", dtype)


class NPUBackend(_TorchAcceleratorBackend):
    """Ascend NPUs through ``torch.npu``, which exists only after ``import torch_npu``.

    The import happens inside `_module` (never at module import) and is retried on each call
    rather than cached, so this object holds no state; once it succeeded Python's module cache
    makes it free. ``import_module`` is injectable so the error paths can be tested without a
    fake module in ``sys.modules``.
    """

    type = "npu"

    def __init__(self, import_module: Callable[[str], ModuleType] | None = None):
        self._import = import_module or importlib.import_module

    def _module(self) -> Any:
        try:
            torch_npu = self._import("torch_npu")
        except ModuleNotFoundError as exc:
            if exc.name == "torch_npu":
                raise DeviceError(
                    "torch_npu is not installed: install the torch_npu wheel matching your torch "
                    "and CANN versions (see docs/npu.md)"
                ) from exc
            raise DeviceError(
                f"torch_npu is installed but not importable: it needs the module {exc.name!r} "
                f"({exc}). Install the matching dependencies (see docs/npu.md)"
            ) from exc
        # Broad on purpose: a missing CANN library is an ImportError/OSError, a torch/torch_npu
        # version mismatch is a RuntimeError or AttributeError; all mean "not importable".
        except Exception as exc:
            raise DeviceError(
                f"torch_npu is installed but not importable ({type(exc).__name__}: {exc}). "
                "Usually the CANN environment is not loaded (run `source "
                "/usr/local/Ascend/ascend-toolkit/set_env.sh`) or torch_npu does not match the "
                "installed torch version"
            ) from exc
        return torch_npu.npu

    def availability(self) -> tuple[bool, str]:
        try:
            npu = self._module()
        except DeviceError as exc:
            return False, str(exc)
        try:
            available = bool(npu.is_available())
            count = int(npu.device_count()) if available else 0
        except Exception as exc:  # driver/runtime errors surface as various types
            return False, (
                f"torch_npu imported but querying NPUs failed ({type(exc).__name__}: {exc}): "
                "check the driver with `npu-smi info` and that CANN is loaded"
            )
        if not available or count == 0:
            return False, (
                "CANN not loaded or no NPU visible: torch_npu imported but torch.npu.is_available() "
                "is False. Check the driver with `npu-smi info`, load CANN with `source "
                "/usr/local/Ascend/ascend-toolkit/set_env.sh` and check ASCEND_RT_VISIBLE_DEVICES"
            )
        return True, f"{count} NPU(s) visible"


class CUDABackend(_TorchAcceleratorBackend):
    """NVIDIA (or ROCm) GPUs through ``torch.cuda``; utilisation through NVML when installed."""

    type = "cuda"

    def _module(self) -> Any:
        import torch

        return torch.cuda

    def availability(self) -> tuple[bool, str]:
        import torch

        if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
            return False, (
                f"this torch build ({torch.__version__}) has no CUDA support: install a CUDA "
                "build of torch to use a GPU"
            )
        try:
            count = int(torch.cuda.device_count())
            available = count > 0 and bool(torch.cuda.is_available())
        except Exception as exc:  # broken drivers raise from inside the CUDA runtime
            return False, f"querying CUDA devices failed ({type(exc).__name__}: {exc})"
        if not available:
            return False, (
                f"torch is built with CUDA {torch.version.cuda or torch.version.hip} but no GPU is "
                "visible: check `nvidia-smi` and CUDA_VISIBLE_DEVICES"
            )
        return True, f"{count} GPU(s) visible"

    def is_bf16_supported(self) -> bool | None:
        import torch

        try:
            # Native bf16 only: emulated bf16 on pre-Ampere GPUs works but is slower than fp16.
            return bool(torch.cuda.is_bf16_supported(including_emulation=False))
        except TypeError:  # torch older than 2.3 has no including_emulation
            return bool(torch.cuda.is_bf16_supported())

    def utilization(self, index: int | None) -> float | None:
        if importlib.util.find_spec("pynvml") is None:  # nvidia-ml-py not installed
            return None
        import torch

        # torch.cuda.utilization queries NVML and maps the visible index to NVML's physical
        # numbering (CUDA_VISIBLE_DEVICES, UUIDs included), which NVML alone does not do.
        return float(torch.cuda.utilization(index))


CPU_LOAD_REUSE = 0.5  # seconds
_CPU_LOAD_LOCK = threading.Lock()
_CPU_LOAD: list = []  # [monotonic time, percent] of the last measurement


class CPUBackend:
    """The host. Always available; synchronisation, caches and device binding do not exist.

    Memory policy: ``mem_get_info`` is host RAM (available, total) because that is what a CPU
    run draws from. There is no device allocator, so allocated / reserved / peak are None
    rather than the process RSS: RSS counts Python, libraries and weights alike and would make
    the "device memory" row lie. The snapshot reports RSS separately as ``process_rss``.
    """

    type = "cpu"

    def availability(self) -> tuple[bool, str]:
        return True, "always available"

    def is_available(self) -> bool:
        return True

    def device_count(self) -> int:
        return 1

    def set_device(self, index: int | None) -> None:
        return None

    def current_device(self) -> int | None:
        return None

    def mem_get_info(self, index: int | None) -> tuple[int, int]:
        import psutil

        vm = psutil.virtual_memory()
        return int(vm.available), int(vm.total)

    def memory_stats(self, index: int | None) -> dict[str, int]:
        return {}

    def memory_allocated(self, index: int | None) -> int | None:
        return None

    def memory_reserved(self, index: int | None) -> int | None:
        return None

    def max_memory_allocated(self, index: int | None) -> int | None:
        return None

    def reset_peak_memory_stats(self, index: int | None) -> None:
        return None

    def empty_cache(self) -> None:
        return None

    def synchronize(self, index: int | None) -> None:
        return None

    def get_device_name(self, index: int | None) -> str:
        try:
            with open("/proc/cpuinfo", encoding="utf-8") as handle:
                for line in handle:
                    if line.startswith("model name"):
                        return line.split(":", 1)[1].strip()
        except OSError:  # not Linux
            pass
        return platform.processor() or platform.machine() or "CPU"

    def is_bf16_supported(self) -> bool | None:
        import torch

        try:
            # True only with native bf16 units (AVX512-BF16 / AMX); elsewhere bf16 is emulated
            # and slower than fp32, which is why `auto` never picks it on CPU.
            return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
        except (AttributeError, RuntimeError):  # builds without oneDNN
            return None

    def utilization(self, index: int | None) -> float | None:
        import psutil

        # Whole-machine CPU load since the previous call (non-blocking; the first call of the
        # process returns 0.0). Polled every few seconds by the status panel, that is useful.
        # Callers within CPU_LOAD_REUSE of a measurement share it: a pool of CPU engines (and
        # each status poll) asks several times in a row, and a call right after another measures
        # nothing (0 %).
        with _CPU_LOAD_LOCK:
            now = time.monotonic()
            if _CPU_LOAD and now - _CPU_LOAD[0] < CPU_LOAD_REUSE:
                return _CPU_LOAD[1]
            value = float(psutil.cpu_percent(interval=None))
            _CPU_LOAD[:] = [now, value]
            return value

    def probe_dtype(self, index: int | None, dtype: str) -> tuple[bool, str]:
        return run_dtype_probe("cpu", dtype)


def default_backends() -> dict[str, Backend]:
    """The real backend table, built on demand (constructing a backend touches no device)."""
    return {"npu": NPUBackend(), "cuda": CUDABackend(), "cpu": CPUBackend()}


def run_dtype_probe(torch_device: str, dtype: str) -> tuple[bool, str]:
    """Runs a tiny matmul and a reduction in ``dtype`` on ``torch_device``.

    Device failures come back as ``(False, reason)``, never as exceptions; only a dtype name
    that is not bf16/fp16/fp32 raises `DeviceError` (a caller bug).

    Checks the result is finite and close to the same computation in fp32 on the CPU. A
    capability flag is not enough: some accelerators accept a dtype and return garbage or
    raise only when a kernel for it is missing.
    """
    import torch

    name = _canonical_dtype(dtype)
    if name == "auto":
        raise DeviceError("run_dtype_probe needs a concrete dtype (bf16, fp16 or fp32), not 'auto'")
    target = getattr(torch, _TORCH_DTYPE_ATTR[name])
    generator = torch.Generator(device="cpu").manual_seed(0)
    a = torch.rand((_PROBE_SIZE, _PROBE_SIZE), generator=generator) * 2 - 1
    b = torch.rand((_PROBE_SIZE, _PROBE_SIZE), generator=generator) * 2 - 1
    reference = (a @ b).sum(dim=-1)
    try:
        da = a.to(device=torch_device, dtype=target)
        db = b.to(device=torch_device, dtype=target)
        result = (da @ db).sum(dim=-1).to(device="cpu", dtype=torch.float32)
    # Broad on purpose: a missing kernel is RuntimeError on CUDA/CPU but vendor-specific on NPU.
    except Exception as exc:
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        return False, f"{name} matmul failed on {torch_device}: {type(exc).__name__}: {message}"
    return judge_probe(name, torch_device, result, reference)


def judge_probe(dtype: str, torch_device: str, result: "torch.Tensor", reference: "torch.Tensor") -> tuple[bool, str]:
    """Accepts a probe ``result`` (fp32, on CPU) if finite and within the dtype's tolerance."""
    import torch

    if not bool(torch.isfinite(result).all()):
        return False, f"{dtype} matmul on {torch_device} returned non-finite values"
    error = float((result - reference).abs().max())
    limit = _PROBE_TOLERANCE[dtype] * max(float(reference.abs().max()), 1.0)
    if error > limit:
        return False, f"{dtype} matmul on {torch_device} is off by {error:.3g} (allowed {limit:.3g})"
    return True, f"{dtype} matmul+sum ok on {torch_device} (max error {error:.2g})"


def _canonical_dtype(spec: str) -> str:
    canonical = _DTYPE_ALIASES.get(str(spec).strip().lower()) if isinstance(spec, str) else None
    if canonical is None:
        raise DeviceError(f"dtype {spec!r} is not valid: use {', '.join(DTYPE_SPECS)}")
    return canonical


def dtype_name(dtype: "torch.dtype") -> str:
    """``torch.bfloat16`` -> ``"bf16"``, ``torch.float16`` -> ``"fp16"``, ``torch.float32`` -> ``"fp32"``."""
    import torch

    for name, attr in _TORCH_DTYPE_ATTR.items():
        if dtype == getattr(torch, attr):
            return name
    raise DeviceError(f"dtype {dtype!r} is not one of the compute dtypes bf16, fp16, fp32")


def _torch_dtype(name: str) -> "torch.dtype":
    import torch

    return getattr(torch, _TORCH_DTYPE_ATTR[name])
