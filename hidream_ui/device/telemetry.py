"""Device telemetry people can watch: what `npu-smi`, NVML and psutil say about each device.

The allocator figures (`memory.snapshot`) say what *this process* holds; telemetry says what the
card itself reports: NPU AICore %, HBM used, temperature and power (`npu-smi info -t usages|temp|
power -i N`), CUDA utilisation, memory, temperature, power and SM clock (NVML), CPU per-core load
and RSS (psutil).

Off the hot path: `npu-smi` is a subprocess that can take a second or hang on a sick driver, so
the status poll never runs it. `TelemetrySampler.read` returns the last reading at once and, when
it is older than `max_age`, starts one background refresh (with a timeout) per device. A missing
tool is a reading with a `note` ("npu-smi not found"), never an exception.

Everything external is injectable (`run` for subprocesses, `nvml` for the pynvml module) so the
parsers and the fallbacks are tested against recorded layouts (tests/telemetry_samples.py).
"""

from __future__ import annotations

import logging
import re
import subprocess
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping

if TYPE_CHECKING:  # pragma: no cover
    from hidream_ui.device.backends import DeviceInfo

logger = logging.getLogger(__name__)

MiB = 1024 * 1024
NPU_SMI = "npu-smi"
COMMAND_TIMEOUT = 3.0  # seconds one npu-smi call may take before the reading says so
MAX_AGE = 2.0  # seconds a reading is reused (the status panel polls every 2 s)
HISTORY_SECONDS = 300.0  # what the live plot shows: the last five minutes

Runner = Callable[[list[str], float], str]


@dataclass(frozen=True)
class DeviceTelemetry:
    """One reading of one device. Percentages 0-100, bytes, degrees C, watts, MHz; None = not reported.

    ``utilization``: NPU AICore %, CUDA GPU %, CPU whole-machine %. ``memory_used`` /
    ``memory_total``: NPU HBM (DDR on 310P), CUDA device memory (all processes), CPU this process's
    RSS / host RAM. ``source`` names where the figures came from; ``note`` says what is missing.
    """

    device: str
    source: str  # "npu-smi" | "nvml" | "psutil" | "none"
    utilization: float | None = None
    memory_used: int | None = None
    memory_total: int | None = None
    temperature: float | None = None
    power: float | None = None
    sm_clock: int | None = None
    vector_utilization: float | None = None  # NPU AIVector / Vectorcore %
    per_core: tuple[float, ...] = ()  # CPU: load of every core
    note: str | None = None
    timestamp: float = field(default_factory=time.time)

    @property
    def memory_percent(self) -> float | None:
        if self.memory_used is None or not self.memory_total:
            return None
        return 100.0 * self.memory_used / self.memory_total

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["per_core"] = list(self.per_core)
        return data


# ---------------------------------------------------------------------------------------------
# npu-smi: parsers (pure functions of the text)
# ---------------------------------------------------------------------------------------------

# Key names differ between chips and driver versions (910B: HBM, 310P: DDR only; power is
# "Power Dissipation(W)" on older drivers and "NPU Real-time Power(W)" on newer ones).
_NPU_KEYS: Mapping[str, tuple[str, ...]] = {
    "aicore": ("Aicore Usage Rate(%)", "AI Core Usage Rate(%)", "AICore Usage Rate(%)"),
    "vector": ("Aivector Usage Rate(%)", "Vectorcore Usage Rate(%)"),
    "hbm_total": ("HBM Capacity(MB)",),
    "hbm_rate": ("HBM Usage Rate(%)",),
    "ddr_total": ("DDR Capacity(MB)",),
    "ddr_rate": ("DDR Usage Rate(%)", "Memory Usage Rate(%)"),
    "temperature": ("NPU Temperature(C)", "Chip Temperature(C)", "Temperature(C)", "NPU Temperature (C)"),
    "power": ("NPU Real-time Power(W)", "Power Dissipation(W)", "Chip Power(W)", "Power(W)"),
}
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def parse_npu_smi_sections(text: str) -> list[dict[str, str]]:
    """`npu-smi info -t ... -i N` output -> one dict per chip ("Chip ID" closes a chip's block;
    the header keys "NPU ID" / "Chip Count" are copied into every chip)."""
    header: dict[str, str] = {}
    chips: list[dict[str, str]] = []
    current: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if not sep:
            continue
        key, value = key.strip(), value.strip()
        if key in ("NPU ID", "Chip Count") and not chips and not current:
            header[key] = value
            continue
        current[key] = value
        if key == "Chip ID":
            chips.append({**header, **current})
            current = {}
    if current:  # a layout without "Chip ID" lines: one chip
        chips.append({**header, **current})
    return chips


def _number(section: Mapping[str, str], name: str) -> float | None:
    for key in _NPU_KEYS[name]:
        value = section.get(key)
        if value is None:
            continue
        match = _NUMBER.search(value)  # "NA" on 310P power -> None
        if match:
            return float(match.group())
    return None


def _chip(sections: list[dict[str, str]], chip: int) -> dict[str, str]:
    for section in sections:
        if section.get("Chip ID", "").strip() == str(chip):
            return section
    return sections[0] if sections else {}


def parse_npu_smi_usages(text: str, chip: int = 0) -> dict[str, float | int | None]:
    """`-t usages`: AICore %, vector %, memory used/total in bytes (HBM where the chip has it,
    else DDR: 310P cards have no HBM)."""
    section = _chip(parse_npu_smi_sections(text), chip)
    total_mb, rate = _number(section, "hbm_total"), _number(section, "hbm_rate")
    if not total_mb:
        total_mb, rate = _number(section, "ddr_total"), _number(section, "ddr_rate")
    total = int(total_mb * MiB) if total_mb else None
    used = int(total * rate / 100.0) if total is not None and rate is not None else None
    return {
        "aicore": _number(section, "aicore"),
        "vector": _number(section, "vector"),
        "memory_used": used,
        "memory_total": total,
    }


def parse_npu_smi_value(text: str, name: str, chip: int = 0) -> float | None:
    """`-t temp` (name "temperature") or `-t power` (name "power") for one chip."""
    return _number(_chip(parse_npu_smi_sections(text), chip), name)


def parse_npu_smi_mapping(text: str) -> dict[int, tuple[int, int]]:
    """`npu-smi info -m` -> {chip logic id: (NPU ID, chip ID)}.

    The logic id is what ASCEND_RT_VISIBLE_DEVICES and torch_npu count (our `physical_index`);
    npu-smi's `-i` takes the NPU ID (a card), `-c` the chip on that card (310P Duo: two chips per
    card). Rows whose logic id is "-" (the card's MCU) are skipped.
    """
    mapping: dict[int, tuple[int, int]] = {}
    for line in text.splitlines():
        fields = line.split()
        if len(fields) >= 3 and fields[0].isdigit() and fields[1].isdigit() and fields[2].isdigit():
            mapping[int(fields[2])] = (int(fields[0]), int(fields[1]))
    return mapping


def run_command(argv: list[str], timeout: float) -> str:
    """Runs a tool and returns its stdout; raises FileNotFoundError, subprocess.TimeoutExpired or
    subprocess.CalledProcessError (the callers turn each into a note)."""
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=True)
    return done.stdout


# ---------------------------------------------------------------------------------------------
# Readers: one per device type
# ---------------------------------------------------------------------------------------------


def read_npu(device: "DeviceInfo", run: Runner = run_command, timeout: float = COMMAND_TIMEOUT) -> DeviceTelemetry:
    """npu-smi's figures for one NPU (`device.physical_index`, the chip logic id)."""
    logic = device.physical_index if device.physical_index is not None else (device.index or 0)
    try:
        mapping = parse_npu_smi_mapping(run([NPU_SMI, "info", "-m"], timeout))
        card, chip = mapping.get(logic, (logic, 0))
        usages = parse_npu_smi_usages(run([NPU_SMI, "info", "-t", "usages", "-i", str(card)], timeout), chip)
        temperature = parse_npu_smi_value(
            run([NPU_SMI, "info", "-t", "temp", "-i", str(card)], timeout), "temperature", chip
        )
        power = parse_npu_smi_value(run([NPU_SMI, "info", "-t", "power", "-i", str(card)], timeout), "power", chip)
    except FileNotFoundError:
        return DeviceTelemetry(
            device.torch_device, "none", note="npu-smi not found (install the Ascend driver tools or add them to PATH)"
        )
    except subprocess.TimeoutExpired:
        return DeviceTelemetry(device.torch_device, "none", note=f"npu-smi did not answer within {timeout:g} s")
    except subprocess.CalledProcessError as exc:
        return DeviceTelemetry(
            device.torch_device,
            "none",
            note=f"npu-smi failed (exit {exc.returncode}): {(exc.stderr or '').strip()[:120]}",
        )
    except OSError as exc:
        return DeviceTelemetry(device.torch_device, "none", note=f"npu-smi could not run: {exc}")
    return DeviceTelemetry(
        device.torch_device,
        "npu-smi",
        utilization=usages["aicore"],
        vector_utilization=usages["vector"],
        memory_used=usages["memory_used"],
        memory_total=usages["memory_total"],
        temperature=temperature,
        power=power,
    )


_NVML_LOCK = threading.Lock()
_NVML_READY: set[int] = set()  # id() of the nvml modules initialised in this process


def _import_nvml():
    import pynvml  # nvidia-ml-py; imported only when a CUDA device is read

    return pynvml


def read_cuda(device: "DeviceInfo", nvml: Any = None) -> DeviceTelemetry:
    """NVML's figures for one GPU. NVML numbers GPUs physically: `device.physical_index` (what
    CUDA_VISIBLE_DEVICES maps the visible index to), else the visible index."""
    try:
        nvml = nvml if nvml is not None else _import_nvml()
    except ImportError:
        return DeviceTelemetry(device.torch_device, "none", note="NVML not available: pip install nvidia-ml-py")
    index = device.physical_index if device.physical_index is not None else (device.index or 0)
    try:
        with _NVML_LOCK:
            if id(nvml) not in _NVML_READY:
                nvml.nvmlInit()
                _NVML_READY.add(id(nvml))
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        rates = nvml.nvmlDeviceGetUtilizationRates(handle)
        memory = nvml.nvmlDeviceGetMemoryInfo(handle)
        reading = DeviceTelemetry(
            device.torch_device,
            "nvml",
            utilization=float(rates.gpu),
            memory_used=int(memory.used),
            memory_total=int(memory.total),
        )
    except nvml.NVMLError as exc:
        return DeviceTelemetry(device.torch_device, "none", note=f"NVML: {exc}")
    extras: dict[str, Any] = {}
    # Each extra is optional: many boards (and MIG slices) do not report power or temperature.
    for name, read in (
        ("temperature", lambda: float(nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU))),
        ("power", lambda: nvml.nvmlDeviceGetPowerUsage(handle) / 1000.0),  # milliwatts
        ("sm_clock", lambda: int(nvml.nvmlDeviceGetClockInfo(handle, nvml.NVML_CLOCK_SM))),
    ):
        try:
            extras[name] = read()
        except nvml.NVMLError:
            extras[name] = None
    return DeviceTelemetry(**{**asdict(reading), **extras, "per_core": ()})


CPU_MIN_INTERVAL = 0.5  # seconds: readers within this of the last measurement share it
_CPU_LOCK = threading.Lock()
_CPU_LAST: dict[int, tuple[float, tuple[float, ...]]] = {}  # id(psutil module) -> (monotonic time, per-core %)


def _per_core_load(psutil: Any) -> tuple[float, ...]:
    """psutil's per-core load since its previous call, shared by every reader of this host: with
    `--devices cpu,cpu` both rows refresh together, and a second `cpu_percent` call microseconds
    after the first measures nothing (0 %)."""
    with _CPU_LOCK:
        now = time.monotonic()
        last = _CPU_LAST.get(id(psutil))
        if last is not None and now - last[0] < CPU_MIN_INTERVAL:
            return last[1]
        cores = tuple(float(x) for x in psutil.cpu_percent(interval=None, percpu=True))
        _CPU_LAST[id(psutil)] = (now, cores)
        return cores


def read_cpu(device: "DeviceInfo", psutil_module: Any = None) -> DeviceTelemetry:
    """psutil: per-core load since the previous call (non-blocking), this process's RSS, host RAM."""
    psutil = psutil_module
    if psutil is None:
        import psutil
    cores = _per_core_load(psutil)
    return DeviceTelemetry(
        device.torch_device,
        "psutil",
        utilization=round(sum(cores) / len(cores), 1) if cores else None,
        memory_used=int(psutil.Process().memory_info().rss),
        memory_total=int(psutil.virtual_memory().total),
        per_core=cores,
    )


def read_device(
    device: "DeviceInfo", *, run: Runner = run_command, nvml: Any = None, psutil_module: Any = None
) -> DeviceTelemetry:
    """The reading for `device`'s type (blocking: call it off the hot path)."""
    if device.type == "npu":
        return read_npu(device, run=run)
    if device.type == "cuda":
        return read_cuda(device, nvml=nvml)
    if device.type == "cpu":
        return read_cpu(device, psutil_module=psutil_module)
    return DeviceTelemetry(device.torch_device, "none", note=f"no telemetry for {device.type}")


# ---------------------------------------------------------------------------------------------
# The sampler: cached readings, background refresh, history for the plot
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TelemetryPoint:
    """One point of the live plot."""

    timestamp: float
    device: str  # the row's label ("npu:1", "cpu#2")
    utilization: float | None
    memory_percent: float | None


class TelemetrySampler:
    """Cached readings per device label, refreshed in the background; never blocks the caller.

    `read(label, device)` returns the last reading (a "collecting" placeholder the first time) and,
    when that reading is older than `max_age`, starts one refresh thread for that label. Every
    finished refresh appends a point to `history` (the last `HISTORY_SECONDS`).
    """

    def __init__(
        self,
        reader: Callable[["DeviceInfo"], DeviceTelemetry] = read_device,
        max_age: float = MAX_AGE,
        history_seconds: float = HISTORY_SECONDS,
    ):
        self._reader = reader
        self.max_age = max_age
        self.history_seconds = history_seconds
        self._lock = threading.Lock()
        self._latest: dict[str, DeviceTelemetry] = {}
        self._refreshing: set[str] = set()
        self._history: deque[TelemetryPoint] = deque()

    def read(self, label: str, device: "DeviceInfo") -> DeviceTelemetry:
        with self._lock:
            latest = self._latest.get(label)
            stale = latest is None or time.time() - latest.timestamp > self.max_age
            start = stale and label not in self._refreshing
            if start:
                self._refreshing.add(label)
        if start:
            threading.Thread(target=self._refresh, args=(label, device), name=f"telemetry-{label}", daemon=True).start()
        return latest or DeviceTelemetry(device.torch_device, "none", note="collecting…")

    def _refresh(self, label: str, device: "DeviceInfo") -> None:
        try:
            reading = self._reader(device)
        except Exception as exc:  # noqa: BLE001 - telemetry is an extra: a failing reader becomes a note
            logger.debug("telemetry of %s failed", label, exc_info=True)
            reading = DeviceTelemetry(
                device.torch_device, "none", note=f"telemetry failed: {type(exc).__name__}: {exc}"[:200]
            )
        with self._lock:
            self._latest[label] = reading
            self._refreshing.discard(label)
            self._history.append(TelemetryPoint(reading.timestamp, label, reading.utilization, reading.memory_percent))
            cutoff = time.time() - self.history_seconds
            while self._history and self._history[0].timestamp < cutoff:
                self._history.popleft()

    def history(self) -> list[TelemetryPoint]:
        with self._lock:
            return list(self._history)


__all__ = [
    "DeviceTelemetry",
    "TelemetryPoint",
    "TelemetrySampler",
    "parse_npu_smi_mapping",
    "parse_npu_smi_sections",
    "parse_npu_smi_usages",
    "parse_npu_smi_value",
    "read_cpu",
    "read_cuda",
    "read_device",
    "read_npu",
    "run_command",
]
