"""EnginePool: the in-process executor: one worker (EditEngine) per device (`--devices`), or a pool of
one (`--device`). Its surface is the `Engine` interface (engine/protocol.py); it can do everything
that interface declares (`capabilities`: all of them).

Why a pool of whole engines rather than one engine fanning out: each engine owns its model, its
lock and its device, exactly as a single-device app does, so everything that holds for one engine
(loading, attention, memory plans, cancellation, OOM recovery) holds for each, and flags apply to
every engine by construction (each is built from the AppConfig, only the device differs).

* A job goes to an idle engine (the least used first, so a queue spreads evenly); the device lane's
  concurrency equals the pool size (`ui/layout.py`), so N jobs run at once.
* Engines load lazily in the background: the first job starts every engine's load and waits only
  for the engine it got. The loads themselves run one at a time (`model.loading.BUILD_LOCK`:
  from_pretrained patches process-global state), so "parallel" means beside the serving engines.
* A batch spreads its items over the engines (round-robin shares, each run by `engine.batch.execute`
  on one engine, batching within its share) and keeps its stable item order; each result's
  metadata names the engine that ran it (`RunInfo.engine`).
* CPU engines (`--devices cpu,cpu`) split the host's cores: each computing thread sets its own
  intra-op thread count (OpenMP's thread count is per calling thread).
* On NPU/CUDA each engine makes its card current in the computing thread (`bind_device_to_thread`,
  inside EditEngine), so two jobs on two cards never compute on the same one.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator, Sequence

from hidream_ui.config import AppConfig
from hidream_ui.engine.engine import EditEngine
from hidream_ui.engine.errors import EditCancelled, EngineError
from hidream_ui.engine.protocol import ALL_CAPABILITIES, Capabilities, Engine
from hidream_ui.engine.status import DeviceRow, EngineStatus, ModelFacts

if TYPE_CHECKING:  # pragma: no cover
    from hidream_ui.device.telemetry import TelemetrySampler
    from hidream_ui.engine.batch import BatchPlan, BatchResult
    from hidream_ui.engine.jobs import CancelToken

logger = logging.getLogger(__name__)

ALL_ENGINES = "all"  # the attention switch's target meaning every engine of the pool
_STATE_ORDER = ("editing", "rewriting", "loading", "idle")  # the pool's state: the busiest engine's
_WAIT_POLL = 0.2  # seconds between two looks at a job's cancel token while it waits for an engine


def host_cores() -> int:
    """Cores this process may run on (its affinity mask, not the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


@dataclass
class Slot:
    """One engine of the pool and its bookkeeping."""

    index: int
    given_label: str | None  # "npu:1"; "cpu#2" when a device type repeats; None: the device it resolves to
    engine: EditEngine
    threads: int | None = None  # CPU engines: intra-op threads of each computing thread
    busy: bool = False
    jobs: int = 0
    load_error: str | None = None  # why its background load failed (shown in its row until a load succeeds)

    @property
    def label(self) -> str:
        """What its row, its telemetry and the attention switch call it: the `--devices` entry, or for
        a pool of one (`--device auto`), the device it resolved to ("?" while it cannot be used)."""
        if self.given_label is not None:
            return self.given_label
        try:
            return self.engine.device.torch_device
        except EngineError:
            return "?"

    @property
    def failed(self) -> bool:
        """Its background load failed and no load has succeeded since: jobs go elsewhere."""
        return self.load_error is not None and not self.engine.loaded


_SHARED_SAMPLER: "TelemetrySampler | None" = None
_SAMPLER_LOCK = threading.Lock()


def shared_sampler() -> "TelemetrySampler":
    """The process's telemetry sampler: one device has one reading, whoever asks."""
    global _SHARED_SAMPLER
    with _SAMPLER_LOCK:
        if _SHARED_SAMPLER is None:
            from hidream_ui.device.telemetry import TelemetrySampler

            _SHARED_SAMPLER = TelemetrySampler()
        return _SHARED_SAMPLER


def device_row(
    engine: EditEngine,
    label: str | None = None,
    sampler: "TelemetrySampler | None" = None,
    *,
    status: EngineStatus | None = None,
    busy: bool | None = None,
    jobs: int = 0,
    load_error: str | None = None,
) -> DeviceRow:
    """One engine's row for the System panel and `/status` `devices`. Cheap: no lock, no device
    sync (the engine's status), telemetry from the sampler's cache."""
    status = status or engine.status()
    telemetry = None
    label = label or status.device or "?"
    if status.device is not None:
        try:
            telemetry = (sampler or shared_sampler()).read(label, engine.device)
        except EngineError:  # the device cannot be used: the row says why (status.device_error)
            telemetry = None
    return DeviceRow(
        engine=label,
        device=status.device,
        device_name=status.device_name,
        state=status.state,
        progress=status.progress,
        loaded=status.loaded,
        busy=status.state != "idle" if busy is None else busy,
        jobs=jobs,
        memory=status.memory,
        telemetry=telemetry,
        error=status.device_error or load_error or status.last_error,
        attention=status.attention,
    )


def engine_labels(devices: Sequence[str]) -> list[str]:
    """Pool labels: the device string, numbered where it repeats ("cpu#1", "cpu#2")."""
    repeated = {name for name in devices if list(devices).count(name) > 1}
    seen: dict[str, int] = {}
    labels = []
    for name in devices:
        seen[name] = seen.get(name, 0) + 1
        labels.append(f"{name}#{seen[name]}" if name in repeated else name)
    return labels


class EnginePool(Engine):
    """Several workers behind the surface of one (`edit`, `run_batch`, `load`, `status`, ...)."""

    def __init__(
        self,
        config: AppConfig,
        engines: Sequence[EditEngine],
        labels: Sequence[str] | None = None,
        threads: Sequence[int | None] | None = None,
        sampler: "TelemetrySampler | None" = None,
    ):
        if not engines:
            raise EngineError("an engine pool needs at least one engine")
        if labels is None:  # several engines: numbered device names; one: named by the device it resolves to
            labels = engine_labels([e.config.device for e in engines]) if len(engines) > 1 else [None]
        labels = list(labels)
        threads = list(threads or [None] * len(engines))
        self.config = config
        self.slots = [
            Slot(i, label, engine, thread_count)
            for i, (label, engine, thread_count) in enumerate(zip(labels, engines, threads))
        ]
        for slot in self.slots:
            slot.engine.pool_label = slot.given_label if len(self.slots) > 1 else None
        self._cond = threading.Condition()
        self._sampler = sampler
        self._loading_started = False
        self._default_threads: int | None = None  # torch's thread count before the pool set any
        # One pool-wide attention switch at a time (two could leave the engines on different strategies).
        self._attention_lock = threading.Lock()

    @classmethod
    def for_config(
        cls,
        config: AppConfig,
        backends=None,
        *,
        cores: int | None = None,
        hide_paths: bool = False,
        limit: int | None = None,
    ) -> "EnginePool":
        """One engine per device of `config.devices` (or one engine on `config.device`). `all` is
        resolved here (it needs the device survey); named devices resolve lazily, as `--device` does.
        Raises EngineError for a device that cannot be used (only with `all`). `hide_paths`: results
        and the status name model folders, never their paths (an app without login). `limit`: only the
        first that many devices (one CLI edit does not load every card)."""
        from hidream_ui.device.pool_spec import ALL, expand_devices

        def factory(cfg: AppConfig) -> EditEngine:
            return EditEngine(cfg, backends=backends, hide_paths=hide_paths)

        if not config.devices:
            return cls(config, [factory(config)])
        names = list(config.devices)
        if config.devices == (ALL,):
            from hidream_ui.device.backends import DeviceError

            try:
                names = [info.torch_device for info in expand_devices(config.devices, backends=backends)]
            except DeviceError as exc:
                raise EngineError(f"--devices all: {exc}") from exc
        names = names[:limit] if limit else names
        if len(names) == 1:
            return cls(config, [factory(dataclasses.replace(config, devices=(), device=names[0]))])
        engines = [factory(dataclasses.replace(config, devices=(), device=name)) for name in names]
        cpu_engines = sum(1 for name in names if name == "cpu")
        share = max(1, (cores or host_cores()) // cpu_engines) if cpu_engines > 1 else None
        threads = [share if name == "cpu" else None for name in names]
        return cls(config, engines, engine_labels(names), threads)

    # ------------------------------------------------------------------ the pool
    @property
    def size(self) -> int:
        return len(self.slots)

    @property
    def engines(self) -> list[EditEngine]:
        return [slot.engine for slot in self.slots]

    @property
    def primary(self) -> EditEngine:
        """The engine whose facts (model geometry, attention choices) stand for all: every engine
        runs the same model in the same configuration."""
        return self.slots[0].engine

    @contextmanager
    def _threads(self, slot: Slot) -> Iterator[None]:
        """The engine's share of the cores in the calling thread for the block, then the process's
        count again: a gradio worker goes on to other work with it, not with an engine's share, and
        so does every new thread (torch starts one from the last count set anywhere)."""
        if slot.threads is None:
            yield
            return
        import torch

        # Per calling thread under OpenMP (torch's CPU build): each engine's computing thread
        # gets its share of the cores, whichever gradio worker thread it is.
        with self._cond:
            if self._default_threads is None:  # before any engine of this pool set its share
                self._default_threads = torch.get_num_threads()
            default = self._default_threads
        torch.set_num_threads(slot.threads)
        try:
            yield
        finally:
            torch.set_num_threads(default)

    @contextmanager
    def acquire(
        self, cancel: "CancelToken | None" = None, *, slot: Slot | None = None, prefer: int | None = None
    ) -> Iterator[Slot]:
        """An idle engine for the caller's job (waits for one; a cancelled job stops waiting).

        Among idle engines: a loaded one before one still loading, then the least used, then the
        lowest index, so a steady queue spreads its jobs evenly over the cards. An engine whose
        background load failed gets no job while another engine can take it (the job waits
        instead of failing the same way); when every engine failed, a job tries again and reports.
        `slot`: that engine and no other, once it is idle (not counted as a job: an attention switch).
        `prefer`: the index of the engine to take when it is idle (a batch's share i runs on engine i)."""
        wanted = slot
        with self._cond:
            while True:
                idle = [s for s in self.slots if not s.busy and (wanted is None or s is wanted)]
                if wanted is None and not all(s.failed for s in self.slots):
                    idle = [s for s in idle if not s.failed]
                if idle:
                    break
                if cancel is not None and cancel.cancelled:
                    raise EditCancelled("cancelled while waiting for a free device")
                self._cond.wait(_WAIT_POLL)
            slot = min(idle, key=lambda s: (not s.engine.loaded, s.index != prefer, s.jobs, s.index))
            slot.busy = True
            if wanted is None:
                slot.jobs += 1
        try:
            with self._threads(slot):
                yield slot
        finally:
            with self._cond:
                slot.busy = False
                self._cond.notify_all()

    @contextmanager
    def _pinned(self, cancel: "CancelToken | None" = None) -> Iterator[EditEngine]:
        """One idle worker held for a whole job of several edits (a comparison switches attention
        between its cells: on its own worker only, and nobody else's job runs there meanwhile).
        Inside engine/ only (engine/compare.py): the interface never hands out a worker."""
        with self.acquire(cancel) as slot:
            self.start_loading(skip=slot)
            yield slot.engine

    def start_loading(self, skip: Slot | None = None) -> None:
        """Starts the engines' loads (once) in one background thread, in the pool's order. The loads
        run one at a time anyway (the loader's lock); in this order the first job, which gets the
        first engine, waits for that engine's load only, not for the loads of engines that won the
        lock while its own still probed its dtype. Each load makes its device current in that
        thread. `skip`: the engine the caller has just loaded itself (a pool of one then starts no thread)."""
        with self._cond:
            if self._loading_started:
                return
            self._loading_started = True
        slots = [slot for slot in self.slots if slot is not skip]
        if slots:
            self._load_in_background(slots)

    def _load_in_background(self, slots: list[Slot]) -> None:
        def run() -> None:
            for slot in slots:
                threading.current_thread().name = f"hidream-load-{slot.label}"
                self._load_slot(slot)

        threading.Thread(target=run, name="hidream-load", daemon=True).start()

    def _load_slot(self, slot: Slot) -> None:
        try:
            with self._threads(slot):
                slot.engine.load()
        except Exception as exc:  # noqa: BLE001 - reported in the engine's row; its jobs go to the others
            logger.exception("loading the model on %s failed", slot.label)
            with self._cond:
                slot.load_error = f"loading the model failed: {exc}"
                self._cond.notify_all()

    # ------------------------------------------------------------------ Engine interface members
    @property
    def capabilities(self) -> Capabilities:
        """Everything: each worker is in this process, so a job can hold one, switch its attention or
        run the local rewriter on its device."""
        return ALL_CAPABILITIES

    @property
    def loaded(self) -> bool:
        return any(engine.loaded for engine in self.engines)

    def load(self, on_progress=None) -> None:
        """Loads the first engine here (with progress: the caller does not wait without a word for a
        background thread), then starts the others' loads in the background; engines whose
        background load failed try again."""
        slot = self.slots[0]
        try:
            with self._threads(slot):
                slot.engine.load(on_progress=on_progress)
        finally:
            retry = [other for other in self.slots[1:] if other.failed]
            self.start_loading(skip=slot)
            if retry:
                self._load_in_background(retry)

    def _execute(self, request, on_step, token, on_preview):
        """One edit on an idle worker, unsaved: `Engine.edit` saves it once that worker is free for
        the next job (live previews to `on_preview`, see EditEngine.edit)."""
        with self.acquire(token) as slot:
            self.start_loading(skip=slot)  # the others load beside this job; this worker loads in it
            return slot.engine.edit(request, on_step, save=False, cancel=token, on_preview=on_preview)

    def run_exclusive(self, state: str, work, *, cancel: "CancelToken | None" = None):
        """Device work that is not an edit (the local rewriter), on an idle engine."""
        with self.acquire(cancel) as slot:
            self.start_loading(skip=slot)
            return slot.engine.run_exclusive(state, work, cancel=cancel)

    def _run_plan(self, plan: "BatchPlan", on_item, on_step, token: "CancelToken") -> "BatchResult":
        """A batch over the pool: item i goes to share i mod N, each share runs on an idle worker
        (batching within the share); items keep their planned order in the result."""
        pending = [item for item in plan.items if item.status == "pending"]
        shares = [pending[i :: self.size] for i in range(self.size)]
        shares = [share for share in shares if share]
        started = time.perf_counter()
        results: list[Any] = [None] * len(shares)
        failures: list[BaseException] = []

        def run_share(index: int, share: list) -> None:
            try:
                with self.acquire(token, prefer=index) as slot:
                    self.start_loading(skip=slot)  # once, by the first share to get an engine
                    sub = dataclasses.replace(plan, items=share)
                    results[index] = slot.engine.run_batch(sub, on_item, on_step, cancel=token)
            except EditCancelled:
                for item in share:
                    if item.status == "pending":
                        item.status, item.error = "cancelled", "not started: the batch was cancelled"
            except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread below
                failures.append(exc)
                token.cancel(f"another part of the batch failed: {exc}")

        # The first share runs in the calling thread (the job's own), the others in threads joined
        # here before the batch returns: a pool of one starts no thread, none outlives the job.
        threads = [
            threading.Thread(target=run_share, args=(i, share), name=f"hidream-batch-{i}", daemon=True)
            for i, share in enumerate(shares)
            if i > 0
        ]
        for thread in threads:
            thread.start()
        if shares:
            run_share(0, shares[0])
        for thread in threads:
            thread.join()
        if failures:
            raise failures[0]
        return self._merge(plan, [r for r in results if r is not None], time.perf_counter() - started, token)

    @staticmethod
    def _merge(plan: "BatchPlan", parts: list["BatchResult"], seconds: float, token: "CancelToken") -> "BatchResult":
        from hidream_ui.engine.batch import BatchResult

        stats: dict[str, Any] = {"batch_sizes": {}}
        for part in parts:
            for key, value in part.stats.items():
                if key == "batch_sizes":
                    stats["batch_sizes"].update(value)
                else:
                    stats[key] = stats.get(key, 0) + value
        cancelled = token.cancelled or any(part.cancelled for part in parts)
        return BatchResult(
            items=plan.items, rejected=plan.rejected, cancelled=cancelled, seconds=round(seconds, 4), stats=stats
        )

    def slot_for(self, label: str) -> Slot:
        """The engine labelled `label` ("cpu#1", "npu:1"); EngineError naming the labels otherwise."""
        for slot in self.slots:
            if slot.label == label:
                return slot
        known = ", ".join(slot.label for slot in self.slots)
        raise EngineError(f"unknown engine {label!r:.40}: one of {known}, or {ALL_ENGINES!r} for every engine")

    def set_attention(self, name: str, engine: str | None = None) -> str:
        """Switches every engine (`engine` None or "all") or the one labelled `engine`, each once it is
        idle (never in the middle of a job: a comparison holds its engine from its first cell to its
        last), one switch at a time (a one-engine switch never lands between the engines of a pool-wide
        one). Returns the strategy active on the (first) switched engine; an unknown label is refused
        before any engine changes."""
        slots = self.slots if engine is None or engine == ALL_ENGINES else [self.slot_for(engine)]
        resolved = []
        with self._attention_lock:
            for slot in slots:
                with self.acquire(slot=slot):
                    resolved.append(slot.engine.set_attention(name))
        return resolved[0]

    def labels(self) -> list[str]:
        """The labels of the app's device rows (what the telemetry is kept under), without computing
        any status; a pool of one whose device cannot be used has none."""
        return [slot.label for slot in self.slots if slot.given_label is not None or slot.label != "?"]

    def attention_of(self, target: str | None = None) -> str:
        """The strategy active on `target` (an engine's label; None or "all": the first engine's).
        Cheap: the engine's status, no lock."""
        engine = self.primary if target in (None, ALL_ENGINES) else self.slot_for(target).engine
        return engine.status().attention or "auto"

    def set_speed(self, name: str) -> str:
        """The step cache of the next edits, on every engine (it only changes what the next edit asks
        for, so no engine needs to be idle); EngineError naming the value before any engine changes."""
        spec = self.primary.set_speed(name)
        for engine in self.engines[1:]:
            engine.set_speed(spec)
        return spec

    @property
    def hide_paths(self) -> bool:
        """Whether every engine names model folders, never their paths (set at construction)."""
        return all(engine.hide_paths for engine in self.engines)

    @property
    def counters(self) -> dict[str, int]:
        total: dict[str, int] = {}
        for engine in self.engines:
            for key, value in engine.counters.items():
                total[key] = total.get(key, 0) + value
        return total

    # Facts that are the same on every engine (same model, same configuration): the primary's.
    def model_facts(self) -> ModelFacts | None:
        """A loaded worker's model facts (every worker loads the same model); None while none is loaded."""
        for engine in self.engines:
            if engine.loaded:
                return engine.model_facts()
        return None

    def auto_attention(self) -> str:
        """What "auto" attention resolves to on these devices ("?" when it cannot be told yet)."""
        from hidream_ui.pipeline.attention.registry import resolve

        try:
            return resolve("auto", self.primary.device, self.primary.dtype).name
        except Exception as exc:  # noqa: BLE001 - only a label; the switch itself reports errors
            logger.debug("cannot resolve auto attention: %s", exc)
            return "?"

    def attention_choices(self):
        return self.primary.attention_choices()

    def working_plan(self, source_size, working_resolution):
        return self.primary.working_plan(source_size, working_resolution)

    def working_resolution_choices(self) -> list[str]:
        return self.primary.working_resolution_choices()

    # ------------------------------------------------------------------ status
    def device_rows(self, statuses: list[EngineStatus] | None = None) -> list[DeviceRow]:
        """One row per engine; `statuses` (one per slot) when the caller has them already."""
        statuses = statuses or [slot.engine.status() for slot in self.slots]
        return [
            device_row(
                slot.engine,
                slot.label,
                self._sampler,
                status=status,
                busy=slot.busy,
                jobs=slot.jobs,
                load_error=slot.load_error if slot.failed else None,
            )
            for slot, status in zip(self.slots, statuses)
        ]

    def status(self) -> EngineStatus:
        """The primary engine's status with the pool's state (its busiest engine's), summed
        counters and one row per device. Cheap: no lock, no device sync."""
        statuses = [slot.engine.status() for slot in self.slots]  # one snapshot per engine per tick
        rows = self.device_rows(statuses)
        states = [row.state for row in rows]
        state = next((s for s in _STATE_ORDER if s in states), states[0])
        busiest = next(row for row in rows if row.state == state)
        base = statuses[0]
        return base.replace(
            state=state,
            progress=busiest.progress,
            loaded=any(row.loaded for row in rows),
            counters=self.counters,
            devices=rows,
        )


__all__ = ["ALL_ENGINES", "EnginePool", "Slot", "device_row", "engine_labels", "host_cores", "shared_sampler"]
