"""The Batch tab: many images x many instructions with one set of settings, streamed as they finish.

`build_batch_tab(engine, config, services)` adds a `gr.Tab("Batch")` to the Blocks being built (call it
inside `with gr.Tabs():`). API: ``/batch_edit`` (files, instructions, mode, settings ->
gallery, report, results zip).

How a run streams: the handler is a generator. It validates everything and opens the uploads
first (bad input never reaches the device), then runs `engine.run_batch` in a worker thread whose
callbacks put events on a `queue.Queue`; the generator turns each finished item into a gallery
update. Stop sets the run's cancel token (the job stops after the current step) instead of killing
the event, so the run still ends normally: the finished items stay in the gallery and in the zip.

Imports gradio at the top: only the UI imports this module.
"""

from __future__ import annotations

import html
import logging
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gradio as gr

from hidream_ui.archive import ZipLimits, sources_from_uploads, write_batch_zip
from hidream_ui.config import AppConfig
from hidream_ui.edits import (
    EditParams,
    RequestError,
    seed_from_form,
    settings_from_form,
    validated_flag,
    validated_seed,
)
from hidream_ui.engine.batch import (
    BATCH_PIXEL_BUDGET,
    MAX_BATCH_SIZE,
    BatchRequest,
    BatchResult,
    BatchSource,
    check_item_count,
    clean_instructions,
    open_sources,
    plan_batch,
)
from hidream_ui.engine.jobs import StepInfo
from hidream_ui.engine.protocol import Engine
from hidream_ui.engine.runner import stream_job
from hidream_ui.ui.common import (
    SETTINGS_FILE_CONCURRENCY,
    SETTINGS_FILE_GROUP,
    USER_ERRORS,
    RunTabHandles,
    device_run,
    disable_on_click,
    format_seconds,
    guarded,
    md,
    move_bar,
    people_message,
    settings_widgets,
    stop_on_click,
)
from hidream_ui.ui.services import AppServices
from hidream_ui.ui.world_examples import batch_placeholder, instructions_note

logger = logging.getLogger(__name__)

MODE_CHOICES = (("every image × every instruction", "matrix"), ("line i ↔ image i (paired)", "paired"))
SEED_POLICY_CHOICES = (("fixed", "fixed"), ("+1 per item", "increment"), ("random", "random"))
ZIPS_KEPT = 8  # results zips kept in this tab's temp folder (gradio serves its own copy)


# ---------------------------------------------------------------------------------------------
# Shared helpers (also used by the Compare tab)
# ---------------------------------------------------------------------------------------------


# ---------------------------------------------------------------------------------------------
# The batch handler
# ---------------------------------------------------------------------------------------------


def _batch_size(value: Any) -> int | None:
    """0 / empty = auto (None); otherwise a whole number (the engine checks the range)."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    try:
        number = float(value)
    except (TypeError, ValueError, OverflowError):  # OverflowError: a 400-digit JSON integer
        raise RequestError("batch_size", value, "a whole number of items per transformer call, 0 for auto") from None
    if not number.is_integer() or number < 0:
        raise RequestError("batch_size", value, "a whole number of items per transformer call, 0 for auto")
    return int(number) or None


def item_caption(item) -> str:
    """The instruction and the seed (the /batch_edit gallery's captions: API clients read them);
    the gallery shows them whole, and the Sources strip shows the images they came from."""
    if item.original_instruction is not None:  # rewritten: the user's line reads better; the PNG has the prompt
        return f"{item.original_instruction} (rewritten) · seed {item.seed}"
    return f"{item.instruction} · seed {item.seed}"


def grouping_line(result: BatchResult) -> str:
    """How the items shared transformer calls, per working size, in counts that add up to the
    items ("144×96: 3 items in 1 call of up to 8")."""
    per_call = (result.stats or {}).get("batch_sizes") or {}
    counts: dict[str, int] = {}
    for item in result.items:
        if item.result is not None:
            size = "x".join(map(str, item.result.working_size))
            counts[size] = counts.get(size, 0) + 1
    parts = []
    for size, count in counts.items():
        limit = int(per_call.get(size) or 1)
        calls = -(-count // limit)
        shown = size.replace("x", "×")
        parts.append(
            f"{shown}: {count} item{'s' if count != 1 else ''} in {calls} call{'s' if calls != 1 else ''}"
            + (f" of up to {limit}" if limit > 1 else "")
        )
    return "; ".join(parts)


class BatchRun:
    """What the report shows while a batch runs: counts, timing, errors, rejections."""

    def __init__(self, total: int, rejected: list[tuple[str, str]]):
        self.total = total
        self.rejected = list(rejected)
        self.gallery: list[tuple[str, str]] = []
        self.errors: list[tuple[str, str, str]] = []  # (source, instruction, message)
        self.done = 0
        self.started = time.perf_counter()
        self.first_step: float | None = None
        self.step_text = ""
        self.note: str | None = None  # the offline model's words: world_examples.instruction_note

    def add(self, item) -> None:
        self.done += 1
        if item.status == "ok" and item.result is not None:
            shown = item.result.saved_png or item.result.image
            self.gallery.append((str(shown) if isinstance(shown, Path) else shown, item_caption(item)))
        elif item.status == "error":
            self.errors.append((item.source_name, item.instruction, item.error or "failed"))

    def eta(self) -> float | None:
        if not self.done or self.first_step is None or self.done >= self.total:
            return None
        elapsed = time.perf_counter() - self.first_step
        return elapsed / self.done * (self.total - self.done)

    def report(self, result: BatchResult | None = None) -> str:
        elapsed = time.perf_counter() - self.started
        if result is None:
            line = f"**{self.done}/{self.total}** done · {format_seconds(elapsed)}"
            eta = self.eta()
            line += f" · ETA {format_seconds(eta)}" if eta is not None else ""
            line += f" · {self.step_text}" if self.step_text else ""
        else:
            ok, failed = len(result.ok), len(result.errors)
            skipped = sum(1 for item in result.items if item.status == "cancelled")
            line = (
                f"**{'Stopped' if result.cancelled else 'Done'}: {ok}/{len(result.items)}** ok"
                + (f" · {failed} failed" if failed else "")
                + (f" · {skipped} not run" if skipped else "")
                + f" · {format_seconds(result.seconds)}"
            )
            stats = result.stats or {}
            if "text_encoder_calls" in stats:
                line += (
                    f" · text encoder runs {stats['text_encoder_calls']}, "
                    f"transformer steps {stats.get('transformer_calls', 0)}"
                )
            grouping = grouping_line(result)
            if grouping:
                line += f"\n\nShared transformer calls by working size: {grouping}"
        text = line
        if self.note:  # the items ran; this says why some may be guesses (letters-only words: no markup)
            text += f"\n\nℹ️ {html.escape(self.note, quote=False)}"
        if self.errors:
            text += "\n\n**Errors**\n\n" + "\n".join(
                f"- {md(source)} × “{md(instruction)}”: {md(message)}" for source, instruction, message in self.errors
            )
        if self.rejected:
            # Reader messages usually start with the file name already ("x.png: not a ..."): once is enough.
            text += "\n\n**Rejected uploads**\n\n" + "\n".join(
                f"- {md(name)}: {md(reason.removeprefix(f'{name}: '))}" for name, reason in self.rejected
            )
        return text


class BatchTab:
    """The Batch tab's handlers for one engine. Runs are jobs of the shared registry, so one user's
    Stop never stops another user's work."""

    def __init__(self, engine: Engine, config: AppConfig, services: AppServices | None = None):
        self.engine = engine
        self.config = config
        self.services = services or AppServices.for_config(config)
        self.services.cleanups.append(self.close)  # zips never outlive the server
        self._zip_dir: Path | None = None
        # What the zips of one request may cost (--max-zip-mb; tests lower it further).
        total = config.max_zip_mb * 2**20
        self.zip_limits = ZipLimits(max_total_bytes=total, max_member_bytes=min(ZipLimits.max_member_bytes, total))

    # ------------------------------------------------------------------ inputs
    def _sources(self, files: Any, cancel=None) -> tuple[list[BatchSource], list[tuple[str, str]]]:
        if files is None:
            files = []
        elif not isinstance(files, (list, tuple)):
            files = [files]
        uploads = []
        for value in files:
            path, name = self.services.gate.path(value, "files")
            uploads.append((name or "upload", path))
        if not uploads:
            raise RequestError("files", None, "at least one image (or a .zip of images): upload some")
        return sources_from_uploads(uploads, limits=self.zip_limits, cancel=cancel)

    def _zip_path(self) -> Path:
        if self._zip_dir is None or not self._zip_dir.is_dir():
            # The system temp dir: gradio may serve files from it, and it is not the results folder
            # (whose retention only counts PNGs).
            self._zip_dir = Path(tempfile.mkdtemp(prefix="hidream-batch-"))
        old = sorted(self._zip_dir.glob("batch-*.zip"))
        for stale in old[: max(0, len(old) - (ZIPS_KEPT - 1))]:
            stale.unlink(missing_ok=True)
        return self._zip_dir / f"batch-{time.strftime('%Y%m%d-%H%M%S')}-{time.perf_counter_ns() % 10**6:06d}.zip"

    # ------------------------------------------------------------------ run
    @guarded("the batch")
    def run(
        self,
        files,
        instructions,
        mode,
        negative_prompt,
        guidance_scale,
        image_guidance_scale,
        num_inference_steps,
        refine_strength,
        clip_cfg_norm,
        working_resolution,
        seed,
        seed_policy,
        batch_size,
        rewrite=False,
        request: gr.Request = None,
        progress=gr.Progress(),
    ):
        """Edits every uploaded image (or zip of images) with every instruction (one per line), or
        pairs line i with image i. Streams (gallery, report, results zip) as items finish.

        With `rewrite` each (image, instruction) pair goes through the configured rewriter first
        (cached); an item whose rewrite fails is listed as an error and the others run."""
        # Everything is checked before the device is touched: a typo costs nothing.
        settings = settings_from_form(locals())  # the SHARED_FORM fields among the arguments
        first_seed = validated_seed(seed_from_form(seed))  # before any upload is read
        rewriter = None
        if validated_flag("rewrite", rewrite):
            rewriter = self.services.rewriter
            if rewriter is None:
                raise RequestError(
                    "rewrite",
                    True,
                    "false: no rewriter is configured (start the app with "
                    "--rewriter-url URL --rewriter-model NAME, or --rewriter local)",
                )
        size = _batch_size(batch_size)
        lines = clean_instructions(instructions or "")
        # The job (and its cancel token) exists before any upload is read: expanding zips and
        # decoding images is work too, and Stop, /cancel and a client that went away stop it.
        with self.services.job("batch", request) as job:
            sources, rejected = self._sources(files, cancel=job.token)
            batch = BatchRequest(
                sources=tuple(sources),
                instructions=lines,
                settings=settings,
                seed=first_seed,
                mode=str(mode or "matrix"),
                seed_policy=str(seed_policy or "fixed"),
                batch_size=size,
            )
            # Decoded and planned here, once (the engine runs this plan), so the item count is known
            # for the progress line and every file that does not open is reported with its reason.
            check_item_count(batch, len(sources), self.config.max_batch_items)  # before decoding anything
            images, refused = open_sources(
                sources,
                self.engine.open_image,
                max_total_pixels=BATCH_PIXEL_BUDGET * self.config.max_pixels,
                cancel=job.token,
            )
            plan = plan_batch(
                batch, self.engine.open_image, self.config.max_batch_items, opened=(images, rejected + refused)
            )
            total = len(plan.items)

            run = BatchRun(total, plan.rejected)
            run.note = instructions_note(self.config, lines)  # the offline model's unknown words, once
            yield [], run.report(), None  # clears the previous run's zip
            move_bar(progress, job, 0.0, "Loading the model" if not self.engine.loaded else "Starting")

            result: BatchResult | None = None

            def work(emit):
                if rewriter is not None:  # per item, before any edit: cached per image + instruction
                    rewriter.rewrite_items(
                        plan,
                        cancel=job.token,
                        on_failed=lambda item: emit("item", item),
                        on_progress=lambda done, count: emit("rewrite", (done, count)),
                    )
                return self.engine.run_batch(
                    plan,
                    on_item=lambda item: emit("item", item),
                    on_step=lambda info: emit("step", info),
                    cancel=job.token,
                )

            for event in stream_job(work, job.token, name="hidream-batch"):
                kind, payload = event.kind, event.payload
                if kind == "rewrite":
                    done, count = payload
                    run.step_text = f"rewriting instruction {done + 1}/{count}"
                    move_bar(progress, job, done / max(1, count), run.step_text)
                elif kind == "step":
                    info: StepInfo = payload
                    run.first_step = run.first_step or time.perf_counter()
                    run.step_text = f"{info.stage} step {info.step}/{info.total}"
                    # The steps of the items in flight count: the bar moves before the first item ends.
                    move_bar(
                        progress,
                        job,
                        (run.done + info.step / max(1, info.total)) / max(1, total),
                        # The bar's percent is the whole batch's: the text says so, and which item steps.
                        f"{run.done}/{total} items done · item {min(run.done + 1, total)}: "
                        f"{run.step_text} · whole batch",
                        step=info.step,
                        total=info.total,
                    )
                elif kind == "item":
                    if payload.result is not None:
                        self.services.results.add(payload.result.saved_png)
                    run.add(payload)
                    move_bar(progress, job, run.done / max(1, total), f"{run.done}/{total} items")
                    yield list(run.gallery), run.report(), gr.update()
                elif kind == "done":
                    result = payload
        archive = write_batch_zip(result, self._zip_path())
        # Plain values (not gr.update) on the last yield: that is what API clients receive.
        yield list(run.gallery), run.report(result), str(archive)

    def preview_sources(self, files):
        """The uploads as thumbnails ("Sources"), checked on arrival: a file that is not an image is
        left out and named in a warning; a .zip is opened only by the run (its images are listed
        there). Returns the gallery's items."""
        values = files if isinstance(files, (list, tuple)) else ([files] if files else [])
        items, refused, archives = [], [], 0
        for value in values:
            try:
                path, name = self.services.gate.path(value, "files")
            except RequestError as exc:
                refused.append(str(exc))
                continue
            if str(name or path).lower().endswith(".zip"):
                archives += 1
                continue
            try:
                self.engine.open_image(path, name=name)
            except USER_ERRORS as exc:
                refused.append(people_message(exc))
                continue
            items.append((path, name))
        if refused:
            gr.Warning(html.escape(" ".join(refused), quote=False), title="Not an image")
        if archives:
            gr.Info(f"{archives} .zip file(s): their images are read when the batch runs.")
        return items

    def stop(self, request: gr.Request = None) -> None:
        """Stops this session's batch after the current step; finished items are kept."""
        if self.services.cancel(request, kind="batch"):
            logger.info("batch stopped by its user")

    def close(self) -> None:
        """Removes this tab's zips (the app calls it on shutdown; tests after use)."""
        if self._zip_dir is not None:
            shutil.rmtree(self._zip_dir, ignore_errors=True)
            self._zip_dir = None


# ---------------------------------------------------------------------------------------------
# Layout
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class BatchHandles(RunTabHandles):
    """What `build_batch_tab` made: its handlers (a BatchTab), /batch_edit's inputs and its widgets."""

    gallery: gr.Gallery
    report: gr.Markdown
    download: gr.DownloadButton


def build_batch_tab(engine: Engine, config: AppConfig, services: AppServices | None = None) -> BatchHandles:
    """Adds the Batch tab to the Blocks being built; returns its handles."""
    handlers = BatchTab(engine, config, services)
    defaults = EditParams.defaults_for(config.variant)
    rewriter = handlers.services.rewriter
    with gr.Tab("Batch", id="batch"):
        gr.Markdown(
            "Upload images (or a **.zip** of images) and write **one instruction per line**. "
            f"Up to {config.max_batch_items} items per run. Items of the same working size share "
            "transformer calls; each keeps its own seed, so a result equals the single edit with "
            "the same settings. Every PNG carries its settings."
        )
        with gr.Row(equal_height=False):
            with gr.Column():
                files = gr.File(
                    label="Images or .zip",
                    file_count="multiple",
                    file_types=["image", ".zip"],
                    elem_id="hui-batch-files",
                )
                instructions = gr.Textbox(
                    label="Instructions (one per line)",
                    lines=4,
                    placeholder=batch_placeholder(config),
                    elem_id="hui-batch-instructions",
                )
                mode = gr.Radio(list(MODE_CHOICES), value="matrix", label="Pairing")
                rewrite = gr.Checkbox(
                    value=rewriter is not None and config.variant == "e1-full",
                    visible=rewriter is not None,
                    label="Rewrite instructions",
                    info="each image + instruction through the rewriter first "
                    f"({rewriter.label if rewriter is not None else 'none configured'})",
                    elem_id="hui-batch-rewrite",
                )
                with gr.Row():
                    run_button = gr.Button("Run batch", variant="primary", elem_id="hui-batch-run")
                    stop_button = gr.Button("Stop", variant="stop", elem_id="hui-batch-stop")
            with gr.Column():
                sources = gr.Gallery(
                    label="Sources",
                    value=[],
                    columns=6,
                    height=120,
                    object_fit="contain",
                    interactive=False,
                    allow_preview=False,
                    elem_id="hui-batch-sources",
                )
                # No label on the results: it sat on top of the first thumbnail.
                gallery = gr.Gallery(
                    label="Results",
                    show_label=False,
                    columns=2,
                    height=420,
                    object_fit="contain",
                    interactive=False,
                    elem_id="hui-batch-gallery",
                )
                report = gr.Markdown(elem_id="hui-batch-report")
                download = gr.DownloadButton("Download results (.zip)", value=None, elem_id="hui-batch-zip")
        # Below the results, not between the Run button and them (on a phone the results come first).
        with gr.Accordion("Settings (shared by every item)", open=False):
            settings = settings_widgets(defaults)
            with gr.Row():
                seed = gr.Number(value=defaults.seed, precision=0, minimum=-1, label="Seed", info="-1: random")
                seed_policy = gr.Radio(list(SEED_POLICY_CHOICES), value="fixed", label="Seed per item")
            batch_size = gr.Number(
                value=0,
                precision=0,
                minimum=0,
                maximum=MAX_BATCH_SIZE,
                label="Items per transformer call",
                info="0 = from free memory",
            )
        # The order of /batch_edit's inputs (BatchTab.run's parameters).
        inputs = [files, instructions, mode, *settings.values(), seed, seed_policy, batch_size, rewrite]
        disable_on_click(run_button)
        run_event = device_run(
            run_button,
            handlers.run,
            inputs,
            [gallery, report, download],
            api_name="batch_edit",
            lane=engine.size,
            progress_on=gallery,
        )
        # The uploads' thumbnails: it decodes a client's files, so it is queued on the small lane.
        files.change(
            handlers.preview_sources,
            [files],
            [sources],
            concurrency_id=SETTINGS_FILE_GROUP,
            concurrency_limit=SETTINGS_FILE_CONCURRENCY,
            show_progress="hidden",
            api_visibility="private",
            preprocess=False,
        )
        stop_on_click(stop_button, handlers.stop)  # the batch keeps the items it finished
    return BatchHandles(
        handlers=handlers,
        inputs=tuple(inputs),
        settings=settings,
        run_button=run_button,
        stop_button=stop_button,
        gallery=gallery,
        report=report,
        download=download,
        runs=((run_button, run_event),),
    )


__all__ = ["build_batch_tab", "BatchTab", "BatchHandles", "BatchRun"]
