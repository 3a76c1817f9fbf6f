"""Quality comparison: one source and one instruction edited over a grid of settings.

One or two axes (seed, guidance, image guidance, steps, refine strength, attention strategy,
working resolution, speed: the step cache), each with a list of values. Every value is checked -- by
the same rules as a single edit (`EditParams.validated`), by the attention registry, and the cell count against
`AppConfig.max_grid_cells` -- before any model work, so a typo costs nothing. The cells run as
ordinary edits (row-major: y values are rows, x values columns), which keeps every cell's PNG
reproducible from its own metadata; the text encoders run once thanks to the engine's prompt
cache. `render_grid` draws the labelled contact sheet.

Only PIL and the standard library at import; the engine is passed in.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Callable, Sequence

from PIL import Image, ImageDraw, ImageFont

from hidream_ui.edits import (
    SEED_MAX,
    EditParams,
    EditRequest,
    EditResult,
    EditSettings,
    RequestError,
    validated_seed,
)

if TYPE_CHECKING:  # pragma: no cover
    from hidream_ui.engine.engine import EditEngine
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

# Debian's fonts-dejavu-core; PIL's built-in font is the fallback when it is absent.
DEJAVU_SANS = Path("/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf")
# Ranges are expanded before the grid limit is known; this bounds the list itself ("0:1e9:1").
MAX_AXIS_VALUES = 256
# A range's end is included when it is within this fraction of a step (0.1 steps do not add up
# exactly in binary floating point: 0 + 10 * 0.1 is 0.9999999999999999).
_RANGE_TOLERANCE = 1e-9


@dataclass(frozen=True)
class Axis:
    name: str  # what the UI and the API call it
    label: str  # what the grid image says
    field: str | None  # the EditParams field it sets; None for the attention strategy
    kind: str  # "int" | "float" | "resolution" | "attention" | "cache"


AXES = MappingProxyType(
    {
        axis.name: axis
        for axis in (
            Axis("seed", "seed", "seed", "int"),
            Axis("guidance", "guidance scale", "guidance_scale", "float"),
            Axis("image_guidance", "image guidance", "image_guidance_scale", "float"),
            Axis("steps", "steps", "num_inference_steps", "int"),
            Axis("refine", "refine strength", "refine_strength", "float"),
            Axis("attention", "attention", None, "attention"),
            Axis("resolution", "working resolution", "working_resolution", "resolution"),
            Axis(
                "speed", "speed", "cache", "cache"
            ),  # step cache: a preset or any --cache value (settings.CACHE_GRAMMAR)
        )
    }
)
_ALIASES = MappingProxyType({axis.field: axis.name for axis in AXES.values() if axis.field})


def get_axis(name: str | Axis) -> Axis:
    """The axis called `name` (its short name or the EditParams field name)."""
    if isinstance(name, Axis):
        return name
    key = str(name or "").strip().lower().replace("-", "_").replace(" ", "_")
    key = _ALIASES.get(key, key)
    if key not in AXES:
        raise RequestError("axis", name, f"one of {', '.join(AXES)}")
    return AXES[key]


def format_value(axis: Axis | str, value: Any) -> str:
    """How a value is shown on the grid and in captions (2.5, 7, sdpa, draft, 512)."""
    axis = get_axis(axis)
    if axis.kind == "float":
        return f"{float(value):g}"
    return str(value)


# ---------------------------------------------------------------------------------------------
# Parsing and validating axis values
# ---------------------------------------------------------------------------------------------


def parse_axis_values(axis: str | Axis, text: str | Sequence[Any], *, max_values: int = MAX_AXIS_VALUES) -> tuple:
    """The values of one axis, validated.

    `text` lists values separated by commas (or spaces): `1, 2, 3`; numeric axes also take
    inclusive ranges `start:stop[:step]` (`1.5:4.5:1.0` gives 1.5, 2.5, 3.5, 4.5; step 1 when
    omitted; a negative step counts down). Attention takes strategy names, resolution takes
    `auto`, `draft` or a side in px (ranges allowed). A list instead of text is validated the same
    way. Each value passes the single-edit rules (`EditParams.validated`) or the attention
    registry; duplicates are refused. Raises RequestError naming the axis and the bad value.
    """
    axis = get_axis(axis)
    field = f"{axis.name} values"
    if isinstance(text, str):
        tokens = _tokens(text)
    elif text is None:
        tokens = []
    else:
        tokens = list(text)
    if not tokens:
        raise RequestError(field, text, f"at least one value for {axis.name}, e.g. {_example(axis)}")
    raw: list[Any] = []
    for token in tokens:
        if isinstance(token, str) and ":" in token and axis.kind != "cache":  # interval:2 is a value
            raw.extend(_expand_range(axis, field, token, max_values - len(raw)))
        else:
            raw.append(token)
        if len(raw) > max_values:
            raise RequestError(field, text, f"at most {max_values} values on one axis")
    values = tuple(_validate_value(axis, value) for value in raw)
    seen: set = set()
    for value in values:
        if value in seen:
            raise RequestError(field, format_value(axis, value), "each value once (it is listed twice)")
        seen.add(value)
    return values


def _tokens(text: str) -> list[str]:
    # "1.5 : 4.5" -> "1.5:4.5", so ranges survive the split on spaces.
    return [t for t in re.split(r"[,;\s]+", re.sub(r"\s*:\s*", ":", text.strip())) if t]


def value_words(axis: str | Axis, text: Any, values: Sequence[Any]) -> tuple[str, ...]:
    """How the user wrote each value ("exact, fast, faster" rather than "none, interval:2,
    interval:3"): their own words when the text lists the values one by one, else the values as
    `format_value` writes them (a range "0:0.6:0.2" has no word per value)."""
    axis = get_axis(axis)
    tokens = _tokens(text) if isinstance(text, str) else []
    ranges = axis.kind != "cache" and any(":" in token for token in tokens)
    if len(tokens) == len(values) and not ranges:
        return tuple(tokens)
    return tuple(format_value(axis, value) for value in values)


def _example(axis: Axis) -> str:
    return {
        "seed": "1, 2, 3",
        "guidance": "2, 3.5, 5 or 1.5:4.5:1",
        "image_guidance": "1, 1.5, 2",
        "steps": "10, 20, 28",
        "refine": "0:0.6:0.2",
        "attention": "sdpa, math",
        "resolution": "draft, auto, 768",
        "speed": "exact, fast, faster or none, interval:2, taylorseer:2, fbcache:0.1",
    }[axis.name]


def _number(field: str, token: str) -> float:
    try:
        number = float(token)
    except ValueError:
        raise RequestError(field, token, "a number in a range start:stop[:step]") from None
    if not math.isfinite(number):
        raise RequestError(field, token, "a finite number")
    return number


def _expand_range(axis: Axis, field: str, token: str, room: int) -> list:
    if axis.kind == "attention":
        raise RequestError(field, token, "strategy names separated by commas (ranges are for numbers)")
    parts = token.split(":")
    if len(parts) not in (2, 3) or not all(parts):
        raise RequestError(field, token, "a range start:stop or start:stop:step")
    start, stop = _number(field, parts[0]), _number(field, parts[1])
    step = _number(field, parts[2]) if len(parts) == 3 else (1.0 if stop >= start else -1.0)
    integral = axis.kind in ("int", "resolution")
    if integral and not all(float(x).is_integer() for x in (start, stop, step)):
        raise RequestError(field, token, f"whole numbers for {axis.name} (start, stop and step)")
    # Signs, not a product: (stop - start) * step underflows to 0 for tiny values (2e-320:1e-320:1e-320).
    if step == 0 or (stop > start and step < 0) or (stop < start and step > 0):
        raise RequestError(field, token, "a step that is not 0 and goes from start towards stop")
    # The number of steps as a float first: a tiny step (1e-320) or a huge span (-1e308:1e308) gives
    # infinity, which has no integer count; every such range is far over the limit anyway.
    steps = (stop - start) / step
    count = math.floor(steps + _RANGE_TOLERANCE) + 1 if math.isfinite(steps) else None
    if count is None or count > max(room, 0):
        size = count if count is not None and count < 10**6 else "far more"
        raise RequestError(
            field,
            token,
            f"at most {MAX_AXIS_VALUES} values on one axis (this range has {size}: "
            "use a larger step or a shorter range)",
        )
    if integral:
        return [int(start) + i * int(step) for i in range(count)]
    # Computed from the start each time (no running sum), then rounded so 0.1 * 3 shows as 0.3.
    return [_tidy(start + i * step) for i in range(count)]


def _tidy(number: float) -> float:
    return float(f"{number:.12g}") + 0.0  # + 0.0 turns -0.0 into 0.0


def _validate_value(axis: Axis, value: Any) -> Any:
    field = f"{axis.name} values"
    if axis.kind == "attention":
        from hidream_ui.pipeline.attention.registry import get_strategy, strategy_names

        name = str(value).strip().lower()
        try:
            return get_strategy(name).name
        except ValueError:
            raise RequestError(field, value, f"an attention strategy: one of {', '.join(strategy_names())}") from None
    if axis.name == "seed":
        # -1 ("random") would make the cell unreproducible from the grid's labels.
        try:
            seed = validated_seed(value)
        except RequestError as exc:
            raise RequestError(field, value, exc.expected) from None
        if seed < 0:
            raise RequestError(field, value, f"a concrete seed from 0 to {SEED_MAX} (not -1 on a compare axis)")
        return seed
    try:
        checked = EditSettings(**{axis.field: value}).validated()
    except RequestError as exc:
        raise RequestError(field, value, exc.expected) from None
    return getattr(checked, axis.field)


# ---------------------------------------------------------------------------------------------
# Planning
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CompareCell:
    index: int  # row-major
    row: int
    col: int
    x: Any
    y: Any  # None without a y axis
    params: EditParams  # validated, seed resolved
    attention: str | None  # the strategy for this cell, when attention is an axis


@dataclass(frozen=True)
class ComparePlan:
    axis_x: Axis
    values_x: tuple
    axis_y: Axis | None
    values_y: tuple
    cells: tuple[CompareCell, ...]
    # The values as the user wrote them (`value_words`): the grid's headers and the captions.
    words_x: tuple[str, ...] = ()
    words_y: tuple[str, ...] = ()

    def word_x(self, value: Any) -> str:
        return self.words_x[self.values_x.index(value)] if self.words_x else format_value(self.axis_x, value)

    def word_y(self, value: Any) -> str:
        return self.words_y[self.values_y.index(value)] if self.words_y else format_value(self.axis_y, value)

    @property
    def rows(self) -> int:
        return len(self.values_y) if self.axis_y is not None else 1

    @property
    def cols(self) -> int:
        return len(self.values_x)


def plan_compare(
    params: EditParams, axis_x: str | Axis, values_x, axis_y: str | Axis | None = None, values_y=None, *, max_cells: int
) -> ComparePlan:
    """Every cell's settings, checked: axes distinct, values valid, at most `max_cells` cells.

    A shared seed of -1 is resolved once here, so every cell of a grid that does not vary the
    seed uses the same noise (otherwise the grid would compare seeds, not the axis).
    """
    shared = params.validated().resolve_seed()
    x = get_axis(axis_x)
    y = get_axis(axis_y) if axis_y not in (None, "", "none") else None
    if y is not None and y.name == x.name:
        raise RequestError("axis_y", y.name, f"a different axis than x ({x.name}), or none")
    xs = parse_axis_values(x, values_x)
    ys = parse_axis_values(y, values_y) if y is not None else (None,)
    cells_count = len(xs) * len(ys)
    if cells_count > max_cells:
        raise RequestError(
            "grid",
            f"{len(xs)} x {len(ys)} = {cells_count} cells",
            f"at most {max_cells} cells (--max-grid-cells); use fewer values",
        )
    cells = []
    for row, y_value in enumerate(ys):
        for col, x_value in enumerate(xs):
            changes, attention = {}, None
            for axis, value in ((x, x_value), (y, y_value)):
                if axis is None:
                    continue
                if axis.kind == "attention":
                    attention = value
                else:
                    changes[axis.field] = value
            cell_params = dataclasses.replace(shared, **changes).validated()
            cells.append(
                CompareCell(
                    index=len(cells), row=row, col=col, x=x_value, y=y_value, params=cell_params, attention=attention
                )
            )
    return ComparePlan(
        axis_x=x,
        values_x=xs,
        axis_y=y,
        values_y=ys if y is not None else (),
        cells=tuple(cells),
        words_x=value_words(x, values_x, xs),
        words_y=value_words(y, values_y, ys) if y is not None else (),
    )


# ---------------------------------------------------------------------------------------------
# Running
# ---------------------------------------------------------------------------------------------


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


def cell_caption(plan: ComparePlan, cell: CompareCell) -> str:
    """ "guidance scale 3.5 · steps 20" for a cell."""
    text = f"{plan.axis_x.label} {plan.word_x(cell.x)}"
    if plan.axis_y is not None:
        text += f" · {plan.axis_y.label} {plan.word_y(cell.y)}"
    return text


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
    axis the strategy is switched per cell through `engine.set_attention` and the one active
    before is restored afterwards, also when a cell fails. The `cancel` token (also checked
    between two cells) ends the run early; the finished cells are kept and `cancelled` is set.
    A region mask in `params` (`params.mask`) applies to every cell: each keeps the source outside it.
    Other errors propagate (EngineError, OutOfMemory, ...).
    """
    from hidream_ui.engine.errors import EditCancelled
    from hidream_ui.engine.jobs import CancelToken
    from hidream_ui.results import file_sha256

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
    # A pool (--devices) lends one engine for the whole grid: its attention switches stay on that
    # engine, and no other job runs there between a switch and the cell it is for.
    try:
        with engine.pinned(cancel) as engine:
            engine.load()
            for cell in plan.cells:  # a size the model cannot take fails the request before any cell runs
                engine.working_plan(picture.size, cell.params.working_resolution)
            token = cancel or CancelToken()
            previous = engine.attention_state() if uses_attention else None
            results: list[EditResult] = []
            cancelled = False
            try:
                for cell, request in zip(plan.cells, requests):
                    if token.cancelled:
                        cancelled = True
                        break
                    if cell.attention is not None:
                        engine.set_attention(cell.attention)
                    try:
                        result = engine.edit(request, on_step, save=save, cancel=token)
                    except EditCancelled:
                        cancelled = True
                        break
                    results.append(result)
                    if on_cell is not None:
                        on_cell(cell, result)
            finally:
                if uses_attention and previous:
                    try:
                        engine.restore_attention(previous)
                    except Exception:  # noqa: BLE001 - never mask the error that got us here
                        logger.exception("could not restore attention %r after the comparison", previous[0])
            return CompareResult(
                plan=plan,
                source_image=picture,
                cells=results,
                cancelled=cancelled,
                seconds=round(time.perf_counter() - started, 4),
            )
    except EditCancelled:  # while it waited for one of the pool's engines: nothing ran
        return CompareResult(
            plan=plan, source_image=picture, cells=[], cancelled=True, seconds=round(time.perf_counter() - started, 4)
        )


def _check_attention_available(engine: "EditEngine", names: set) -> None:
    statuses = {status.name: status for status in engine.attention_choices()}
    for name in sorted(n for n in names if n):
        status = statuses.get(name)
        if status is not None and not status.available:
            raise RequestError("attention values", name, f"a strategy available here ({name}: {status.reason})")


# ---------------------------------------------------------------------------------------------
# The grid image
# ---------------------------------------------------------------------------------------------

BACKGROUND = (255, 255, 255)
INK = (20, 20, 20)
MISSING = (225, 225, 225)


@dataclass(frozen=True)
class GridLayout:
    size: tuple[int, int]
    cell_size: tuple[int, int]
    font_size: int
    title_xy: tuple[int, int]  # top-left of the axis title line
    header_band: tuple[int, int, int, int]  # box holding the column values
    label_band: tuple[int, int, int, int] | None  # box holding the row values (None: one axis)
    cell_boxes: tuple[tuple[int, int, int, int], ...]  # row-major
    source_box: tuple[int, int, int, int] | None = None  # the source image, left of the first row


def _font(size: int):
    try:
        return ImageFont.truetype(str(DEJAVU_SANS), size)
    except OSError:
        pass
    try:
        return ImageFont.load_default(size=size)  # scalable since Pillow 10.1
    except TypeError:
        return ImageFont.load_default()


def _text_width(font, text: str) -> int:
    left, _, right, _ = font.getbbox(text)
    return int(math.ceil(right - left))


def _fit(font, text: str, width: int) -> str:
    """`text`, cut with an ellipsis to fit `width` pixels (long strategy names in narrow cells)."""
    if _text_width(font, text) <= width:
        return text
    while text and _text_width(font, text + "…") > width:
        text = text[:-1]
    return text + "…"


def _row_labels(result: CompareResult) -> list[str]:
    plan = result.plan
    return [plan.word_y(v) for v in plan.values_y] if plan.axis_y is not None else []


def _title(result: CompareResult) -> str:
    plan = result.plan
    text = f"columns: {plan.axis_x.label}"
    if plan.axis_y is not None:
        text += f"   rows: {plan.axis_y.label}"
    return text


def grid_layout(result: CompareResult, *, cell_side: int = 256, source: bool = False) -> GridLayout:
    """Where everything goes on the grid image; `render_grid` draws exactly this. `source`: a
    column for the source image before the cells (headed "source")."""
    if cell_side < 16:
        raise ValueError(f"cell_side must be at least 16 px (got {cell_side})")
    width, height = result.source_image.size
    scale = cell_side / max(width, height)
    cell_w, cell_h = max(1, round(width * scale)), max(1, round(height * scale))
    font_size = max(12, cell_side // 14)
    font = _font(font_size)
    pad = max(4, font_size // 2)
    line = font_size + pad
    labels = _row_labels(result)
    label_w = (max(_text_width(font, text) for text in labels) + 2 * pad) if labels else 0
    # The row labels fit in at most a cell's width; longer ones are cut when drawn.
    label_w = min(label_w, cell_w)
    left = pad + label_w
    source_x = left
    if source:
        left += cell_w + 2 * pad  # a wider gap sets the source apart from the cells
    top = pad + line + line  # title line, then the column values
    gap = pad
    boxes = []
    for row in range(result.rows):
        for col in range(result.cols):
            x0 = left + col * (cell_w + gap)
            y0 = top + row * (cell_h + gap)
            boxes.append((x0, y0, x0 + cell_w, y0 + cell_h))
    total_w = left + result.cols * (cell_w + gap)
    total_w = max(total_w, pad + _text_width(font, _title(result)) + pad)
    total_h = top + result.rows * (cell_h + gap)
    header = (left, pad + line, left + result.cols * (cell_w + gap) - gap, top - pad // 2)
    band = (pad, top, pad + label_w, top + result.rows * (cell_h + gap) - gap) if labels else None
    source_box = (source_x, top, source_x + cell_w, top + cell_h) if source else None
    return GridLayout(
        size=(total_w, total_h),
        cell_size=(cell_w, cell_h),
        font_size=font_size,
        title_xy=(pad, pad),
        header_band=header,
        label_band=band,
        cell_boxes=tuple(boxes),
        source_box=source_box,
    )


def render_grid(result: CompareResult, *, cell_side: int = 256, source: bool = False) -> Image.Image:
    """The labelled grid: axis names on top, column values (as the user wrote them) above the
    columns, row values to the left of the rows, each cell's image scaled to `cell_side` on its
    long side; with `source`, the source image in a column of its own first. Cells that did not
    run (a cancelled comparison) are grey boxes marked "not run"."""
    layout = grid_layout(result, cell_side=cell_side, source=source)
    font = _font(layout.font_size)
    canvas = Image.new("RGB", layout.size, BACKGROUND)
    draw = ImageDraw.Draw(canvas)
    _place(draw, font, _title(result), (layout.title_xy[0], layout.title_xy[1], layout.size[0], None), "left")
    cell_w, cell_h = layout.cell_size
    plan = result.plan
    if layout.source_box is not None:
        x0, y0, x1, _ = layout.source_box
        _place(
            draw, font, _fit(font, "source", cell_w), (x0, layout.header_band[1], x1, layout.header_band[3]), "center"
        )
        thumb = result.source_image.convert("RGB").resize((cell_w, cell_h), Image.Resampling.LANCZOS)
        canvas.paste(thumb, (x0, y0))
    for col, value in enumerate(plan.values_x):
        x0, _, x1, _ = layout.cell_boxes[col]
        text = _fit(font, plan.word_x(value), cell_w)
        _place(draw, font, text, (x0, layout.header_band[1], x1, layout.header_band[3]), "center")
    if layout.label_band is not None:
        band_x0, _, band_x1, _ = layout.label_band
        pad = max(4, layout.font_size // 2)
        for row, text in enumerate(_row_labels(result)):
            _, y0, _, y1 = layout.cell_boxes[row * result.cols]
            text = _fit(font, text, band_x1 - band_x0 - pad)
            _place(draw, font, text, (band_x0, y0, band_x1 - pad, y1), "right")
    for index, box in enumerate(layout.cell_boxes):
        if index < len(result.cells):
            thumb = result.cells[index].image.convert("RGB").resize((cell_w, cell_h), Image.Resampling.LANCZOS)
            canvas.paste(thumb, box[:2])
        else:
            draw.rectangle(box, fill=MISSING)
            _place(draw, font, _fit(font, "not run", cell_w), box, "center")
    return canvas


def _place(draw: ImageDraw.ImageDraw, font, text: str, box: tuple, align: str) -> None:
    """Draws `text` in `box` (x0, y0, x1, y1; y1 None = top-aligned), vertically centred.

    Positions come from the text's bounding box rather than PIL anchors, which PIL's bitmap
    fallback font does not support.
    """
    left, top, right, bottom = font.getbbox(text)
    x0, y0, x1, y1 = box
    if align == "center":
        x = (x0 + x1 - (right - left)) / 2 - left
    elif align == "right":
        x = x1 - right
    else:
        x = x0 - left
    y = y0 - top if y1 is None else (y0 + y1 - (bottom - top)) / 2 - top
    draw.text((x, y), text, fill=INK, font=font)
