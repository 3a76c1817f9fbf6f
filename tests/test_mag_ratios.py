"""MagCache's ratios measured on the checkpoint (pipeline/speed/mag_ratios.py): the calibration measures what
diffusers' formula says, per stage; the cache takes each stage's curve; the loader finds a checkpoint's file."""

from __future__ import annotations

import shutil

import pytest
import torch
from helpers import random_picture

from hidream_ui.config import AppConfig
from hidream_ui.device.detect import resolve_device
from hidream_ui.model import layout
from hidream_ui.model.loading import load_model
from hidream_ui.model.sources import ModelError
from hidream_ui.pipeline.guidance import refine_start_step
from hidream_ui.pipeline.speed import mag_calibrate, mag_ratios
from hidream_ui.pipeline.speed.cache import apply_step_cache, step_cache_spec
from hidream_ui.pipeline.speed.mag_ratios import MagRatios

STEPS, STRENGTH = 8, 0.5
SWITCH = refine_start_step(STEPS, STRENGTH)


@pytest.fixture(scope="module")
def pipe(tiny_dir):
    pipeline = load_model(AppConfig(model_dir=tiny_dir), resolve_device("cpu"), torch.float32).pipeline
    yield pipeline
    apply_step_cache(pipeline.transformer, "none")


def _edit(pipe, seed=3):
    return pipe(
        image=random_picture(seed, (64, 64)),
        prompt="make it blue",
        num_inference_steps=STEPS,
        refine_strength=STRENGTH,
        generator=torch.Generator().manual_seed(seed),
        output_type="latent",
    ).images


def _by_hand(pipe, seed=3) -> list[float]:
    """diffusers' calibration formula, measured with plain forward hooks: per call, the residual is the last
    block's image tokens minus the first block's input; the ratio is the mean over tokens (and rows) of
    |residual| / |previous residual|, restarting at 1.0 in each stage."""
    transformer = pipe.transformer
    first, last = transformer.double_stream_blocks[0], transformer.single_stream_blocks[-1]
    inputs, residuals = [], []

    def before(module, args, kwargs):
        inputs.append(kwargs["hidden_states"] if "hidden_states" in kwargs else args[0])

    def after(module, args, kwargs, output):
        image = inputs[-1]
        residuals.append(output[:, : image.shape[1]] - image)

    handles = [
        first.register_forward_pre_hook(before, with_kwargs=True),
        last.register_forward_hook(after, with_kwargs=True),
    ]
    try:
        _edit(pipe, seed)
    finally:
        for handle in handles:
            handle.remove()
    ratios = []
    for index, residual in enumerate(residuals):
        if index in (0, SWITCH):
            ratios.append(1.0)
        else:
            now, before_ = (torch.linalg.norm(r.float(), dim=-1) for r in (residual, residuals[index - 1]))
            ratios.append(float((now / (before_ + 1e-8)).mean()))
    return ratios


@pytest.mark.slow
def test_calibration_measures_each_stage_by_diffusers_formula_and_changes_nothing(pipe):
    exact = _edit(pipe)
    expected = _by_hand(pipe)
    ratios = mag_calibrate.calibrate(pipe, [lambda: _edit(pipe)] * 2, STEPS, STRENGTH)
    assert (ratios.steps, ratios.refine_strength, ratios.cases) == (STEPS, STRENGTH, 2)
    assert len(ratios.edit) == SWITCH and len(ratios.refine) == STEPS - SWITCH
    assert list(ratios.edit) + list(ratios.refine) == pytest.approx(expected, rel=1e-4)
    assert any(abs(v - 1) > 1e-3 for v in ratios.edit[1:])  # something was measured, not the neutral start
    assert not step_cache_spec(pipe.transformer).active  # no cache left behind
    assert torch.equal(_edit(pipe), exact)  # calibrating skipped nothing and left no state


@pytest.mark.slow
def test_the_average_is_per_call_over_the_edits(pipe):
    one = mag_calibrate.calibrate(pipe, [lambda: _edit(pipe, 3)], STEPS, STRENGTH)
    other = mag_calibrate.calibrate(pipe, [lambda: _edit(pipe, 4)], STEPS, STRENGTH)
    both = mag_calibrate.calibrate(pipe, [lambda: _edit(pipe, 3), lambda: _edit(pipe, 4)], STEPS, STRENGTH)
    assert both.edit == pytest.approx([(a + b) / 2 for a, b in zip(one.edit, other.edit)])
    assert both.refine == pytest.approx([(a + b) / 2 for a, b in zip(one.refine, other.refine)])


def _skipped_calls(pipe, ratios: MagRatios) -> int:
    setattr(pipe.transformer, mag_ratios.ATTRIBUTE, ratios)
    try:
        apply_step_cache(pipe.transformer, "magcache:0.06")
        _edit(pipe)
        stats = pipe.step_cache_stats
        return stats.calls - stats.full_calls
    finally:
        apply_step_cache(pipe.transformer, "none")
        delattr(pipe.transformer, mag_ratios.ATTRIBUTE)


@pytest.mark.slow
def test_magcache_takes_the_checkpoints_curve_of_each_stage(pipe):
    # A ratio of 1 accumulates no error (skip as much as MagCache allows: after the stage's first call, 3 in
    # a row); 0.5 exceeds any small threshold at once (never skip). Each stage must read its own curve.
    calm, wild = (1.0,) * 4, (0.5,) * 4
    common = dict(steps=STEPS, refine_strength=STRENGTH, cases=1)
    assert _skipped_calls(pipe, MagRatios(edit=calm, refine=wild, **common)) == 3
    assert _skipped_calls(pipe, MagRatios(edit=wild, refine=calm, **common)) == 3
    assert _skipped_calls(pipe, MagRatios(edit=calm, refine=calm, **common)) == 6
    assert _skipped_calls(pipe, MagRatios(edit=wild, refine=wild, **common)) == 0


@pytest.mark.slow
def test_the_loader_attaches_a_checkpoints_calibration_and_names_a_broken_one(tiny_dir, tmp_path):
    root = tmp_path / "model"
    shutil.copytree(tiny_dir, root)
    folder = root / layout.E11_DIR / "transformer"
    load = lambda: load_model(AppConfig(model_dir=root), resolve_device("cpu"), torch.float32)  # noqa: E731
    assert not hasattr(load().pipeline.transformer, mag_ratios.ATTRIBUTE)  # none: Flux's ratios
    ratios = MagRatios(edit=(1.0, 0.9), refine=(1.0, 0.8), steps=4, refine_strength=0.5, cases=3)
    mag_ratios.write(folder, ratios)
    assert getattr(load().pipeline.transformer, mag_ratios.ATTRIBUTE) == ratios
    (folder / mag_ratios.RATIOS_FILE).write_text('{"edit": [1.0, -2]}')
    with pytest.raises(ModelError, match=mag_ratios.RATIOS_FILE):
        load()


@pytest.mark.parametrize(
    "data, fault",
    [
        ({"edit": [], "refine": [1.0], "steps": 1, "refine_strength": 0.3, "cases": 1}, "edit stage"),
        ({"edit": [1.0], "refine": [0.0], "steps": 2, "refine_strength": 0.3, "cases": 1}, "refine stage"),
        ({"edit": [1.0], "steps": 2, "refine_strength": 0.3, "cases": 1}, "refine"),
        ({"edit": ["x"], "refine": [1.0], "steps": 2, "refine_strength": 0.3, "cases": 1}, "not a MagCache"),
    ],
)
def test_bad_calibrations_are_refused_naming_the_fault(data, fault):
    with pytest.raises(ValueError, match=fault):
        MagRatios.from_json(data, "f.json")


def test_calibrations_round_trip_through_their_file(tmp_path):
    ratios = MagRatios(edit=(1.0, 0.97531), refine=(1.0, 0.5), steps=4, refine_strength=0.5, cases=2)
    assert mag_ratios.read(tmp_path) is None
    mag_ratios.write(tmp_path, ratios)
    assert mag_ratios.read(tmp_path) == ratios
