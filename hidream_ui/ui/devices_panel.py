"""The System panel's device rows (one per engine: state, memory, what npu-smi / NVML / psutil say)
and the live plot of memory and utilisation over the last minutes.

Both read only cached figures (`EngineStatus.devices`, `TelemetrySampler.history`): the 2 s timer
that feeds them never syncs a device or runs npu-smi itself.
"""

from __future__ import annotations

import html
import time
from typing import Iterable

from hidream_ui.device.memory import format_bytes
from hidream_ui.device.telemetry import DeviceTelemetry, TelemetryPoint
from hidream_ui.engine.status import DeviceRow

DEVICES_CSS = """
.hui-status .hui-device { border-top: 1px solid rgba(127, 127, 127, 0.25); padding-top: 0.3em; margin-top: 0.3em; }
.hui-status .hui-device-head { display: flex; justify-content: space-between; font-weight: 600; }
.hui-status .hui-device-figures { font-size: 0.85em; opacity: 0.9; }
"""

PLOT_COLUMNS = ("seconds", "percent", "series")


def _telemetry_text(telemetry: DeviceTelemetry | None) -> str:
    if telemetry is None:
        return ""
    figures = []
    kind = {"npu-smi": "AICore", "nvml": "GPU", "psutil": "CPU"}.get(telemetry.source, "load")
    if telemetry.utilization is not None:
        figures.append(f"{kind} {telemetry.utilization:.0f}%")
    if telemetry.vector_utilization is not None:
        figures.append(f"vector {telemetry.vector_utilization:.0f}%")
    if telemetry.memory_used is not None and telemetry.memory_total:
        memory = {"npu-smi": "HBM", "nvml": "mem", "psutil": "RSS"}.get(telemetry.source, "mem")
        figures.append(f"{memory} {format_bytes(telemetry.memory_used)} / {format_bytes(telemetry.memory_total)}")
    if telemetry.temperature is not None:
        figures.append(f"{telemetry.temperature:.0f} °C")
    if telemetry.power is not None:
        figures.append(f"{telemetry.power:.0f} W")
    if telemetry.sm_clock is not None:
        figures.append(f"SM {telemetry.sm_clock} MHz")
    if telemetry.per_core:
        figures.append("cores " + " ".join(f"{load:.0f}" for load in telemetry.per_core))
    if telemetry.note:
        figures.append(telemetry.note)
    return " · ".join(figures)


def _row_state(row: DeviceRow) -> str:
    if row.state == "editing" and row.progress.total:
        return f"editing {row.progress.step}/{row.progress.total}"
    if row.state == "loading" and row.progress.fraction is not None:
        return f"loading {row.progress.fraction:.0%}"
    return row.state + ("" if row.loaded else " · not loaded")


def render_device_rows(rows: Iterable[DeviceRow]) -> str:
    """HTML: one block per device (inside the panel's `.hui-status` div); with several, each names the
    attention strategy its engine runs."""
    rows = list(rows)
    if not rows:
        return ""
    parts = [f"<h4>Devices ({len(rows)})</h4>"]
    for row in rows:
        head = f"{row.engine} · {row.device_name or row.device or '?'}"
        figures = []
        if len(rows) > 1 and row.attention:  # a pool's engines may run different strategies
            figures.append(f"attention {row.attention}")
        memory = row.memory
        if memory is not None and memory.allocated is not None:
            figures.append(f"allocated {format_bytes(memory.allocated)} / {format_bytes(memory.total)}")
        telemetry = _telemetry_text(row.telemetry)
        if telemetry:
            figures.append(telemetry)
        figures.append(f"{row.jobs} job(s)" if row.jobs else "")
        if row.error:
            figures.append(f"error: {row.error}")
        parts.append(
            f'<div class="hui-device" data-engine="{html.escape(row.engine)}">'
            f'<div class="hui-device-head"><span>{html.escape(head)}</span><span>{html.escape(_row_state(row))}</span>'
            f'</div><div class="hui-device-figures">{html.escape(" · ".join(f for f in figures if f))}</div></div>'
        )
    return "".join(parts)


def plot_rows(history: Iterable[TelemetryPoint], labels: Iterable[str], now: float | None = None) -> list[list]:
    """[seconds ago (negative), percent, series] for the live plot: memory and utilisation of the
    app's devices (`labels`), oldest first."""
    wanted = set(labels)
    now = time.time() if now is None else now
    rows = []
    for point in history:
        if point.device not in wanted:
            continue
        ago = round(point.timestamp - now, 1)
        if point.memory_percent is not None:
            rows.append([ago, round(point.memory_percent, 1), f"{point.device} memory"])
        if point.utilization is not None:
            rows.append([ago, round(point.utilization, 1), f"{point.device} utilisation"])
    return rows


__all__ = ["DEVICES_CSS", "PLOT_COLUMNS", "plot_rows", "render_device_rows"]
