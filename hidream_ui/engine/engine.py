"""EditEngine, the worker: one device and one loaded model.

The worker loads the model, executes one request (or one batch chunk) into unsaved results with step
and preview callbacks and the job's cancel token, runs a function against the model (`run_exclusive`:
the local rewriter's Llama), and reports its status. Executors place jobs on workers and save what
they return: in process (`engine/pool.py`, one worker per device) and on Ray (`engine/ray_serve.py`,
one worker per replica); nothing outside engine/ holds a worker (tests/test_engine_interface.py).

Everything that touches the device (load, edit, batch chunk, attention switch) runs under one lock:
the model is not re-entrant, and `torch.nn.attention.sdpa_kernel` (used by some attention
strategies) is process-global. `status()` never takes that lock, so the UI can poll it while an
edit runs. Attention switching (`worker_attention.py`), sizes (`worker_sizes.py`), the status report
(`worker_status.py`) and the prompt cache (`prompt_cache.py`) live in modules of their own.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import TYPE_CHECKING, Callable, TypeVar

from hidream_ui.config import AppConfig
from hidream_ui.edits import EditRequest, EditResult, Timings
from hidream_ui.engine.errors import EditCancelled, EngineError, OutOfMemory
from hidream_ui.engine.jobs import CancelToken, Preview, PreviewFn, StepFn, StepInfo
from hidream_ui.engine.prompt_cache import PromptCache
from hidream_ui.engine.status import Progress
from hidream_ui.engine.worker_attention import AttentionSwitching
from hidream_ui.engine.worker_sizes import OFFERED_SIDES, WorkingSizes, working_sides
from hidream_ui.engine.worker_status import StatusReporting
from hidream_ui.model.layout import PROMPT_TOKENS
from hidream_ui.model.loading import ProgressFn
from hidream_ui.results import ResultStore

if TYPE_CHECKING:  # pragma: no cover
    from hidream_ui.device.backends import DeviceInfo
    from hidream_ui.engine.batch import BatchPlan, BatchRequest, BatchResult
    from hidream_ui.model.loading import LoadedModel
    from hidream_ui.pipeline.edit_pipeline import PromptEmbeds

logger = logging.getLogger(__name__)
T = TypeVar("T")


class EditEngine(AttentionSwitching, WorkingSizes, StatusReporting):
    """The worker (see the module's docstring)."""

    def __init__(self, config: AppConfig, backends=None, *, hide_paths: bool = False):
        self.config = config
        self._backends = backends
        self._lock = threading.RLock()
        # Cancellation lives on each job's own CancelToken (edit/batch bring one or get a fresh one), never on
        # the engine, so a Stop pressed while idle never cancels the next edit.
        self._model: "LoadedModel | None" = None
        self._device: "DeviceInfo | None" = None
        self._dtype = None
        self._attention_request = config.attention
        self._attention: str | None = None
        self._attention_note: str | None = None
        self._cache = PromptCache(config.prompt_cache_size)
        self._state = "idle"
        self._progress = Progress()
        self._last_error: str | None = None
        # An app without login: results and the status name model folders, never their paths.
        self.hide_paths = hide_paths
        self.results = ResultStore.at(config.output_dir, config.retention)
        # Set by an EnginePool (engine/pool.py): which of its engines this is, saved in every result.
        self.pool_label: str | None = None
        self.counters = {"edits": 0, "text_encoder_calls": 0, "transformer_calls": 0}
        # The live preview's latent -> RGB map, fitted to the loaded model's VAE (pipeline/previews.py).
        self._previewer = None
        from hidream_ui.pipeline.speed.runtime import SpeedRuntime

        self._speed = SpeedRuntime.from_config(config)  # --moe / --compile / --cache (README "Speed modes")

    # ------------------------------------------------------------------ device
    @property
    def device(self) -> "DeviceInfo":
        if self._device is None:
            from hidream_ui.device.backends import DeviceError
            from hidream_ui.device.detect import resolve_device

            try:
                # --placement names the transformer's device: the engine's device.
                spec = dict(self.config.placement).get("transformer", self.config.device)
                self._device = resolve_device(spec, backends=self._backends)
            except DeviceError as exc:
                raise EngineError(str(exc)) from exc
        return self._device

    @property
    def dtype(self):
        if self._dtype is None:
            from hidream_ui.device.backends import DeviceError
            from hidream_ui.device.detect import resolve_dtype

            try:
                self._dtype = resolve_dtype(self.config.dtype, self.device, backends=self._backends)
            except DeviceError as exc:
                raise EngineError(str(exc)) from exc
        return self._dtype

    @property
    def model_source(self) -> str:
        """ "tiny" or "real": the loaded model's kind (a --model-dir can hold a tiny checkpoint),
        before the load what the configuration says."""
        if self._model is not None:
            return self._model.sources.kind
        return "tiny" if self.config.uses_tiny_model else "real"

    @property
    def loaded(self) -> bool:
        return self._model is not None

    @property
    def model(self) -> "LoadedModel":
        if self._model is None:
            raise EngineError("the model is not loaded yet")
        return self._model

    # ------------------------------------------------------------------ load
    def load(self, on_progress: ProgressFn | None = None) -> "LoadedModel":
        """Loads the model once (later calls return at once)."""
        if self._model is not None:
            return self._model
        with self._lock:
            if self._model is not None:
                return self._model
            from hidream_ui.device.runtime import bind_device_to_thread
            from hidream_ui.model.loading import load_model
            from hidream_ui.model.planner import resolve_plan
            from hidream_ui.model.plans import PlanRefused
            from hidream_ui.model.sources import ModelError

            self._state = "loading"
            self._progress = Progress(fraction=0.0, message="starting")

            def progress(fraction: float, message: str) -> None:
                self._progress = Progress(fraction=fraction, message=message)
                if on_progress is not None:
                    on_progress(fraction, message)

            oom = False
            try:
                device, dtype = self.device, self.dtype
                bind_device_to_thread(device, backends=self._backends)
                # The memory plan is decided from the configs and the free memory before any weight is read,
                # so a model that cannot fit is refused with the numbers instead of failing mid-load.
                plan = resolve_plan(self.config, device, dtype, backends=self._backends)
                progress(0.0, f"memory plan {plan.label}: {plan.reason}")
                model = load_model(self.config, device, dtype, on_progress=progress, plan=plan)
                self._model = model
                try:
                    self._apply_attention_at_load()
                    self._apply_speed_at_load()
                except BaseException:
                    # Never leave a half-configured model behind: the next load() would return it as is.
                    self._model = None
                    raise
            except (ModelError, PlanRefused) as exc:
                self._last_error = str(exc)
                raise EngineError(str(exc)) from exc
            except Exception as exc:
                if not self._is_oom(exc):
                    raise
                oom = True  # freed below, once this except block has dropped the traceback
            finally:
                self._state = "idle"
                self._progress = Progress()
            if oom:
                self._free()
                raise EngineError(
                    f"out of memory while loading the model on {self.device.torch_device}: "
                    "try a smaller --memory plan (see `python -m hidream_ui plan`), --weights fp8, "
                    "or another device"
                )
            logger.info("model loaded: %s", model.sources.to_dict())
            return model

    def _apply_speed_at_load(self) -> None:
        """The MoE mode and `--compile blocks` (its warm-up shows as the state "compiling")."""
        from hidream_ui.edits import DEFAULT_NEGATIVE
        from hidream_ui.pipeline.speed.runtime import warm_up_call

        pipe = self._model.pipeline

        def warm_up() -> None:
            self._state = "compiling"
            self._progress = Progress(message="compiling the transformer blocks (first call)")
            plan = self.working_plan((1024, 1024), "auto")
            warm_up_call(pipe, self.encode(DEFAULT_NEGATIVE), plan.working_size)

        self._speed.at_load(pipe.transformer, self.device.type, warm_up)

    def preview_map(self):
        """The live preview's latent -> RGB map, fitted to this model's VAE on the first edit that asks
        for previews (one batched VAE encode, under the engine lock) and kept with the loaded model;
        None with --preview-every 0. Callers that never show previews (the CLI, batches) never fit it."""
        if self.config.preview_every <= 0:
            return None
        if self._previewer is None:
            from hidream_ui.pipeline.previews import fit_latent_rgb

            started = time.perf_counter()
            self._previewer = fit_latent_rgb(self.model.pipeline).to(self.model.device.torch_device)
            logger.info(
                "live preview map fitted in %.2f s (RMS error %.3f)",
                time.perf_counter() - started,
                self._previewer.residual,
            )
        return self._previewer

    @property
    def previewer(self):
        """The fitted latent -> RGB map (None until an edit asked for previews, or with --preview-every 0)."""
        return self._previewer

    def set_speed(self, name: str) -> str:
        """Sets the step cache of the next edits whose settings say "default" (the UI's Speed setting:
        exact, fast, faster, or a `--cache` spec); returns the canonical spec. Raises EngineError
        naming the value. An edit that is running keeps the mode it started with."""
        from hidream_ui.pipeline.speed.settings import cache_unavailable, parse_cache

        try:
            spec = parse_cache(name if isinstance(name, str) else repr(name), "speed")
        except ValueError as exc:
            raise EngineError(str(exc)) from None
        reason = cache_unavailable(spec)  # e.g. dbcache without the optional cache-dit
        if reason:
            raise EngineError(reason)
        self._speed.cache = str(spec)
        return self._speed.cache

    # ------------------------------------------------------------------ edit
    def encode(self, text: str) -> "PromptEmbeds":
        """Embeddings for one text, from the cache when it was seen before."""
        model = self.model
        key = (text, PROMPT_TOKENS, model.sources.to_dict()["i1"], str(model.dtype))

        def compute():
            self.counters["text_encoder_calls"] += 1
            return model.pipeline.encode_text(text)

        return self._cache.get(key, compute)

    def edit(
        self,
        request: EditRequest,
        on_step: StepFn | None = None,
        *,
        save: bool = True,
        cancel: CancelToken | None = None,
        on_preview: PreviewFn | None = None,
    ) -> EditResult:
        """Runs one edit; returns the result (saved with its metadata when `save`).

        `cancel` is the job's token: once set, the edit stops after the current step, raises
        EditCancelled and saves nothing. `on_preview` gets a live `Preview` every
        `config.preview_every` steps, at most PREVIEWS_MAX per edit (none when that is 0); previews
        never change the result.
        """
        token = cancel or CancelToken()
        results = self._run([request], on_step, token=token, on_preview=on_preview)
        # Saved here, after `_run` released the device lock: the next job may start meanwhile.
        return self.results.save(results, token)[0] if save else results[0]

    def _run(
        self,
        requests: list[EditRequest],
        on_step: StepFn | None,
        *,
        token: CancelToken,
        on_preview: PreviewFn | None = None,
    ) -> list[EditResult]:
        """Edits requests that share parameters other than image/instruction/seed in ONE pipeline call.
        Returns the unsaved results (the caller saves them with `self.results`, outside the lock)."""
        from hidream_ui.device.memory import snapshot
        from hidream_ui.device.runtime import bind_device_to_thread, make_generator, reset_peak
        from hidream_ui.geometry import restore_size, to_working_size
        from hidream_ui.pipeline.edit_pipeline import EditInterrupted

        started = time.perf_counter()
        params_list = [r.params.validated().resolve_seed() for r in requests]
        load_seconds = 0.0
        if self._model is None:
            t0 = time.perf_counter()
            self.load()
            load_seconds = time.perf_counter() - t0
        with self._lock:
            model = self.model
            pipe = model.pipeline
            if token.cancelled:  # cancelled while it waited for the lock or the model
                raise EditCancelled("edit cancelled before it started")
            self._state = "editing"
            first = params_list[0]
            # A speed setting with a step cap (`CACHE@S`: a preset measured at fewer steps) runs at most S
            # steps; the params, and so the metadata, record the count that ran.
            steps = self._speed.resolve_cache(first.cache).steps_for(first.num_inference_steps)
            if steps != first.num_inference_steps:
                params_list = [dataclasses.replace(p, num_inference_steps=steps) for p in params_list]
                first = params_list[0]
            total = first.num_inference_steps
            self._progress = Progress(step=0, total=total, stage="edit")
            working = []
            oom_message = None
            try:
                bind_device_to_thread(model.device, backends=self._backends)
                reset_peak(model.device, backends=self._backends)
                for request, params in zip(requests, params_list):
                    plan = self.working_plan(request.image.size, params.working_resolution)
                    working.append((to_working_size(request.image, plan), plan))
                sizes = {image.size for image, _ in working}
                if len(sizes) != 1:
                    raise EngineError(f"one pipeline call needs one working size, got {sorted(sizes)}")
                # Region edits: each mask at its source's size, then through the source's own working plan.
                working_masks = None
                if any(p.mask is not None for p in params_list):
                    from hidream_ui.pipeline.masks import mask_at

                    working_masks = [
                        None
                        if p.mask is None
                        else to_working_size(mask_at(p.mask.image, r.image.size), plan).convert("L")
                        for r, p, (_, plan) in zip(requests, params_list, working)
                    ]
                previewer = self.preview_map() if on_preview is not None else None
                every = 0
                if previewer is not None:  # every K steps, at most PREVIEWS_MAX per edit
                    from hidream_ui.config import PREVIEWS_MAX

                    every = max(self.config.preview_every, -(-total // PREVIEWS_MAX))
                text_seconds = [0.0]

                def embeds(text: str):
                    t0 = time.perf_counter()
                    try:
                        return self.encode(text)
                    finally:
                        text_seconds[0] += time.perf_counter() - t0

                marks: dict[str, float] = {}
                stages: list[str] = []

                def stage_fn(stage: str) -> None:
                    marks.setdefault("denoise_start", time.perf_counter())
                    stages.append(stage)
                    model.use_stage_weights(stage)

                def step_end(pipeline, i, t, tensors):
                    now = time.perf_counter()
                    marks["last_step"] = now
                    self.counters["transformer_calls"] += 1
                    elapsed = now - marks["denoise_start"]
                    done = i + 1
                    stage = "refine" if stages and stages[-1] == "refine" else "edit"
                    eta = elapsed / done * (total - done)
                    self._progress = Progress(step=done, total=total, stage=stage)
                    token.step = done
                    if on_step is not None:
                        on_step(StepInfo(step=done, total=total, stage=stage, elapsed=elapsed, eta=eta))
                    if every and done % every == 0 and done < total and "x0" in tensors and not token.cancelled:
                        # The first image's picture (an edit has one); read only, the latents are untouched.
                        # None once cancelled: the edit ends with this step, nobody waits for a picture.
                        on_preview(Preview(step=done, total=total, image=previewer.image(tensors["x0"][0])))
                    if token.cancelled:  # the pipeline stops before the next step
                        pipeline._interrupt = True
                    return tensors

                generators = [make_generator(p.seed, model.device) for p in params_list]
                cache_spec = self._speed.before_call(pipe.transformer, first.cache)
                params_list = [dataclasses.replace(p, cache=str(cache_spec)) for p in params_list]  # as used
                output = pipe(
                    image=[image for image, _ in working],
                    prompt=[p.instruction for p in params_list],
                    negative_prompt=[p.negative_prompt for p in params_list],
                    guidance_scale=first.guidance_scale,
                    image_guidance_scale=first.image_guidance_scale,
                    num_inference_steps=first.num_inference_steps,
                    refine_strength=first.refine_strength,
                    clip_cfg_norm=first.clip_cfg_norm,
                    collapse_padding=first.collapse_padding,
                    generator=generators,
                    mask=working_masks,
                    prompt_embeds_fn=embeds,
                    stage_fn=stage_fn,
                    callback_on_step_end=step_end,
                    callback_on_step_end_tensor_inputs=("latents", "x0") if every else ("latents",),
                )
                if token.cancelled:  # during the last step (or the decode): a cancelled edit saves nothing
                    raise EditCancelled(f"edit cancelled: {token.reason or 'cancelled'} after the last step")
                finished = time.perf_counter()
                peak = snapshot(model.device, backends=self._backends).peak
            except EditInterrupted as exc:
                raise EditCancelled(f"edit cancelled: {exc}") from exc
            except EngineError:
                raise
            except Exception as exc:
                if not self._is_oom(exc):
                    raise
                size = "x".join(map(str, working[0][0].size)) if working else "?"
                oom_message = (
                    f"out of memory on {model.device.torch_device} editing {len(requests)} image(s) at working "
                    f"size {size}; memory was freed. Try the draft resolution, fewer images per batch, "
                    "or --text-encoders cpu."
                )
            finally:
                self._state = "idle"
                self._progress = Progress()
            if oom_message is not None:
                # Freed here, not in the except block: there the traceback still holds the
                # pipeline's frames and every activation tensor they reference.
                self._free()
                raise OutOfMemory(oom_message)

            denoise_start = marks.get("denoise_start", finished)
            last_step = marks.get("last_step", finished)
            timings = Timings(
                load=round(load_seconds, 4),
                text_encode=round(text_seconds[0], 4),
                prepare=round(denoise_start - started - load_seconds - text_seconds[0], 4),
                denoise=round(last_step - denoise_start, 4),
                per_step=round((last_step - denoise_start) / max(1, total), 4),
                decode=round(finished - last_step, 4),
                total=round(finished - started, 4),
            )
            self.counters["edits"] += len(requests)
            info = dataclasses.replace(self._info(), speed=self._speed.call_info(pipe, cache_spec))
            results = []
            for request, params, (image, _), out in zip(requests, params_list, working, output.images):
                edited, feather = restore_size(out, request.image.size), None
                if params.mask is not None:  # outside the mask (beyond the feather) the source's own pixels
                    from hidream_ui.pipeline.masks import composite, feather_px

                    feather = feather_px(request.image.size, image.size, pipe.vae_scale_factor)
                    edited = composite(edited, request.image, params.mask.image, feather)
                results.append(
                    EditResult(
                        image=edited,
                        source_image=request.image,
                        params=params,
                        working_size=image.size,
                        source_size=request.image.size,
                        timings=timings,
                        peak_memory_bytes=peak,
                        info=dataclasses.replace(info, batch_size=len(requests)),
                        source_name=request.source_name,
                        rewrite=request.rewrite,
                        source_sha256=request.source_sha256,
                        mask_feather=feather,
                    )
                )
            return results

    def run_exclusive(self, state: str, work: Callable[["LoadedModel"], T], *, cancel: CancelToken | None = None) -> T:
        """Runs `work(model)` on the device under the engine lock, the model loaded first: device
        work that is not an edit (the local instruction rewriter runs the Llama). `state` is what
        the status shows meanwhile ("rewriting"); `cancel` is the job's token `work` may
        check. An out-of-memory frees the memory and raises OutOfMemory, as an edit's does.
        """
        from hidream_ui.device.runtime import bind_device_to_thread

        self.load()
        with self._lock:
            model = self.model
            token = cancel or CancelToken()
            if token.cancelled:
                raise EditCancelled(f"{state} cancelled before it started")
            self._state = state
            try:
                bind_device_to_thread(model.device, backends=self._backends)
                return work(model)
            except Exception as exc:
                if not self._is_oom(exc):
                    raise
                # Only out-of-memory gets here; freed below, once this block has dropped the traceback.
            finally:
                self._state = "idle"
            self._free()
            raise OutOfMemory(f"out of memory on {model.device.torch_device} while {state}; memory was freed")

    def run_batch(
        self,
        batch: "BatchRequest | BatchPlan",
        on_item: Callable | None = None,
        on_step: StepFn | None = None,
        *,
        cancel: CancelToken | None = None,
    ) -> "BatchResult":
        """Runs a batch; calls `on_item(item)` as each item finishes (ok or error).

        `batch` is a BatchRequest (planned here: sources opened, items expanded, limits checked,
        all before the model loads) or the BatchPlan the caller already made. Items with the same
        working size go through the transformer together (up to the batch size); each keeps its
        own seed, so the results equal one-by-one edits (see `engine.batch.execute`). The `cancel`
        token stops after the current step and keeps what finished.
        """
        from hidream_ui.engine import batch as batches

        plan = batches.as_plan(batch, self.open_image, self.config)
        self.load()
        # Each pipeline call takes the device lock (`_run`) and each chunk is saved after it is
        # released: the lock is not held across the whole batch.
        return batches.execute(self, plan, cancel or CancelToken(), on_item, on_step)

    @property
    def open_image(self) -> Callable:
        """`imaging.open_image` with this app's pixel limit (checked from the header)."""
        import functools

        from hidream_ui.imaging import open_image

        return functools.partial(open_image, max_pixels=self.config.max_pixels)

    # ------------------------------------------------------------------ memory
    def _is_oom(self, exc: BaseException) -> bool:
        from hidream_ui.device.runtime import is_oom_error

        return is_oom_error(exc)

    def _free(self) -> None:
        from hidream_ui.device.runtime import free_memory

        try:
            free_memory(self.device, backends=self._backends)
        except Exception:  # noqa: BLE001 - freeing is best effort after an OOM; the error is reported anyway
            logger.exception("freeing memory after an out-of-memory error failed")


# The vLLM-style name for what this class is; `EditEngine` stays the public name (tests and benches use it).
Worker = EditEngine

__all__ = [
    "OFFERED_SIDES",
    "EditCancelled",
    "EditEngine",
    "EngineError",
    "OutOfMemory",
    "PromptCache",
    "StepInfo",
    "Worker",
    "working_sides",
]
