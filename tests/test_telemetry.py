"""Device telemetry: npu-smi parsers (910B and 310P layouts), NVML through a fake module, psutil, the
missing-tool and hung-tool paths, and the sampler that keeps all of it off the status poll."""

from __future__ import annotations

import subprocess
import threading
import time

import pytest
import telemetry_samples as samples
from helpers import wait_for

from hidream_ui.device.backends import DeviceInfo
from hidream_ui.device.telemetry import (
    DeviceTelemetry,
    TelemetrySampler,
    parse_npu_smi_mapping,
    parse_npu_smi_usages,
    parse_npu_smi_value,
    read_cpu,
    read_cuda,
    read_npu,
)
from hidream_ui.ui.devices_panel import plot_rows, render_device_rows

MiB = 1024 * 1024


def npu(index: int, physical: int | None = None) -> DeviceInfo:
    return DeviceInfo(
        type="npu",
        index=index,
        torch_device=f"npu:{index}",
        name="Ascend",
        physical_index=index if physical is None else physical,
    )


def fake_npu_smi(outputs: dict[tuple[str, ...], str]):
    calls = []

    def run(argv, timeout):
        calls.append((tuple(argv), timeout))
        key = tuple(argv[1:])
        if key not in outputs:
            raise subprocess.CalledProcessError(2, argv, stderr=f"unexpected {key}")
        return outputs[key]

    return run, calls


def test_910b_usages_give_aicore_and_hbm():
    usages = parse_npu_smi_usages(samples.NPU_910B_USAGES)
    assert usages == {
        "aicore": 87.0,
        "vector": 41.0,
        "memory_total": 65536 * MiB,
        "memory_used": int(65536 * MiB * 0.53),
    }
    assert parse_npu_smi_value(samples.NPU_910B_TEMP, "temperature") == 47.0
    assert parse_npu_smi_value(samples.NPU_910B_POWER, "power") == 283.6


def test_310p_has_two_chips_per_card_and_ddr_instead_of_hbm():
    chip0, chip1 = (parse_npu_smi_usages(samples.NPU_310P_USAGES, chip) for chip in (0, 1))
    assert chip0["aicore"] == 0.0 and chip1["aicore"] == 64.0
    assert chip1["memory_total"] == 44280 * MiB and chip1["memory_used"] == int(44280 * MiB * 0.25)
    assert chip1["vector"] == 12.0
    assert parse_npu_smi_value(samples.NPU_310P_TEMP, "temperature", chip=1) == 51.0
    assert parse_npu_smi_value(samples.NPU_310P_POWER, "power", chip=1) is None  # "NA"


def test_mapping_goes_from_logic_id_to_card_and_chip_skipping_the_mcu():
    assert parse_npu_smi_mapping(samples.NPU_910B_MAPPING) == {0: (0, 0), 1: (1, 0)}
    assert parse_npu_smi_mapping(samples.NPU_310P_MAPPING) == {0: (8, 0), 1: (8, 1)}


def test_read_npu_asks_npu_smi_for_the_card_of_the_physical_device():
    run, calls = fake_npu_smi(
        {
            ("info", "-m"): samples.NPU_310P_MAPPING,
            ("info", "-t", "usages", "-i", "8"): samples.NPU_310P_USAGES,
            ("info", "-t", "temp", "-i", "8"): samples.NPU_310P_TEMP,
            ("info", "-t", "power", "-i", "8"): samples.NPU_310P_POWER,
        }
    )
    # ASCEND_RT_VISIBLE_DEVICES=1: visible npu:0 is logic id 1 = card 8, chip 1.
    reading = read_npu(npu(0, physical=1), run=run, timeout=1.5)
    assert reading.source == "npu-smi" and reading.device == "npu:0"
    assert (reading.utilization, reading.temperature, reading.power) == (64.0, 51.0, None)
    assert reading.memory_percent == pytest.approx(25.0, abs=0.01)
    assert all(timeout == 1.5 for _, timeout in calls)

    run, _ = fake_npu_smi(
        {
            ("info", "-m"): samples.NPU_910B_MAPPING,
            ("info", "-t", "usages", "-i", "1"): samples.NPU_910B_USAGES,
            ("info", "-t", "temp", "-i", "1"): samples.NPU_910B_TEMP,
            ("info", "-t", "power", "-i", "1"): samples.NPU_910B_POWER,
        }
    )
    reading = read_npu(npu(1), run=run)
    assert (reading.utilization, reading.vector_utilization, reading.temperature, reading.power) == (
        87.0,
        41.0,
        47.0,
        283.6,
    )


def test_missing_hung_or_failing_npu_smi_becomes_a_note():
    def missing(argv, timeout):
        raise FileNotFoundError(2, "No such file or directory", argv[0])

    def hung(argv, timeout):
        raise subprocess.TimeoutExpired(argv, timeout)

    def failing(argv, timeout):
        raise subprocess.CalledProcessError(255, argv, stderr="dcmi module initialize failed. ret is -8005")

    assert read_npu(npu(0), run=missing).note.startswith("npu-smi not found")
    assert "did not answer within 3 s" in read_npu(npu(0), run=hung, timeout=3).note
    note = read_npu(npu(0), run=failing).note
    assert "exit 255" in note and "dcmi module initialize failed" in note
    assert read_npu(npu(0), run=missing).utilization is None


def test_the_real_npu_smi_is_not_on_this_machine():
    assert read_npu(npu(0)).note.startswith("npu-smi not found")


class FakeNVML:
    """The pynvml calls `read_cuda` makes, with NVML's units (power in milliwatts)."""

    NVML_TEMPERATURE_GPU = 0
    NVML_CLOCK_SM = 1

    class NVMLError(Exception):
        pass

    def __init__(self, power_supported: bool = True):
        self.inits = 0
        self.handles = []
        self.power_supported = power_supported

    def nvmlInit(self):
        self.inits += 1

    def nvmlDeviceGetHandleByIndex(self, index):
        if index > 3:
            raise self.NVMLError("Invalid Argument")
        self.handles.append(index)
        return f"handle-{index}"

    def nvmlDeviceGetUtilizationRates(self, handle):
        return type("Rates", (), {"gpu": 93, "memory": 40})()

    def nvmlDeviceGetMemoryInfo(self, handle):
        return type("Memory", (), {"used": 30 * 1024**3, "total": 80 * 1024**3, "free": 50 * 1024**3})()

    def nvmlDeviceGetTemperature(self, handle, sensor):
        assert sensor == self.NVML_TEMPERATURE_GPU
        return 66

    def nvmlDeviceGetPowerUsage(self, handle):
        if not self.power_supported:
            raise self.NVMLError("Not Supported")
        return 412_345

    def nvmlDeviceGetClockInfo(self, handle, clock):
        assert clock == self.NVML_CLOCK_SM
        return 1980


def test_nvml_reading_uses_the_physical_index_and_converts_units():
    nvml = FakeNVML()
    gpu = DeviceInfo(type="cuda", index=0, torch_device="cuda:0", name="H100", physical_index=2)
    reading = read_cuda(gpu, nvml=nvml)
    assert nvml.handles == [2]  # CUDA_VISIBLE_DEVICES=2: NVML counts physically
    assert (reading.source, reading.utilization, reading.temperature, reading.power, reading.sm_clock) == (
        "nvml",
        93.0,
        66.0,
        pytest.approx(412.345),
        1980,
    )
    assert reading.memory_used == 30 * 1024**3 and reading.memory_total == 80 * 1024**3
    read_cuda(gpu, nvml=nvml)
    assert nvml.inits == 1  # initialised once per process


def test_nvml_without_power_or_with_a_bad_index_says_so():
    reading = read_cuda(DeviceInfo("cuda", 1, "cuda:1", "T4", physical_index=1), nvml=FakeNVML(power_supported=False))
    assert reading.power is None and reading.utilization == 93.0
    bad = read_cuda(DeviceInfo("cuda", 7, "cuda:7", "?", physical_index=7), nvml=FakeNVML())
    assert bad.source == "none" and "Invalid Argument" in bad.note


def test_cpu_reading_has_a_load_per_core_and_the_rss():
    import psutil

    reading = read_cpu(DeviceInfo("cpu", None, "cpu", "CPU"))
    assert reading.source == "psutil" and len(reading.per_core) == psutil.cpu_count()
    assert 0 < reading.memory_used < reading.memory_total
    assert reading.to_dict()["per_core"] == list(reading.per_core)


def test_the_sampler_never_blocks_and_refreshes_in_the_background():
    release = threading.Event()
    reads = []

    def slow_reader(device):
        reads.append(threading.current_thread().name)
        release.wait(10)  # a hung npu-smi
        return DeviceTelemetry(device.torch_device, "npu-smi", utilization=50.0, memory_used=1, memory_total=4)

    sampler = TelemetrySampler(reader=slow_reader, max_age=60)
    started = time.perf_counter()
    first = sampler.read("npu:0", npu(0))
    second = sampler.read("npu:0", npu(0))
    assert time.perf_counter() - started < 0.5
    assert first.note == "collecting…" and second.note == "collecting…"
    assert len(reads) == 1 and reads[0] == "telemetry-npu:0"  # one refresh at a time, not in the caller
    release.set()
    reading = wait_for(
        lambda: sampler.read("npu:0", npu(0)).source == "npu-smi" and sampler.read("npu:0", npu(0)),
        "the refreshed reading",
    )
    assert reading.utilization == 50.0
    (point,) = sampler.history()
    assert (point.device, point.utilization, point.memory_percent) == ("npu:0", 50.0, 25.0)


def test_a_failing_reader_is_a_note_not_an_exception():
    def broken(device):
        raise RuntimeError("driver gone")

    sampler = TelemetrySampler(reader=broken, max_age=60)
    sampler.read("npu:3", npu(3))
    reading = wait_for(
        lambda: sampler.read("npu:3", npu(3)).note != "collecting…" and sampler.read("npu:3", npu(3)),
        "the failed reading",
    )
    assert "RuntimeError: driver gone" in reading.note


def test_panel_rows_and_plot_rows_show_each_device():
    from hidream_ui.engine.status import DeviceRow, Progress

    reading = DeviceTelemetry(
        "npu:1",
        "npu-smi",
        utilization=87.0,
        memory_used=32 * 1024**3,
        memory_total=64 * 1024**3,
        temperature=47.0,
        power=283.6,
        timestamp=100.0,
    )
    rows = [
        DeviceRow(
            engine="npu:1",
            device="npu:1",
            device_name="Ascend910B3",
            state="editing",
            progress=Progress(step=3, total=28),
            loaded=True,
            busy=True,
            jobs=2,
            memory=None,
            telemetry=reading,
        ),
        DeviceRow(
            engine="npu:2",
            device="npu:2",
            device_name="Ascend910B3",
            state="idle",
            progress=Progress(),
            loaded=False,
            busy=False,
            jobs=0,
            memory=None,
            telemetry=DeviceTelemetry("npu:2", "none", note="npu-smi not found"),
        ),
    ]
    text = render_device_rows(rows)
    assert "Devices (2)" in text and "editing 3/28" in text and "AICore 87%" in text and "47 °C" in text
    assert "HBM 32.0 GiB / 64.0 GiB" in text and "284 W" in text and "npu-smi not found" in text
    from hidream_ui.device.telemetry import TelemetryPoint

    history = [TelemetryPoint(100.0, "npu:1", 87.0, 50.0), TelemetryPoint(101.0, "other-app", 1.0, 1.0)]
    assert plot_rows(history, ["npu:1", "npu:2"], now=110.0) == [
        [-10.0, 50.0, "npu:1 memory"],
        [-10.0, 87.0, "npu:1 utilisation"],
    ]


def test_two_cpu_engines_reading_together_see_the_same_load():
    """--devices cpu,cpu: both rows refresh in the same poll. psutil's load is "since the previous
    call", so a second call right after the first would measure nothing (0 %) for one of them."""
    cpu = DeviceInfo("cpu", None, "cpu", "CPU")
    read_cpu(cpu)
    deadline = time.perf_counter() + 0.8
    while time.perf_counter() < deadline:  # keep one core busy
        sum(range(10_000))
    first, second = read_cpu(cpu), read_cpu(cpu)
    assert max(first.per_core) > 0
    assert second.per_core == first.per_core and second.utilization == first.utilization
