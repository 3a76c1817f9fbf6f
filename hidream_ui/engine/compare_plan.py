"""Compare's plan: the axes, their values (parsed and validated) and the grid's cells.

One or two axes (seed, guidance, image guidance, steps, refine strength, attention strategy,
working resolution, speed: the step cache), each with a list of values. Every value is checked -- by
the same rules as a single edit (`EditParams.validated`), by the attention registry, and the cell count
against `AppConfig.max_grid_cells` -- before any model work, so a typo costs nothing. Cells are
row-major: y values are rows, x values columns.

Standard library and the app's edit schema only; running the plan is engine/compare.py.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Sequence

from hidream_ui.edits import SEED_MAX, EditParams, EditSettings, RequestError, validated_seed

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


def cell_caption(plan: ComparePlan, cell: CompareCell) -> str:
    """ "guidance scale 3.5 · steps 20" for a cell."""
    text = f"{plan.axis_x.label} {plan.word_x(cell.x)}"
    if plan.axis_y is not None:
        text += f" · {plan.axis_y.label} {plan.word_y(cell.y)}"
    return text


__all__ = [
    "AXES",
    "MAX_AXIS_VALUES",
    "Axis",
    "CompareCell",
    "ComparePlan",
    "cell_caption",
    "format_value",
    "get_axis",
    "parse_axis_values",
    "plan_compare",
    "value_words",
]
