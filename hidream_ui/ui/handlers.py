"""What the Edit tab, the system panel and History do: widget values -> request dataclasses ->
engine; results -> widget updates. Imports gradio at the top: only the UI imports it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import html
import io
import logging
import time
from pathlib import Path
from typing import Any, Callable, Mapping

import gradio as gr
from PIL import Image

from hidream_ui.config import AppConfig
from hidream_ui.edits import (
    EditParams,
    EditRequest,
    RequestError,
    params_from_form,
    validated_flag,
    validated_mask,
)
from hidream_ui.engine.errors import EditCancelled, EngineError
from hidream_ui.engine.jobs import Preview, StepInfo
from hidream_ui.engine.pool import ALL_ENGINES, shared_sampler
from hidream_ui.engine.protocol import Engine
from hidream_ui.engine.runner import stream_job
from hidream_ui.engine.status import DeviceRow, EngineStatus, QueueFigures
from hidream_ui.outputs import load_settings, summary_line
from hidream_ui.results import file_sha256
from hidream_ui.rewrite.prompt import RewriteError, RewriteResult
from hidream_ui.rewrite.service import needs_rewrite
from hidream_ui.server import gradio_internals
from hidream_ui.server.operator import may_change_engine, refusal
from hidream_ui.ui.common import (
    ADD_BOTH,
    DEVICE_GROUP,
    USER_ERRORS,
    WORKING_RESOLUTIONS,
    form_values,
    gr_error,
    guarded,
    move_bar,
    people_message,
    stopped_message,
    summarise_result,
)
from hidream_ui.ui.history_entries import (
    added,
    browser_secret,
    check_entries,
    new_browser_secret,
    new_entry,
    picker_choices,
    render_entries,
    signed,
)
from hidream_ui.ui.services import STOPPED_BY_USER, AppServices, redact_paths
from hidream_ui.ui.status_panel import attention_label, render_state, render_status, render_visitor_card

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------
# Handlers
# ---------------------------------------------------------------------------------------------


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


class Handlers:
    """The handlers of one demo: the engine plus the services shared with the other tabs (jobs
    and their cancel tokens, so one user's Stop only ever stops that user's work)."""

    def __init__(
        self,
        engine: Engine,
        queue_info: Callable[[], Mapping[str, Any] | None] | None = None,
        services: AppServices | None = None,
    ):
        self.engine = engine
        self.queue_info = queue_info
        self.services = services or AppServices.for_config(getattr(engine, "config", None) or AppConfig())

    # ------------------------------------------------------------------ operator mode
    def require_operator(self, request, what: str) -> None:
        """Raises the refusal when `request` may not change `what` for everyone (--kiosk and not
        the operator; see server/operator.py). Without --kiosk everyone may, as before."""
        config = self.services.config
        if not may_change_engine(config, request):
            logger.info("%s: refused to a visitor in kiosk mode", what)
            raise gr_error(refusal(config, what), title="Operator only")

    # ------------------------------------------------------------------ model
    def _load_with_progress(self, progress: gr.Progress | None) -> float:
        """Loads the model if needed; returns the seconds this call waited for it."""
        if self.engine.loaded:
            return 0.0
        started = time.perf_counter()

        def on_progress(fraction: float, message: str) -> None:
            if progress is not None:
                # Load messages name model files; strangers (no --auth) see folder names, as in /status.
                shown = redact_paths(message) if self.services.public else message
                progress(fraction, desc=f"Loading model: {shown}")

        self.engine.load(on_progress=on_progress)
        return time.perf_counter() - started

    @guarded("loading the model")
    def load_model(self, request: gr.Request = None, progress=gr.Progress()) -> str:
        """Loads the model now (otherwise the first edit loads it). With --kiosk: the operator only."""
        self.require_operator(request, "loading the model")
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
        rewrite=False,
        mask=None,
        request: gr.Request = None,
        progress=gr.Progress(),
    ):
        """Edits the image following the instruction.

        With `rewrite` the instruction goes through the configured rewriter first (cached per image
        and instruction; an E1-Full prompt already in its two-part format is used as written) and
        the edit uses its prompt; the metadata records both. `mask` (optional) limits the edit to a
        region: white = may change, black = keep (transparency: unpainted, i.e. keep). Streams
        (before, live preview) pairs every --preview-every steps; its last answer is the (before,
        after) images, the saved PNG (with the settings in its metadata), the seed used, a one-line
        summary and this session's history entry.
        """
        # Validate everything before loading anything: bad input costs nothing. Both missing: say both.
        if image is None and not str(instruction or "").strip():
            raise gr_error(ADD_BOTH, title="Nothing to edit yet")
        # The parameters are the form's fields (EDIT_FORM, tests/test_edit_schema.py checks the names).
        params = params_from_form(locals())
        service = self._rewriter() if validated_flag("rewrite", rewrite) else None
        yield from self._edit(
            image, params, service=service, record=None, request=request, progress=progress, mask=mask
        )

    @guarded("the edit")
    def edit_rewritten(
        self,
        image,
        rewritten,
        rewrite,
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
        mask=None,
        request: gr.Request = None,
        progress=gr.Progress(),
    ):
        """Edits with the rewritten (and perhaps hand-edited) prompt `rewritten`; `rewrite`, the
        rewriter's answer as `/rewrite` returned it (or null), is recorded beside it in the metadata.
        `mask` as for `/edit`."""
        if rewritten is None or (isinstance(rewritten, str) and not rewritten.strip()):
            raise RequestError(
                "instruction",
                rewritten,
                "a rewritten instruction: press Rewrite first (or Edit to use your instruction as written)",
            )
        record = RewriteResult.from_dict(_json_value(rewrite)) if _json_value(rewrite) else None
        params = params_from_form({**locals(), "instruction": rewritten})  # EDIT_FORM but the instruction
        yield from self._edit(image, params, service=None, record=record, request=request, progress=progress, mask=mask)

    def _region(self, mask) -> Any:
        return open_region(self.services, mask)

    def _edit(self, image, params: EditParams, *, service, record: RewriteResult | None, request, progress, mask=None):
        source, name = self.services.gate.path(image, "image")
        picture = self.engine.open_image(source, name=name)
        region = self._region(mask)
        if region is not None:
            params = dataclasses.replace(params, mask=region).validated()
        # The parent of the result: the source file's own bytes (an earlier result's PNG is its file).
        digest = file_sha256(source) if isinstance(source, (str, Path)) else None
        EditRequest(image=picture, params=params, source_name=name).validated()  # before any work

        # The job (its cancel token, what Stop and /cancel find) ends with its work, in the edit's own
        # thread, not with this generator: gradio drops a stopped generator wherever it stands, and one
        # left at a preview's yield is never resumed (its `finally` would run only when collected).
        job_scope = contextlib.ExitStack()
        job = job_scope.enter_context(self.services.job("edit", request))
        try:
            load_seconds = 0.0
            if service is not None and needs_rewrite(params.instruction):
                if service.uses_device:
                    load_seconds = self._load_with_progress(progress)
                progress(0.0, desc=f"Rewriting the instruction ({service.label})")
                try:
                    record = service.rewrite(picture, params.instruction, cancel=job.token)
                except RewriteError as exc:
                    raise gr_error(
                        f"Rewriting the instruction failed: {exc}. Nothing was edited: uncheck "
                        "“Rewrite instruction” to edit with your instruction as written.",
                        title="Rewrite failed",
                    ) from None
                params = dataclasses.replace(params, instruction=service.prompt(record)).validated()
            edit_request = EditRequest(
                image=picture, params=params, source_name=name, rewrite=record, source_sha256=digest
            ).validated()
            load_seconds += self._load_with_progress(progress)
            progress(0.0, desc="Encoding the instruction")

            # The edit runs in a thread of its own (stream_job) so that this generator can hand out the
            # live previews as they come, into the result area (`EditTabHandles.result_slider`); progress
            # is reported from here. A Stop pressed while the model loaded has already set the token:
            # the engine then refuses to start.
            def work(emit):
                try:
                    return self.engine.edit(
                        edit_request,
                        lambda info: emit("step", info),
                        cancel=job.token,
                        on_preview=lambda shot: emit("preview", shot),
                    )
                finally:
                    job_scope.close()

            result, before = None, None
            try:
                for event in stream_job(work, job.token, name="hidream-edit"):
                    if event.kind == "step":
                        info: StepInfo = event.payload
                        eta = f" · ETA {info.eta:.0f} s" if info.eta is not None else ""
                        move_bar(
                            progress,
                            job,
                            info.step / max(1, info.total),
                            f"{info.stage} step {info.step}/{info.total}{eta}",
                            step=info.step,
                            total=info.total,
                        )
                    elif event.kind == "preview" and not job.token.cancelled:  # a stopped edit shows no more
                        shot: Preview = event.payload
                        size = preview_size(picture.size)
                        before = before or png_bytes(picture.resize(size, Image.Resampling.BILINEAR))
                        # The same "before" on every preview: a file written once (cache_once says why).
                        yield (
                            (
                                gradio_internals.cache_once(before, PREVIEW_BEFORE_NAME),
                                shot.image.resize(size, Image.Resampling.BILINEAR),
                            ),
                            gr.update(),
                            gr.update(),
                            gr.update(),
                            gr.update(),
                        )
                    elif event.kind == "done":
                        result = event.payload
            except EditCancelled:
                if job.token.reason != STOPPED_BY_USER:
                    raise  # /cancel, a client's Job.cancel(): the API's contract is an error
                # The browser's Stop: a neutral note where the result would have been, no error.
                total = job.progress.total if job.progress is not None else params.num_inference_steps
                message = stopped_message(job.token.step, total)
                gr.Info(message, title="Stopped")
                yield gr.update(), gr.update(), gr.update(), message, None
                return
        finally:
            job_scope.close()  # a second close is a no-op
        self.services.results.add(result.saved_png)

        metadata = result.saved_metadata or result.metadata()  # built once, when it was saved
        png = str(result.saved_png) if result.saved_png else None
        entry = {
            "png": png,
            "summary": summary_line(metadata),
            "metadata": metadata,
            # What this browser's History keeps of it (history_entries: thumbnails, the result's
            # opaque id, never its path; add_history signs it for the browser).
            "history": new_entry(
                result=self.services.results.result_id(png),
                name=result.saved_png.name if result.saved_png else None,
                params=metadata.get("params") or result.params.to_dict(),
                before=result.source_image,
                after=result.image,
                seconds=round(result.timings.total, 2),
                parent=metadata.get("parent"),
                sha256=file_sha256(png) if png else None,
            ),
        }
        yield (
            (result.source_image, result.image),
            str(result.saved_png) if result.saved_png else None,
            result.params.seed,
            summarise_result(result, load_seconds),
            entry,
        )

    # ------------------------------------------------------------------ rewrite
    def _rewriter(self):
        service = self.services.rewriter
        if service is None:
            raise RequestError(
                "rewrite",
                True,
                "false: no rewriter is configured (start the app with "
                "--rewriter-url URL --rewriter-model NAME, or --rewriter local)",
            )
        return service

    @guarded("rewriting the instruction")
    def rewrite(self, image, instruction, request: gr.Request = None, progress=gr.Progress()):
        """Rewrites the instruction for this image with the configured rewriter (a vision-language
        model behind an OpenAI-compatible URL, or the local Llama, text only).

        Returns the prompt the edit would use (E1.1: the refined instruction; E1-Full: `Editing
        Instruction: ... Target Image Description: ...`) and the rewriter's answer (original, source,
        instruction, target, backend, model, seconds). Answers are cached per image and instruction.
        """
        service = self._rewriter()
        text = EditParams(instruction="" if instruction is None else instruction).validated().instruction
        source, name = self.services.gate.path(image, "image")
        picture = self.engine.open_image(source, name=name)
        if not needs_rewrite(text):  # as the edit itself does: a two-part prompt is used as written
            gr.Info("The instruction is already in E1-Full's two-part format: it is used as written.")
            return text, None
        with self.services.job("rewrite", request) as job:
            if service.uses_device:
                self._load_with_progress(progress)
            progress(0.0, desc=f"Rewriting with {service.label}")
            try:
                result = service.rewrite(picture, text, cancel=job.token)
            except RewriteError as exc:
                raise gr_error(
                    f"Rewriting failed: {exc}. Your instruction is unchanged: “Edit with this” edits "
                    "with it as written; Rewrite tries again.",
                    title="Rewrite failed",
                ) from None
        return service.prompt(result), result.to_dict()

    @staticmethod
    def rewrite_failed(instruction):
        """After a failed Rewrite: the box holds the instruction as written, so "Edit with this" uses it."""
        return (
            instruction or "",
            None,
            "Not rewritten (the message says why). The box holds your instruction as written.",
        )

    def rewrite_note(self, rewrite) -> str:
        """The line under the rewritten prompt: who rewrote it, and what to do next."""
        try:
            record = RewriteResult.from_dict(_json_value(rewrite))
        except RequestError:
            return ""
        return (
            f"Rewritten by {record.backend} · {record.model} in {record.seconds:.1f} s. "
            "Change the text if you like, then press “Edit with this”."
        )

    def show_rewrite(self, entry: dict | None):
        """After an edit: the prompt it used and the rewriter's answer, when the edit rewrote."""
        record = ((entry or {}).get("metadata") or {}).get("rewrite")
        if not record:
            return gr.update(), gr.update(), gr.update()
        answer = {key: value for key, value in record.items() if key not in ("prompt", "edited")}
        return entry["metadata"]["params"]["instruction"], answer, self.rewrite_note(answer)

    def stop(self, request: gr.Request = None):
        """Stops the caller's running edit after its current step (never another user's); returns
        the summary's new text, "Stopped after k of N steps" (unchanged when nothing ran)."""
        session = getattr(request, "session_hash", None)
        running = [job for job in self.services.jobs.running(session) if job.kind == "edit"] if session else []
        if not self.services.cancel(request, kind="edit") or not running:
            return gr.update()
        logger.info("edit cancelled by its user")
        job = running[0]
        return stopped_message(job.token.cancelled_at_step, job.progress.total if job.progress else None)

    def check_source(self, image):
        """An upload, checked when it arrives: a file that is not an image (a text file renamed .png)
        is refused now, with what to do, and the slot is emptied (no broken sliver until Edit).
        Returns (the image slot, the summary)."""
        if image is None:
            return gr.update(), gr.update()
        try:
            source, name = self.services.gate.path(image, "image")
            self.engine.open_image(source, name=name)
        except USER_ERRORS as exc:
            message = people_message(exc)
            logger.info("upload refused: %s", exc)
            gr.Warning(html.escape(redact_paths(message), quote=False), title="Not an image")
            return None, html.escape(redact_paths(message), quote=False)
        return gr.update(), ""

    def region_background(self, image):
        """The region editor for a (new) source: the source as the background to paint on, nothing
        painted (a region belongs to one image), a brush sized to the picture. No source: empty.
        Runs on every change of the source (upload, example, "Edit the result", "Edit again") and
        on "Clear the region"; the file goes through the upload gate and only its header is read."""
        from hidream_ui.ui.region_editor import brush, eraser

        if image is None:
            return gr.update(value=None, brush=brush(), eraser=eraser())
        try:
            source, name = self.services.gate.path(image, "image")
            size = source_size(source, name)
        except (*USER_ERRORS, OSError) as exc:  # check_source tells the user; the editor stays empty
            logger.info("no region editor for this source: %s", exc)
            return gr.update(value=None, brush=brush(), eraser=eraser())
        background = source if isinstance(source, Image.Image) else str(source)
        return gr.update(
            value={"background": background, "layers": [], "composite": background},
            brush=brush(size),
            eraser=eraser(size),
        )

    def edit_result(self, entry: dict | None):
        """ "Edit the result": the last result becomes the source (the instruction box keeps its text
        for the next step). Only a result this server stored and still serves."""
        png = (entry or {}).get("png")
        if not png or png not in self.services.results or not Path(png).is_file():
            gr.Warning("That result is no longer on the server; edit the source again.", title="Result gone")
            return gr.update(), gr.update()
        return png, "The result is the source now: change the instruction and press Edit."

    def cancel(self, request: gr.Request) -> str:
        """Stops the caller's own running jobs (edit, batch or comparison) after their current step.

        A cancelled edit saves nothing; a cancelled batch or comparison keeps what finished. Jobs
        of other clients are never touched. Answers at once, whatever the queue holds.
        """
        stopped = self.services.cancel(request, reason="cancelled through /cancel")
        return f"stopped {stopped} job(s)" if stopped else "nothing of yours is running"

    # ------------------------------------------------------------------ status
    def _queue(self) -> Mapping[str, Any] | None:
        """The device lane's queue figures: `queue_info()` when given, else the demo's queue."""
        demo = self.services.demo
        if self.queue_info is None and demo is None:
            return None
        try:
            return (
                self.queue_info() if self.queue_info is not None else gradio_internals.queue_figures(demo, DEVICE_GROUP)
            )
        except Exception:  # noqa: BLE001 - the queue figures are a best-effort extra
            logger.debug("queue figures unavailable", exc_info=True)
            return None

    def engine_status(self) -> EngineStatus:
        """The engine's status plus the queue figures; without a login (`--auth`) it names model
        sources, never their absolute paths, and error texts lose the paths they hold."""
        status = self.engine.status()  # one device row per engine, a pool of one included
        queue = self._queue()
        if queue is not None:
            status = status.replace(queue=QueueFigures(**queue))
        if self.services.rewriter is not None:
            rewriter = self.services.rewriter.status()
            if self.services.public and rewriter.last_error:
                # It may quote the vision model's words about one visitor's photo: not for the others.
                rewriter = dataclasses.replace(rewriter, last_error="the last rewrite failed (see the server log)")
            status = status.replace(rewriter=rewriter)
        if self.services.public:  # model_paths are folder names already (`EnginePool.for_config(hide_paths=...)`)
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
            status = status.replace(devices=[_redacted_row(row) for row in status.devices])
        return status

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
            labels = self.engine.labels()
            rows = plot_rows(shared_sampler().history(), labels)
        except Exception:  # noqa: BLE001 - a broken plot must not spam error toasts
            logger.warning("telemetry plot failed", exc_info=True)
            rows = []
        # Numeric columns even when there are no rows: an empty frame's columns are "object", the plot
        # then takes both axes for categories and keeps them (a stack of labels instead of an axis).
        return pd.DataFrame(rows, columns=list(PLOT_COLUMNS)).astype({"seconds": float, "percent": float})

    def live_progress(self) -> list[str]:
        """What the progress bars of the running jobs show now (the same `Job.progress` they are
        drawn from), oldest job first."""
        jobs = sorted(self.services.jobs.running(), key=lambda job: job.started)
        return [job.progress.text for job in jobs if job.progress is not None]

    def status_state(self) -> str:
        """HTML for the panel's state line: the running jobs' own progress text, else the engine's
        state (loading, idle, ...). Never raises: a timer calls it."""
        try:
            return render_state(self.engine_status(), self.live_progress())
        except Exception as exc:  # noqa: BLE001 - a broken panel must not spam error toasts
            logger.warning("status line failed: %s", exc, exc_info=True)
            return (
                '<div class="hui-status"><div class="hui-state hui-state-error">'
                f"status unavailable: {html.escape(str(exc))}</div></div>"
            )

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
        return self.status_state(), gr.Timer(active=busy)

    def run_finished(self):
        """A run ended (done, failed or stopped): the fast timer off, and the panel redrawn at once
        (no "editing 42/60" left over after the result); "Load model" goes once a run loaded it."""
        return (
            gr.Timer(active=False),
            self.status_state(),
            self.status_panel(),
            gr.update(visible=not self.engine.loaded),
        )

    def status_panel(self) -> str:
        """HTML for the system panel. Never raises: the timer calls it every 2 s."""
        try:
            return render_status(self.engine_status(), with_state=False)
        except Exception as exc:  # noqa: BLE001 - a broken panel must not spam error toasts
            logger.warning("status panel failed: %s", exc, exc_info=True)
            return (
                '<div class="hui-status"><div class="hui-state hui-state-error">'
                f"status unavailable: {html.escape(str(exc))}</div></div>"
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

    def load_button_update(self):
        """ "Load model" shows only while there is a model to load."""
        return gr.update(visible=not self.engine.loaded)

    def visitor_card(self, request: gr.Request = None) -> str:
        """With --kiosk, what a visitor sees of the system: the device, the queue and their place in
        it. Never raises: the timer calls it."""
        try:
            status = self.engine.status()
            queue = self._queue() or {}
            demo = self.services.demo
            position = (
                gradio_internals.queue_position(demo, getattr(request, "session_hash", None), DEVICE_GROUP)
                if demo is not None
                else None
            )
            return render_visitor_card(status, queue, position)
        except Exception as exc:  # noqa: BLE001 - a broken card must not spam error toasts
            logger.warning("visitor card failed: %s", exc, exc_info=True)
            return '<div class="hui-status"><div class="hui-note">status unavailable</div></div>'

    def page_load(self, request: gr.Request = None):
        """Fills the attention dropdown (needs torch, so not at start-up), the panel, and the
        working resolutions the configured model can take; shows the engine-wide controls (and the
        full panel) to whoever may use them (everyone, or with --kiosk the operator only; visitors
        get the small card)."""
        operator = may_change_engine(self.services.config, request)
        controls = gr.update(visible=operator)
        choices = []
        try:
            choices = self.attention_choices()
        except Exception as exc:  # noqa: BLE001 - the page must still open
            logger.warning("attention choices unavailable: %s", exc, exc_info=True)
        current = self.engine.status().attention or "auto"
        if current not in {value for _, value in choices}:
            choices.append((current, current))
        kiosk = bool(getattr(self.services.config, "kiosk", False))
        card = self.visitor_card(request) if kiosk and not operator else ""
        return (
            gr.update(choices=choices, value=current),
            self.status_state(),
            self.status_panel(),
            self.resolution_choices(),
            controls,
            self.unavailable_attention(),
            self.load_button_update(),
            gr.update(visible=operator),
            gr.update(visible=operator),
            gr.update(value=card, visible=kiosk and not operator),
        )

    def resolution_choices(self):
        """A dropdown update offering only working resolutions the model can take."""
        try:
            choices = self.engine.working_resolution_choices()
        except Exception as exc:  # noqa: BLE001 - the page must still open; the edit validates anyway
            logger.warning("working resolutions unknown: %s", exc, exc_info=True)
            choices = list(WORKING_RESOLUTIONS)
        return gr.update(choices=choices)

    @guarded("switching attention")
    def set_attention(self, name: str, engine: str = ALL_ENGINES, request: gr.Request = None) -> str:
        """Switches the attention strategy; returns the active strategy (what "auto" became).

        `engine`: "all" (default) switches every engine of the app; with `--devices`, one engine's
        label ("cpu#1", "npu:1", as in `/status` `devices`) switches that engine only. Refuses unknown
        engines and unknown or unavailable strategies with the reason; the current one stays active.
        With --kiosk only the operator may switch.
        """
        self.require_operator(request, "the attention strategy")
        return self.engine.set_attention(name, engine)

    def _attention_on(self, target: str | None) -> tuple[str, str]:
        """(the strategy of `target`, " on LABEL" for the note); an unknown label: the first engine's."""
        try:
            resolved = self.engine.attention_of(target)
        except EngineError:
            return self.engine.attention_of(), ""
        return resolved, "" if target in (None, ALL_ENGINES) else f" on {html.escape(str(target))}"

    def change_attention(self, name: str, target: str | None = ALL_ENGINES, request: gr.Request = None):
        """The dropdown's handler: shows the outcome or the refusal, and the active strategy of the
        engine(s) the panel's Engine choice names (every engine by default)."""
        self.require_operator(request, "the attention strategy")
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

    # ------------------------------------------------------------------ history
    # The History lives in the browser (gr.BrowserState: it survives a reload, and holds only that
    # browser's results), beside the browser's secret that its entries are signed for. What comes
    # back from it is checked (history_entries.check_entries); the checked list is kept server-side
    # for the session (a gr.State) and the buttons act on it.
    def _history_view(self, stored: Any, secret: str):
        results = self.services.results
        checked = check_entries(stored, lambda result, ticket: results.stored(result, ticket, secret))
        choices = picker_choices(checked)
        picker = gr.update(choices=choices, value=choices[0][1] if choices else None)
        return checked, render_entries(checked), picker

    def add_history(self, stored: Any, secret: Any, entry: dict | None):
        """A finished edit: its entry, signed for this browser, goes first in its History. Returns
        (the browser's list, the checked list, the cards, the picker, the result's buttons row, the
        browser's secret: made here if the page load did not make it)."""
        secret = browser_secret(secret)
        made = (entry or {}).get("history")
        results = self.services.results
        history = added(stored, signed(made, lambda result: results.ticket(result, secret)) if made else None)
        # The result's buttons and seed show with a result (a stopped edit has none).
        return (history, *self._history_view(history, secret), gr.Row(visible=True) if entry else gr.update(), secret)

    def refresh_history(self, stored: Any, secret: Any):
        """The History as this browser stored it (page load, tab opened): checked, then drawn.
        Returns (the checked list, the cards, the picker, the browser's secret: made on its first visit)."""
        secret = browser_secret(secret)
        return (*self._history_view(stored, secret), secret)

    def clear_history(self):
        """Forgets this browser's History (the result files stay on the server until retention) and
        gives it a new secret: a copy of the old entries opens nothing here any more."""
        secret = new_browser_secret()
        return [], *self._history_view([], secret), secret

    @staticmethod
    def _picked(checked: list | None, index: Any):
        try:
            position = int(index)
        except (TypeError, ValueError):
            position = -1
        if not checked or not 0 <= position < len(checked):
            raise gr.Error("Pick a result first.", print_exception=False)
        return checked[position], position

    @guarded("loading the settings")
    def apply_history(self, checked: list | None, index: Any):
        """ "Load settings": the picked result's settings fill the Edit form."""
        entry, position = self._picked(checked, index)
        params = entry.params
        gr.Info(f"Loaded the settings of result {position + 1} (seed {params.seed}).")
        return (*form_values(params), gr.Tabs(selected="edit"))

    @guarded("opening the result")
    def edit_again(self, checked: list | None, index: Any):
        """ "Edit again": the picked result becomes the source of the Edit tab, its instruction
        fills the box. Only a result this server stored for this browser and still serves."""
        entry, _ = self._picked(checked, index)
        if not entry.available:
            raise gr.Error(
                "That result is no longer on this server; “Load settings” still works.", print_exception=False
            )
        return entry.png, entry.params.instruction, gr.Tabs(selected="edit")

    @guarded("reading the PNG")
    def settings_from_file(self, file):
        if not file:
            raise gr.Error("Upload a PNG saved by this app.", print_exception=False)
        # The event runs with preprocess=False: gr.File's preprocessing leaves an empty temp file in
        # gradio's cache on every call. The gate opens only what this app stored (or its examples).
        path, name = self.services.gate.path(file, "file")
        params = load_settings(path)
        gr.Info(f"Loaded the settings from {name or 'the PNG'} (seed {params.seed}).")
        return (*form_values(params), gr.Tabs(selected="edit"))


MAX_REGION_LAYERS = 8  # the brush paints one; each is a full-size image to decode
# An editor value that names its layers only by an id: the browser streamed them to the component
# (it does when the editor has a .change or .input listener), where only gradio's preprocessing finds them.
LAYERS_NOT_SENT = (
    "the painted layers as files (the region did not arrive: paint it again, or send a mask file "
    "or {background, layers, composite} with the layers as files)"
)


def open_region(services: AppServices, mask) -> Any:
    """The validated EditMask of an optional mask (None: none), for /edit and /compare: an uploaded
    file (white = may change, black = keep), or the region editor's value (`region_editor`: its
    painted layers, ``preprocess=False``; transparent = keep, painted = may change; nothing painted:
    no mask). Through the same gate and decoder as a source image: only files gradio stored for
    this app are opened, never a path a client names."""
    from PIL import ImageChops

    from hidream_ui.imaging import open_mask

    def opened(value, layer: bool = False) -> tuple[Any, str | None]:
        source, name = services.gate.path(value, "mask")
        return open_mask(source, max_pixels=services.config.max_pixels, name=name, layer=layer), name

    if mask is None:
        return None
    if isinstance(mask, Mapping) and "path" not in mask and ("layers" in mask or "background" in mask):
        layers = mask.get("layers") or []
        if not isinstance(layers, list) or len(layers) > MAX_REGION_LAYERS:
            what = f"{len(layers)} layers" if isinstance(layers, list) else type(layers).__name__
            raise RequestError("mask", what, f"layers as a list of at most {MAX_REGION_LAYERS} image files")
        if not layers and mask.get("id"):
            raise RequestError("mask", "an editor value without its layers", LAYERS_NOT_SENT)
        planes = [opened(layer, layer=True)[0] for layer in layers if layer]
        if not planes or all(plane.getbbox() is None for plane in planes):
            return None  # nothing painted: the whole image may change, exactly as without a mask
        union = planes[0]
        for plane in planes[1:]:
            union = ImageChops.lighter(union, plane.resize(union.size))
        return validated_mask(union, "painted region")
    plane, name = opened(mask)
    return validated_mask(plane, name)


def source_size(source: Any, name: str | None = None) -> tuple[int, int]:
    """The size of a source the gate let through (a stored file: from its header, nothing decoded)."""
    from hidream_ui.imaging import open_header

    if isinstance(source, Image.Image):
        return source.size
    with open(source, "rb") as fp, open_header(fp, name or "image") as picture:
        return picture.size


PREVIEW_SIDE = 512  # longest side a live preview is shown at (it is computed at 1/8 of the working size)
PREVIEW_BEFORE_NAME = "before.png"  # the cached file of a live preview's "before" half


def preview_size(source_size: tuple[int, int]) -> tuple[int, int]:
    """The display size of a live preview: the source's shape, at most PREVIEW_SIDE on its longest side."""
    width, height = source_size
    scale = min(1.0, PREVIEW_SIDE / max(width, height))
    return max(1, round(width * scale)), max(1, round(height * scale))


def png_bytes(image: Image.Image) -> bytes:
    """`image` encoded as PNG (fast settings: a preview is shown once and thrown away)."""
    buffer = io.BytesIO()
    image.save(buffer, format="PNG", compress_level=1)
    return buffer.getvalue()


def _json_value(value: Any) -> Any:
    """A gr.JSON value as handlers receive it with `preprocess=False` (the parsed JSON, or its text)."""
    if isinstance(value, str):
        import json

        try:
            return json.loads(value) if value.strip() else None
        except ValueError:
            raise RequestError("rewrite", value, "the rewriter's answer as JSON (what /rewrite returned)") from None
    return value
