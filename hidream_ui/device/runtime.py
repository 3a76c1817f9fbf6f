"""Per-call device housekeeping: generators, the per-thread device, syncs, freeing memory, OOM."""

from __future__ import annotations

import gc
import sys
import threading
from typing import TYPE_CHECKING, Mapping

from hidream_ui.device.backends import Backend, DeviceError, DeviceInfo
from hidream_ui.device.detect import _backend_for

if TYPE_CHECKING:
    import torch


# Lower-cased fragments of allocator failures that are not (yet) torch.OutOfMemoryError:
# torch_npu raises RuntimeError("NPU out of memory. Tried to allocate ..."), older CUDA builds
# RuntimeError("CUDA out of memory ..."), ACL reports raw allocation failures by this code name
# and torch's CPU allocator says "DefaultCPUAllocator: can't allocate memory".
_OOM_MARKERS: tuple[str, ...] = ("out of memory", "acl_error_rt_memory_allocation", "can't allocate memory")


# --------------------------------------------------------------------------------------------
# Random numbers, threads, housekeeping
# --------------------------------------------------------------------------------------------


def make_generator(seed: int, device: DeviceInfo, on_device: bool = False) -> "torch.Generator":
    """A seeded ``torch.Generator``; on the CPU unless ``on_device=True``.

    Why CPU by default: diffusers' ``randn_tensor`` draws the starting noise on the
    generator's device and then moves it to the model's device. A CPU generator therefore
    gives the *same* starting noise for the same seed on NPU, CUDA and CPU (results still
    differ slightly because the kernels do), and the noise is tiny compared with a denoising
    step. ``on_device=True`` draws on ``device`` instead: reproducible only on that device
    type (and torch/driver version).
    """
    import torch

    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**64:
        raise DeviceError(f"seed must be an integer in [0, 2**64), got {seed!r}")
    target = device.torch_device if on_device else "cpu"
    return torch.Generator(device=target).manual_seed(seed)


def bind_device_to_thread(device: DeviceInfo, backends: Mapping[str, Backend] | None = None) -> None:
    """Makes ``device`` current in the *calling* thread (no-op on CPU).

    Gradio runs sync handlers in worker threads, and on NPU (as on CUDA) the current device is
    per thread: a worker that never called ``set_device`` computes on device 0, whatever the
    main thread chose. Call this at the start of every computation, in the computing thread.
    """
    if device.index is None:
        return
    backend = _backend_for(device, backends)
    try:
        backend.set_device(device.index)
    except Exception as exc:  # re-raised with the device and thread named
        raise DeviceError(
            f"could not make {device.torch_device} current in thread {threading.current_thread().name!r}: {exc}"
        ) from exc


def synchronize(device: DeviceInfo, backends: Mapping[str, Backend] | None = None) -> None:
    """Waits for queued work on ``device`` (accurate timings, peak memory); no-op on CPU."""
    _backend_for(device, backends).synchronize(device.index)


def empty_cache(device: DeviceInfo, backends: Mapping[str, Backend] | None = None) -> None:
    """Returns the allocator's cached, unused blocks to the driver; no-op on CPU."""
    _backend_for(device, backends).empty_cache()


def reset_peak(device: DeviceInfo, backends: Mapping[str, Backend] | None = None) -> None:
    """Resets the allocator's peak counters so the next peak is per edit; no-op on CPU."""
    _backend_for(device, backends).reset_peak_memory_stats(device.index)


def free_memory(device: DeviceInfo, backends: Mapping[str, Backend] | None = None) -> None:
    """Collects Python garbage, then empties the allocator cache.

    In that order: tensors kept alive only by reference cycles (e.g. a traceback holding a
    frame after an OOM) must be collected before their blocks can be released.
    """
    gc.collect()
    empty_cache(device, backends)


def is_oom_error(exc: BaseException) -> bool:
    """True for out-of-memory failures, device or host.

    Covers ``torch.OutOfMemoryError``, RuntimeErrors whose message says "out of memory" (NPU:
    "NPU out of memory. Tried to allocate ..."), names ACL's allocation error or comes from
    torch's CPU allocator ("can't allocate memory"), and host ``MemoryError``. Follows explicit
    ``raise ... from`` chains, since pipelines re-raise.
    """
    torch = sys.modules.get("torch")  # if torch was never imported, no torch OOM can exist
    oom_type = getattr(torch, "OutOfMemoryError", None) if torch is not None else None
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, MemoryError):
            return True
        if oom_type is not None and isinstance(current, oom_type):
            return True
        if isinstance(current, RuntimeError):
            text = str(current).lower()
            if any(marker in text for marker in _OOM_MARKERS):
                return True
        current = current.__cause__
    return False
