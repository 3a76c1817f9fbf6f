"""The offline default: with no weights and no --tiny-profile the app opens on the trained tiny model, says what
it can do, and shows scenes of its world as examples (the random `tiny` stays what tests and code get)."""

from __future__ import annotations

import json

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
    monkeypatch.setenv("HIDREAM_MODEL_CACHE", str(tmp_path))
    from hidream_ui.ui.services import AppServices

    return AppServices.for_config(AppConfig(tiny_profile="trained"))


def test_the_upload_gate_accepts_the_world_examples_and_nothing_beside_them(trained_services, tmp_path):
    (path, _), *_ = world_examples(AppConfig(tiny_profile="trained"))
    assert trained_services.gate.allows(path)
    stranger = tmp_path / "other.png"
    Image.new("RGB", (8, 8)).save(stranger)
    assert not trained_services.gate.allows(stranger)


def test_the_banner_quotes_the_held_out_test_recorded_with_the_shipped_weights():
    from hidream_ui.model.tiny import trained
    from hidream_ui.model.tiny.profiles import PROFILES

    measured = trained.held_out_success(trained.asset_dir(PROFILES["trained"].weights_asset))
    assert measured is not None, "assets/tiny_trained/trained.json has no held_out record (train-tiny --eval N)"
    success, cases = measured
    assert 0 <= success <= 1 and cases >= 96
    assert f"{round(100 * success)} % of {cases} held-out edits" in offline_banner(AppConfig(tiny_profile="trained"))


def test_held_out_figures_round_trip_through_trained_json(tmp_path):
    from hidream_ui.model.tiny import trained

    (tmp_path / trained.META_FILE).write_text(json.dumps({"profile": "trained"}))
    assert trained.held_out_success(tmp_path) is None  # nothing recorded: the banner says no number
    trained.record_held_out(tmp_path, {"cases": 96, "success": 0.5, "untouched_psnr_median_db": 24.0}, "cmd")
    meta = json.loads((tmp_path / trained.META_FILE).read_text())
    assert meta["profile"] == "trained" and meta[trained.HELD_OUT_KEY]["command"] == "cmd"
    assert trained.held_out_success(tmp_path) == (0.5, 96)
    assert trained.held_out_success(tmp_path / "missing") is None


def test_train_tiny_eval_only_needs_a_count_and_existing_weights(tmp_path, capsys):
    from hidream_ui.lab.train.cli import main

    for argv, says in (
        ([str(tmp_path), "--eval-only"], "--eval-only needs --eval N"),
        (
            [str(tmp_path), "--init-from", str(tmp_path), "--vae-from", str(tmp_path)],
            "--init-from and --vae-from exclude each other",
        ),
        ([str(tmp_path), "--init-from", str(tmp_path / "nothing")], "--init-from: no trained weights in"),
        ([str(tmp_path), "--lr", "0"], "--lr must be in (0, 1], got 0.0"),
        ([str(tmp_path), "--edit-noise-min", "1"], "--edit-noise-min must be in [0, 1), got 1.0"),
        ([str(tmp_path), "--background-share", "1.5"], "--background-share must be in [0, 1], got 1.5"),
        ([str(tmp_path), "--self-drift", "1.5"], "--self-drift must be in [0, 1], got 1.5"),
        ([str(tmp_path), "--refine-self-drift", "-0.5"], "--refine-self-drift must be in [0, 1], got -0.5"),
        ([str(tmp_path), "--decoder-own", "5"], "--decoder-own samples edits with the weights of --decoder-from DIR"),
        ([str(tmp_path), "--decoder-from", str(tmp_path), "--decoder-own", "-1"], "--decoder-own must be >= 0, got -1"),
        (
            [str(tmp_path), "--decoder-from", str(tmp_path), "--decoder-own-share", "0.5"],
            "--decoder-own-share weighs the latents of --decoder-own N: give --decoder-own",
        ),
        (
            [str(tmp_path), "--decoder-from", str(tmp_path), "--decoder-own", "5", "--decoder-own-share", "0"],
            "--decoder-own-share must be in (0, 1], got 0.0",
        ),
        (
            [str(tmp_path), "--decoder-from", str(tmp_path), "--decoder-own", "5", "--decoder-own-share", "1.5"],
            "--decoder-own-share must be in (0, 1], got 1.5",
        ),
        ([str(tmp_path), "--decoder-lr", "0"], "--decoder-lr must be in (0, 1], got 0.0"),
        ([str(tmp_path), "--vae-locality", "-1"], "--vae-locality must be >= 0, got -1.0"),
        (
            [str(tmp_path), "--vae-locality", "0.1", "--vae-from", str(tmp_path)],
            "--vae-locality weighs a loss of the VAE's training: not with",
        ),
        ([str(tmp_path / "nothing"), "--eval-only", "--eval", "4"], "no trained weights in"),
    ):
        with pytest.raises(SystemExit):
            main(argv)
        assert says in capsys.readouterr().err, argv


def test_edit_noise_min_squeezes_the_edit_noise_levels_and_is_recorded():
    """--edit-noise-min S: every edit-stage noise level in [S, 1], drawn from the same random numbers (the
    default 0 gives exactly the earlier draws, so the shipped weights' command still reproduces them); the
    recorded command names it when it is not the default."""
    import torch

    from hidream_ui.lab.train.run import run_meta
    from hidream_ui.lab.train.schedule import edit_sigmas
    from hidream_ui.lab.train.settings import TrainSettings

    def draws(settings):
        generator = torch.Generator().manual_seed(0)
        return edit_sigmas(settings, lambda n: torch.rand(n, generator=generator))

    plain = TrainSettings(batch=4096)
    raised = TrainSettings(batch=4096, edit_noise_min=0.8)
    low, high = draws(plain), draws(raised)
    assert float(low.min()) < 0.1 and float(high.min()) >= 0.8 and float(high.max()) <= 1.0
    assert torch.allclose(high, 0.8 + 0.2 * low)
    assert torch.equal(low, draws(TrainSettings(batch=4096, edit_noise_min=0.0)))
    assert "--edit-noise-min" not in run_meta(plain, 0.0, 1.0, 0.0, 0.0, 0.0, 0)["command"]
    meta = run_meta(raised, 0.0, 1.0, 0.0, 0.0, 0.0, 0)
    assert " --edit-noise-min 0.8 " in meta["command"] and meta["settings"]["edit_noise_min"] == 0.8


def test_the_vae_locality_loss_charges_latent_change_only_where_no_pixel_changes():
    """vae.still_cells marks the latent cells of each source/target pair where no pixel differs, and
    vae.locality_loss charges the latent change there only, in units of the latent variance; the weight is
    recorded in the command (the refusals: test_train_tiny_eval_only_needs_a_count_and_existing_weights)."""
    import torch

    from hidream_ui.lab import world
    from hidream_ui.lab.train.run import run_meta
    from hidream_ui.lab.train.settings import TrainSettings
    from hidream_ui.lab.train.vae import locality_loss, still_cells

    cases = [c for c in world.held_out_cases(12) if c.edit.kind in ("recolour", "background")][:2]
    images = [im for c in cases for im in (c.source, c.target)]
    still = still_cells(images, (16, 16))
    assert still.shape == (2, 16, 16) and still.any(axis=(1, 2)).all() and not still.all(axis=(1, 2)).any()
    for case, cells in zip(cases, still):
        same = case.source == case.target
        for r, c in zip(*np.nonzero(cells)):  # a still cell: every pixel the same
            assert same[8 * r : 8 * r + 8, 8 * c : 8 * c + 8].all()
    assert still_cells([cases[0].source] * 2, (16, 16)).all()

    z = torch.randn(4, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    z[1], z[3] = z[0], z[2]
    moved = torch.from_numpy(~still)
    only_moved = z.clone()
    only_moved[1] += 5 * moved[0]  # the target's latents change where pixels do: free
    assert float(locality_loss(only_moved, torch.from_numpy(still))) == 0.0
    on_still = z.clone()
    on_still[3] += torch.from_numpy(still[1]).float()  # change where no pixel does: charged
    charged = float(locality_loss(on_still, torch.from_numpy(still)))
    assert charged > 0
    # Scale-free: shrinking every latent does not escape the charge.
    assert abs(float(locality_loss(on_still * 0.01, torch.from_numpy(still))) - charged) < 1e-4 * charged

    meta = run_meta(TrainSettings(vae_locality=0.3), 0.0, 1.0, 0.0, 0.0, 0.0, 0)
    assert " --vae-locality 0.3 " in meta["command"] and meta["settings"]["vae_locality"] == 0.3
    assert "--vae-locality" not in run_meta(TrainSettings(), 0.0, 1.0, 0.0, 0.0, 0.0, 0)["command"]


@pytest.mark.slow
def test_background_share_sets_the_share_of_background_edits_in_the_pool_and_is_recorded():
    """--background-share P: that share of the pool's cases are background edits; without it the pool draws the
    world's mix from the very same seeds as before (the shipped weights' command still reproduces them)."""
    import torch

    from hidream_ui.lab import world
    from hidream_ui.lab.train.data import CasePool, Seeds, world_prompts
    from hidream_ui.lab.train.run import run_meta
    from hidream_ui.lab.train.settings import TrainSettings

    prompt_ids = {p: i for i, p in enumerate(world_prompts())}
    background_ids = {i for p, i in prompt_ids.items() if p.startswith("make the background")}

    def pool(share, size=240):
        return CasePool(
            size, lambda images: images[:, :1, ::32, ::32], Seeds(0), prompt_ids, torch, background_share=share
        )

    def share_of(p):
        return sum(int(i) in background_ids for i in p.prompt) / len(p.prompt)

    plain = pool(None)
    seeds = Seeds(0)
    assert plain.prompt.tolist() == [prompt_ids[world.make_case(seeds.next()).instruction] for _ in range(240)]
    assert 0.2 < share_of(plain) < 0.45
    assert share_of(pool(1.0)) == 1.0 and share_of(pool(0.0)) == 0.0
    assert 0.5 < share_of(pool(0.6)) < 0.7
    weighted = pool(1.0, size=8)
    weighted.refresh(8)  # fresh cases keep the share
    assert share_of(weighted) == 1.0
    meta = run_meta(TrainSettings(background_share=0.6), 0.0, 1.0, 0.0, 0.0, 0.0, 0)
    assert " --background-share 0.6 " in meta["command"] and meta["settings"]["background_share"] == 0.6
    assert "--background-share" not in run_meta(TrainSettings(), 0.0, 1.0, 0.0, 0.0, 0.0, 0)["command"]
