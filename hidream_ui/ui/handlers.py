"""What the Edit tab, the system panel and History do: widget values -> request dataclasses ->
engine; results -> widget updates. Imports gradio at the top: only the UI imports it.
"""

from __future__ import annotations

import html
import logging
import time
from pathlib import Path
from typing import Any, Callable, Mapping

import gradio as gr

from hidream_ui.config import AppConfig
from hidream_ui.engine.engine import EditEngine
from hidream_ui.engine.errors import EngineError
from hidream_ui.engine.jobs import StepInfo
from hidream_ui.engine.status import EngineStatus, QueueFigures
from hidream_ui.outputs import load_settings, summary_line
from hidream_ui.requests import EditParams, EditRequest
from hidream_ui.ui.common import (
    WORKING_RESOLUTIONS,
    deleted_placeholder,
    form_values,
    guarded,
    params_from_widgets,
    summarise_result,
)
from hidream_ui.ui.services import AppServices, redact_paths
from hidream_ui.ui.status_panel import attention_label, render_status

logger = logging.getLogger(__name__)


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
            return f"Model already loaded ({status.model_source}, {status.load_seconds} s)."
        return f"Model loaded in {time.perf_counter() - started:.1f} s ({status.model_source})."

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
        picture = self.engine.open_image(source, name=name)
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

    def engine_status(self) -> EngineStatus:
        """The engine's status plus the queue figures; without a login (`--auth`) it names model
        sources, never their absolute paths, and error texts lose the paths they hold."""
        status = self.engine.status()
        queue = self._queue()
        if queue is not None:
            status = status.replace(queue=QueueFigures(**queue))
        if self.services.public:  # model_paths are folder names already (`EditEngine.hide_paths`)
            status = status.replace(**{key: redact_paths(getattr(status, key))
                                       for key in ("device_error", "last_error", "attention_note")
                                       if getattr(status, key)})
        return status

    def status(self) -> dict:
        """Engine status (device, dtype, attention, memory, state, queue, ...) as JSON.

        Never waits in the queue. Without a login (`--auth`) it names model sources, never their
        absolute paths.
        """
        return self.engine_status().to_dict()

    def status_panel(self) -> str:
        """HTML for the system panel. Never raises: the timer calls it every 2 s."""
        try:
            return render_status(self.engine_status())
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
            current = self.engine.status().attention or "auto"
            return [(f"{current} — device unavailable: {exc}", current)]
        choices = []
        for s in statuses:
            label = attention_label(s.name, s.description, s.available, s.reason)
            if s.name == "auto" and s.available:
                label = f"auto → {self._auto_resolves_to()} (best available here)"
            choices.append((label, s.name))
        return choices

    def _auto_resolves_to(self) -> str:
        from hidream_ui.pipeline.attention.registry import resolve

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
        current = self.engine.status().attention or "auto"
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
            resolved = self.engine.status().attention or "auto"
            note = (f"Refused: {html.escape(str(exc))}. "
                    f"Still using <b>{html.escape(resolved)}</b>.")
        except Exception as exc:  # noqa: BLE001
            logger.exception("switching attention to %r failed", name)
            resolved = self.engine.status().attention or "auto"
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
