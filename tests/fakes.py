"""Fake accelerator backends with the `hidream_ui.device.backends.Backend` surface.

They stand in for Ascend NPUs (and CUDA GPUs) on a machine that has neither: inject them with
``backends={"npu": FakeNPUBackend(), "cpu": CPUBackend(), ...}``. Nothing is put into
``sys.modules``. Every call is recorded with the calling thread so tests can check *where*
things happen (e.g. that ``set_device`` ran in the worker thread), and the current device is
kept per thread, as the real NPU runtime does.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

GiB = 1024**3


@dataclass(frozen=True)
class Call:
    method: str
    args: tuple[Any, ...]
    thread_id: int
    thread_name: str


class FakeBackend:
    """A configurable fake accelerator.

    ``available=False`` makes it unusable with ``reason``. ``bf16=False`` / ``fp16=False``
    make the backend report (bf16) and probe that dtype as unsupported; ``fail_probe_dtypes``
    makes probes of those dtype names fail as if the kernel returned garbage. ``broken=True``
    makes every query (memory, name, utilisation, sync ...) raise RuntimeError.
    """

    type = "fake"

    def __init__(
        self,
        count: int = 2,
        names: Sequence[str] | None = None,
        bf16: bool = True,
        fp16: bool = True,
        free: int = 20 * GiB,
        total: int = 64 * GiB,
        allocated: int = 3 * GiB,
        reserved: int = 6 * GiB,
        active: int = 4 * GiB,
        peak: int = 5 * GiB,
        utilization: float | None = 37.0,
        fail_probe_dtypes: Iterable[str] = (),
        available: bool = True,
        reason: str = "",
        broken: bool = False,
    ):
        self.count = count
        self.names = list(names) if names is not None else [f"Fake{self.type.upper()}-{i}" for i in range(count)]
        self.bf16 = bf16
        self.fp16 = fp16
        self.free = free
        self.total = total
        self.allocated = allocated
        self.reserved = reserved
        self.active = active
        self.peak = peak
        self.util = utilization
        self.fail_probe_dtypes = set(fail_probe_dtypes)
        self.available = available
        self.reason = reason or f"fake {self.type} switched off"
        self.broken = broken
        self.calls: list[Call] = []
        self._current: dict[int, int] = {}  # thread id -> current device, like the NPU runtime
        self._lock = threading.Lock()

    # -- bookkeeping ---------------------------------------------------------------------
    def _record(self, method: str, *args: Any, may_break: bool = True) -> None:
        thread = threading.current_thread()
        with self._lock:
            self.calls.append(Call(method, args, threading.get_ident(), thread.name))
        if self.broken and may_break:
            raise RuntimeError(f"fake {self.type}: {method} failed (broken=True)")

    def calls_to(self, method: str) -> list[Call]:
        with self._lock:
            return [call for call in self.calls if call.method == method]

    def _check_index(self, index: int | None) -> int:
        index = 0 if index is None else index
        if not 0 <= index < self.count:
            raise RuntimeError(f"fake {self.type}: invalid device ordinal {index}")
        return index

    # -- Backend surface -----------------------------------------------------------------
    def availability(self) -> tuple[bool, str]:
        self._record("availability", may_break=False)
        if not self.available:
            return False, self.reason
        return True, f"{self.count} fake {self.type} device(s)"

    def is_available(self) -> bool:
        return self.availability()[0]

    def device_count(self) -> int:
        self._record("device_count", may_break=False)
        return self.count if self.available else 0

    def set_device(self, index: int | None) -> None:
        self._record("set_device", index)
        index = self._check_index(index)
        with self._lock:
            self._current[threading.get_ident()] = index

    def current_device(self) -> int | None:
        self._record("current_device")
        with self._lock:
            return self._current.get(threading.get_ident(), 0)

    def mem_get_info(self, index: int | None) -> tuple[int, int]:
        self._record("mem_get_info", index)
        self._check_index(index)
        return self.free, self.total

    def memory_stats(self, index: int | None) -> dict[str, int]:
        self._record("memory_stats", index)
        self._check_index(index)
        return {
            "allocated_bytes.all.current": self.allocated,
            "allocated_bytes.all.peak": self.peak,
            "reserved_bytes.all.current": self.reserved,
            "active_bytes.all.current": self.active,
        }

    def memory_allocated(self, index: int | None) -> int | None:
        self._record("memory_allocated", index)
        return self.allocated

    def memory_reserved(self, index: int | None) -> int | None:
        self._record("memory_reserved", index)
        return self.reserved

    def max_memory_allocated(self, index: int | None) -> int | None:
        self._record("max_memory_allocated", index)
        return self.peak

    def reset_peak_memory_stats(self, index: int | None) -> None:
        self._record("reset_peak_memory_stats", index)
        self.peak = self.allocated

    def empty_cache(self) -> None:
        self._record("empty_cache")
        self.reserved = self.active  # cached, inactive blocks go back to the driver

    def synchronize(self, index: int | None) -> None:
        self._record("synchronize", index)

    def get_device_name(self, index: int | None) -> str:
        self._record("get_device_name", index)
        return self.names[self._check_index(index)]

    def is_bf16_supported(self) -> bool | None:
        self._record("is_bf16_supported")
        return self.bf16

    def utilization(self, index: int | None) -> float | None:
        self._record("utilization", index)
        return self.util

    def probe_dtype(self, index: int | None, dtype: str) -> tuple[bool, str]:
        self._record("probe_dtype", index, dtype, may_break=False)
        if dtype == "bf16" and not self.bf16:
            return False, f"fake {self.type}: no bf16 kernels"
        if dtype == "fp16" and not self.fp16:
            return False, f"fake {self.type}: no fp16 kernels"
        if dtype in self.fail_probe_dtypes:
            return False, f"fake {self.type}: {dtype} matmul returned non-finite values"
        return True, f"fake {self.type}: {dtype} ok"


class FakeNPUBackend(FakeBackend):
    type = "npu"


class FakeCUDABackend(FakeBackend):
    type = "cuda"


class FakeTorchNPUModule:
    """What `NPUBackend` reads from an imported ``torch_npu``: just ``.npu`` (torch.npu).

    Passed through ``NPUBackend(import_module=...)``, never installed in ``sys.modules``.
    """

    def __init__(self, npu: Any):
        self.npu = npu
