"""`EngineStatus`: what the status panel shows and `/status` returns (as `to_dict()`), typed.

Built by the worker's `status()` (engine/worker_status.py) without the engine lock and without a
device sync, so the panel can poll it every 2 s while an edit runs. The UI adds the queue figures
and, for an app without login, hides absolute paths (`ui.system_handlers.SystemHandlers.status`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Sequence

from hidream_ui.device.memory import MemorySnapshot
from hidream_ui.device.telemetry import DeviceTelemetry
from hidream_ui.model.plans import MemoryPlan


@dataclass(frozen=True)
class Progress:
    """Editing: step / total / stage. Loading: fraction (0..1) / message. Idle: all None."""

    step: int | None = None
    total: int | None = None
    stage: str | None = None  # "edit" | "refine"
    fraction: float | None = None
    message: str | None = None


@dataclass(frozen=True)
class PromptCacheStats:
    entries: int
    hits: int
    misses: int


@dataclass(frozen=True)
class WeightSwapStats:
    """The refine stage's second weight set (`--refiner i1`)."""

    tensors: int
    bytes: int
    on_device: bool
    swaps: int
    bytes_copied: int


@dataclass(frozen=True)
class QueueFigures:
    waiting: int
    running: int


@dataclass(frozen=True)
class RewriterStatus:
    """The instruction rewriter (`--rewriter`), when one is configured."""

    backend: str  # "openai" | "local"
    model: str
    timeout: float | None = None  # openai: seconds one answer may take
    lm_head_bytes: int | None = None  # local: memory the Llama LM head takes (known once the model is loaded)
    lm_head_loaded: bool | None = None  # local: loaded (on the first rewrite)
    rewrites: int = 0  # answers from the back end
    cache_hits: int = 0
    failures: int = 0
    last_error: str | None = None


@dataclass(frozen=True)
class DeviceRow:
    """One engine (one device) of the app: the System panel's row and an entry of `/status` `devices`."""

    engine: str  # "npu:1", or "cpu#2" when a device type repeats (--devices cpu,cpu)
    device: str | None
    device_name: str | None
    state: str
    progress: Progress
    loaded: bool
    busy: bool  # running a job of the pool
    jobs: int  # jobs the pool gave it so far
    memory: MemorySnapshot | None  # the allocator's figures (this process)
    telemetry: DeviceTelemetry | None  # what the device reports (npu-smi / NVML / psutil)
    error: str | None = None
    attention: str | None = None  # the strategy this engine runs (engines of a pool may differ)
    node: str | None = None  # the machine it runs on (a Ray replica's node address); None: this process's


@dataclass(frozen=True)
class ModelFacts:
    """What callers outside engine/ may know about a loaded model, as plain data (never the model
    or the worker): `Engine.model_facts()`. The local rewriter names its Llama and sizes its LM head
    from it; benchmarks read the geometry and the memory plan."""

    sources: Any  # model.sources.ModelSources: the folders (or hub ids) it was loaded from
    geometry: Any  # model.geometry.Geometry: image size, token budget, latent multiple
    dtype: str  # "bfloat16", "float32", ...
    element_bytes: int  # bytes per weight element in that dtype
    plan: MemoryPlan | None  # the memory plan it was placed with
    llama_config: dict[str, Any]  # the Llama text encoder's config (vocab_size, hidden_size, ...)


@dataclass(frozen=True)
class EngineStatus:
    state: str  # "idle" | "loading" | "compiling" | "editing" | "rewriting"
    progress: Progress
    loaded: bool
    variant: str
    model_source: str  # "tiny" | "real"
    attention: str
    attention_note: str | None
    refiner: str
    text_encoders: str
    prompt_cache: PromptCacheStats
    counters: dict[str, int] = field(default_factory=dict)
    last_error: str | None = None
    # The device; None (with `device_error`) when it cannot be used.
    device: str | None = None
    device_type: str | None = None
    device_name: str | None = None
    dtype: str | None = None
    memory: MemorySnapshot | None = None
    device_error: str | None = None
    # Once the model is loaded.
    model_paths: dict[str, Any] | None = None
    # The offline profile when model_source is "tiny" (`trained` edits its world; the others are random).
    tiny_profile: str | None = None
    load_seconds: float | None = None
    weight_swap: WeightSwapStats | None = None
    memory_plan: MemoryPlan | None = None  # the plan the model was placed with (model/plans.py)
    # Speed modes (pipeline/speed/runtime.py SpeedRuntime.status): moe, compile, compile_error, cache_default, ...
    speed: dict[str, Any] | None = None
    # Added by the UI.
    queue: QueueFigures | None = None
    rewriter: RewriterStatus | None = None
    # One row per engine/device (engine/pool.py); a single engine gives one row.
    devices: list[DeviceRow] = field(default_factory=list)
    # With --ray: the cluster's totals (address, nodes, resources, available, replicas); None locally.
    cluster: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        """The `/status` JSON."""
        return dataclasses.asdict(self)

    def replace(self, **changes: Any) -> "EngineStatus":
        return dataclasses.replace(self, **changes)

    def following(self, jobs: Sequence[Any]) -> "EngineStatus":
        """This status with the running jobs' own record (`engine.jobs.JobProgress`: what their bars
        show, oldest job first) as its progress and its busy device rows' progress: the summary's bar,
        the panel's state line and the Devices rows then read one record and never disagree (an
        engine's own counter may lag, or sit at 0 in a worker whose figures are cached). Jobs without
        denoising steps (loading, rewriting) leave the status as it is."""
        stepped = [job for job in jobs if job is not None and job.total]
        if not stepped:
            return self
        first = stepped[0]
        stage = "refine" if "refine" in (first.text or "") else "edit"
        progress = Progress(step=first.step or 0, total=first.total, stage=stage)
        rows, queue = [], list(stepped)
        lone = len(self.devices) == 1  # one engine: its job is the running one, whatever its cached row says
        for row in self.devices:
            if queue and (lone or row.busy or row.state == "editing"):
                job = queue.pop(0)
                stage = "refine" if "refine" in (job.text or "") else "edit"
                row = dataclasses.replace(
                    row, state="editing", progress=Progress(step=job.step or 0, total=job.total, stage=stage)
                )
            rows.append(row)
        return self.replace(state="editing", progress=progress, devices=rows)


__all__ = [
    "DeviceRow",
    "EngineStatus",
    "ModelFacts",
    "Progress",
    "PromptCacheStats",
    "QueueFigures",
    "RewriterStatus",
    "WeightSwapStats",
]
