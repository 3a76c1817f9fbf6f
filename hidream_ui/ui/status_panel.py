"""The system panel: engine status -> HTML (state line, device, memory bars)."""

from __future__ import annotations

import html

from hidream_ui.device.memory import format_bytes
from hidream_ui.engine.status import EngineStatus
from hidream_ui.pipeline.speed.settings import SPEED_PRESETS
from hidream_ui.ui.devices_panel import DEVICES_CSS, render_device_rows

# ---------------------------------------------------------------------------------------------
# Status panel
# ---------------------------------------------------------------------------------------------

STATUS_CSS = (
    """
.hui-status { font-size: 0.9em; line-height: 1.45; }
.hui-status .hui-kv { display: flex; justify-content: space-between; gap: 0.5em; }
.hui-status .hui-kv span:first-child { opacity: 0.75; }
.hui-status .hui-kv span:last-child { text-align: right; font-weight: 600; overflow-wrap: anywhere; }
.hui-status .hui-state { padding: 0.35em 0.6em; border-radius: 6px; margin-bottom: 0.5em; font-weight: 600; }
.hui-status .hui-state-idle { background: rgba(34, 197, 94, 0.15); }
.hui-status .hui-state-loading { background: rgba(234, 179, 8, 0.22); }
.hui-status .hui-state-editing { background: rgba(59, 130, 246, 0.2); }
.hui-status .hui-state-error { background: rgba(239, 68, 68, 0.2); }
.hui-status .hui-bar { height: 8px; border-radius: 4px; background: rgba(127, 127, 127, 0.22); overflow: hidden; }
.hui-status .hui-bar > div { height: 100%; background: #3b82f6; }
.hui-status .hui-bar.hui-high > div { background: #ef4444; }
.hui-status .hui-bar-label { display: flex; justify-content: space-between; font-size: 0.85em; margin-top: 0.35em; }
.hui-status .hui-note { font-size: 0.85em; opacity: 0.85; margin-top: 0.4em; }
.hui-status h4 { margin: 0.7em 0 0.2em 0; font-size: 0.95em; }
"""
    + DEVICES_CSS
)


def _kv(key: str, value: str) -> str:
    return f'<div class="hui-kv"><span>{html.escape(key)}</span><span>{html.escape(value)}</span></div>'


def _bar(label: str, used: float | int | None, total: float | int | None, text: str | None = None) -> str:
    if used is None or not total:
        return ""
    fraction = max(0.0, min(1.0, float(used) / float(total)))
    high = " hui-high" if fraction >= 0.9 else ""
    text = text or f"{format_bytes(used)} / {format_bytes(total)}"
    return (
        f'<div class="hui-bar-label"><span>{html.escape(label)}</span><span>{html.escape(text)}</span></div>'
        f'<div class="hui-bar{high}" title="{fraction:.0%}"><div style="width:{fraction * 100:.1f}%"></div></div>'
    )


def state_line(status: EngineStatus) -> tuple[str, str]:
    """("idle" | "loading" | "editing", human text) from an engine status."""
    state = status.state or "idle"
    progress = status.progress
    if state == "editing":
        text = f"editing · step {progress.step}/{progress.total}" if progress.total else "editing"
        if progress.stage == "refine":
            text += " (refine)"
        return state, text
    if state == "rewriting":
        return state, "rewriting the instruction (local Llama)"
    if state == "compiling":
        return state, "compiling the transformer blocks (--compile blocks, first call)"
    if state == "loading":
        percent = f" {progress.fraction:.0%}" if progress.fraction is not None else ""
        return state, f"loading model{percent} · {progress.message or ''}".rstrip(" ·")
    return state, "idle" + ("" if status.loaded else " · model not loaded yet (loads on first edit)")


def render_state(status: EngineStatus, live: list[str] | None = None) -> str:
    """The panel's state line. `live`: the running jobs' progress texts, exactly as their bars show
    them (`Job.progress`); without any, the engine's own state (loading, idle, ...)."""
    if live:
        state, text = "editing", live[0] + (f" · and {len(live) - 1} more job(s)" if len(live) > 1 else "")
    else:
        state, text = state_line(status)
    return (
        f'<div class="hui-status"><div class="hui-state hui-state-{html.escape(state)}">{html.escape(text)}</div></div>'
    )


def render_status(status: EngineStatus, with_state: bool = True) -> str:
    """The system panel's HTML for an engine status (with the queue figures when the UI added them);
    `with_state=False`: without the state line (the panel draws it apart, `render_state`)."""
    state, text = state_line(status)
    parts = ['<div class="hui-status">']
    if with_state:
        parts.append(f'<div class="hui-state hui-state-{html.escape(state)}">{html.escape(text)}</div>')
    if status.device:
        parts.append(_kv("Device", f"{status.device_name or '?'} ({status.device})"))
    else:
        parts.append(_kv("Device", "unavailable"))
    parts.append(_kv("Computes in", status.dtype or "?"))
    source_text = status.model_source or "?"
    if status.model_source == "tiny":
        source_text = (
            "tiny, trained on the shapes world"
            if status.tiny_profile == "trained"
            else f"tiny {status.tiny_profile or ''} (random weights)".replace("  ", " ")
        )
    parts.append(_kv("Model", f"{(status.variant or '?').upper()} · {source_text}"))
    parts.append(_kv("Attention", attention_line(status)))
    plan = status.memory_plan
    if plan is not None:
        parts.append(_kv("Memory plan", plan_line(plan, status.dtype)))
    if status.speed is not None:
        parts.append(_kv("Speed", speed_line(status.speed)))
    if status.queue is not None:
        parts.append(_kv("Queue", f"{status.queue.waiting} waiting · {status.queue.running} running"))
    rewriter = status.rewriter
    if rewriter is not None:
        parts.append(_kv("Rewriter", f"{rewriter.backend} · {rewriter.model}"))
        if rewriter.backend == "local":
            head = (
                "known once the model is loaded"
                if rewriter.lm_head_bytes is None
                else f"{format_bytes(rewriter.lm_head_bytes)}, "
                + ("loaded" if rewriter.lm_head_loaded else "loads on the first rewrite")
            )
            parts.append(_kv("LM head", head))
    memory = status.memory
    if memory is not None:
        parts.append("<h4>Memory</h4>")
        total = memory.total
        if memory.allocated is not None:
            parts.append(_bar("allocated", memory.allocated, total))
            parts.append(_bar("reserved", memory.reserved, total))
            parts.append(_bar("peak", memory.peak, total))
        elif status.device_type == "cpu":
            parts.append('<div class="hui-note">CPU: no device allocator; model memory is in the process RSS.</div>')
        if memory.free is not None and total and status.device_type != "cpu":
            parts.append(_bar("device in use", total - memory.free, total))
        if memory.host_total and memory.host_available is not None:
            parts.append(_bar("host RAM", memory.host_total - memory.host_available, memory.host_total))
        parts.append(_bar("process RSS", memory.process_rss, memory.host_total))
        if memory.utilization is not None:
            kind = (status.device_type or "device").upper()
            parts.append(_bar(f"{kind} utilisation", memory.utilization, 100.0, f"{memory.utilization:.0f}%"))
    parts.append(render_device_rows(status.devices))
    rewrite_error = status.rewriter.last_error if status.rewriter is not None else None
    compile_error = status.speed.get("compile_error") if status.speed is not None else None
    for prefix, note in (
        ("device: ", status.device_error),
        ("", status.attention_note),
        ("", compile_error),
        ("last error: ", status.last_error),
        ("last rewrite error: ", rewrite_error),
    ):
        if note:
            parts.append(f'<div class="hui-note">{html.escape(prefix + str(note))}</div>')
    parts.append("</div>")
    return "".join(parts)


def attention_line(status: EngineStatus) -> str:
    """The strategy; when a pool's engines run different ones (a one-engine switch), each engine's."""
    strategies = {row.attention for row in status.devices if row.attention}
    if len(strategies) > 1:
        return " · ".join(f"{row.engine} {row.attention or '?'}" for row in status.devices)
    return status.attention or "?"


# The step caches by the names the Speed setting gives them (ui/speed_setting.py).
CACHE_WORDS = {cache: word for word, cache in SPEED_PRESETS.items()}


def speed_line(speed: dict) -> str:
    """The step cache of the next edits and whether the transformer is compiled, in plain words
    (the MoE implementation and the cache's spec are in /status)."""
    compiled = speed.get("compile") == "blocks"
    compile_text = (
        f"compiled ({speed.get('compile_backend')})"
        if speed.get("compiled")
        else "compiling failed, runs uncompiled"
        if compiled and speed.get("compile_error")
        else "compiles on the first edit"
        if compiled
        else "not compiled"
    )
    cache = str(speed.get("cache_default"))
    return f"{CACHE_WORDS.get(cache, cache)} · {compile_text}"


def plan_line(plan, dtype: str | None) -> str:
    """Where the model's parts live, the weights' format and the predicted peak, in words that
    agree with "Computes in": the plan's "bf16" means "the compute dtype" (not fp8)."""
    where = plan.spec.description.split(";")[0]
    weights = "fp8 weights" if plan.weights == "fp8" else f"weights in {dtype or plan.weights}"
    chosen = " (chosen to fit)" if plan.requested == "auto" else ""
    peak = "" if plan.predicted_peak is None else f" · needs about {format_bytes(plan.predicted_peak)}"
    return f"{where}{chosen} · {weights}{peak}"


def attention_label(name: str, description: str, available: bool, reason: str) -> str:
    if not available:
        return f"{name} — unavailable: {reason}"
    short = description.split(";")[0].split(":")[0].strip()
    return f"{name} — {short}" if short else name


def render_visitor_card(status: EngineStatus, queue: dict, position: int | None) -> str:
    """With --kiosk, a visitor's view of the system: the device, the queue, and their own place."""
    waiting, running = int(queue.get("waiting") or 0), int(queue.get("running") or 0)
    device = status.device_name or status.device or "unavailable"
    if position is not None:
        place = f"you are number {position} of {waiting} waiting"
    elif running:
        place = "nothing of yours is waiting"
    else:
        place = "free: your edit starts at once"
    parts = [
        '<div class="hui-status hui-card">',
        _kv("Device", device),
        _kv("Queue", f"{waiting} waiting · {running} running"),
        _kv("You", place),
        "</div>",
    ]
    return "".join(parts)
