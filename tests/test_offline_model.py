"""The offline default: with no weights and no --tiny-profile the app opens on the trained tiny model, says what
it can do, and shows scenes of its world as examples (the random `tiny` stays what tests and code get)."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from hidream_ui.config import OFFLINE_DEFAULT_PROFILE, AppConfig, from_args
from hidream_ui.model.tiny import world
from hidream_ui.ui.layout import TINY_BANNER, offline_banner
from hidream_ui.ui.world_examples import examples_folder, world_examples


def test_the_cli_default_is_the_trained_model_and_code_keeps_the_random_one():
    assert OFFLINE_DEFAULT_PROFILE == "trained"
    assert from_args([], environ={}).tiny_profile == "trained"
    assert from_args([], environ={}).uses_trained_tiny_model
    assert from_args([], environ={"HIDREAM_TINY_PROFILE": "tiny"}).tiny_profile == "tiny"
    assert from_args(["--tiny-profile", "deep"], environ={}).tiny_profile == "deep"
    assert AppConfig().tiny_profile == "tiny" and not AppConfig().uses_trained_tiny_model
    # Real weights: no offline model at all, whatever the profile says.
    assert not from_args(["--model-dir", "/models"], environ={}).uses_trained_tiny_model


def test_the_banner_says_what_the_offline_model_is():
    trained = offline_banner(AppConfig(tiny_profile="trained"))
    assert "trained" in trained and "random" not in trained
    for word in (*world.SHAPES, *world.COLOURS, *world.BACKGROUNDS, "remove the"):
        assert word in trained, word
    assert offline_banner(AppConfig(tiny_profile="tiny")) == TINY_BANNER
    assert offline_banner(AppConfig(tiny_profile="trained", model_dir="/models")) is None


def test_world_examples_are_held_out_scenes_of_every_kind(tmp_path):
    examples = world_examples(AppConfig(tiny_profile="trained"), cache_root=tmp_path)
    cases = world.example_cases()
    assert [instruction for _, instruction in examples] == [case.instruction for case in cases]
    kinds = [case.edit.kind for case in cases]
    assert all(kinds.count(kind) == 2 for kind in world.EDIT_KINDS)
    assert all(case.seed >= world.HELD_OUT_SEED_START for case in cases)
    for (path, _), case in zip(examples, cases):
        assert path.startswith(str(examples_folder(tmp_path)))
        assert np.array_equal(np.asarray(Image.open(path).convert("RGB")), case.source)
    # A second call reuses the files; other models get the bundled examples instead.
    stamp = [(tmp_path / p).stat().st_mtime_ns for p, _ in examples]
    assert world_examples(AppConfig(tiny_profile="trained"), cache_root=tmp_path) == examples
    assert [(tmp_path / p).stat().st_mtime_ns for p, _ in examples] == stamp
    assert world_examples(AppConfig(tiny_profile="tiny"), cache_root=tmp_path) == []


def test_a_read_only_cache_means_no_examples_not_a_crash(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    assert world_examples(AppConfig(tiny_profile="trained"), cache_root=blocker) == []


@pytest.fixture
def trained_services(monkeypatch, tmp_path):
    monkeypatch.setenv("HIDREAM_UI_CACHE", str(tmp_path))
    from hidream_ui.ui.services import AppServices

    return AppServices.for_config(AppConfig(tiny_profile="trained"))


def test_the_upload_gate_accepts_the_world_examples_and_nothing_beside_them(trained_services, tmp_path):
    (path, _), *_ = world_examples(AppConfig(tiny_profile="trained"))
    assert trained_services.gate.allows(path)
    stranger = tmp_path / "other.png"
    Image.new("RGB", (8, 8)).save(stranger)
    assert not trained_services.gate.allows(stranger)
