"""Quality comparison: one source and one instruction edited over a grid of settings.

The plan (axes, values, cells, all validated before any model work) is engine/compare_plan.py; the
labelled contact sheet is engine/compare_grid.py. Here the cells run: as ordinary edits on one
worker held for the whole grid (an attention axis switches that worker only, and nobody else's job
runs there between a switch and its cell), which keeps every cell's PNG reproducible from its own
metadata; the text encoders run once thanks to the worker's prompt cache. An executor that cannot
hold a worker (Ray) declares so (`capabilities.compare`) and is refused with its reason.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from PIL import Image

from hidream_ui.edits import EditParams, EditRequest, EditResult, RequestError
from hidream_ui.engine.compare_grid import GridLayout, grid_layout, render_grid
from hidream_ui.engine.compare_plan import (
    AXES,
    Axis,
    CompareCell,
    ComparePlan,
    cell_caption,
    format_value,
    get_axis,
    parse_axis_values,
    plan_compare,
    value_words,
)

if TYPE_CHECKING:  # pragma: no cover
    from hidream_ui.engine.jobs import CancelToken, StepFn
    from hidream_ui.engine.protocol import Engine

__all__ = [
    "AXES",
    "Axis",
    "CompareCell",
    "ComparePlan",
    "CompareResult",
    "GridLayout",
    "get_axis",
    "parse_axis_values",
    "plan_compare",
    "run_compare",
    "grid_layout",
    "render_grid",
    "value_words",
    "format_value",
    "cell_caption",
]

logger = logging.getLogger(__name__)


@dataclass
class CompareResult:
    plan: ComparePlan
    source_image: Image.Image
    cells: list[EditResult]  # finished cells, row-major (a prefix of plan.cells when cancelled)
    cancelled: bool = False
    seconds: float = 0.0

    @property
    def axis_x(self) -> Axis:
        return self.plan.axis_x

    @property
    def axis_y(self) -> Axis | None:
        return self.plan.axis_y

    @property
    def rows(self) -> int:
        return self.plan.rows

    @property
    def cols(self) -> int:
        return self.plan.cols

    def cell(self, row: int, col: int) -> EditResult | None:
        index = row * self.cols + col
        return self.cells[index] if index < len(self.cells) else None

    def caption(self, index: int) -> str:
        return cell_caption(self.plan, self.plan.cells[index])


CellFn = Callable[[CompareCell, EditResult], None]


def run_compare(
    engine: "Engine",
    image,
    params: EditParams,
    axis_x: str | Axis,
    values_x,
    axis_y: str | Axis | None = None,
    values_y=None,
    on_cell: CellFn | None = None,
    *,
    on_step: "StepFn | None" = None,
    source_name: str | None = None,
    save: bool = True,
    cancel: "CancelToken | None" = None,
) -> CompareResult:
    """Edits `image` once per grid cell; returns the cells in row-major order.

    Everything is validated first (values, grid size, attention availability on this device),
    then the model loads and every cell's working size is checked against it, all before the
    first cell runs. `on_cell(cell, result)` is called as each cell finishes. With an attention
    axis the strategy is switched per cell on the worker held for the grid, and the one active
    before is restored afterwards, also when a cell fails. An executor without `capabilities.compare`
    (Ray) is refused at once, with its reason. The `cancel` token (also checked
    between two cells) ends the run early; the finished cells are kept and `cancelled` is set.
    A region mask in `params` (`params.mask`) applies to every cell: each keeps the source outside it.
    Other errors propagate (EngineError, OutOfMemory, ...).
    """
    from hidream_ui.engine.errors import EditCancelled, EngineError
    from hidream_ui.engine.jobs import CancelToken
    from hidream_ui.results import file_sha256

    if not engine.capabilities.compare:  # declared up front: the UI hides the tab, an API caller reads why
        raise EngineError(f"Compare is not available here: {engine.capabilities.missing['compare']}")
    started = time.perf_counter()
    plan = plan_compare(params, axis_x, values_x, axis_y, values_y, max_cells=engine.config.max_grid_cells)
    picture = engine.open_image(image, name=source_name)  # the app's --max-pixels
    # Every cell names the same parent: the source file's bytes when it is a file.
    digest = file_sha256(image) if isinstance(image, (str, os.PathLike)) else None
    requests = [
        EditRequest(image=picture, params=cell.params, source_name=source_name, source_sha256=digest)
        for cell in plan.cells
    ]
    if requests:
        requests[0].validated()  # a mask of another shape than the source: refused before any work
    uses_attention = any(axis is not None and axis.kind == "attention" for axis in (plan.axis_x, plan.axis_y))
    if uses_attention:
        _check_attention_available(engine, {cell.attention for cell in plan.cells})
    token = cancel or CancelToken()
    results: list[EditResult] = []
    cancelled = False
    # The executor lends one worker for the whole grid: its attention switches stay on that worker,
    # and no other job runs there between a switch and the cell it is for.
    try:
        with engine._pinned(token) as worker:
            worker.load()
            for cell in plan.cells:  # a size the model cannot take fails the request before any cell runs
                worker.working_plan(picture.size, cell.params.working_resolution)
            previous = worker.attention_state() if uses_attention else None
            try:
                for cell, request in zip(plan.cells, requests):
                    if token.cancelled:
                        cancelled = True
                        break
                    if cell.attention is not None:
                        worker.set_attention(cell.attention)
                    try:
                        result = worker.edit(request, on_step, save=save, cancel=token)
                    except EditCancelled:
                        cancelled = True
                        break
                    results.append(result)
                    if on_cell is not None:
                        on_cell(cell, result)
            finally:
                if previous:
                    try:
                        worker.restore_attention(previous)
                    except Exception:  # noqa: BLE001 - never mask the error that got us here
                        logger.exception("could not restore attention %r after the comparison", previous[0])
    except EditCancelled:  # while it waited for one of the pool's workers: nothing ran
        cancelled = True
    seconds = round(time.perf_counter() - started, 4)
    return CompareResult(plan=plan, source_image=picture, cells=results, cancelled=cancelled, seconds=seconds)


def _check_attention_available(engine: "Engine", names: set) -> None:
    statuses = {status.name: status for status in engine.attention_choices()}
    for name in sorted(n for n in names if n):
        status = statuses.get(name)
        if status is not None and not status.available:
            raise RequestError("attention values", name, f"a strategy available here ({name}: {status.reason})")
