"""`Engine`: the one interface the app, the CLI and the benchmarks hold.

`EnginePool` implements it, for one device (`--device`, a pool of one) or several (`--devices`);
`EditEngine` is the single-device worker inside a pool. A remote pool (Ray replicas) is one more
implementation: the UI never asks which kind it holds.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
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


# Not runtime_checkable: isinstance() would read `model`, which raises while nothing is loaded.
class Engine(Protocol):
    """Edits on the app's device(s). Jobs take a cancel token; results come back saved unless asked not to."""

    config: "AppConfig"

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


__all__ = ["Engine"]
