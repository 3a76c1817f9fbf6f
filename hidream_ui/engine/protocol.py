"""`Engine`: the one interface the app, the CLI and the benchmarks hold: an executor of edits.

Executors place jobs on workers (`EditEngine`, engine/engine.py: one device, one loaded model) and
save what the workers return: `EnginePool` in process (one worker per device: `--device` is a pool
of one, `--devices` several) and `RayEngine` over Ray Serve replicas (one worker each). The interface
never hands out a worker or its model: a caller asks a question (`model_facts`, `working_plan`,
`status`) or gives a function to run against the model (`run_exclusive`). Each executor declares its
`capabilities` up front, so the UI shows only what the running executor can do.

`Engine` is an abstract base class in the style of vLLM's executors: what every executor does the
same way is written here once (the save path of an edit, planning a batch, opening an image with the
app's pixel limit); the rest each executor implements.
"""

from __future__ import annotations

import abc
import functools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, TypeVar

if TYPE_CHECKING:  # pragma: no cover
    from hidream_ui.config import AppConfig
    from hidream_ui.edits import EditRequest, EditResult
    from hidream_ui.engine.batch import BatchPlan, BatchRequest, BatchResult
    from hidream_ui.engine.jobs import CancelToken, PreviewFn, StepFn
    from hidream_ui.engine.status import EngineStatus, ModelFacts
    from hidream_ui.results import ResultStore

T = TypeVar("T")


# One name per capability an executor may lack; the UI shows a control only when its executor has it.
CAPABILITY_NAMES = ("compare", "attention", "speed", "local_rewriter", "previews", "batch")


@dataclass(frozen=True)
class Capabilities:
    """What an executor can do, declared up front so the UI shows only what works (nothing is refused
    only after a click). `missing` says, for each capability it lacks, why, in words a visitor reads
    in the System panel (e.g. "Compare needs one engine held for several edits; Ray replicas are
    independent")."""

    compare: bool = True  # the Compare tab: several edits on one held worker, switching attention
    attention: bool = True  # switching the attention implementation at runtime
    speed: bool = True  # switching the step cache / speed preset at runtime
    local_rewriter: bool = True  # the rewriter may run a local VLM on the app's device
    previews: bool = True  # live previews while an edit runs
    batch: bool = True  # the Batch tab
    missing: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in self.missing:
            if name not in CAPABILITY_NAMES:
                raise ValueError(f"capability {name!r}: expected one of {', '.join(CAPABILITY_NAMES)}")
            if getattr(self, name):
                raise ValueError(f"capability {name!r} is declared present and missing at once")
        for name in CAPABILITY_NAMES:
            if not getattr(self, name) and not self.missing.get(name):
                raise ValueError(f"capability {name!r} is missing without a reason for the System panel")

    @classmethod
    def without(cls, **reasons: str) -> "Capabilities":
        """All capabilities but the named ones, each with its reason: `Capabilities.without(compare="...")`."""
        unknown = [name for name in reasons if name not in CAPABILITY_NAMES]
        if unknown:  # checked here: the constructor would only say "unexpected keyword argument"
            raise ValueError(f"capability {unknown[0]!r}: expected one of {', '.join(CAPABILITY_NAMES)}")
        return cls(**{name: False for name in reasons}, missing=dict(reasons))

    def has(self, name: str) -> bool:
        if name not in CAPABILITY_NAMES:
            raise ValueError(f"capability {name!r}: expected one of {', '.join(CAPABILITY_NAMES)}")
        return bool(getattr(self, name))


ALL_CAPABILITIES = Capabilities()


class Engine(abc.ABC):
    """Edits on the app's device(s). Jobs take a cancel token; results come back saved unless asked not to."""

    config: "AppConfig"

    # ------------------------------------------------------------------ what it is
    @property
    @abc.abstractmethod
    def capabilities(self) -> Capabilities:
        """What this executor can do (the UI hides what it cannot, and the System panel says why)."""

    @property
    @abc.abstractmethod
    def size(self) -> int:
        """How many jobs may run at once (the device lane's concurrency): one per worker."""

    @property
    @abc.abstractmethod
    def loaded(self) -> bool: ...

    @property
    @abc.abstractmethod
    def hide_paths(self) -> bool:
        """Results and the status name model folders, never their paths (an app without login)."""

    @property
    @abc.abstractmethod
    def counters(self) -> dict[str, int]: ...

    @property
    def open_image(self) -> Callable:
        """`imaging.open_image` with this app's pixel limit (checked from the header)."""
        from hidream_ui.imaging import open_image

        return functools.partial(open_image, max_pixels=self.config.max_pixels)

    @abc.abstractmethod
    def load(self, on_progress: Callable[[float, str], None] | None = None) -> None:
        """Loads the model on the workers (a caller waits for the first one; later calls return at once)."""

    # ------------------------------------------------------------------ jobs
    def edit(
        self,
        request: "EditRequest",
        on_step: "StepFn | None" = None,
        *,
        save: bool = True,
        cancel: "CancelToken | None" = None,
        on_preview: "PreviewFn | None" = None,
    ) -> "EditResult":
        """One edit on a free worker: step events to `on_step`, live previews to `on_preview` (where
        the executor has them). Saved by `ResultStore` (PNG, sidecar, mask file, parent, retention)
        once the worker is free for the next job, unless `save` is False. Once `cancel` is set the
        edit stops after its current step, raises EditCancelled and saves nothing."""
        from hidream_ui.engine.jobs import CancelToken

        token = cancel or CancelToken()
        result = self._execute(request, on_step, token, on_preview)
        return self._store().save([result], token)[0] if save else result

    def run_batch(
        self,
        batch: "BatchRequest | BatchPlan",
        on_item: Callable | None = None,
        on_step: "StepFn | None" = None,
        *,
        cancel: "CancelToken | None" = None,
    ) -> "BatchResult":
        """A batch (a BatchRequest, planned here before any model work, or the caller's BatchPlan);
        `on_item(item)` as each item finishes; `cancel` stops after the current step and keeps what
        finished. Items keep their planned order in the result."""
        from hidream_ui.engine import batch as batches
        from hidream_ui.engine.jobs import CancelToken

        plan = batches.as_plan(batch, self.open_image, self.config)
        return self._run_plan(plan, on_item, on_step, cancel or CancelToken())

    @abc.abstractmethod
    def run_exclusive(self, state: str, work: Callable[[Any], T], *, cancel: "CancelToken | None" = None) -> T:
        """`work(model)` on a free worker's device under its lock (`state` is what the status shows)."""

    @abc.abstractmethod
    def _execute(
        self, request: "EditRequest", on_step: "StepFn | None", token: "CancelToken", on_preview: "PreviewFn | None"
    ) -> "EditResult":
        """One edit into an unsaved result; the worker is free for the next job when this returns."""

    @abc.abstractmethod
    def _run_plan(
        self, plan: "BatchPlan", on_item: Callable | None, on_step: "StepFn | None", token: "CancelToken"
    ) -> "BatchResult":
        """A planned batch over the workers, each finished chunk saved."""

    def _store(self) -> "ResultStore":
        """Where this executor saves results: the app's --output-dir with its --retention."""
        from hidream_ui.results import ResultStore

        return ResultStore.at(self.config.output_dir, self.config.retention)

    # ------------------------------------------------------------------ settings and facts
    @abc.abstractmethod
    def labels(self) -> list[str]:
        """The labels of the app's device rows (workers or replicas)."""

    @abc.abstractmethod
    def set_attention(self, name: str, engine: str | None = None) -> str: ...

    @abc.abstractmethod
    def attention_of(self, target: str | None = None) -> str: ...

    @abc.abstractmethod
    def attention_choices(self) -> list: ...

    @abc.abstractmethod
    def auto_attention(self) -> str: ...

    @abc.abstractmethod
    def set_speed(self, name: str) -> str: ...

    @abc.abstractmethod
    def model_facts(self) -> "ModelFacts | None":
        """The loaded model's facts as plain data (None while none is loaded, or where the model lives
        elsewhere): never the model itself."""

    @abc.abstractmethod
    def working_plan(self, source_size: tuple[int, int], working_resolution: Any) -> Any: ...

    @abc.abstractmethod
    def working_resolution_choices(self) -> list[str]: ...

    @abc.abstractmethod
    def status(self) -> "EngineStatus": ...


__all__ = ["ALL_CAPABILITIES", "CAPABILITY_NAMES", "Capabilities", "Engine"]
