"""What the widgets do: widget values -> request dataclasses -> engine; results -> widget updates.

Every handler the layout wires goes through :func:`guarded`, so a user only ever sees a
`gr.Error` with a readable message: the engine's, the request validator's or the image
reader's message as is, and for anything unexpected "<what> failed unexpectedly (...)" while
the traceback goes to the server log. Tracebacks never reach the browser or an API client.

This module imports gradio at the top: it is only imported by `hidream_ui.ui.layout`, which the
app imports lazily.
"""

from __future__ import annotations

import functools
import html
import inspect
import logging
import time
from pathlib import Path
from typing import Any, Callable, Mapping

import gradio as gr

from ..archive import ArchiveError
from ..config import AppConfig
from ..engine import EditCancelled, EditEngine, EngineError, StepInfo
from ..imaging import ImageError
from ..memory import format_bytes
from ..outputs import MetadataError, load_settings, summary_line
from ..requests import TARGET_MARKER, EditParams, EditRequest, RequestError
from .services import AppServices, redact_paths

logger = logging.getLogger(__name__)

# Errors whose message is written for users: shown exactly as raised.
USER_ERRORS = (EngineError, RequestError, ImageError, MetadataError, ArchiveError)

# Working resolutions offered before the model's geometry is known; `page_load` replaces them with
# the ones the configured model can take (`EditEngine.working_resolution_choices`).
WORKING_RESOLUTIONS = ("auto", "draft")

E11_HINT = (
    "**E1.1** takes a plain instruction, e.g. *Turn the sky into a sunset*. "
    "Describe the change, not the whole picture."
)
E1_FULL_HINT = (
    "**E1-Full** expects two parts: `Editing Instruction: <the change>. "
    f"{TARGET_MARKER} <the whole edited image>`. The description after "
    f"`{TARGET_MARKER}` drives the refine stage; without it the instruction is used for both."
)


def variant_hint(variant: str) -> str:
    return E1_FULL_HINT if variant == "e1-full" else E11_HINT


def instruction_placeholder(variant: str) -> str:
    if variant == "e1-full":
        return ("Editing Instruction: Convert the image into a Ghibli style. "
                f"{TARGET_MARKER} A Ghibli-style cottage on a green hill under a blue sky.")
    return "Turn the scene into a snowy winter evening"


def example_instruction(instruction: str, variant: str, target: str | None = None) -> str:
    """Examples are written as E1.1 instructions plus a target description; E1-Full gets both in
    its two-part format (without a description the instruction stands in for it)."""
    if variant != "e1-full" or TARGET_MARKER in instruction:
        return instruction
    return f"Editing Instruction: {instruction.rstrip('.')}. {TARGET_MARKER} {target or instruction}"


# ---------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------


def gr_error(message: str, title: str = "Error") -> gr.Error:
    # gr.Error renders its message as HTML in the browser; file names in messages are user input.
    return gr.Error(html.escape(message, quote=False), title=title, print_exception=False)


def guarded(what: str) -> Callable[[Callable], Callable]:
    """Turns every failure of the wrapped handler into a `gr.Error` with a readable message.

    Works for plain and generator handlers (streaming tabs): for a generator, errors raised while
    iterating are converted too. `functools.wraps` keeps the signature, which gradio reads to
    inject `gr.Request` and `gr.Progress` and to name the API parameters.
    """

    def convert(exc: Exception) -> gr.Error:
        if isinstance(exc, EditCancelled):
            return gr_error(str(exc), title="Stopped")
        if isinstance(exc, USER_ERRORS):
            return gr_error(str(exc))
        logger.error("%s failed", what, exc_info=exc)
        return gr_error(f"{what} failed unexpectedly ({type(exc).__name__}: {exc}). The server log has the details.")

    def decorate(fn: Callable) -> Callable:
        if inspect.isgeneratorfunction(fn):
            @functools.wraps(fn)
            def stream(*args, **kwargs):
                try:
                    yield from fn(*args, **kwargs)
                except gr.Error:
                    raise
                except Exception as exc:  # noqa: BLE001 - the one place that turns bugs into messages
                    raise convert(exc) from None

            return stream

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            try:
                return fn(*args, **kwargs)
            except gr.Error:
                raise
            except Exception as exc:  # noqa: BLE001 - the one place that turns bugs into messages
                raise convert(exc) from None

        return wrapper

    return decorate


# ---------------------------------------------------------------------------------------------
# Widget values <-> params
# ---------------------------------------------------------------------------------------------


def params_from_widgets(
    instruction: Any,
    negative_prompt: Any,
    guidance_scale: Any,
    image_guidance_scale: Any,
    num_inference_steps: Any,
    refine_strength: Any,
    clip_cfg_norm: Any,
    working_resolution: Any,
    seed: Any,
    randomize_seed: Any,
    collapse_padding: Any,
) -> EditParams:
    """Validated params from raw widget / API values (RequestError names the bad field)."""
    if randomize_seed is True or str(randomize_seed).strip().lower() in ("true", "1"):
        seed = -1
    elif seed is None or (isinstance(seed, str) and not seed.strip()):
        seed = -1  # a cleared seed box means "pick one", not an error
    return EditParams(
        instruction=instruction if instruction is not None else "",
        negative_prompt=negative_prompt,
        guidance_scale=guidance_scale,
        image_guidance_scale=image_guidance_scale,
        num_inference_steps=num_inference_steps,
        refine_strength=refine_strength,
        clip_cfg_norm=clip_cfg_norm,
        seed=seed,
        working_resolution=working_resolution if working_resolution not in (None, "") else "auto",
        collapse_padding=collapse_padding,
    ).validated()


def form_values(params: EditParams) -> tuple:
    """Values for the form widgets, in `layout.FORM_FIELDS` order (randomize is switched off so
    the loaded seed is the one used)."""
    return (
        params.instruction,
        params.negative_prompt,
        params.guidance_scale,
        params.image_guidance_scale,
        params.num_inference_steps,
        params.refine_strength,
        params.clip_cfg_norm,
        str(params.working_resolution),
        params.seed,
        False,
        params.collapse_padding,
    )


# ---------------------------------------------------------------------------------------------
# Status panel
# ---------------------------------------------------------------------------------------------

STATUS_CSS = """
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


def _kv(key: str, value: str) -> str:
    return f'<div class="hui-kv"><span>{html.escape(key)}</span><span>{html.escape(value)}</span></div>'


def _bar(label: str, used: float | int | None, total: float | int | None, text: str | None = None) -> str:
    if used is None or not total:
        return ""
    fraction = max(0.0, min(1.0, float(used) / float(total)))
    high = " hui-high" if fraction >= 0.9 else ""
    text = text or f"{format_bytes(used)} / {format_bytes(total)}"
    return (f'<div class="hui-bar-label"><span>{html.escape(label)}</span><span>{html.escape(text)}</span></div>'
            f'<div class="hui-bar{high}" title="{fraction:.0%}"><div style="width:{fraction * 100:.1f}%"></div></div>')


def state_line(status: Mapping[str, Any]) -> tuple[str, str]:
    """("idle" | "loading" | "editing", human text) from an engine status dict."""
    state = str(status.get("state") or "idle")
    progress = status.get("progress") or {}
    if state == "editing":
        step, total = progress.get("step"), progress.get("total")
        stage = progress.get("stage")
        text = f"editing · step {step}/{total}" if total else "editing"
        if stage == "refine":
            text += " (refine)"
        return state, text
    if state == "loading":
        fraction = progress.get("fraction")
        message = progress.get("message") or ""
        percent = f" {fraction:.0%}" if isinstance(fraction, (int, float)) else ""
        return state, f"loading model{percent} · {message}".rstrip(" ·")
    return state, "idle" + ("" if status.get("loaded") else " · model not loaded yet (loads on first edit)")


def render_status(status: Mapping[str, Any]) -> str:
    """The system panel's HTML for an `engine.status()` dict (plus an optional "queue" entry)."""
    state, text = state_line(status)
    parts = [f'<div class="hui-status"><div class="hui-state hui-state-{html.escape(state)}">{html.escape(text)}</div>']
    if status.get("device"):
        parts.append(_kv("Device", f"{status.get('device_name') or '?'}"))
        parts.append(_kv("Type", f"{status.get('device_type')} ({status.get('device')})"))
    else:
        parts.append(_kv("Device", "unavailable"))
    parts.append(_kv("Dtype", str(status.get("dtype") or "?")))
    source = status.get("model_source")
    source_text = "tiny (random weights)" if source == "tiny" else str(source or "?")
    parts.append(_kv("Model", f"{str(status.get('variant') or '?').upper()} · {source_text}"))
    parts.append(_kv("Attention", str(status.get("attention") or "?")))
    queue = status.get("queue")
    if isinstance(queue, Mapping):
        parts.append(_kv("Queue", f"{queue.get('waiting', 0)} waiting · {queue.get('running', 0)} running"))
    memory = status.get("memory")
    if isinstance(memory, Mapping):
        parts.append("<h4>Memory</h4>")
        total = memory.get("total")
        if memory.get("allocated") is not None:
            parts.append(_bar("allocated", memory.get("allocated"), total))
            parts.append(_bar("reserved", memory.get("reserved"), total))
            parts.append(_bar("peak", memory.get("peak"), total))
        elif status.get("device_type") == "cpu":
            parts.append('<div class="hui-note">CPU: no device allocator; model memory is in the process RSS.</div>')
        if memory.get("free") is not None and total and status.get("device_type") != "cpu":
            parts.append(_bar("device in use", total - memory["free"], total))
        host_total = memory.get("host_total")
        if host_total and memory.get("host_available") is not None:
            parts.append(_bar("host RAM", host_total - memory["host_available"], host_total))
        parts.append(_bar("process RSS", memory.get("process_rss"), host_total))
        utilization = memory.get("utilization")
        if isinstance(utilization, (int, float)):
            kind = str(status.get("device_type") or "device").upper()
            parts.append(_bar(f"{kind} utilisation", utilization, 100.0, f"{utilization:.0f}%"))
    if status.get("device_error"):
        parts.append(f'<div class="hui-note">device: {html.escape(str(status["device_error"]))}</div>')
    if status.get("attention_note"):
        parts.append(f'<div class="hui-note">{html.escape(str(status["attention_note"]))}</div>')
    if status.get("last_error"):
        parts.append(f'<div class="hui-note">last error: {html.escape(str(status["last_error"]))}</div>')
    parts.append("</div>")
    return "".join(parts)


def attention_label(name: str, description: str, available: bool, reason: str) -> str:
    if not available:
        return f"{name} — unavailable: {reason}"
    short = description.split(";")[0].split(":")[0].strip()
    return f"{name} — {short}" if short else name


def summarise_result(result, load_seconds: float = 0.0) -> str:
    """One Markdown line for a finished edit; `load_seconds` is the model load this request waited
    for (the first edit after start-up), shown apart from the edit's own time."""
    params = result.params
    timings = result.timings
    width, height = result.working_size
    name = result.saved_png.name if result.saved_png else "not saved"
    load = f" · model load {load_seconds:.1f} s" if load_seconds >= 0.05 else ""
    return (
        f"Seed **{params.seed}** · working size {width}×{height} · {params.num_inference_steps} steps · "
        f"{timings.get('total', 0):.1f} s (denoise {timings.get('denoise', 0):.1f} s, "
        f"{timings.get('per_step', 0):.2f} s/step){load} · saved `{name}` (settings in its metadata)"
    )


def deleted_placeholder():
    """The History thumbnail of a result that retention deleted (instead of a broken image)."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (256, 256), (236, 236, 236))
    draw = ImageDraw.Draw(image)
    for y, line in ((104, "deleted by"), (128, "retention")):
        width = draw.textlength(line)
        draw.text(((256 - width) / 2, y), line, fill=(90, 90, 90))
    return image


# ---------------------------------------------------------------------------------------------
# Handlers
# ---------------------------------------------------------------------------------------------


class Handlers:
    """The handlers of one demo: the engine plus the services shared with the other tabs (jobs
    and their cancel tokens, so one user's Stop only ever stops that user's work)."""

    def __init__(self, engine: EditEngine, queue_info: Callable[[], Mapping[str, Any] | None] | None = None,
                 services: AppServices | None = None):
        self.engine = engine
        self.queue_info = queue_info
        self.services = services or AppServices.for_config(getattr(engine, "config", None) or AppConfig())

    # ------------------------------------------------------------------ model
    def _load_with_progress(self, progress: gr.Progress | None) -> float:
        """Loads the model if needed; returns the seconds this call waited for it."""
        if self.engine.loaded:
            return 0.0
        started = time.perf_counter()

        def on_progress(fraction: float, message: str) -> None:
            if progress is not None:
                progress(fraction, desc=f"Loading model: {message}")

        self.engine.load(on_progress=on_progress)
        return time.perf_counter() - started

    @guarded("loading the model")
    def load_model(self, progress=gr.Progress()) -> str:
        """Loads the model now (otherwise the first edit loads it)."""
        started = time.perf_counter()
        was_loaded = self.engine.loaded
        self._load_with_progress(progress)
        status = self.engine.status()
        if was_loaded:
            return f"Model already loaded ({status.get('model_source')}, {status.get('load_seconds')} s)."
        return f"Model loaded in {time.perf_counter() - started:.1f} s ({status.get('model_source')})."

    # ------------------------------------------------------------------ edit
    @guarded("the edit")
    def edit(
        self,
        image,
        instruction,
        negative_prompt,
        guidance_scale,
        image_guidance_scale,
        num_inference_steps,
        refine_strength,
        clip_cfg_norm,
        working_resolution,
        seed,
        randomize_seed,
        collapse_padding,
        request: gr.Request = None,
        progress=gr.Progress(),
    ):
        """Edits the image following the instruction.

        Returns (before, after) images, the saved PNG (with the settings in its metadata), the
        seed used, a one-line summary and this session's history entry.
        """
        # Validate everything before loading anything: bad input costs nothing.
        params = params_from_widgets(instruction, negative_prompt, guidance_scale, image_guidance_scale,
                                     num_inference_steps, refine_strength, clip_cfg_norm, working_resolution,
                                     seed, randomize_seed, collapse_padding)
        source, name = self.services.gate.path(image, "image")
        picture = self.services.open_image(source, name=name)
        edit_request = EditRequest(image=picture, params=params, source_name=name).validated()

        with self.services.job("edit", request) as job:
            load_seconds = self._load_with_progress(progress)
            progress(0.0, desc="Encoding the instruction")

            def on_step(info: StepInfo) -> None:
                eta = f" · ETA {info.eta:.0f} s" if info.eta is not None else ""
                progress((info.step, info.total), desc=f"{info.stage} step {info.step}/{info.total}{eta}",
                         unit="steps")

            # A Stop pressed while the model loaded has already set the token: the engine then
            # refuses to start instead of running an edit nobody waits for.
            result = self.engine.edit(edit_request, on_step, cancel=job.token)
        self.services.results.add(result.saved_png)

        metadata = result.metadata()
        entry = {
            "png": str(result.saved_png) if result.saved_png else None,
            "summary": summary_line(metadata),
            "metadata": metadata,
        }
        return ((result.source_image, result.image),
                str(result.saved_png) if result.saved_png else None,
                result.params.seed,
                summarise_result(result, load_seconds),
                entry)

    def stop(self, request: gr.Request = None) -> None:
        """Stops the caller's running edit after its current step (never another user's)."""
        if self.services.cancel(request):
            logger.info("edit cancelled by its user")

    def cancel(self, request: gr.Request) -> str:
        """Stops the caller's own running jobs (edit, batch or comparison) after their current step.

        A cancelled edit saves nothing; a cancelled batch or comparison keeps what finished. Jobs
        of other clients are never touched. Answers at once, whatever the queue holds.
        """
        stopped = self.services.cancel(request, reason="cancelled through /cancel")
        return f"stopped {stopped} job(s)" if stopped else "nothing of yours is running"

    # ------------------------------------------------------------------ status
    def _queue(self) -> Mapping[str, Any] | None:
        if self.queue_info is None:
            return None
        try:
            return self.queue_info()
        except Exception:  # noqa: BLE001 - the queue figures are a best-effort extra
            logger.debug("queue figures unavailable", exc_info=True)
            return None

    def status(self) -> dict:
        """Engine status (device, dtype, attention, memory, state, ...) plus the queue when known.

        Never waits in the queue. Without a login (`--auth`) it names model sources, never their
        absolute paths, and error texts lose the paths they hold.
        """
        status = dict(self.engine.status())
        queue = self._queue()
        if queue is not None:
            status["queue"] = dict(queue)
        if self.services.public:
            paths = status.get("model_paths")
            if isinstance(paths, Mapping):
                status["model_paths"] = {key: (Path(value).name if isinstance(value, str) and value else value)
                                         for key, value in paths.items()}
            for key in ("device_error", "last_error", "attention_note"):
                if isinstance(status.get(key), str):
                    status[key] = redact_paths(status[key])
        return status

    def status_panel(self) -> str:
        """HTML for the system panel. Never raises: the timer calls it every 2 s."""
        try:
            return render_status(self.status())
        except Exception as exc:  # noqa: BLE001 - a broken panel must not spam error toasts
            logger.warning("status panel failed: %s", exc, exc_info=True)
            return ('<div class="hui-status"><div class="hui-state hui-state-error">'
                    f"status unavailable: {html.escape(str(exc))}</div></div>")

    # ------------------------------------------------------------------ attention
    def attention_choices(self) -> list[tuple[str, str]]:
        """(label, name) for every strategy; unavailable ones say why."""
        try:
            statuses = self.engine.attention_choices()
        except EngineError as exc:
            current = str(self.engine.status().get("attention") or "auto")
            return [(f"{current} — device unavailable: {exc}", current)]
        choices = []
        for s in statuses:
            label = attention_label(s.name, s.description, s.available, s.reason)
            if s.name == "auto" and s.available:
                label = f"auto → {self._auto_resolves_to()} (best available here)"
            choices.append((label, s.name))
        return choices

    def _auto_resolves_to(self) -> str:
        from ..attention import resolve

        try:
            return resolve("auto", self.engine.device, self.engine.dtype).name
        except Exception as exc:  # noqa: BLE001 - only a label; the switch itself reports errors
            logger.debug("cannot resolve auto attention: %s", exc)
            return "?"

    def page_load(self):
        """Fills the attention dropdown (needs torch, so not at start-up), the panel, and the
        working resolutions the configured model can take."""
        choices = []
        try:
            choices = self.attention_choices()
        except Exception as exc:  # noqa: BLE001 - the page must still open
            logger.warning("attention choices unavailable: %s", exc, exc_info=True)
        current = str(self.engine.status().get("attention") or "auto")
        if current not in {value for _, value in choices}:
            choices.append((current, current))
        return gr.update(choices=choices, value=current), self.status_panel(), self.resolution_choices()

    def resolution_choices(self):
        """A dropdown update offering only working resolutions the model can take."""
        try:
            choices = self.engine.working_resolution_choices()
        except Exception as exc:  # noqa: BLE001 - the page must still open; the edit validates anyway
            logger.warning("working resolutions unknown: %s", exc, exc_info=True)
            choices = list(WORKING_RESOLUTIONS)
        return gr.update(choices=choices)

    @guarded("switching attention")
    def set_attention(self, name: str) -> str:
        """Switches the attention strategy; returns the active strategy (what "auto" became).

        Refuses unknown or unavailable strategies with the reason; the current one stays active.
        """
        return self.engine.set_attention(name)

    def change_attention(self, name: str):
        """The dropdown's handler: shows the outcome or the refusal, and the active strategy."""
        try:
            resolved = self.engine.set_attention(name)
            note = f"Attention: <b>{html.escape(resolved)}</b> active."
            logger.info("attention switched to %s (asked for %s)", resolved, name)
        except EngineError as exc:
            logger.info("attention %r refused: %s", name, exc)
            gr.Warning(html.escape(str(exc), quote=False))
            resolved = str(self.engine.status().get("attention") or "auto")
            note = (f"Refused: {html.escape(str(exc))}. "
                    f"Still using <b>{html.escape(resolved)}</b>.")
        except Exception as exc:  # noqa: BLE001
            logger.exception("switching attention to %r failed", name)
            resolved = str(self.engine.status().get("attention") or "auto")
            note = f"Switching attention failed unexpectedly ({html.escape(type(exc).__name__)}); see the server log."
        return gr.update(value=resolved), note, self.status_panel()

    # ------------------------------------------------------------------ history
    @staticmethod
    def gallery_items(history: list[dict]) -> list[tuple[Any, str]]:
        """(image, caption) per History entry, in order. A result that retention deleted keeps its
        place (and its settings) with a "deleted by retention" thumbnail instead of a broken image."""
        items = []
        for entry in history:
            png = entry.get("png")
            if not png:
                continue
            caption = entry.get("summary", "")[:120]
            if Path(png).is_file():
                items.append((png, caption))
            else:
                items.append((deleted_placeholder(), f"[deleted by retention] {caption}"))
        return items

    def add_history(self, history: list[dict] | None, entry: dict | None):
        history = list(history or [])
        if entry:
            history.insert(0, entry)  # newest first, like the gallery reads
        return history, self.gallery_items(history), gr.Row(visible=True)

    def refresh_history(self, history: list[dict] | None):
        """Re-reads the gallery when the History tab opens (retention may have run since)."""
        return self.gallery_items(list(history or []))

    def select_history(self, history: list[dict] | None, evt: gr.SelectData):
        history = history or []
        index = evt.index if isinstance(evt.index, int) else None
        if index is None or not 0 <= index < len(history):
            return None, None, gr.update(interactive=False)
        return history[index]["metadata"], index, gr.update(interactive=True)

    @guarded("loading the settings")
    def apply_history(self, history: list[dict] | None, index: int | None):
        history = history or []
        if index is None or not 0 <= int(index) < len(history):
            raise gr.Error("Select a result in the gallery first.", print_exception=False)
        params = EditParams.from_dict(history[int(index)]["metadata"]["params"])
        gr.Info(f"Loaded the settings of result {int(index) + 1} (seed {params.seed}).")
        return (*form_values(params), gr.Tabs(selected="edit"))

    @guarded("reading the PNG")
    def settings_from_file(self, file):
        if not file:
            raise gr.Error("Upload a PNG saved by this app.", print_exception=False)
        path = file if isinstance(file, (str, Path)) else getattr(file, "name", file)
        params = load_settings(path)
        gr.Info(f"Loaded the settings from {Path(str(path)).name} (seed {params.seed}).")
        return (*form_values(params), gr.Tabs(selected="edit"))


__all__ = [
    "Handlers",
    "USER_ERRORS",
    "WORKING_RESOLUTIONS",
    "guarded",
    "params_from_widgets",
    "form_values",
    "render_status",
    "state_line",
    "attention_label",
    "variant_hint",
    "instruction_placeholder",
    "example_instruction",
]
