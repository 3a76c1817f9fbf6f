"""Counting host syncs: the device-to-host transfers a piece of code makes.

Counted the same way on every device (CPU included, and NPU, which has no sync debug mode like
CUDA's): a `TorchFunctionMode` sees every call that would synchronize on an accelerator:
reading a tensor's value on the host (`.cpu()`, `.to("cpu")`, `.item()`, `.tolist()`, `bool()` /
`int()` / `float()` / `index` of a tensor) and ops whose output shape depends on the data
(`nonzero`, boolean-mask indexing, `masked_select`, `unique`), and slicing with tensor bounds.
A `.to("cpu")` counts only when the tensor is elsewhere; `.cpu()` always counts (code that says
`.cpu()` means a host copy on every device). On CPU these are no-ops or plain
memory reads, so the count says what the same forward would cost in round trips on a device.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

import torch
from torch.overrides import TorchFunctionMode

# Methods / functions that read device data on the host.
_READS = {
    torch.Tensor.cpu: "cpu",
    torch.Tensor.item: "item",
    torch.Tensor.tolist: "tolist",
    torch.Tensor.__bool__: "bool",
    torch.Tensor.__int__: "int",
    torch.Tensor.__float__: "float",
    torch.Tensor.__index__: "index",
    torch.Tensor.nonzero: "nonzero",
    torch.nonzero: "nonzero",
    torch.Tensor.masked_select: "masked_select",
    torch.masked_select: "masked_select",
    torch.unique: "unique",
    torch.Tensor.unique: "unique",
}


@dataclass
class SyncCount:
    total: int = 0
    by_kind: dict[str, int] = field(default_factory=collections.Counter)

    def add(self, kind: str) -> None:
        self.total += 1
        self.by_kind[kind] += 1


class HostSyncCounter(TorchFunctionMode):
    """`with HostSyncCounter() as counter: ...` then `counter.count.total`."""

    def __init__(self):
        super().__init__()
        self.count = SyncCount()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        kind = _READS.get(func)
        if kind is None and func is torch.Tensor.to and _to_host(args, kwargs):
            kind = "to_cpu"
        if kind is None and func is torch.Tensor.__getitem__:
            kind = _sync_index(args)
        if kind is not None:
            self.count.add(kind)
        return func(*args, **kwargs)


def _to_host(args, kwargs) -> bool:
    target = kwargs.get("device", args[1] if len(args) > 1 else None)
    # Only a real transfer: `x.to(y.device)` is a no-op when both are on the same device.
    return (
        isinstance(target, (str, torch.device)) and torch.device(target).type == "cpu" and args[0].device.type != "cpu"
    )


def _sync_index(args) -> str | None:
    """ "bool_index" (data-dependent shape) or "tensor_slice" (a slice bound read on the host)."""
    index = args[1] if len(args) > 1 else None
    items = index if isinstance(index, tuple) else (index,)
    if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items):
        return "bool_index"
    if any(isinstance(i, slice) and any(isinstance(b, torch.Tensor) for b in (i.start, i.stop, i.step)) for i in items):
        return "tensor_slice"
    return None


def count_host_syncs(fn, *args, **kwargs) -> tuple[object, SyncCount]:
    """Runs `fn(*args, **kwargs)`; returns (its result, the host syncs it made)."""
    with HostSyncCounter() as counter:
        result = fn(*args, **kwargs)
    return result, counter.count
