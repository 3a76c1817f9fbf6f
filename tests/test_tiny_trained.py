"""The `trained` tiny profile: its tokenizers know the world's words, `train-tiny` runs and is deterministic,
and the shipped weights (assets/tiny_trained/) materialise into a normal tiny build that loads through the
usual path. CI never trains fully: a few steps prove the loop, the shipped weights prove the result."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from hidream_ui.lab import world
from hidream_ui.model import layout
from hidream_ui.model.tiny import trained
from hidream_ui.model.tiny.build import build_tiny, ensure_tiny, read_marker, tiny_path
from hidream_ui.model.tiny.profiles import PROFILES

ASSET = trained.asset_dir(PROFILES["trained"].weights_asset)


@pytest.fixture(scope="module")
def one_thread():
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def random_trained(tmp_path_factory) -> Path:
    """The trained profile's tree with random weights (what train-tiny starts from)."""
    return build_tiny(tmp_path_factory.mktemp("random_trained") / "model", "trained", 0, trained_weights=False)


def test_profile_words_are_the_world_words():
    assert set(PROFILES["trained"].extra_words) == set(world.WORDS)


def test_every_world_word_is_one_known_token_in_every_tokenizer(random_trained):
    from transformers import AutoTokenizer, CLIPTokenizer

    i1 = random_trained / layout.I1_DIR
    llama = AutoTokenizer.from_pretrained(random_trained / layout.LLAMA_DIR, local_files_only=True)
    clip = CLIPTokenizer.from_pretrained(i1 / "tokenizer", local_files_only=True)
    t5 = AutoTokenizer.from_pretrained(i1 / "tokenizer_3", local_files_only=True)
    for word in world.WORDS:
        # Llama: the word after a space (as inside an instruction) and at the start.
        for text in (" " + word, word):
            ids = llama(text, add_special_tokens=False).input_ids
            assert len(ids) == 1, (text, llama.convert_ids_to_tokens(ids))
        ids = clip(word, add_special_tokens=False).input_ids
        assert len(ids) == 1 and ids[0] != clip.unk_token_id, (word, clip.convert_ids_to_tokens(ids))
        ids = t5(word, add_special_tokens=False).input_ids
        assert len(ids) == 1 and ids[0] != t5.unk_token_id, (word, t5.convert_ids_to_tokens(ids))
    # The whole instruction fits the short prompt length the profile pads to.
    longest = max(world.held_out_cases(50), key=lambda c: len(c.instruction)).instruction
    assert len(llama(longest).input_ids) <= PROFILES["trained"].text_tokens
    assert t5.model_max_length == llama.model_max_length == PROFILES["trained"].text_tokens


def test_random_tiny_profile_keeps_its_vocabulary(tiny_dir):
    """The extra words are the trained profile's own: the random `tiny` build's bytes do not change."""
    from transformers import CLIPTokenizer

    clip = CLIPTokenizer.from_pretrained(tiny_dir / layout.I1_DIR / "tokenizer", local_files_only=True)
    assert len(clip("triangle", add_special_tokens=False).input_ids) > 1


def _train(out: Path, *extra: str) -> None:
    from hidream_ui.lab.train.cli import main

    assert main([str(out), "--steps", "2", "--vae-steps", "2", "--pool", "4", *extra]) == 0


def test_train_tiny_runs_is_deterministic_and_loads_through_the_pipeline(tmp_path, one_thread, random_trained, capsys):
    import torch
    from PIL import Image

    from hidream_ui.config import AppConfig
    from hidream_ui.device.detect import resolve_device
    from hidream_ui.model.loading import load_model

    _train(tmp_path / "a")
    printed = capsys.readouterr().out
    assert "vae step 2/2 loss" in printed and "step 2/2 loss" in printed and "still-cell" not in printed
    _train(tmp_path / "b")
    _train(tmp_path / "c", "--seed", "1")
    weights = {name: (tmp_path / name / trained.WEIGHTS_FILE).read_bytes() for name in "abc"}
    assert weights["a"] == weights["b"]
    assert weights["a"] != weights["c"]
    meta = json.loads((tmp_path / "a" / trained.META_FILE).read_text())
    assert meta["settings"]["steps"] == 2 and meta["transformer_steps_done"] == 2
    assert set(meta["vae"]) == {"scaling_factor", "shift_factor"}

    # Decoder fine-tuning changes the decoder only: the encoder (the transformer's latents) stays as it was.
    from safetensors.torch import load_file

    from hidream_ui.lab.train.cli import main

    assert main([str(tmp_path / "d"), "--decoder-from", str(tmp_path / "a"), "--decoder-steps", "1"]) == 0
    before, after = (load_file(str(tmp_path / n / trained.WEIGHTS_FILE)) for n in "ad")
    assert before.keys() == after.keys()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all(k.startswith("vae/decoder.") for k in changed)

    # --vae-locality W adds the locality loss to the VAE's steps: the same seed gives another VAE, and the loop
    # logs the loss; the weight is in the recorded command.
    _train(tmp_path / "h", "--vae-locality", "1")
    assert "still-cell change" in capsys.readouterr().out
    local = load_file(str(tmp_path / "h" / trained.WEIGHTS_FILE))
    assert any(not torch.equal(before[k], local[k]) for k in before if k.startswith("vae/encoder."))
    assert " --vae-locality 1.0 " in json.loads((tmp_path / "h" / trained.META_FILE).read_text())["command"]

    # --self-drift P: the same seed gives another transformer (its inputs are pulled towards its own estimates),
    # and the share is in the recorded command.
    _train(tmp_path / "s", "--self-drift", "1")
    drifted = load_file(str(tmp_path / "s" / trained.WEIGHTS_FILE))
    assert any(not torch.equal(before[k], drifted[k]) for k in before if k.startswith("transformer/"))
    assert " --self-drift 1.0 " in json.loads((tmp_path / "s" / trained.META_FILE).read_text())["command"]

    # --refine-self-drift P: the refine samples are pulled too, so the same seed gives another transformer than
    # the plain run's and than --self-drift's, and the share is in the recorded command.
    _train(tmp_path / "r", "--refine-self-drift", "1")
    refined = load_file(str(tmp_path / "r" / trained.WEIGHTS_FILE))
    for other in (before, drifted):
        assert any(not torch.equal(other[k], refined[k]) for k in other if k.startswith("transformer/"))
    assert " --refine-self-drift 1.0 " in json.loads((tmp_path / "r" / trained.META_FILE).read_text())["command"]

    # --vae-from reuses an earlier run's VAE as it was (and its latent statistics); the transformer trains anew.
    _train(tmp_path / "e", "--vae-from", str(tmp_path / "a"), "--seed", "1")
    first, reused = (load_file(str(tmp_path / n / trained.WEIGHTS_FILE)) for n in "ae")
    assert all(torch.equal(first[k], reused[k]) for k in first if k.startswith("vae/"))
    assert any(not torch.equal(first[k], reused[k]) for k in first if k.startswith("transformer/"))
    reused_meta = json.loads((tmp_path / "e" / trained.META_FILE).read_text())
    assert reused_meta["vae"] == meta["vae"] and "--vae-from" in reused_meta["command"]

    # --init-from fine-tunes: the transformer starts from that run's weights (0 steps: exactly them) and keeps
    # its VAE and text encoders (another seed's random encoders would change every prompt embedding); the
    # recorded command says so, with the batch settings that differ from the defaults.
    _train(tmp_path / "f", "--init-from", str(tmp_path / "e"), "--steps", "0", "--refine-batch", "3")
    _train(tmp_path / "g", "--init-from", str(tmp_path / "e"), "--seed", "1")
    start, same, tuned = (load_file(str(tmp_path / n / trained.WEIGHTS_FILE)) for n in "efg")
    assert all(torch.equal(start[k], same[k]) for k in start)
    kept = [k for k in start if not k.startswith("transformer/")]
    assert {k.split("/")[0] for k in kept} == {"vae", "clip_l", "clip_g", "t5", "llama"}
    assert all(torch.equal(start[k], tuned[k]) for k in kept)
    assert any(not torch.equal(start[k], tuned[k]) for k in start if k.startswith("transformer/"))
    tuned_meta = json.loads((tmp_path / "f" / trained.META_FILE).read_text())
    assert f"--init-from {tmp_path / 'e'} --refine-batch 3 " in tuned_meta["command"]
    assert tuned_meta["settings"]["refine_batch"] == 3
    # ... and how the weights it started from were made, since the folder it names may be gone.
    assert tuned_meta["init_from"] == {"command": reused_meta["command"], "train_seconds": reused_meta["train_seconds"]}

    # The written weights lay over the profile's build and load with the app's loader.
    root = build_tiny(tmp_path / "model", "trained", 0, trained_weights=False)
    trained.overlay(root, tmp_path / "a")
    loaded = load_model(AppConfig(model_dir=root), resolve_device("cpu"), torch.float32)
    case = world.make_case(world.HELD_OUT_SEED_START)
    image = loaded.pipeline(
        Image.fromarray(case.source),
        case.instruction,
        num_inference_steps=2,
        generator=torch.Generator().manual_seed(0),
    ).images[0]
    assert image.size == (world.SIZE, world.SIZE)


def test_a_recorded_magcache_calibration_lands_where_the_loader_looks(tmp_path, random_trained):
    import shutil

    from hidream_ui.pipeline.speed import mag_ratios

    asset, root = tmp_path / "asset", tmp_path / "model"
    shutil.copytree(ASSET, asset)
    shutil.copytree(random_trained, root)
    ratios = mag_ratios.MagRatios(edit=(1.0, 0.98, 0.97), refine=(1.0, 0.9), steps=5, refine_strength=0.4, cases=2)
    trained.record_mag_ratios(asset, ratios.to_json(), "python -m hidream_ui train-tiny OUT --calibrate-magcache 2")
    assert trained.read_meta(asset)[trained.MAG_RATIOS_KEY]["command"].endswith("--calibrate-magcache 2")
    trained.overlay(root, asset)
    assert mag_ratios.read(root / layout.E11_DIR / "transformer") == ratios


def test_overlay_refuses_weights_that_do_not_fit(tmp_path, random_trained):
    import shutil

    from safetensors.torch import load_file, save_file

    _asset = tmp_path / "asset"
    shutil.copytree(ASSET, _asset)
    tensors = load_file(str(_asset / trained.WEIGHTS_FILE))
    dropped = sorted(k for k in tensors if k.startswith("transformer/"))[0]
    del tensors[dropped]
    save_file(tensors, str(_asset / trained.WEIGHTS_FILE))
    copy = tmp_path / "model"
    shutil.copytree(random_trained, copy)
    with pytest.raises(KeyError, match=dropped.split("/", 1)[1]):
        trained.overlay(copy, _asset)


def test_shipped_weights_are_small_bf16_and_cover_every_part():
    from safetensors import safe_open

    files = sorted(p for p in ASSET.iterdir() if p.is_file())
    assert sum(p.stat().st_size for p in files) <= 8 * 1024 * 1024
    with safe_open(str(ASSET / trained.WEIGHTS_FILE), framework="pt") as handle:
        keys = list(handle.keys())
        assert all(str(handle.get_slice(k).get_dtype()) == "BF16" for k in keys)
    assert {k.split("/")[0] for k in keys} == {"llama", "clip_l", "clip_g", "t5", "vae", "transformer"}


def test_ensure_tiny_materialises_the_shipped_weights(tmp_path, offline_hub):
    import torch
    from safetensors.torch import load_file

    root = ensure_tiny("trained", 0, cache_root=tmp_path)
    assert root == tiny_path("trained", 0, cache_root=tmp_path)
    assert trained.asset_digest(ASSET) in root.name  # new weights, new cache entry
    assert read_marker(root).profile == "trained"
    shipped = load_file(str(ASSET / trained.WEIGHTS_FILE))
    for relative in (f"{layout.E11_DIR}/transformer", f"{layout.I1_DIR}/transformer", f"{layout.I1_DIR}/vae"):
        part = trained.PART_FOLDERS[relative]
        for path in (root / relative).glob("*.safetensors"):
            for key, value in load_file(str(path)).items():
                assert torch.equal(value, shipped[f"{part}/{key}"]), (path, key)
    vae = json.loads((root / layout.I1_DIR / "vae" / "config.json").read_text())
    meta = trained.read_meta(ASSET)
    assert (vae["scaling_factor"], vae["shift_factor"]) == (meta["vae"]["scaling_factor"], meta["vae"]["shift_factor"])
    lora = load_file(str(root / layout.E1_FULL_DIR / layout.E1_FULL_FILE))
    assert all(not v.any() for k, v in lora.items() if ".lora_B." in k)  # E1-Full runs the same trained model
    # A MagCache calibration goes with the weights (none shipped: it measured worse than Flux's curve).
    from hidream_ui.pipeline.speed import mag_ratios

    assert (mag_ratios.read(root / layout.E11_DIR / "transformer") is None) == (trained.MAG_RATIOS_KEY not in meta)
    digest = hashlib.sha256(
        (root / layout.E11_DIR / "transformer" / "diffusion_pytorch_model.safetensors").read_bytes()
    ).hexdigest()
    assert ensure_tiny("trained", 0, cache_root=tmp_path) == root  # cached: not rebuilt
    assert (
        hashlib.sha256(
            (root / layout.E11_DIR / "transformer" / "diffusion_pytorch_model.safetensors").read_bytes()
        ).hexdigest()
        == digest
    )


@pytest.fixture
def offline_hub(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def test_the_copy_heads_start_out_looking_at_the_source_token_of_each_target_token():
    """make_transformer's copy heads: from step one, each copy head of the first double block puts most of its
    attention on the source token at the same place (W patches to the right) for every target token."""
    import math

    import torch
    from diffusers.models.transformers.transformer_hidream_image import apply_rope

    from hidream_ui.lab.train.model import copy_heads, make_transformer

    spec = PROFILES["trained"]
    model = make_transformer(spec, 2)
    attention = model.double_stream_blocks[0].block.attn1
    rows = spec.max_resolution[0] // spec.patch_size
    columns = spec.max_resolution[1] // spec.patch_size
    ids = torch.zeros(rows * 2 * columns, 3)
    ids[:, 1] = torch.arange(rows).repeat_interleave(2 * columns)
    ids[:, 2] = torch.arange(2 * columns).repeat(rows)
    with torch.no_grad():
        hidden = torch.nn.functional.layer_norm(torch.randn(1, len(ids), spec.inner_dim), (spec.inner_dim,))
        heads, dim = spec.num_attention_heads, spec.attention_head_dim
        query = attention.q_rms_norm(attention.to_q(hidden)).view(1, -1, heads, dim)
        key = attention.k_rms_norm(attention.to_k(hidden)).view(1, -1, heads, dim)
        query, key = apply_rope(query, key, model.pe_embedder(ids[None]))
        scores = torch.einsum("bnhd,bmhd->bhnm", query, key)[0] / math.sqrt(dim)
    targets = [r * 2 * columns + c for r in range(rows) for c in range(columns)]
    assert 1 <= copy_heads(spec) < heads
    for head in range(copy_heads(spec)):
        weights = scores[head].softmax(-1)
        on_source = torch.stack([weights[t, t + columns] for t in targets])
        assert all(int(weights[t].argmax()) == t + columns for t in targets), head
        assert float(on_source.mean()) > 0.9 and float(on_source.min()) > 0.7, head
    # The other heads start free: nothing pins them to the source token.
    free = scores[copy_heads(spec)].softmax(-1)
    assert float(torch.stack([free[t, t + columns] for t in targets]).mean()) < 0.5
    gate = model.double_stream_blocks[0].block.adaLN_modulation[-1].bias.view(12, -1)[2]
    assert torch.equal(gate, torch.ones_like(gate))  # the block's attention reaches the stream from step one


def test_the_oracle_put_on_the_target_after_the_last_step_returns_the_target():
    """train-tiny --oracle K: after the last step the noise level is 0, so the latents put there are the
    target's own and the edit succeeds whatever the transformer did: the output is the VAE's round trip of the
    target, to the hundredth of a dB; with nothing put (-1) it is the model's."""
    import torch

    from hidream_ui.lab.scoring import eval_pipeline
    from hidream_ui.lab.train.decoder import round_trip
    from hidream_ui.lab.train.evaluate import oracle

    results = oracle(ASSET, 3, [3, -1], log=lambda line: None, num_inference_steps=4)
    with eval_pipeline(ASSET) as pipeline:
        vae = round_trip(pipeline.vae.float(), world.held_out_cases(3), torch)
    assert results[3]["success"] == 1.0 and vae["success"] == 1.0
    assert results[3]["untouched_psnr_median_db"] == pytest.approx(vae["untouched_psnr_median_db"], abs=0.01)
    assert results[3]["untouched_psnr_median_db"] > world.UNTOUCHED_MIN_PSNR_DB
    assert results[-1]["untouched_psnr_median_db"] < results[3]["untouched_psnr_median_db"]


def test_eval_grid_draws_source_target_and_result_with_the_verdict(tmp_path, capsys):
    """train-tiny --eval N --grid PNG: a row per case (source | target | result | strip), the strip green
    exactly for the cases the recorded figures count as successes."""
    import shutil

    import numpy as np
    from PIL import Image

    from hidream_ui.lab.train.cli import main
    from hidream_ui.lab.train.evaluate import GRID_STRIP

    out = tmp_path / "w"
    shutil.copytree(ASSET, out)
    assert main([str(out), "--eval-only", "--eval", "3", "--grid", str(tmp_path / "g" / "grid.png")]) == 0
    grid = np.asarray(Image.open(tmp_path / "g" / "grid.png").convert("RGB"))
    side = world.SIZE
    assert grid.shape == (3 * side, 3 * side + GRID_STRIP, 3)
    cases = world.held_out_cases(3)
    for row, case in enumerate(cases):
        band = grid[row * side : (row + 1) * side]
        assert np.array_equal(band[:, :side], case.source) and np.array_equal(band[:, side : 2 * side], case.target)
        assert not np.array_equal(band[:, 2 * side : 3 * side], case.target)  # the model's, not a copy of the answer
    strips = [tuple(grid[row * side + side // 2, -1]) for row in range(3)]
    assert set(strips) <= {(40, 170, 60), (220, 40, 40)}
    held_out = json.loads((out / trained.META_FILE).read_text())["held_out"]
    assert strips.count((40, 170, 60)) == round(held_out["success"] * 3)
    assert "wrote" in capsys.readouterr().out

    for bad, says in (
        (["--eval-only", "--eval", "2", "--oracle", "3", "--grid", "x.png"], "not --oracle"),
        (["--eval-only", "--calibrate-magcache", "1", "--grid", "x.png"], "give --eval N"),
        (["--eval-only", "--eval", "2", "--grid", "x.jpg"], "ending in .png"),
    ):
        with pytest.raises(SystemExit):
            main([str(out), *bad])
        assert says in capsys.readouterr().err


def test_self_drift_pulls_the_input_towards_the_models_own_estimate():
    """loop.own_estimate is the clean estimate of one call at noise 1 on [pure noise | source] (x_1 + the
    output, which is x0 - e); loop.pulled_noise moves x_t's content towards it by pull x s, and a pull of 0
    leaves the plain flow-matching point."""
    import torch

    from hidream_ui.lab.train import loop

    source = torch.randn(3, 16, 4, 4)
    prompt = torch.tensor([0, 5, 7])
    seen = {}

    def forward(hidden, sigma, prompt_ids):
        seen.update(hidden=hidden, sigma=sigma, prompt=prompt_ids, grad=torch.is_grad_enabled())
        return torch.cat([torch.full_like(source, 0.25), torch.full_like(source, 9.0)], dim=-1)

    estimate = loop.own_estimate(forward, source, prompt, 4, torch.Generator().manual_seed(7))
    pure = torch.randn(source.shape, generator=torch.Generator().manual_seed(7))
    assert torch.equal(seen["hidden"], torch.cat([pure, source], dim=-1)) and torch.equal(seen["prompt"], prompt)
    assert torch.equal(seen["sigma"], torch.ones(3)) and not seen["grad"]
    assert torch.allclose(estimate, pure + 0.25)  # the target half of the output only

    target, other, noise = torch.randn(3, 16, 4, 4), torch.randn(3, 16, 4, 4), torch.randn(3, 16, 4, 4)
    s = torch.tensor([0.9, 0.5, 0.2]).view(-1, 1, 1, 1)
    pulled = loop.pulled_noise(noise, target, other, torch.tensor([0.0, 1.0, 0.5]), s)
    x_t = (1 - s) * target + s * pulled
    content = (x_t - s * noise) / (1 - s)  # what the input shows, its own noise taken out
    assert torch.allclose(content[0], target[0], atol=1e-6)
    for i, pull in ((1, 1.0), (2, 0.5)):
        assert torch.allclose(content[i], target[i] + pull * float(s[i]) * (other[i] - target[i]), atol=1e-5)
    # A pull of 0 is the plain draw itself, to the bit (so runs without drift reproduce their weights).
    assert torch.equal(pulled[0], noise[0]) and not torch.equal(pulled[1], noise[1])


def test_estimate_from_is_one_call_without_gradient_by_either_stage():
    """loop.estimate_from: one call without gradient on the noisy latents at each sample's level, with the
    source beside them for the edit stage and alone for the refine stage; the estimate is x + level * output
    (the output is x0 - e), the source half of the edit stage's output dropped. own_estimate is its call at
    level 1 on pure noise."""
    import torch

    from hidream_ui.lab.train import loop

    x, source = torch.randn(3, 16, 4, 4), torch.randn(3, 16, 4, 4)
    prompt, level = torch.tensor([0, 5, 7]), torch.tensor([1.0, 0.6, 0.3])
    seen = []

    def forward(hidden, sigma, prompt_ids):
        seen.append(dict(hidden=hidden, sigma=sigma, prompt=prompt_ids, grad=torch.is_grad_enabled()))
        return torch.cat([torch.full_like(x, 0.5), torch.full_like(x, 9.0)], dim=-1)[..., : hidden.shape[-1]]

    for given in (source, None):
        estimate = loop.estimate_from(forward, x, level, prompt, given)
        call = seen[-1]
        assert torch.equal(call["hidden"], x if given is None else torch.cat([x, source], dim=-1))
        assert torch.equal(call["sigma"], level) and torch.equal(call["prompt"], prompt) and not call["grad"]
        assert torch.allclose(estimate, x + level.view(-1, 1, 1, 1) * 0.5)
    pure = torch.randn(x.shape, generator=torch.Generator().manual_seed(3))
    assert torch.equal(
        loop.own_estimate(forward, source, prompt, 4, torch.Generator().manual_seed(3)),
        loop.estimate_from(forward, pure, torch.ones(3), prompt, source),
    )


def test_decoder_own_trains_the_decoder_on_the_pipelines_own_latents(tmp_path, one_thread, monkeypatch):
    """--decoder-own N: N training edits sampled by the weights' own pipeline join the decoder's batches (those
    whose named region comes out right); only the decoder changes, the run differs from the plain decoder
    fine-tune, the meta says how many were sampled and kept, with what share, and the round trip it ends with;
    none kept is a clear error."""
    import torch
    from safetensors.torch import load_file

    from hidream_ui.lab.train.decoder import DECODER_OWN_SHARE, finetune_decoder

    plain = finetune_decoder(ASSET, tmp_path / "plain", 1, log=lambda line: None, round_trip_cases=2)
    lines = []
    meta = finetune_decoder(ASSET, tmp_path / "own", 1, own=3, log=lines.append, round_trip_cases=3)["decoder_finetune"]
    assert meta["own_edits"] == 3 and 1 <= meta["own_kept"] <= 3 and "own_edits" not in plain["decoder_finetune"]
    assert meta["own_share"] == DECODER_OWN_SHARE and meta["round_trip"]["cases"] == 3
    assert plain["decoder_finetune"]["round_trip"]["cases"] == 2
    assert any(line.startswith("decoder: round trip of 3 fresh training targets: success ") for line in lines)
    shipped, before, after = (
        load_file(str(d / trained.WEIGHTS_FILE)) for d in (ASSET, tmp_path / "plain", tmp_path / "own")
    )
    changed = {k for k in shipped if not torch.equal(shipped[k], after[k])}
    assert changed and all(k.startswith("vae/decoder.") for k in changed)
    assert any(not torch.equal(before[k], after[k]) for k in changed)

    monkeypatch.setattr(world, "score", lambda case, image: {"colour_ok": False})
    with pytest.raises(RuntimeError, match="none of the 2 sampled edits came out right"):
        finetune_decoder(ASSET, tmp_path / "none", 1, own=2, log=lambda line: None)


def test_train_tiny_passes_the_decoder_flags_to_the_decoder_fine_tune(tmp_path, monkeypatch):
    """train-tiny --decoder-from DIR --decoder-own N [--decoder-own-share S]: the fine-tune gets N and S, and the
    default share when S is not given."""
    from hidream_ui.lab.train import cli
    from hidream_ui.lab.train.decoder import DECODER_OWN_SHARE

    calls = []
    monkeypatch.setattr(cli, "finetune_decoder", lambda *args, **kwargs: calls.append((args, kwargs)))
    monkeypatch.setattr(cli, "torch_threads", lambda threads: None)
    base = [str(tmp_path / "out"), "--decoder-from", str(ASSET), "--decoder-own", "7", "--decoder-steps", "3"]
    assert cli.main(base + ["--decoder-own-share", "0.5"]) == 0
    assert cli.main(base) == 0
    (args, given), (_, default) = calls
    assert args[2] == 3 and given["own"] == 7 and given["own_share"] == 0.5
    assert default["own"] == 7 and default["own_share"] == DECODER_OWN_SHARE


def test_to_images_is_the_inverse_of_pixels_and_clips():
    """scoring.to_images undoes scoring.pixels exactly on the world's images, and clips what a decoder overshoots."""
    import numpy as np
    import torch

    from hidream_ui.lab.scoring import pixels, to_images

    images = [world.make_case(seed).target for seed in range(3)]
    x = pixels(images, torch)
    assert np.array_equal(to_images(x), np.stack(images))
    over = to_images(torch.stack([torch.full((3, 2, 2), 1.7), torch.full((3, 2, 2), -3.0)]))
    assert over.dtype == np.uint8 and over.shape == (2, 2, 2, 3)
    assert (over[0] == 255).all() and (over[1] == 0).all()


def test_round_trip_scores_the_decoded_true_targets_like_edits(one_thread):
    """decoder.round_trip: the shipped VAE decodes the encoded true targets of training cases to a success every
    time; a decoder whose last convolution is zeroed (a grey canvas) fails them all, and says how many."""
    import torch

    from hidream_ui.lab.scoring import eval_pipeline
    from hidream_ui.lab.train.decoder import round_trip

    cases = [world.make_case(seed) for seed in range(6)]
    with eval_pipeline(ASSET) as pipeline:
        vae = pipeline.vae.float()
        kept = round_trip(vae, cases, torch)
        assert kept["cases"] == 6 and kept["success"] == 1.0 and kept["failed"] == 0
        assert kept["untouched_psnr_median_db"] > 28
        with torch.no_grad():
            vae.decoder.conv_out.weight.zero_()
            vae.decoder.conv_out.bias.zero_()
        broken = round_trip(vae, cases, torch)
    assert broken["success"] == 0.0 and broken["failed"] == 6  # each of these scenes keeps a shape to lose
    assert broken["untouched_psnr_median_db"] < kept["untouched_psnr_median_db"]


def test_kept_shapes_counts_the_untouched_shapes_that_keep_their_colour():
    """probe.kept_shapes: the true target keeps every shape the instruction does not name; a bare background
    keeps none of them; for a background edit every shape counts."""
    import numpy as np

    from hidream_ui.lab.probe import kept_shapes

    cases = world.held_out_cases(12)
    for case in cases:
        named = 0 if case.edit.kind == "background" else 1
        kept, total = kept_shapes(case, case.target)
        assert total == len(case.scene.shapes) - named and kept == total
        bare = np.empty_like(case.target)
        bare[:] = world.BACKGROUNDS[case.scene.background]
        assert kept_shapes(case, bare) == (0, total)
    assert {c.edit.kind for c in cases} == set(world.EDIT_KINDS)


def test_one_call_near_zero_noise_gives_the_target_back(capsys):
    """train-tiny --one-call S: at noise 0.02 the input is nearly the target, so the clean estimate is close to it
    in both stages (within a dB of the VAE's round trip of the targets, whose median over these 4 cases is what
    one decoder or another makes of a few hard cases: 29.8 dB with the decoder shipped until 2026-11-29, 27.4 with
    today's); at noise 1 it is the model's guess, further away. At 0.6 the shipped
    weights' edit stage comes back above 20 dB (24.4 dB on these 4 cases; 23.3 with the earlier decoder): the
    estimate is x_t - s v, and the wrong sign adds the noise again instead of removing it (10.7 dB, measured with
    the earlier decoder)."""
    import torch

    from hidream_ui.lab.probe import one_call
    from hidream_ui.lab.scoring import eval_pipeline
    from hidream_ui.lab.train.cli import main
    from hidream_ui.lab.train.decoder import round_trip

    lines = []
    results = one_call(ASSET, 4, [1.0, 0.6, 0.02], log=lines.append)
    with eval_pipeline(ASSET) as pipeline:
        vae = round_trip(pipeline.vae.float(), world.held_out_cases(4), torch)
    assert results["edit"][0.6]["untouched_psnr_median_db"] > 20
    assert set(results["latents"]) <= set(world.EDIT_KINDS) and results["latents"]["background"]["latents"] > 0.9
    assert sum(line.startswith("the VAE, ") for line in lines) == len(results["latents"])
    for stage in ("edit", "refine"):
        near, far = results[stage][0.02], results[stage][1.0]
        assert near["success"] == 1.0 and near["shapes_kept"] == 1.0
        assert near["untouched_psnr_median_db"] > max(
            vae["untouched_psnr_median_db"] - 1.0, world.UNTOUCHED_MIN_PSNR_DB
        )
        assert far["untouched_psnr_median_db"] < near["untouched_psnr_median_db"]
    for bad, says in (
        (["--one-call", "0.5"], "--one-call needs --eval-only --eval N"),
        (["--eval-only", "--eval", "2", "--one-call", "0"], "must be in (0, 1]"),
        (["--eval-only", "--eval", "2", "--one-call", "x"], "noise levels like"),
    ):
        with pytest.raises(SystemExit):
            main([str(ASSET), *bad])
        assert says in capsys.readouterr().err


class _Editor:
    """A stand-in pipeline for probe._grounding whose latents are the world's images pooled to 16 x 16 (3
    channels): `predict` returns the velocity that takes x_t to the scene with the edit applied to the shape that
    the instruction names (`offset` 1: to the next shape instead), whatever the input."""

    def __init__(self, case, offset: int):
        self.case, self.offset = case, offset

    @staticmethod
    def latents(image):
        import torch

        pixels = torch.from_numpy(image).permute(2, 0, 1)[None].float() / 255
        return torch.nn.functional.avg_pool2d(pixels, 8)

    def encode_text(self, instruction: str):
        import torch

        from hidream_ui.pipeline.edit_pipeline import PromptEmbeds

        kinds = [shape.kind for shape in self.case.scene.shapes]
        named = kinds[(kinds.index(instruction.split()[2]) + self.offset) % len(kinds)]
        tag = torch.full((1, 1, 1), float(kinds.index(named)))
        return PromptEmbeds(t5=tag, llama=tag[None], pooled=tag[0])

    def predict(self, hidden, timestep, text):
        import torch

        s = float(timestep[0]) / 1000
        x_t = hidden[..., :16]
        edits = [
            world.Edit(self.case.edit.kind, self.case.scene.shapes[int(k)].kind, self.case.edit.value)
            for k in text.t5[:, 0, 0]
        ]
        x0 = torch.cat([self.latents(world.render(world.apply_edit(self.case.scene, e))) for e in edits])
        return torch.cat([(x_t - x0) / s, hidden[..., 16:]], dim=-1)


def test_latent_locality_tells_a_local_encoder_from_one_that_sees_the_whole_image():
    """probe.latent_locality: latents that are the image pooled over each cell change only where pixels do (no
    `far` change); add a term every cell shares (what a mid-block attention or GroupNorm can do) and the same
    edits change latents far from any changed pixel. A background edit changes the pixels of nearly every cell."""
    import torch

    from hidream_ui.lab.probe import latent_locality

    cases = world.held_out_cases(24)
    source = torch.cat([_Editor.latents(c.source) for c in cases])
    target = torch.cat([_Editor.latents(c.target) for c in cases])
    local = latent_locality(cases, source, target)
    assert set(local) == set(world.EDIT_KINDS) and sum(v["cases"] for v in local.values()) == 24
    for kind, found in local.items():
        assert found["far"] == 0 and 0 < found["latents"] <= found["pixels"], (kind, found)
        assert found["still"] == 0, (kind, found)  # where no pixel changes, a pooled cell cannot change
    assert local["background"]["pixels"] > 0.8 and local["remove"]["pixels"] < 0.3

    def shared(latents):  # every cell also carries the image's mean, strongly enough that one shape moves it
        return latents + 100 * latents.mean(dim=(2, 3), keepdim=True)

    spread = latent_locality(cases, shared(source), shared(target))
    for kind in ("recolour", "remove"):
        assert spread[kind]["far"] > 0.5 and spread[kind]["pixels"] == local[kind]["pixels"], spread[kind]
    # `far` misses the background edit (its changed pixels are nearly everywhere); `still` sees the shape
    # interiors move.
    assert spread["background"]["far"] < 0.1 < 0.9 < spread["background"]["still"], spread["background"]


def test_grounding_counts_edits_that_land_on_the_shape_the_instruction_names():
    """probe._grounding: a model that edits the shape each instruction names is grounded on every instruction;
    one that edits the next shape instead on none; both against the same chance."""
    import torch

    from hidream_ui.lab.probe import _grounding

    case = next(c for c in world.held_out_cases(64) if c.edit.kind == "remove" and len(c.scene.shapes) == 3)
    source = _Editor.latents(case.source)
    noise = torch.randn(source.shape, generator=torch.Generator().manual_seed(0))
    right = _grounding(_Editor(case, 0), [case], source, noise, 1.0)
    wrong = _grounding(_Editor(case, 1), [case], source, noise, 1.0)
    assert right == {"grounded": 1.0, "grounding_cases": 3, "grounding_chance": 0.333}
    assert wrong == {"grounded": 0.0, "grounding_cases": 3, "grounding_chance": 0.333}


def test_word_encoders_make_the_shape_words_distinct_and_keep_every_tensor(tmp_path, one_thread, random_trained):
    """words.apply rewrites only the four text encoders, key for key, and through the pipeline's own encoding
    the instructions that differ in one word become far apart where the random encoders kept them close."""
    import shutil

    import torch

    from hidream_ui.lab import words
    from hidream_ui.lab.train.data import world_prompts
    from hidream_ui.lab.train.run import prompt_embeddings

    root = tmp_path / "model"
    shutil.copytree(random_trained, root)
    before = trained.part_tensors(root)
    words.apply(root, seed=0, prompts=world_prompts())
    after = trained.part_tensors(root)
    assert before.keys() == after.keys()
    assert all(before[k].shape == after[k].shape and before[k].dtype == after[k].dtype for k in before)
    changed = {k.split("/")[0] for k in before if not torch.equal(before[k], after[k])}
    assert changed == set(words.PARTS)

    prompts = [
        "make the circle red",
        "make the square red",
        "remove the circle",
        "remove the square",
        "make the circle green",
    ]
    assert set(prompts) <= set(world_prompts())

    def cosines(root):
        e = prompt_embeddings(root, prompts)

        def cos(a, b):
            return float(torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0))

        return {
            stream: [cos(x[i], x[j]) for i, j in ((0, 1), (2, 3), (0, 4))]
            for stream, x in (("t5", e.t5), ("llama", e.llama.transpose(0, 1)), ("pooled", e.pooled))
        }

    random, designed = cosines(random_trained), cosines(root)
    # Shape words: the random Llama keeps "circle" and "square" instructions at a cosine near 1.
    assert random["llama"][0] > 0.9
    for stream, values in designed.items():
        # Two content words each, one shared: a bag of orthonormal words gives 0.5; the end and pad tokens add
        # a little common ground.
        assert all(v < 0.65 for v in values), (stream, values)
    # Deterministic for a seed; another seed gives other directions.
    again = tmp_path / "again"
    shutil.copytree(random_trained, again)
    words.apply(again, seed=0, prompts=world_prompts())
    assert all(torch.equal(after[k], v) for k, v in trained.part_tensors(again).items())
    other = tmp_path / "other"
    shutil.copytree(random_trained, other)
    words.apply(other, seed=1, prompts=world_prompts())
    assert not torch.equal(trained.part_tensors(other)["t5/shared.weight"], after["t5/shared.weight"])


def test_word_directions_are_orthonormal_and_refuse_too_many_words():
    import torch

    from hidream_ui.lab import words

    directions = words.word_directions([f"w{i}" for i in range(words.WORD_DIMS)], seed=3)
    basis = torch.stack(list(directions.values()))
    assert torch.allclose(basis @ basis.T, torch.eye(words.WORD_DIMS), atol=1e-5)
    with pytest.raises(ValueError, match="17 words"):
        words.word_directions([f"w{i}" for i in range(words.WORD_DIMS + 1)], seed=3)


def _case_with(shapes, edit):
    scene = world.Scene("white", tuple(shapes), antialias=False)
    return world.Case(0, scene, edit, world.render(scene), world.render(world.apply_edit(scene, edit)))


def test_shape_tokens_mark_the_named_shape_among_the_shapes_and_asks_which_shape_picks_those_cases():
    from hidream_ui.lab.train.data import asks_which_shape, shape_tokens

    circle = world.Shape("circle", "red", x=0, y=0, size=32)  # tokens (0, 0), (0, 1), (1, 0), (1, 1)
    square = world.Shape("square", "blue", x=64, y=80, size=32)  # tokens (5, 4), (5, 5), (6, 4), (6, 5)
    case = _case_with([circle, square], world.Edit("recolour", "square", "green"))
    labels = shape_tokens(case, 8).reshape(2, 8, 8)
    named, shapes = labels[0].astype(bool), labels[1].astype(bool)
    assert set(zip(*named.nonzero())) == {(5, 4), (5, 5), (6, 4), (6, 5)}
    assert set(zip(*shapes.nonzero())) == {(0, 0), (0, 1), (1, 0), (1, 1), (5, 4), (5, 5), (6, 4), (6, 5)}
    assert asks_which_shape(case)
    assert not asks_which_shape(_case_with([circle, square], world.Edit("background", "background", "black")))
    assert not asks_which_shape(_case_with([square], world.Edit("remove", "square", "")))


def test_the_grounding_head_reads_the_target_half_of_the_hooked_block_in_token_order():
    import torch

    from hidream_ui.lab.train.model import GroundingHead, make_transformer

    spec = PROFILES["trained"]
    model = make_transformer(spec, 0)
    grounding = GroundingHead(model, spec, 1, torch)
    rows, cols = grounding.rows, grounding.cols
    # Token t of the [target | source] input at (row t // (2 cols), column t % (2 cols)); two text tokens after.
    hidden = torch.arange(rows * 2 * cols + 2, dtype=torch.float32).view(1, -1, 1).repeat(2, 1, 3)
    picked = grounding.target_tokens(hidden)[0, :, 0].long().tolist()
    assert picked == [r * 2 * cols + c for r in range(rows) for c in range(cols)]
    # The hook keeps block 1's image tokens on a forward: exactly one logit per target token.
    latents = torch.zeros(1, spec.latent_channels, spec.max_resolution[0], 2 * spec.max_resolution[1])
    embeds = {
        "encoder_hidden_states_t5": torch.zeros(1, 4, 32),
        "encoder_hidden_states_llama3": torch.zeros(len(spec.llama_layers), 1, 4, 32),
        "pooled_embeds": torch.zeros(1, 32),
    }
    with torch.no_grad():
        model(hidden_states=latents, timesteps=torch.tensor([1000.0]), return_dict=False, **embeds)
        assert grounding.logits().shape == (1, rows * cols)
    # Balanced: the named tokens and the other shapes' count alike, whatever their numbers; unscored tokens not.
    labels = torch.tensor([[[1, 0, 0, 0, 0], [1, 1, 1, 1, 0]]], dtype=torch.float32)
    _, accuracy = grounding.loss(torch.tensor([[5.0, -5.0, -5.0, 5.0, 5.0]]), labels)
    assert accuracy == pytest.approx(0.5 * (1 + 2 / 3))
    with pytest.raises(ValueError, match="ground_block 9"):
        GroundingHead(model, spec, 9, torch)


def test_train_tiny_with_word_encoders_and_grounding_runs_and_records_its_command(tmp_path, one_thread, capsys):
    import torch
    from safetensors.torch import load_file

    _train(tmp_path / "a", "--vae-steps", "2")
    _train(
        tmp_path / "w",
        "--init-from",
        str(tmp_path / "a"),
        "--word-encoders",
        "--ground-steps",
        "2",
        "--ground-weight",
        "1",
        "--ground-flow",
        "0.5",
    )
    printed = capsys.readouterr().out
    assert "grounding step 2/2 loss" in printed and "grounding balanced accuracy" in printed
    start, tuned = (load_file(str(tmp_path / n / trained.WEIGHTS_FILE)) for n in "aw")
    assert start.keys() == tuned.keys()
    changed = {k.split("/")[0] for k in start if not torch.equal(start[k], tuned[k])}
    assert changed == {"transformer", "clip_l", "clip_g", "t5", "llama"}  # the VAE is kept; no head is written
    meta = json.loads((tmp_path / "w" / trained.META_FILE).read_text())
    assert "--ground-steps 2 --ground-weight 1.0 --ground-flow 0.5 --word-encoders" in meta["command"]
    # A fine-tune of it keeps its (designed) encoders as they are.
    _train(tmp_path / "again", "--init-from", str(tmp_path / "w"), "--word-encoders")
    again = load_file(str(tmp_path / "again" / trained.WEIGHTS_FILE))
    # Its record goes back to the first run, through each fine-tune.
    lineage = json.loads((tmp_path / "again" / trained.META_FILE).read_text())["init_from"]
    first = json.loads((tmp_path / "a" / trained.META_FILE).read_text())
    assert lineage["command"] == meta["command"] and lineage["init_from"]["command"] == first["command"]
    assert "init_from" not in lineage["init_from"]
    assert all(torch.equal(tuned[k], again[k]) for k in tuned if not k.startswith(("transformer/", "vae/")))
