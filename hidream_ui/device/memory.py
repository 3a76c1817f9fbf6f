"""Point-in-time memory figures for a device, plus host RAM and this process's RSS.

The status panel polls `snapshot` every couple of seconds *while an edit runs*, so it must be
cheap (no device synchronisation unless asked: a sync would stall the polling thread until the
queued kernels finish) and must never raise (a failing backend call leaves that field None).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping

from hidream_ui.device.backends import default_backends

if TYPE_CHECKING:
    from hidream_ui.device.backends import Backend, DeviceInfo

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


@dataclass(frozen=True)
class MemorySnapshot:
    """Memory of ``device`` (a torch device string) in bytes; None where unknown.

    ``allocated`` / ``reserved`` / ``peak`` come from torch's caching allocator (None on CPU,
    which has none). ``free`` is what could still be allocated: the driver's free memory plus
    the allocator's reserved-but-inactive blocks, which torch reuses without asking the driver
    (the same accounting as ComfyUI). On CPU ``free`` / ``total`` are host available / total.
    ``utilization`` is a percentage (0-100). ``timestamp`` is ``time.time()``.
    """

    device: str
    allocated: int | None
    reserved: int | None
    peak: int | None
    free: int | None
    total: int | None
    utilization: float | None
    host_total: int
    host_available: int
    process_rss: int
    timestamp: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _try(fn: Callable[..., Any], *args: Any) -> Any:
    # Broad on purpose: a status poll must survive any backend failure (driver hiccup, device
    # busy, a backend lacking a counter); the field just becomes None.
    try:
        return fn(*args)
    except Exception:
        return None


def _as_int(value: Any) -> int | None:
    return None if value is None else int(value)


def snapshot(
    device: "DeviceInfo",
    backends: Mapping[str, "Backend"] | None = None,
    sync: bool = False,
) -> MemorySnapshot:
    """Reads the memory figures of ``device`` now; never raises for backend failures.

    ``sync=True`` synchronises the device first, so figures include work still queued (use it
    for a final peak after an edit, not for polling).
    """
    import psutil

    table = default_backends() if backends is None else backends
    backend = table.get(device.type)
    index = device.index
    allocated = reserved = peak = free = total = utilization = None
    if backend is not None:
        if sync:
            _try(backend.synchronize, index)
        allocated = _as_int(_try(backend.memory_allocated, index))
        reserved = _as_int(_try(backend.memory_reserved, index))
        peak = _as_int(_try(backend.max_memory_allocated, index))
        info = _try(backend.mem_get_info, index)
        if info is not None:
            free, total = int(info[0]), int(info[1])
            stats = _try(backend.memory_stats, index) or {}
            cached_reserved = stats.get("reserved_bytes.all.current")
            active = stats.get("active_bytes.all.current")
            # Without allocator stats, free is the driver's figure alone (a lower bound).
            if cached_reserved is not None and active is not None:
                free += max(0, int(cached_reserved) - int(active))
        used = _try(backend.utilization, index)
        utilization = None if used is None else float(used)
    host = psutil.virtual_memory()
    return MemorySnapshot(
        device=device.torch_device,
        allocated=allocated,
        reserved=reserved,
        peak=peak,
        free=free,
        total=total,
        utilization=utilization,
        host_total=int(host.total),
        host_available=int(host.available),
        process_rss=int(psutil.Process().memory_info().rss),
        timestamp=time.time(),
    )


def format_bytes(n: int | float | None) -> str:
    """``1610612736`` -> ``"1.5 GiB"``; ``None`` -> ``"—"``. Binary units, one decimal."""
    if n is None:
        return "—"
    value = float(n)
    sign = "-" if value < 0 else ""
    value = abs(value)
    if value < 1024:
        return f"{sign}{int(value)} B"
    unit_index = 0
    # Compare the *rounded* value so 1023.96 KiB prints as "1.0 MiB", not "1024.0 KiB".
    while round(value, 1) >= 1024 and unit_index < len(_UNITS) - 1:
        value /= 1024
        unit_index += 1
    return f"{sign}{value:.1f} {_UNITS[unit_index]}"


__all__ = ["MemorySnapshot", "format_bytes", "snapshot"]
