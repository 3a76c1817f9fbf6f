"""`Engine`: the one interface the app, the CLI and the benchmarks hold.

`EnginePool` implements it, for one device (`--device`, a pool of one) or several (`--devices`);
`EditEngine` is the single-device worker inside a pool. A remote pool (Ray replicas) is one more
implementation: the UI never asks which kind it holds.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Protocol, TypeVar

if TYPE_CHECKING:  # pragma: no cover
    from hidream_ui.config import AppConfig
    from hidream_ui.edits import EditRequest, EditResult
    from hidream_ui.engine.batch import BatchPlan, BatchRequest, BatchResult
    from hidream_ui.engine.engine import EditEngine
    from hidream_ui.engine.jobs import CancelToken, PreviewFn, StepFn
    from hidream_ui.engine.status import EngineStatus
    from hidream_ui.model.loading import LoadedModel

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
        return cls(**{name: False for name in reasons}, missing=dict(reasons))

    def has(self, name: str) -> bool:
        if name not in CAPABILITY_NAMES:
            raise ValueError(f"capability {name!r}: expected one of {', '.join(CAPABILITY_NAMES)}")
        return bool(getattr(self, name))


ALL_CAPABILITIES = Capabilities()


# Not runtime_checkable: isinstance() would read `model`, which raises while nothing is loaded.
class Engine(Protocol):
    """Edits on the app's device(s). Jobs take a cancel token; results come back saved unless asked not to."""

    config: "AppConfig"

    @property
    def capabilities(self) -> Capabilities:
        """What this executor can do (the UI hides what it cannot, and the System panel says why)."""

    @property
    def size(self) -> int:
        """How many jobs may run at once (the device lane's concurrency): one per engine."""

    @property
    def loaded(self) -> bool: ...

    @property
    def hide_paths(self) -> bool:
        """Results and the status name model folders, never their paths (an app without login)."""

    @property
    def counters(self) -> dict[str, int]: ...

    @property
    def open_image(self) -> Callable: ...

    def load(self, on_progress: Callable[[float, str], None] | None = None) -> "LoadedModel": ...

    def edit(
        self,
        request: "EditRequest",
        on_step: "StepFn | None" = None,
        *,
        save: bool = True,
        cancel: "CancelToken | None" = None,
        on_preview: "PreviewFn | None" = None,
    ) -> "EditResult": ...

    def run_batch(
        self,
        batch: "BatchRequest | BatchPlan",
        on_item: Callable | None = None,
        on_step: "StepFn | None" = None,
        *,
        cancel: "CancelToken | None" = None,
    ) -> "BatchResult": ...

    def run_exclusive(self, state: str, work: Callable[[Any], T], *, cancel: "CancelToken | None" = None) -> T: ...

    def pinned(self, cancel: "CancelToken | None" = None) -> AbstractContextManager["EditEngine"]:
        """One engine held for a job of several edits (a comparison switches attention between cells)."""

    def labels(self) -> list[str]: ...

    def set_attention(self, name: str, engine: str | None = None) -> str: ...

    def attention_of(self, target: str | None = None) -> str: ...

    def attention_choices(self) -> list: ...

    def auto_attention(self) -> str: ...

    @property
    def model(self) -> "LoadedModel":
        """A loaded engine's model (EngineError while none is loaded)."""

    def set_speed(self, name: str) -> str: ...

    def working_plan(self, source_size: tuple[int, int], working_resolution: Any) -> Any: ...

    def working_resolution_choices(self) -> list[str]: ...

    def status(self) -> "EngineStatus": ...


__all__ = ["ALL_CAPABILITIES", "CAPABILITY_NAMES", "Capabilities", "Engine"]
