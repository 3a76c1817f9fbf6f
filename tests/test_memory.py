"""Memory snapshots: the free-memory arithmetic, cheapness, robustness, and byte formatting."""

from __future__ import annotations

import dataclasses
import json

import psutil
import pytest
from fakes import FakeNPUBackend, GiB

from hidream_ui.device.backends import CPUBackend
from hidream_ui.device.detect import resolve_device
from hidream_ui.device.memory import MemorySnapshot, format_bytes, snapshot

MiB = 1024**2
# What a status poll may touch: reads only; never set_device, probes or synchronize.
READ_ONLY_CALLS = {
    "mem_get_info",
    "memory_stats",
    "memory_allocated",
    "memory_reserved",
    "max_memory_allocated",
    "utilization",
}


def npu(fake: FakeNPUBackend, spec: str = "npu:1"):
    backends = {"npu": fake, "cpu": CPUBackend()}
    device = resolve_device(spec, backends=backends, environ={})
    fake.calls.clear()  # only the snapshot's own calls matter below
    return device, backends


def test_fake_numbers_give_the_expected_fields_and_free_computation():
    fake = FakeNPUBackend(
        count=2,
        free=20 * GiB,
        total=64 * GiB,
        allocated=3 * GiB,
        reserved=6 * GiB,
        active=4 * GiB,
        peak=5 * GiB,
        utilization=42.5,
    )
    device, backends = npu(fake)
    snap = snapshot(device, backends=backends)
    assert snap.device == "npu:1"
    assert (snap.allocated, snap.reserved, snap.peak, snap.total) == (3 * GiB, 6 * GiB, 5 * GiB, 64 * GiB)
    # The 2 GiB reserved by the allocator but not active are reusable, so they count as free.
    assert snap.free == 20 * GiB + (6 * GiB - 4 * GiB)
    assert snap.utilization == 42.5
    assert snap.host_total == psutil.virtual_memory().total
    assert 0 < snap.host_available <= snap.host_total
    assert snap.process_rss > 0
    assert {call.args[0] for call in fake.calls if call.args} == {1}  # always the device's own index


def test_free_changes_with_the_allocator_cache():
    fake = FakeNPUBackend(free=1 * GiB, reserved=5 * GiB, active=5 * GiB)
    device, backends = npu(fake, "npu:0")
    assert snapshot(device, backends=backends).free == 1 * GiB  # nothing cached: driver figure only
    fake.active = 2 * GiB
    assert snapshot(device, backends=backends).free == 4 * GiB


def test_polling_snapshot_only_reads_and_never_synchronizes():
    fake = FakeNPUBackend()
    device, backends = npu(fake)
    snapshot(device, backends=backends)
    assert {call.method for call in fake.calls} <= READ_ONLY_CALLS
    assert fake.calls_to("synchronize") == []


def test_sync_snapshot_synchronizes_the_device_first():
    fake = FakeNPUBackend()
    device, backends = npu(fake)
    snapshot(device, backends=backends, sync=True)
    assert [call.args for call in fake.calls_to("synchronize")] == [(1,)]
    assert fake.calls[0].method == "synchronize"


def test_a_raising_backend_gives_none_fields_not_an_exception():
    fake = FakeNPUBackend()
    device, backends = npu(fake)
    fake.broken = True
    snap = snapshot(device, backends=backends, sync=True)
    assert (snap.allocated, snap.reserved, snap.peak, snap.free, snap.total, snap.utilization) == (None,) * 6
    assert snap.host_total > 0 and snap.process_rss > 0
    assert len(fake.calls) >= 6  # every call was attempted and survived


def test_missing_allocator_stats_leave_the_driver_free_figure():
    class NoStats(FakeNPUBackend):
        def memory_stats(self, index):
            raise RuntimeError("memory_stats not supported by this runtime")

    fake = NoStats(free=7 * GiB, total=32 * GiB, reserved=6 * GiB, active=1 * GiB)
    device, backends = npu(fake)
    snap = snapshot(device, backends=backends)
    assert (snap.free, snap.total, snap.reserved) == (7 * GiB, 32 * GiB, 6 * GiB)


def test_unregistered_backend_gives_none_device_fields():
    fake = FakeNPUBackend()
    device, _ = npu(fake)
    snap = snapshot(device, backends={"cpu": CPUBackend()})
    assert (snap.allocated, snap.free, snap.total, snap.utilization) == (None, None, None, None)


def test_real_cpu_snapshot():
    device = resolve_device("cpu", backends={"cpu": CPUBackend()}, environ={})
    snap = snapshot(device, backends={"cpu": CPUBackend()})
    assert snap.device == "cpu"
    # No device allocator on CPU: these are None rather than the process RSS.
    assert (snap.allocated, snap.reserved, snap.peak) == (None, None, None)
    assert snap.total == psutil.virtual_memory().total == snap.host_total
    assert 0 < snap.free <= snap.total
    assert snap.utilization is not None and 0.0 <= snap.utilization <= 100.0
    as_dict = snap.to_dict()
    assert list(as_dict) == [field.name for field in dataclasses.fields(MemorySnapshot)]
    assert json.loads(json.dumps(as_dict)) == as_dict


def test_snapshot_is_frozen():
    snap = snapshot(resolve_device("cpu", backends={"cpu": CPUBackend()}, environ={}), backends={"cpu": CPUBackend()})
    with pytest.raises(dataclasses.FrozenInstanceError):
        snap.free = 0  # type: ignore[misc]


@pytest.mark.parametrize(
    "value, text",
    [
        (None, "—"),
        (0, "0 B"),
        (1023, "1023 B"),
        (1536, "1.5 KiB"),
        (1024 * MiB - 1, "1.0 GiB"),
        (int(1.5 * GiB), "1.5 GiB"),
        (80 * GiB, "80.0 GiB"),
        (3 * 1024 * GiB, "3.0 TiB"),
        (-2 * MiB, "-2.0 MiB"),
    ],
)
def test_format_bytes(value, text):
    assert format_bytes(value) == text
