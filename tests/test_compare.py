"""compare: axis parsing and validation, the cell limit, running a grid on the tiny model, the grid image."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import edit_params as params
from helpers import random_picture as picture
from helpers import run_info
from PIL import Image

from hidream_ui.config import AppConfig
from hidream_ui.edits import EditResult, RequestError, Timings
from hidream_ui.engine.compare import (
    CompareResult,
    format_value,
    get_axis,
    grid_layout,
    parse_axis_values,
    plan_compare,
    render_grid,
    run_compare,
)
from hidream_ui.engine.errors import EngineError
from hidream_ui.engine.pool import EnginePool

# ---------------------------------------------------------------------------------------------
# Parsing


@pytest.mark.parametrize(
    "axis, text, expected",
    [
        ("steps", "1,2,3", (1, 2, 3)),
        ("steps", " 4  8 ;12 ", (4, 8, 12)),
        ("guidance", "1.5:4.5:1.0", (1.5, 2.5, 3.5, 4.5)),
        ("guidance", "1.5 : 4.5 : 1", (1.5, 2.5, 3.5, 4.5)),
        ("refine", "0:1:0.1", tuple(round(0.1 * i, 10) for i in range(11))),  # end included despite 0.1 rounding
        ("refine", "0:0.45:0.2", (0.0, 0.2, 0.4)),  # an end between steps is not reached
        ("image_guidance", "2:1:-0.5", (2.0, 1.5, 1.0)),
        ("seed", "7:10", (7, 8, 9, 10)),
        ("seed", "3, 0:1", (3, 0, 1)),
        ("attention", "sdpa, MATH", ("sdpa", "math")),
        ("resolution", "draft, Auto, 512:768:256", ("draft", "auto", "512", "768")),
        ("guidance_scale", [2, "3.5"], (2.0, 3.5)),  # field names and lists work too
    ],
)
def test_parse_axis_values(axis, text, expected):
    assert parse_axis_values(axis, text) == expected


@pytest.mark.parametrize(
    "axis, text, fragment",
    [
        ("attention", "sdpa, flashy", "one of auto, sdpa"),
        ("attention", "sdpa:math", "strategy names"),
        ("steps", "1.5", "whole number"),
        ("steps", "1:4:0.5", "whole numbers"),
        ("guidance", "2, 50", "from 0 to 30"),
        ("refine", "0:2:0.5", "from 0 to 1"),
        ("guidance", "1:3:0", "step that is not 0"),
        ("guidance", "3:1:1", "towards stop"),
        ("guidance", "1:x", "a number"),
        ("seed", "-1", "not -1"),
        ("steps", "4, 4", "listed twice"),
        ("steps", "  ", "at least one value"),
        ("resolution", "500", "multiple of 16"),
        ("seed", "0:100000", "at most 256 values"),
    ],
)
def test_bad_axis_values_name_the_axis(axis, text, fragment):
    with pytest.raises(RequestError) as info:
        parse_axis_values(axis, text)
    message = str(info.value)
    assert message.startswith(f"{get_axis(axis).name} values") and fragment in message


def test_unknown_axis_and_same_axis_twice_are_refused():
    with pytest.raises(RequestError, match="axis: got 'colour'; expected one of seed, guidance"):
        get_axis("colour")
    with pytest.raises(RequestError, match="different axis"):
        plan_compare(params(), "steps", "1,2", "num_inference_steps", "3", max_cells=10)


def test_plan_is_row_major_and_resolves_a_random_seed_once():
    plan = plan_compare(params(seed=-1), "guidance", "2,3,4", "steps", "1,2", max_cells=6)
    assert (plan.rows, plan.cols) == (2, 3)
    assert [(c.row, c.col) for c in plan.cells] == [(r, c) for r in range(2) for c in range(3)]
    assert [(c.params.guidance_scale, c.params.num_inference_steps) for c in plan.cells] == [
        (g, s) for s in (1, 2) for g in (2.0, 3.0, 4.0)
    ]
    seeds = {c.params.seed for c in plan.cells}
    assert len(seeds) == 1 and seeds.pop() >= 0
    with pytest.raises(RequestError, match=r"3 x 2 = 6 cells.*at most 5 cells"):
        plan_compare(params(), "guidance", "2,3,4", "steps", "1,2", max_cells=5)


def test_format_value():
    assert format_value("guidance", 3.0) == "3" and format_value("refine", 0.25) == "0.25"
    assert format_value("attention", "sdpa") == "sdpa" and format_value("steps", 28) == "28"


# ---------------------------------------------------------------------------------------------
# Limits and availability, before any work


@pytest.fixture
def fresh_engine(tmp_path, tiny_cache):
    return EnginePool.for_config(AppConfig(device="cpu", output_dir=tmp_path / "out", max_grid_cells=4))


def test_too_many_cells_are_refused_before_any_work(fresh_engine):
    with pytest.raises(RequestError, match="at most 4 cells"):
        run_compare(fresh_engine, picture(), params(), "seed", "1,2,3", "steps", "1,2")
    assert not fresh_engine.loaded and fresh_engine.counters["edits"] == 0


def test_unavailable_attention_is_refused_before_any_work(fresh_engine):
    # npu_fusion needs an Ascend NPU; this engine runs on the CPU.
    with pytest.raises(RequestError, match="npu_fusion"):
        run_compare(fresh_engine, picture(), params(), "attention", "sdpa, npu_fusion")
    assert not fresh_engine.loaded


# ---------------------------------------------------------------------------------------------
# Running on the tiny model


@pytest.fixture(scope="module")
def engine(tmp_path_factory, tiny_cache):
    eng = EnginePool.for_config(AppConfig(device="cpu", output_dir=tmp_path_factory.mktemp("compare_outputs")))
    eng.load()
    return eng


@pytest.mark.slow
def test_two_by_three_grid_runs_row_major_and_renders_with_labels(engine):
    seen = []
    result = run_compare(
        engine,
        picture(1),
        params(),
        "seed",
        "1,2,3",
        "steps",
        "1,2",
        on_cell=lambda cell, res: seen.append((cell.row, cell.col)),
    )
    assert (result.rows, result.cols) == (2, 3) and len(result.cells) == 6 and not result.cancelled
    assert seen == [(r, c) for r in range(2) for c in range(3)]
    for row, steps in enumerate((1, 2)):
        for col, seed in enumerate((1, 2, 3)):
            cell = result.cell(row, col)
            assert (cell.params.seed, cell.params.num_inference_steps) == (seed, steps)
            assert cell.saved_png.is_file() and cell.image.size == (80, 60)
    # Different settings, different pictures (the grid really varies along both axes).
    assert result.cell(0, 0).image.tobytes() != result.cell(0, 1).image.tobytes()
    assert result.cell(0, 0).image.tobytes() != result.cell(1, 0).image.tobytes()

    grid = render_grid(result, cell_side=120)
    layout = grid_layout(result, cell_side=120)
    assert grid.size == layout.size
    cell_w, cell_h = layout.cell_size
    assert (cell_w, cell_h) == (120, 90)  # 80x60 scaled to 120 on the long side
    width, height = grid.size
    assert width > 3 * cell_w and height > 2 * cell_h
    pixels = np.asarray(grid)
    # Each cell is the result, scaled, at its box.
    for index, box in enumerate(layout.cell_boxes):
        expected = result.cells[index].image.resize((cell_w, cell_h), Image.Resampling.LANCZOS)
        assert np.array_equal(pixels[box[1] : box[3], box[0] : box[2]], np.asarray(expected))
    # Boxes: inside the image, row-major, not overlapping.
    assert all(0 <= x0 < x1 <= width and 0 <= y0 < y1 <= height for x0, y0, x1, y1 in layout.cell_boxes)
    assert layout.cell_boxes[0][0] < layout.cell_boxes[1][0] < layout.cell_boxes[2][0]
    assert layout.cell_boxes[0][3] <= layout.cell_boxes[3][1]

    # Labels: the title line, one column header above each column, one row label left of each row.
    def inked(region) -> bool:
        return bool((np.asarray(region).min(axis=-1) < 100).any())

    top_of_cells = layout.cell_boxes[0][1]
    left_of_cells = layout.cell_boxes[0][0]
    assert inked(pixels[: layout.header_band[1], :])  # "columns: seed   rows: steps"
    for x0, _, x1, _ in layout.cell_boxes[:3]:
        assert inked(pixels[layout.header_band[1] : top_of_cells, x0:x1])
    for row in range(2):
        _, y0, _, y1 = layout.cell_boxes[row * 3]
        assert inked(pixels[y0:y1, :left_of_cells])
    # Nothing drawn where no label belongs: left of the header values, above the row labels.
    assert not inked(pixels[layout.header_band[1] : top_of_cells, :left_of_cells])


@pytest.mark.slow
def test_attention_axis_switches_and_restores(engine, monkeypatch):
    before = engine.primary.attention_request  # e.g. "auto": restored as asked, not as what it resolved to
    resolved = engine.status().attention
    calls = []
    original = engine.primary.set_attention  # the pool's engine the grid is pinned to
    monkeypatch.setattr(engine.primary, "set_attention", lambda name: calls.append(name) or original(name))
    result = run_compare(engine, picture(2), params(num_inference_steps=1), "attention", "math, sdpa")
    assert [c.info.attention for c in result.cells] == ["math", "sdpa"]
    assert calls == ["math", "sdpa"]  # then restored as it was: asked and resolved
    assert engine.primary.attention_request == before and engine.status().attention == resolved
    # Same seed and settings, two exact attention implementations: (nearly) the same picture.
    a, b = (np.asarray(c.image, dtype=np.int16) for c in result.cells)
    assert np.abs(a - b).max() <= 2


@pytest.mark.slow
def test_a_fallen_back_attention_is_restored_after_the_axis(tmp_path, tiny_cache):
    """Started with a strategy this device lacks (flash_attn on a CPU: auto runs instead), a
    comparison over attention must leave the engine as it found it, not on its last cell's
    strategy for every later visitor (re-asking flash_attn fails, so that used to stick)."""
    fallen = EnginePool.for_config(AppConfig(device="cpu", output_dir=tmp_path / "out", attention="flash_attn"))
    fallen.load()
    before = (fallen.primary.attention_request, fallen.status().attention)
    assert before[0] == "flash_attn" and before[1] != "math"
    run_compare(fallen, picture(5), params(num_inference_steps=1), "attention", "math")
    assert (fallen.primary.attention_request, fallen.status().attention) == before


@pytest.mark.slow
def test_attention_is_restored_when_a_cell_fails(engine, monkeypatch):
    before = engine.status().attention
    original = engine.primary.edit  # the pool's engine the grid is pinned to
    count = {"n": 0}

    def flaky(request, on_step=None, *, save=True, cancel=None):
        count["n"] += 1
        if count["n"] == 2:
            raise EngineError("simulated failure in the second cell")
        return original(request, on_step, save=save, cancel=cancel)

    monkeypatch.setattr(engine.primary, "edit", flaky)
    with pytest.raises(EngineError, match="second cell"):
        run_compare(engine, picture(3), params(num_inference_steps=1), "attention", "math, chunked")
    assert engine.status().attention == before


@pytest.mark.slow
def test_stop_keeps_finished_cells_and_the_grid_marks_the_rest(engine):
    from hidream_ui.engine.jobs import CancelToken

    token = CancelToken()
    result = run_compare(
        engine,
        picture(4),
        params(num_inference_steps=1),
        "seed",
        "5, 6, 7",
        on_cell=lambda cell, res: token.cancel(),
        cancel=token,
    )
    assert result.cancelled and len(result.cells) == 1
    assert result.cell(0, 0) is result.cells[0] and result.cell(0, 1) is None
    layout = grid_layout(result, cell_side=64)
    pixels = np.asarray(render_grid(result, cell_side=64))
    x0, y0, x1, y1 = layout.cell_boxes[2]
    region = pixels[y0:y1, x0:x1]
    assert (region == 225).all(axis=-1).mean() > 0.5  # grey "not run" box
    assert (region.min(axis=-1) < 100).any()  # with its text


def test_grid_without_a_y_axis_has_no_row_labels():
    image = picture(5, size=(40, 40))
    plan = plan_compare(params(), "guidance", "2, 3", max_cells=4)
    fake = [
        EditResult(
            image=image,
            source_image=image,
            params=c.params,
            working_size=(256, 256),
            source_size=(40, 40),
            timings=Timings(),
            peak_memory_bytes=None,
            info=run_info(),
        )
        for c in plan.cells
    ]
    result = CompareResult(plan=plan, source_image=image, cells=fake)
    layout = grid_layout(result, cell_side=100)
    assert layout.label_band is None and (result.rows, result.cols) == (1, 2)
    assert render_grid(result, cell_side=100).size == layout.size
    assert result.caption(1) == "guidance scale 3"


def test_a_resolution_the_model_cannot_take_fails_the_grid_before_any_cell(engine):
    finished = []
    edits = engine.counters["edits"]
    with pytest.raises(EngineError, match="choose 'auto' or 'draft'"):
        run_compare(
            engine,
            picture(6),
            params(num_inference_steps=1),
            "resolution",
            "draft, 512",
            on_cell=lambda cell, result: finished.append(cell),
        )
    assert finished == [] and engine.counters["edits"] == edits
