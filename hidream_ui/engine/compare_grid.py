"""Compare's contact sheet: `grid_layout` says where everything goes, `render_grid` draws it (PIL only).

Axis names on top, the column values as the user wrote them above the columns, the row values to
the left of the rows, each cell scaled to `cell_side` on its long side; cells that did not run (a
cancelled comparison) are grey boxes marked "not run".
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from PIL import Image, ImageDraw, ImageFont

if TYPE_CHECKING:  # pragma: no cover
    from hidream_ui.engine.compare import CompareResult

# Debian's fonts-dejavu-core; PIL's built-in font is the fallback when it is absent.
DEJAVU_SANS = Path("/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf")

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


__all__ = ["GridLayout", "grid_layout", "render_grid"]
