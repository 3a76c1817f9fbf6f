"""What the Edit tab's events do: ``/edit``, ``/edit_rewritten``, ``/rewrite``, Stop, the upload
check, the region editor's background and "Edit the result".

An edit's way: the widget values -> `EditForm` (at the handler's entry) -> `EditParams` (validated
once) -> `EditRequest` -> the engine (`Engine.edit`, in a thread of its own: `engine/runner.stream_job`)
-> the result's widget updates and its History entry. Imports gradio at the top: only the UI imports it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import html
import io
import json
import logging
from pathlib import Path
from typing import Any, Iterator

import gradio as gr
from PIL import Image

from hidream_ui.edits import EditParams, EditRequest, EditResult, RequestError, validated_flag
from hidream_ui.engine.errors import EditCancelled
from hidream_ui.engine.jobs import Preview, StepInfo
from hidream_ui.engine.runner import stream_job
from hidream_ui.outputs import summary_line
from hidream_ui.pipeline.speed.settings import SPEED_PRESETS
from hidream_ui.results import file_sha256
from hidream_ui.rewrite.prompt import RewriteError, RewriteResult
from hidream_ui.rewrite.service import needs_rewrite
from hidream_ui.server import gradio_internals
from hidream_ui.ui.common import (
    ADD_BOTH,
    USER_ERRORS,
    gr_error,
    guarded,
    move_bar,
    people_message,
    stopped_message,
    summarise_result,
)
from hidream_ui.ui.edit_form import EditForm
from hidream_ui.ui.history_entries import new_entry
from hidream_ui.ui.region_input import open_region, source_size
from hidream_ui.ui.services import STOPPED_BY_USER, TabHandlers, redact_paths
from hidream_ui.ui.world_examples import instruction_note

logger = logging.getLogger(__name__)

PREVIEW_SIDE = 512  # longest side a live preview is shown at (it is computed at 1/8 of the working size)
PREVIEW_BEFORE_NAME = "before.png"  # the cached file of a live preview's "before" half
# Stop's outputs: the tab's five (edit_tab.EditTabHandles.outputs) and the result row under them.
STOP_OUTPUTS = ("result_slider", "saved_png", "seed_used", "summary", "last_entry", "result_details")
UNPAINTED_REGION = "whole picture edited: no region was painted on it"
EARLIER_RESULTS = "Earlier results are in History."
NO_REWRITER = (
    "false: no rewriter is configured (start the app with --rewriter-url URL --rewriter-model NAME, "
    "or --rewriter local)"
)


class EditHandlers(TabHandlers):
    """The Edit tab's handlers (`edit_tab.wire_edit_tab` connects them)."""

    # ------------------------------------------------------------------ the API's entries
    # Their parameters are the API's inputs (names and order are a contract: tests/test_edit_schema.py
    # checks them against EDIT_FORM); each builds the form at once and hands it to `run`.
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
        form = EditForm(
            image=image,
            instruction=instruction,
            negative_prompt=negative_prompt,
            guidance_scale=guidance_scale,
            image_guidance_scale=image_guidance_scale,
            num_inference_steps=num_inference_steps,
            refine_strength=refine_strength,
            clip_cfg_norm=clip_cfg_norm,
            working_resolution=working_resolution,
            seed=seed,
            randomize_seed=randomize_seed,
            collapse_padding=collapse_padding,
            mask=mask,
            rewrite=rewrite,
        )
        yield from self.run(form, request=request, progress=progress)

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
        answer = json_value(rewrite)
        form = EditForm(
            image=image,
            instruction=rewritten,  # the form's instruction is the prompt the edit uses
            negative_prompt=negative_prompt,
            guidance_scale=guidance_scale,
            image_guidance_scale=image_guidance_scale,
            num_inference_steps=num_inference_steps,
            refine_strength=refine_strength,
            clip_cfg_norm=clip_cfg_norm,
            working_resolution=working_resolution,
            seed=seed,
            randomize_seed=randomize_seed,
            collapse_padding=collapse_padding,
            mask=mask,
            rewritten_from=RewriteResult.from_dict(answer) if answer else None,
        )
        yield from self.run(form, request=request, progress=progress)

    # ------------------------------------------------------------------ one edit
    def run(self, form: EditForm, *, request=None, progress=None):
        """One edit of `form`: validated before anything loads (bad input costs nothing), then the
        rewrite (when asked), the model load (the first edit) and the edit itself, streaming the
        live previews; its last answer is the result's."""
        if form.is_empty:  # both missing: say both
            raise gr_error(ADD_BOTH, title="Nothing to edit yet")
        params = form.params()
        service = self.rewriter() if validated_flag("rewrite", form.rewrite) else None
        source, name = self.services.gate.path(form.image, "image")
        picture = self.engine.open_image(source, name=name)
        region = open_region(self.services, form.mask)
        # A region sent with nothing painted in it (the brush editor's value, strokes that missed the
        # picture): the whole picture is edited, and the summary says so rather than stay silent.
        # API callers who send no mask (null) mean the whole picture: no note for them.
        unpainted = form.mask is not None and region is None
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
        if progress is None:  # a direct call (tests, scripts): no bar to move
            progress = _no_progress
        try:
            record, load_seconds = form.rewritten_from, 0.0
            if service is not None and needs_rewrite(params.instruction):
                if service.uses_device:
                    load_seconds = self.load_with_progress(progress)
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
            load_seconds += self.load_with_progress(progress)
            progress(0.0, desc="Encoding the instruction")
            result = yield from self._stream(edit_request, job, job_scope, progress)
        finally:
            job_scope.close()  # a second close is a no-op
        if result is not None:
            yield self._answer(result, load_seconds, unpainted=unpainted)

    def _stream(self, edit_request: EditRequest, job, job_scope, progress) -> Iterator[Any]:
        """Runs the edit in a thread of its own (stream_job), so that this generator hands out the
        live previews as they come, into the result area (`EditTabHandles.result_slider`), and moves
        the progress bar from here. Returns the result, or None after the browser's Stop (its note
        was yielded). A Stop pressed while the model loaded has already set the token: the engine
        then refuses to start."""
        picture = edit_request.image

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
                    text = f"{info.stage} step {info.step}/{info.total}{eta}"
                    move_bar(progress, job, info.step / max(1, info.total), text, step=info.step, total=info.total)
                elif event.kind == "preview" and not job.token.cancelled:  # a stopped edit shows no more
                    shot: Preview = event.payload
                    size = preview_size(picture.size)
                    before = before or png_bytes(picture.resize(size, Image.Resampling.BILINEAR))
                    # The same "before" on every preview: a file written once (cache_once says why).
                    pair = (
                        gradio_internals.cache_once(before, PREVIEW_BEFORE_NAME),
                        shot.image.resize(size, Image.Resampling.BILINEAR),
                    )
                    yield pair, gr.update(), gr.update(), gr.update(), gr.update()
                elif event.kind == "done":
                    result = event.payload
        except EditCancelled:
            if job.token.reason != STOPPED_BY_USER:
                raise  # /cancel, a client's Job.cancel(): the API's contract is an error
            # The browser's Stop: a neutral note where the result would have been, no error.
            total = job.progress.total if job.progress is not None else edit_request.params.num_inference_steps
            message = stopped_message(job.token.step, total)
            gr.Info(message, title="Stopped")
            # Nothing of the stopped edit (nor the result before it) stays marked as current.
            yield None, None, None, f"{message} {EARLIER_RESULTS}", None
            return None
        return result

    def _answer(self, result: EditResult, load_seconds: float, unpainted: bool = False) -> tuple:
        """The finished edit's widget values: (before, after), the saved PNG, the seed used, the
        summary, and the entry the History keeps of it. `unpainted`: a region came with nothing
        painted (the summary names the whole picture)."""
        self.services.results.add(result.saved_png)
        metadata = result.saved_metadata or result.metadata()  # built once, when it was saved
        png = str(result.saved_png) if result.saved_png else None
        entry = {
            "png": png,
            "summary": summary_line(metadata),
            "metadata": metadata,
            # What this browser's History keeps of it (history_entries: thumbnails, the result's
            # opaque id, never its path; HistoryHandlers.add_history signs it for the browser).
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
        return (
            (result.source_image, result.image),
            png,
            result.params.seed,
            self.summary(result, load_seconds, unpainted=unpainted),
            entry,
        )

    def summary(self, result: EditResult, load_seconds: float = 0.0, unpainted: bool = False) -> str:
        """The finished edit's summary (Markdown; the /edit API's summary output too): the result's line, the
        speed mode when it was not exact, and a note when the offline model met words it does not know."""
        model_seconds = None
        if load_seconds >= 0.05:  # this request loaded the model: its recorded load time, the panel's figure
            with contextlib.suppress(Exception):  # a summary never fails for a status figure
                model_seconds = self.engine.status().load_seconds
        text = summarise_result(result, load_seconds, model_seconds)
        mode = speed_mode(result.info.speed)
        if mode:  # a visitor should know the result was made faster than exact, and how
            text += f" · speed: {html.escape(mode)}"
        if unpainted:  # a region was sent with nothing painted: not silently the whole picture
            text += f" · {UNPAINTED_REGION}"
        note = instruction_note(self.services.config, result.params.instruction)
        if note:  # the edit ran; this says why it may be a guess (letters-only words: no markup in it)
            text += f"\n\nℹ️ {html.escape(note, quote=False)}"
        return text

    # ------------------------------------------------------------------ rewrite
    def rewriter(self):
        """The configured rewriter; RequestError (naming the `rewrite` field) when there is none."""
        if self.services.rewriter is None:
            raise RequestError("rewrite", True, NO_REWRITER)
        return self.services.rewriter

    @guarded("rewriting the instruction")
    def rewrite(self, image, instruction, request: gr.Request = None, progress=gr.Progress()):
        """Rewrites the instruction for this image with the configured rewriter (a vision-language
        model behind an OpenAI-compatible URL, or the local Llama, text only).

        Returns the prompt the edit would use (E1.1: the refined instruction; E1-Full: `Editing
        Instruction: ... Target Image Description: ...`) and the rewriter's answer (original, source,
        instruction, target, backend, model, seconds). Answers are cached per image and instruction.
        """
        service = self.rewriter()
        text = EditParams(instruction="" if instruction is None else instruction).validated().instruction
        source, name = self.services.gate.path(image, "image")
        picture = self.engine.open_image(source, name=name)
        if not needs_rewrite(text):  # as the edit itself does: a two-part prompt is used as written
            gr.Info("The instruction is already in E1-Full's two-part format: it is used as written.")
            return text, None
        with self.services.job("rewrite", request) as job:
            if service.uses_device:
                self.load_with_progress(progress)
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

    @staticmethod
    def rewrite_note(rewrite) -> str:
        """The line under the rewritten prompt: who rewrote it, and what to do next."""
        try:
            record = RewriteResult.from_dict(json_value(rewrite))
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

    # ------------------------------------------------------------------ the tab's other events
    def stop(self, request: gr.Request = None):
        """Stops the caller's running edit after its current step (never another user's) and clears
        what it stopped: the result area (its live preview, or the result before it, which would read
        as this edit's), the download, the seed used and "Edit the result" (hidden, and its entry
        gone). Returns the tab's outputs plus the result row: (slider, png, seed, summary "Stopped
        after k of N steps", entry, result row); all unchanged when nothing of the caller's ran."""
        session = getattr(request, "session_hash", None)
        running = [job for job in self.services.jobs.running(session) if job.kind == "edit"] if session else []
        if not self.services.cancel(request, kind="edit") or not running:
            return (gr.update(),) * len(STOP_OUTPUTS)
        logger.info("edit cancelled by its user")
        job = running[0]
        message = stopped_message(job.token.cancelled_at_step, job.progress.total if job.progress else None)
        return None, None, None, f"{message} {EARLIER_RESULTS}", None, gr.update(visible=False)

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
            message = html.escape(redact_paths(people_message(exc)), quote=False)
            logger.info("upload refused: %s", exc)
            gr.Warning(message, title="Not an image")
            return None, message
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
        if entry is None:  # nothing finished since the page opened, or the last edit was stopped
            gr.Warning("There is no result to edit yet: press Edit first.", title="No result")
            return gr.update(), gr.update()
        if not png or png not in self.services.results or not Path(png).is_file():
            gr.Warning("That result is no longer on the server; edit the source again.", title="Result gone")
            return gr.update(), gr.update()
        return png, "The result is the source now: change the instruction and press Edit."


def speed_mode(speed: dict[str, Any] | None) -> str | None:
    """The speed mode a result ran with (`RunInfo.speed`), in words: "fast (magcache:0.24@20)", a --cache spec
    that is no preset as it is, with the compiled blocks or the sync-free MoE named; None when exact."""
    if not speed:
        return None
    cache = str(speed.get("cache") or "none")
    preset = next((name for name, spec in SPEED_PRESETS.items() if spec == cache), None)
    parts = [] if cache == "none" else [f"{preset} ({cache})" if preset else cache]
    if speed.get("compile") not in (None, "none"):
        parts.append(f"compiled {speed['compile']}")
    if speed.get("moe") == "sync-free":
        parts.append("sync-free MoE")
    return ", ".join(parts) or None


def _no_progress(*args: Any, **kwargs: Any) -> None:
    pass


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


def json_value(value: Any) -> Any:
    """A gr.JSON value as handlers receive it with `preprocess=False` (the parsed JSON, or its text)."""
    if isinstance(value, str):
        try:
            return json.loads(value) if value.strip() else None
        except ValueError:
            raise RequestError("rewrite", value, "the rewriter's answer as JSON (what /rewrite returned)") from None
    return value


__all__ = ["EditHandlers", "PREVIEW_BEFORE_NAME", "PREVIEW_SIDE", "json_value", "png_bytes", "preview_size"]
