"""The synthetic world of issue 22: exact generation (the runtime's scenes, hidream_ui/model/tiny/world.py) and the
success metric (the lab's, hidream_ui/lab/world.py)."""

import numpy as np
import pytest

from hidream_ui.lab import world
from hidream_ui.model.tiny import world as scenes


def test_same_seed_same_case_and_different_seeds_differ():
    a, b = world.make_case(7), world.make_case(7)
    assert a.scene == b.scene and a.edit == b.edit
    assert np.array_equal(a.source, b.source) and np.array_equal(a.target, b.target)
    assert any(world.make_case(s).scene != a.scene for s in range(8, 12))


@pytest.mark.slow
def test_scenes_follow_the_spec():
    kinds_seen = set()
    for seed in range(200):
        case = world.make_case(seed)
        scene, edit = case.scene, case.edit
        assert case.source.shape == (128, 128, 3) and case.source.dtype == np.uint8
        assert 1 <= len(scene.shapes) <= 3
        assert len({s.kind for s in scene.shapes}) == len(scene.shapes)
        for s in scene.shapes:
            assert world.MIN_BOX <= s.size <= world.MAX_BOX
            assert s.x >= 0 and s.y >= 0 and s.x + s.size <= 128 and s.y + s.size <= 128
        for i, a in enumerate(scene.shapes):
            for b in scene.shapes[i + 1 :]:
                assert scenes._boxes_apart(a, b)
        if edit.kind == "recolour":
            old = next(s.colour for s in scene.shapes if s.kind == edit.target)
            assert edit.value != old
        if edit.kind == "background":
            assert edit.value != scene.background
        assert set(edit.instruction.split()) <= set(world.WORDS)
        kinds_seen.add(edit.kind)
    assert kinds_seen == set(world.EDIT_KINDS)


@pytest.mark.slow
def test_exact_answer_succeeds_and_unedited_source_fails():
    for case in world.held_out_cases(60):
        assert case.seed >= world.HELD_OUT_SEED_START
        ok = world.score(case, case.target)
        assert ok["success"], ok
        assert not world.score(case, case.source)["success"], case.instruction


def test_damaging_the_untouched_region_fails_on_psnr():
    case = next(c for c in (world.make_case(s) for s in range(50)) if c.edit.kind == "recolour")
    rng = np.random.default_rng(0)
    noisy = np.clip(case.target.astype(int) + rng.integers(-80, 81, case.target.shape), 0, 255).astype(np.uint8)
    target = world.shape_mask(next(s for s in case.scene.shapes if s.kind == case.edit.target))
    noisy[world.erode(target)] = case.target[world.erode(target)]  # the edited colour itself stays right
    res = world.score(case, noisy)
    assert res["colour_ok"] and res["untouched_psnr_db"] < world.UNTOUCHED_MIN_PSNR_DB and not res["success"]


def test_bad_inputs_name_the_value():
    with pytest.raises(ValueError, match="-1"):
        world.make_case(-1)
    with pytest.raises(ValueError, match=r"\(128, 128\)"):
        world.score(world.make_case(0), np.zeros((128, 128)))


def test_the_lab_draws_the_runtimes_scenes_and_the_runtime_carries_no_ground_truth():
    """One world: the lab's cases are the runtime's `make_case` (the app's examples, training and `bench quality`
    see the same scene for a seed); what judges an edit lives in the lab only."""
    assert world.make_case is scenes.make_case and world.example_cases is scenes.example_cases
    assert world.held_out_cases(2)[1].scene == scenes.make_case(scenes.HELD_OUT_SEED_START + 1).scene
    for name in ("score", "untouched_mask", "held_out_cases", "FLOOR_SEED_START", "erode", "psnr"):
        assert not hasattr(scenes, name), name
    assert scenes.HELD_OUT_SEED_START < world.FLOOR_SEED_START < scenes.EXAMPLE_SEED_START
