"""What the system panel's events do: the status (``/status``, the panel, the plot, the visitor's
card), ``/cancel``, ``/load_model``, the attention switch (``/set_attention``) and the page's first
fill. The Speed setting has its own (ui/speed_setting.py).

The engine-wide changes are the operator's with ``--kiosk`` (`@operator_only`); the controls of a
capability the executor lacks are not shown at all (ui/system_panel.py), so nothing here is
refused only after a click. Imports gradio at the top: only the UI imports it.
"""

from __future__ import annotations

import dataclasses
import html
import logging
from typing import Any, Mapping

import gradio as gr

from hidream_ui.engine.errors import EngineError
from hidream_ui.engine.pool import ALL_ENGINES, shared_sampler
from hidream_ui.engine.status import DeviceRow, EngineStatus, QueueFigures
from hidream_ui.server import gradio_internals
from hidream_ui.server.operator import may_change_engine
from hidream_ui.ui.common import DEVICE_GROUP, guarded
from hidream_ui.ui.operator_gate import operator_only
from hidream_ui.ui.services import TabHandlers, redact_paths, require_capability
from hidream_ui.ui.status_panel import attention_label, render_state, render_status, render_visitor_card

logger = logging.getLogger(__name__)

STATUS_UNAVAILABLE = '<div class="hui-status"><div class="hui-state hui-state-error">status unavailable: {}</div></div>'


class SystemHandlers(TabHandlers):
    """The system panel's handlers (`system_panel.build_system_panel` connects them)."""

    # ------------------------------------------------------------------ model
    @guarded("loading the model")
    @operator_only("loading the model")
    def load_model(self, request: gr.Request = None, progress=gr.Progress()) -> str:
        """Loads the model now (otherwise the first edit loads it). With --kiosk: the operator only."""
        was_loaded = self.engine.loaded
        seconds = self.load_with_progress(progress)
        status = self.engine.status()
        if was_loaded:
            return f"Model already loaded ({status.model_source}, {status.load_seconds} s)."
        return f"Model loaded in {seconds:.1f} s ({status.model_source})."

    def load_button_update(self):
        """ "Load model" shows only while there is a model to load."""
        return gr.update(visible=not self.engine.loaded)

    def cancel(self, request: gr.Request) -> str:
        """Stops the caller's own running jobs (edit, batch or comparison) after their current step.

        A cancelled edit saves nothing; a cancelled batch or comparison keeps what finished. Jobs
        of other clients are never touched. Answers at once, whatever the queue holds.
        """
        stopped = self.services.cancel(request, reason="cancelled through /cancel")
        return f"stopped {stopped} job(s)" if stopped else "nothing of yours is running"

    # ------------------------------------------------------------------ status
    def _queue(self) -> Mapping[str, Any] | None:
        """The device lane's queue figures from the demo's queue (None without a demo)."""
        demo = self.services.demo
        if demo is None:
            return None
        try:
            return gradio_internals.queue_figures(demo, DEVICE_GROUP)
        except Exception:  # noqa: BLE001 - the queue figures are a best-effort extra
            logger.debug("queue figures unavailable", exc_info=True)
            return None

    def engine_status(self) -> EngineStatus:
        """The engine's status plus the queue figures, its progress and device rows read from the
        running jobs' own record (`EngineStatus.following`: one truth for the bar, the state line and
        Devices); without a login (`--auth`) it names model sources, never their absolute paths, and
        error texts lose the paths they hold."""
        status = self.engine.status()  # one device row per engine, a pool of one included
        status = status.following([job.progress for job in self._running_jobs() if not job.token.cancelled])
        queue = self._queue()
        if queue is not None:
            status = status.replace(queue=QueueFigures(**queue))
        if self.services.rewriter is not None:
            rewriter = self.services.rewriter.status()
            if self.services.public and rewriter.last_error:
                # It may quote the vision model's words about one visitor's photo: not for the others.
                rewriter = dataclasses.replace(rewriter, last_error="the last rewrite failed (see the server log)")
            status = status.replace(rewriter=rewriter)
        return _redacted(status) if self.services.public else status

    def status(self) -> dict:
        """Engine status (device, dtype, attention, memory, state, queue, ...) as JSON.

        Never waits in the queue. Without a login (`--auth`) it names model sources, never their
        absolute paths.
        """
        return self.engine_status().to_dict()

    def telemetry_plot(self):
        """The live plot's rows: memory and utilisation per device over the last minutes (cached
        telemetry only, no engine status: the timer calls it every 2 s, beside the panel's)."""
        import pandas as pd

        from hidream_ui.ui.devices_panel import PLOT_COLUMNS, plot_rows

        try:
            rows = plot_rows(shared_sampler().history(), self.engine.labels())
        except Exception:  # noqa: BLE001 - a broken plot must not spam error toasts
            logger.warning("telemetry plot failed", exc_info=True)
            rows = []
        # Numeric columns even when there are no rows: an empty frame's columns are "object", the plot
        # then takes both axes for categories and keeps them (a stack of labels instead of an axis).
        return pd.DataFrame(rows, columns=list(PLOT_COLUMNS)).astype({"seconds": float, "percent": float})

    def _running_jobs(self, session: str | None = None) -> list:
        return sorted(self.services.jobs.running(session), key=lambda job: job.started)

    def live_progress(self) -> list[str]:
        """What the progress bars of the running jobs show now (the same `Job.progress` they are
        drawn from), oldest job first. A stopped job still finishing its step says so: its last step
        line would read as work going on."""
        texts = []
        for job in self._running_jobs():
            if job.token.cancelled:
                texts.append(f"stopping: {job.kind} stopped after step {job.token.step}")
            elif job.progress is not None:
                texts.append(job.progress.text)
        return texts

    def status_state(self) -> str:
        """HTML for the panel's state line: the running jobs' own progress text, else the engine's
        state (loading, idle, ...). Never raises: a timer calls it."""
        try:
            return render_state(self.engine_status(), self.live_progress())
        except Exception as exc:  # noqa: BLE001 - a broken panel must not spam error toasts
            logger.warning("status line failed: %s", exc, exc_info=True)
            return STATUS_UNAVAILABLE.format(html.escape(str(exc)))

    def status_panel(self) -> str:
        """HTML for the system panel. Never raises: the timer calls it every 2 s."""
        try:
            return render_status(self.engine_status(), with_state=False)
        except Exception as exc:  # noqa: BLE001 - a broken panel must not spam error toasts
            logger.warning("status panel failed: %s", exc, exc_info=True)
            return STATUS_UNAVAILABLE.format(html.escape(str(exc)))

    def visitor_card(self, request: gr.Request = None) -> str:
        """With --kiosk, what a visitor sees of the system: the device, the queue and their place in
        it. Never raises: the timer calls it."""
        try:
            status = self.engine.status()
            demo = self.services.demo
            session = getattr(request, "session_hash", None)
            position = gradio_internals.queue_position(demo, session, DEVICE_GROUP) if demo is not None else None
            return render_visitor_card(status, self._queue() or {}, position)
        except Exception as exc:  # noqa: BLE001 - a broken card must not spam error toasts
            logger.warning("visitor card failed: %s", exc, exc_info=True)
            return '<div class="hui-status"><div class="hui-note">status unavailable</div></div>'

    # ------------------------------------------------------------------ a run of this page
    def run_started(self):
        """A run (edit, batch, comparison) was clicked: the panel's state line follows it closely
        (the fast timer). The button itself is disabled in the browser (common.disable_js): an
        answer from here may arrive after the run's end on a busy machine and would undo it."""
        return gr.Timer(active=True)

    def follow_run(self, request: gr.Request = None):
        """The fast timer's tick: the state line, and the timer stays on only while this page has a
        run waiting or running (it turns itself off, whichever answer came last)."""
        session = getattr(request, "session_hash", None)
        demo = self.services.demo
        busy = bool(session and demo is not None and gradio_internals.session_jobs(demo, session, DEVICE_GROUP))
        # A stopped run leaves gradio's queue at once, its engine step ends a little later: the line
        # follows until the job itself is gone, so it never stays on the stopped step.
        busy = busy or bool(session and self._running_jobs(session))
        return self.status_state(), gr.Timer(active=busy)

    def run_finished(self):
        """A run ended (done, failed or stopped): the fast timer off, and the panel redrawn at once
        (no "editing 42/60" left over after the result); "Load model" goes once a run loaded it."""
        return gr.Timer(active=False), self.status_state(), self.status_panel(), self.load_button_update()

    # ------------------------------------------------------------------ the page's first fill
    def page_load(self, request: gr.Request = None):
        """Fills the attention dropdown (needs torch, so not at start-up) and the panel; shows the
        engine-wide controls (and the full panel) to whoever may use them (everyone, or with
        --kiosk the operator only; visitors get the small card). An executor that cannot switch
        attention has no dropdown to fill (system_panel hides it and says why)."""
        operator = may_change_engine(self.services.config, request)
        attention, unavailable = gr.update(), ""
        if self.engine.capabilities.attention:
            choices = []
            try:
                choices = self.attention_choices()
            except Exception as exc:  # noqa: BLE001 - the page must still open
                logger.warning("attention choices unavailable: %s", exc, exc_info=True)
            current = self.engine.status().attention or "auto"
            if current not in {value for _, value in choices}:
                choices.append((current, current))
            attention, unavailable = gr.update(choices=choices, value=current), self.unavailable_attention()
        kiosk = bool(getattr(self.services.config, "kiosk", False))
        card = self.visitor_card(request) if kiosk and not operator else ""
        return (
            attention,
            self.status_state(),
            self.status_panel(),
            gr.update(visible=operator),  # the engine-wide controls
            unavailable,
            self.load_button_update(),
            gr.update(visible=operator),  # the operator's view: the full panel and the plot
            gr.update(visible=operator),
            gr.update(value=card, visible=kiosk and not operator),
        )

    # ------------------------------------------------------------------ attention
    def attention_choices(self) -> list[tuple[str, str]]:
        """(label, name) for every strategy this device can run (the others are listed apart, with
        their reason: `unavailable_attention`)."""
        try:
            statuses = self.engine.attention_choices()
        except EngineError as exc:
            current = self.engine.status().attention or "auto"
            return [(f"{current} — device unavailable: {exc}", current)]
        choices = []
        for s in statuses:
            if not s.available:
                continue
            label = attention_label(s.name, s.description, s.available, s.reason)
            if s.name == "auto":
                label = f"auto → {self.engine.auto_attention()} (best available here)"
            choices.append((label, s.name))
        return choices

    def unavailable_attention(self) -> str:
        """Markdown: the strategies this device cannot run, each with its reason (not offered in the
        dropdown, so nobody picks one to be refused)."""
        try:
            statuses = [s for s in self.engine.attention_choices() if not s.available]
        except EngineError:
            return ""
        if not statuses:
            return ""
        lines = "\n".join(f"- {html.escape(s.name)}: {html.escape(s.reason or 'not available here')}" for s in statuses)
        return f"<details><summary>Not available here ({len(statuses)})</summary>\n\n{lines}\n</details>"

    @guarded("switching attention")
    @operator_only("the attention strategy")
    def set_attention(self, name: str, engine: str = ALL_ENGINES, request: gr.Request = None) -> str:
        """Switches the attention strategy; returns the active strategy (what "auto" became).

        `engine`: "all" (default) switches every engine of the app; with `--devices`, one engine's
        label ("cpu#1", "npu:1", as in `/status` `devices`) switches that engine only. Refuses unknown
        engines and unknown or unavailable strategies with the reason; the current one stays active.
        With --kiosk only the operator may switch; an executor that cannot switch says why.
        """
        require_capability(self.engine, "attention")
        return self.engine.set_attention(name, engine)

    def _attention_on(self, target: str | None) -> tuple[str, str]:
        """(the strategy of `target`, " on LABEL" for the note); an unknown label: the first engine's."""
        try:
            resolved = self.engine.attention_of(target)
        except EngineError:
            return self.engine.attention_of(), ""
        return resolved, "" if target in (None, ALL_ENGINES) else f" on {html.escape(str(target))}"

    @operator_only("the attention strategy")
    def change_attention(self, name: str, target: str | None = ALL_ENGINES, request: gr.Request = None):
        """The dropdown's handler: shows the outcome or the refusal, and the active strategy of the
        engine(s) the panel's Engine choice names (every engine by default)."""
        try:
            resolved = self.engine.set_attention(name, target)
            where = self._attention_on(target)[1]
            note = f"Attention: <b>{html.escape(resolved)}</b> active{where}."
            logger.info("attention switched to %s (asked for %s)%s", resolved, name, where)
        except EngineError as exc:
            logger.info("attention %r refused: %s", name, exc)
            gr.Warning(html.escape(str(exc), quote=False))
            resolved, where = self._attention_on(target)
            note = f"Refused: {html.escape(str(exc))}. Still using <b>{html.escape(resolved)}</b>{where}."
        except Exception as exc:  # noqa: BLE001
            logger.exception("switching attention to %r failed", name)
            resolved, _ = self._attention_on(target)
            note = f"Switching attention failed unexpectedly ({html.escape(type(exc).__name__)}); see the server log."
        return gr.update(value=resolved), note, self.status_panel()

    def attention_target(self, target: str | None):
        """The panel's Engine choice changed: the Attention dropdown shows that engine's strategy."""
        try:
            resolved = self.engine.attention_of(target)
        except EngineError as exc:
            return gr.update(), f"Refused: {html.escape(str(exc))}."
        where = "every engine" if target in (None, ALL_ENGINES) else html.escape(str(target))
        return gr.update(value=resolved), f"The attention switch applies to {where}."


def _redacted(status: EngineStatus) -> EngineStatus:
    """`status` for strangers (no login): model_paths are folder names already
    (`EnginePool.for_config(hide_paths=...)`); error texts, progress messages and device rows lose
    the absolute paths they hold."""
    status = status.replace(
        **{
            key: redact_paths(getattr(status, key))
            for key in ("device_error", "last_error", "attention_note")
            if getattr(status, key)
        }
    )
    status = status.replace(progress=_redacted_progress(status.progress))
    speed = status.speed or {}
    if speed.get("compile_error"):  # a compiler's message may name its cache folder
        status = status.replace(speed={**speed, "compile_error": redact_paths(speed["compile_error"])})
    # Each device row repeats its engine's errors (and a tool's stderr in the telemetry note).
    return status.replace(devices=[_redacted_row(row) for row in status.devices])


def _redacted_progress(progress):
    """A load's progress message names the folders it reads ("loading ... from /srv/models/..."):
    cut like every other status text."""
    if progress is None or not progress.message:
        return progress
    return dataclasses.replace(progress, message=redact_paths(progress.message))


def _redacted_row(row: DeviceRow) -> DeviceRow:
    telemetry = row.telemetry
    if telemetry is not None and telemetry.note:
        telemetry = dataclasses.replace(telemetry, note=redact_paths(telemetry.note))
    return dataclasses.replace(
        row,
        error=redact_paths(row.error) if row.error else row.error,
        telemetry=telemetry,
        progress=_redacted_progress(row.progress),
    )


__all__ = ["SystemHandlers"]
