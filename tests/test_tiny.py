"""The offline tiny checkpoint: upstream layout, determinism, and loading through the standard from_pretrained calls.

`tiny_dir` (tests/conftest.py) is the session's tiny build (profile "tiny", seed 0).
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from hidream_ui.model import layout
from hidream_ui.model.tiny import build as tiny_build
from hidream_ui.model.tiny import profiles


def _tree_digest(root: Path) -> dict[str, str]:
    return {
        path.relative_to(root).as_posix(): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(root.rglob("*"))
        if path.is_file()
    }


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


@pytest.fixture
def offline(monkeypatch):
    """No hub access: every load below must be satisfied by the local folders alone."""
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


@pytest.fixture(scope="module")
def torch_threads():
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def _transformer_inputs(config: dict, llama_layers: int, height: int, width: int, seed: int = 0):
    """Random conditioning with the shapes HiDreamImagePipeline feeds the transformer."""
    import torch

    g = torch.Generator().manual_seed(seed)
    t5_dim, llama_dim = config["caption_channels"]
    return dict(
        hidden_states=torch.randn(1, config["in_channels"], height, width, generator=g),
        timesteps=torch.tensor([700.0]),
        encoder_hidden_states_t5=torch.randn(1, 12, t5_dim, generator=g),
        encoder_hidden_states_llama3=torch.randn(llama_layers, 1, 10, llama_dim, generator=g),
        pooled_embeds=torch.randn(1, config["text_emb_dim"], generator=g),
    )


# ---------------------------------------------------------------------------------------------------------------
# Layout and configs


def test_layout_mirrors_the_upstream_folders(tiny_dir):
    files = set(_tree_digest(tiny_dir))
    expected = {
        profiles.MARKER_FILENAME,
        "Llama-3.1-8B-Instruct/config.json",
        "Llama-3.1-8B-Instruct/generation_config.json",
        "Llama-3.1-8B-Instruct/tokenizer.json",
        "Llama-3.1-8B-Instruct/tokenizer_config.json",
        "Llama-3.1-8B-Instruct/special_tokens_map.json",
        "Llama-3.1-8B-Instruct/model-00001-of-00002.safetensors",
        "Llama-3.1-8B-Instruct/model-00002-of-00002.safetensors",
        "Llama-3.1-8B-Instruct/model.safetensors.index.json",
        "HiDream-I1-Full/model_index.json",
        "HiDream-I1-Full/scheduler/scheduler_config.json",
        "HiDream-I1-Full/text_encoder/config.json",
        "HiDream-I1-Full/text_encoder/model.safetensors",
        "HiDream-I1-Full/text_encoder_2/config.json",
        "HiDream-I1-Full/text_encoder_2/model.safetensors",
        "HiDream-I1-Full/text_encoder_3/config.json",
        "HiDream-I1-Full/text_encoder_3/model-00001-of-00002.safetensors",
        "HiDream-I1-Full/text_encoder_3/model-00002-of-00002.safetensors",
        "HiDream-I1-Full/text_encoder_3/model.safetensors.index.json",
        "HiDream-I1-Full/tokenizer_3/spiece.model",
        "HiDream-I1-Full/tokenizer_3/tokenizer.json",
        "HiDream-I1-Full/tokenizer_3/tokenizer_config.json",
        "HiDream-I1-Full/tokenizer_3/special_tokens_map.json",
        "HiDream-I1-Full/transformer/config.json",
        "HiDream-I1-Full/transformer/diffusion_pytorch_model-00001-of-00002.safetensors",
        "HiDream-I1-Full/transformer/diffusion_pytorch_model-00002-of-00002.safetensors",
        "HiDream-I1-Full/transformer/diffusion_pytorch_model.safetensors.index.json",
        "HiDream-I1-Full/vae/config.json",
        "HiDream-I1-Full/vae/diffusion_pytorch_model.safetensors",
        "HiDream-E1-1/transformer/config.json",
        "HiDream-E1-1/transformer/diffusion_pytorch_model-00001-of-00002.safetensors",
        "HiDream-E1-1/transformer/diffusion_pytorch_model-00002-of-00002.safetensors",
        "HiDream-E1-1/transformer/diffusion_pytorch_model.safetensors.index.json",
        "HiDream-E1-Full/HiDream-E1-Full.safetensors",
        # --transformer-file inputs: the E1.1 transformer as one file, diffusers and ComfyUI key layouts
        f"{profiles.SINGLE_FILE_DIR}/{profiles.SINGLE_FILES['diffusers']}",
        f"{profiles.SINGLE_FILE_DIR}/{profiles.SINGLE_FILES['comfyui']}",
    }
    for clip_tokenizer in ("tokenizer", "tokenizer_2"):
        expected |= {
            f"HiDream-I1-Full/{clip_tokenizer}/{name}"
            for name in ("vocab.json", "merges.txt", "tokenizer_config.json", "special_tokens_map.json")
        }
    assert files == expected

    index = _read_json(tiny_dir / "HiDream-I1-Full" / "model_index.json")
    assert index["_class_name"] == "HiDreamImagePipeline"
    components = {k: v for k, v in index.items() if not k.startswith("_")}
    assert components == {
        "scheduler": ["diffusers", "UniPCMultistepScheduler"],
        "text_encoder": ["transformers", "CLIPTextModelWithProjection"],
        "text_encoder_2": ["transformers", "CLIPTextModelWithProjection"],
        "text_encoder_3": ["transformers", "T5EncoderModel"],
        "tokenizer": ["transformers", "CLIPTokenizer"],
        "tokenizer_2": ["transformers", "CLIPTokenizer"],
        "tokenizer_3": ["transformers", "T5Tokenizer"],
        "transformer": ["diffusers", "HiDreamImageTransformer2DModel"],
        "vae": ["diffusers", "AutoencoderKL"],
    }
    scheduler = _read_json(tiny_dir / "HiDream-I1-Full" / "scheduler" / "scheduler_config.json")
    flow = (scheduler["flow_shift"], scheduler["use_flow_sigmas"], scheduler["num_train_timesteps"])
    assert flow == (3.0, True, 1000)

    assert tiny_build.is_tiny_checkpoint(tiny_dir)
    expected = profiles.TinyMarker(profile="tiny", seed=0, format_version=profiles.FORMAT_VERSION)
    assert tiny_build.read_marker(tiny_dir) == expected


def test_weights_are_bf16_and_indexes_are_complete(tiny_dir):
    from safetensors import safe_open

    files = sorted(tiny_dir.rglob("*.safetensors"))
    assert files
    modes = {path.stat().st_mode & 0o777 for path in tiny_dir.rglob("*") if path.is_file()}
    assert len(modes) == 1  # weights get the same permissions as the json files next to them
    for path in files:
        with safe_open(str(path), framework="pt") as handle:
            assert handle.metadata() == {"format": "pt"}
            assert {str(handle.get_slice(k).get_dtype()) for k in handle.keys()} == {"BF16"}, path
    for index_path in tiny_dir.rglob("*.safetensors.index.json"):
        index = _read_json(index_path)
        stored, total = {}, 0
        for shard in sorted(set(index["weight_map"].values())):
            with safe_open(str(index_path.parent / shard), framework="pt") as handle:
                for key in handle.keys():
                    stored[key] = shard
                    total += 2 * _numel(handle.get_slice(key).get_shape())
        assert stored == index["weight_map"], index_path
        assert index["metadata"]["total_size"] == total, index_path


def _numel(shape) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count


@pytest.mark.parametrize("name", sorted(profiles.PROFILES))
def test_profile_geometry_satisfies_hidream_constraints(name, tiny_dir):
    profile = profiles.PROFILES[name]
    config = profile.transformer_config()
    llama = _read_json(tiny_dir / "Llama-3.1-8B-Instruct" / "config.json")
    t5 = _read_json(tiny_dir / "HiDream-I1-Full" / "text_encoder_3" / "config.json")
    clip_l = _read_json(tiny_dir / "HiDream-I1-Full" / "text_encoder" / "config.json")
    clip_g = _read_json(tiny_dir / "HiDream-I1-Full" / "text_encoder_2" / "config.json")

    assert sum(config["axes_dims_rope"]) == config["attention_head_dim"]
    assert len(config["llama_layers"]) == config["num_layers"] + config["num_single_layers"]
    assert all(0 <= i < llama["num_hidden_layers"] for i in config["llama_layers"])
    assert config["caption_channels"] == [t5["d_model"], llama["hidden_size"]]
    assert config["text_emb_dim"] == clip_l["projection_dim"] + clip_g["projection_dim"]
    assert clip_l["hidden_size"] != clip_g["hidden_size"]
    assert min(clip_l["max_position_embeddings"], clip_g["max_position_embeddings"]) >= 218
    expected_seq = {"tiny": 64, "bench": 4096, "deep": 256, "trained": 64}[name]
    assert profile.max_seq == expected_seq
    assert config["max_resolution"][0] * config["max_resolution"][1] // config["patch_size"] ** 2 == expected_seq
    if name == "bench":
        assert (config["num_attention_heads"], config["attention_head_dim"]) == (20, 128)
    if name == "deep":  # the release's block count (what step caching's speed-up depends on)
        assert (config["num_layers"], config["num_single_layers"]) == (16, 32)


def test_tiny_transformer_config_matches_profile(tiny_dir):
    for folder in ("HiDream-I1-Full", "HiDream-E1-1"):
        config = _read_json(tiny_dir / folder / "transformer" / "config.json")
        assert config.pop("_class_name") == "HiDreamImageTransformer2DModel"
        config.pop("_diffusers_version")
        assert config == profiles.PROFILES["tiny"].transformer_config()
    vae = _read_json(tiny_dir / "HiDream-I1-Full" / "vae" / "config.json")
    assert (vae["latent_channels"], vae["scaling_factor"], vae["shift_factor"]) == (16, 0.3611, 0.1159)
    assert len(vae["block_out_channels"]) == 4
    assert all(c % vae["norm_num_groups"] == 0 for c in vae["block_out_channels"])
    assert (vae["use_quant_conv"], vae["use_post_quant_conv"]) == (False, False)


def test_vae_latent_channels_follow_the_profile():
    # The transformer's in/out channels and the VAE's latent channels are one fact (the profile's): a profile with
    # fewer latent channels must get a VAE that writes that many, or the pipeline's latents would not fit.
    import dataclasses

    from hidream_ui.model.tiny import parts

    trained = profiles.PROFILES["trained"]
    assert trained.latent_channels == 4  # the shipped weights' (assets/tiny_trained)
    assert parts._vae_config(trained)["latent_channels"] == 4
    assert trained.transformer_config()["in_channels"] == trained.transformer_config()["out_channels"] == 4
    wide = dataclasses.replace(trained, latent_channels=8)
    assert parts._vae_config(wide)["latent_channels"] == 8
    assert parts._vae_config(profiles.PROFILES["tiny"])["latent_channels"] == 16
    assert parts._vae_config()["latent_channels"] == 16


# ---------------------------------------------------------------------------------------------------------------
# Determinism, CLI, overwrite rules


def test_cli_rebuild_is_byte_identical_and_replaces_a_previous_build(tiny_dir, tmp_path, capsys):
    again = tmp_path / "again"
    shutil.copytree(tiny_dir, again)
    stale = again / "HiDream-I1-Full" / "transformer" / "diffusion_pytorch_model-00001-of-00002.safetensors"
    stale.write_bytes(b"stale")
    (again / "leftover.txt").write_text("from an older build")

    assert tiny_build.main([str(again), "--profile", "tiny", "--seed", "0"]) == 0

    assert _tree_digest(again) == _tree_digest(tiny_dir)
    out = capsys.readouterr().out
    for folder in ("Llama-3.1-8B-Instruct/", "HiDream-I1-Full/", "HiDream-E1-1/", "HiDream-E1-Full/"):
        assert folder in out
    assert "total" in out and "bytes" in out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["again"]  # no staging or retired folders left


def test_other_seed_changes_weights_only(tiny_dir, tmp_path):
    other = tiny_build.build_tiny(tmp_path / "seed1", profile="tiny", seed=1)
    ours, theirs = _tree_digest(tiny_dir), _tree_digest(other)
    assert ours.keys() == theirs.keys()
    differing = {name for name in ours if ours[name] != theirs[name]}
    assert differing == {name for name in ours if name.endswith(".safetensors")} | {profiles.MARKER_FILENAME}
    assert tiny_build.read_marker(other).seed == 1


def test_refuses_to_overwrite_a_foreign_folder(tmp_path, capsys):
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "keep.txt").write_text("precious")
    with pytest.raises(FileExistsError, match="not a previous tiny build"):
        tiny_build.build_tiny(foreign)
    assert tiny_build.main([str(foreign)]) == 2
    assert "refusing to overwrite" in capsys.readouterr().err
    assert [p.name for p in foreign.iterdir()] == ["keep.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine"]

    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(FileExistsError, match="not a folder"):
        tiny_build.build_tiny(a_file)


def test_rejects_unknown_profile_and_bad_seed(tmp_path):
    with pytest.raises(ValueError, match="unknown tiny profile 'huge'"):
        tiny_build.build_tiny(tmp_path / "x", profile="huge")
    with pytest.raises(ValueError, match="seed"):
        tiny_build.build_tiny(tmp_path / "x", seed=-1)
    with pytest.raises(SystemExit):
        tiny_build.main([str(tmp_path / "x"), "--profile", "huge"])
    assert not (tmp_path / "x").exists()


def test_is_tiny_checkpoint_rejects_other_folders(tmp_path):
    assert not tiny_build.is_tiny_checkpoint(tmp_path)
    assert not tiny_build.is_tiny_checkpoint(tmp_path / "missing")
    (tmp_path / profiles.MARKER_FILENAME).write_text("{not json")
    assert not tiny_build.is_tiny_checkpoint(tmp_path)
    (tmp_path / profiles.MARKER_FILENAME).write_text(json.dumps({"profile": "tiny", "seed": "0", "format_version": 1}))
    assert not tiny_build.is_tiny_checkpoint(tmp_path)


# ---------------------------------------------------------------------------------------------------------------
# ensure_tiny and the cache


def test_default_cache_root_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv(profiles.CACHE_ENV_VAR, str(tmp_path / "cache"))
    assert tiny_build.default_cache_root() == tmp_path / "cache"
    monkeypatch.delenv(profiles.CACHE_ENV_VAR)
    assert tiny_build.default_cache_root() == Path.home() / ".cache" / "hidream_ui"


def test_ensure_tiny_builds_once_then_reuses(tmp_path, monkeypatch, tiny_dir):
    path = tiny_build.ensure_tiny(profile="tiny", seed=0, cache_root=tmp_path)
    assert path == tmp_path / f"tiny-tiny-seed0-v{profiles.FORMAT_VERSION}"
    assert _tree_digest(path) == _tree_digest(tiny_dir)

    def no_rebuild(*args, **kwargs):
        raise AssertionError("ensure_tiny rebuilt a finished checkpoint")

    monkeypatch.setattr(tiny_build, "_build_tree", no_rebuild)
    assert tiny_build.ensure_tiny(profile="tiny", seed=0, cache_root=tmp_path) == path
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]


def test_ensure_tiny_loser_of_a_race_keeps_the_winners_build(tmp_path, monkeypatch, tiny_dir):
    target = tmp_path / f"tiny-tiny-seed0-v{profiles.FORMAT_VERSION}"

    def another_process_wins(root, spec, seed):
        shutil.copytree(tiny_dir, target)  # the other process renames its finished build into place first
        (root / "half-built").write_text("this copy must be discarded")

    monkeypatch.setattr(tiny_build, "_build_tree", another_process_wins)
    assert tiny_build.ensure_tiny(profile="tiny", seed=0, cache_root=tmp_path) == target
    assert _tree_digest(target) == _tree_digest(tiny_dir)
    assert sorted(p.name for p in tmp_path.iterdir()) == [target.name]


def test_ensure_tiny_refuses_a_foreign_cache_entry(tmp_path):
    target = tmp_path / f"tiny-tiny-seed0-v{profiles.FORMAT_VERSION}"
    target.mkdir()
    (target / "junk").write_text("x")
    with pytest.raises(FileExistsError, match="delete it"):
        tiny_build.ensure_tiny(cache_root=tmp_path)


# ---------------------------------------------------------------------------------------------------------------
# Loading through the standard from_pretrained calls, and forward passes on CPU


def test_text_encoders_and_tokenizers_load_and_run(tiny_dir, offline, torch_threads):
    import torch
    from transformers import (
        AutoTokenizer,
        CLIPTextModelWithProjection,
        CLIPTokenizer,
        LlamaForCausalLM,
        PreTrainedTokenizerFast,
        T5EncoderModel,
        T5Tokenizer,
    )

    i1 = tiny_dir / "HiDream-I1-Full"
    prompt = ["Convert the image into a Ghibli style."]

    clip_parts = (("tokenizer", "text_encoder", "<|endoftext|>"), ("tokenizer_2", "text_encoder_2", "!"))
    for sub_tok, sub_enc, pad in clip_parts:
        tokenizer = CLIPTokenizer.from_pretrained(i1, subfolder=sub_tok)
        assert tokenizer.pad_token == pad
        ids = tokenizer(prompt, padding="max_length", max_length=128, truncation=True, return_tensors="pt").input_ids
        assert ids.shape == (1, 128) and ids[0, 0] == tokenizer.bos_token_id
        encoder, info = CLIPTextModelWithProjection.from_pretrained(
            i1, subfolder=sub_enc, torch_dtype=torch.float32, output_loading_info=True
        )
        assert not info["missing_keys"] and not info["unexpected_keys"]
        out = encoder(ids, output_hidden_states=True)
        assert out[0].shape == (1, encoder.config.projection_dim) and torch.isfinite(out[0]).all()

    t5_tokenizer = T5Tokenizer.from_pretrained(i1, subfolder="tokenizer_3")
    assert (t5_tokenizer.pad_token_id, t5_tokenizer.eos_token_id, t5_tokenizer.unk_token_id) == (0, 1, 2)
    assert t5_tokenizer.model_max_length == 512  # the pipeline pads T5 to min(max_sequence_length, this)
    assert type(AutoTokenizer.from_pretrained(i1, subfolder="tokenizer_3")) is T5Tokenizer
    t5_inputs = t5_tokenizer(prompt, padding="max_length", max_length=128, truncation=True, return_tensors="pt")
    n = int(t5_inputs.attention_mask.sum())
    assert t5_inputs.input_ids[0, n - 1] == 1 and (t5_inputs.input_ids[0, n:] == 0).all()
    assert t5_tokenizer.unk_token_id not in t5_inputs.input_ids[0].tolist()
    t5, info = T5EncoderModel.from_pretrained(
        i1, subfolder="text_encoder_3", torch_dtype=torch.float32, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"]
    hidden = t5(t5_inputs.input_ids, attention_mask=t5_inputs.attention_mask)[0]
    assert hidden.shape == (1, 128, t5.config.d_model) and torch.isfinite(hidden).all()

    llama_dir = tiny_dir / "Llama-3.1-8B-Instruct"
    tokenizer_4 = PreTrainedTokenizerFast.from_pretrained(llama_dir)
    assert (tokenizer_4.bos_token, tokenizer_4.eos_token) == ("<|begin_of_text|>", "<|eot_id|>")
    tokenizer_4.pad_token = tokenizer_4.eos_token  # as HiDreamImagePipeline does
    llama_inputs = tokenizer_4(prompt, padding="max_length", max_length=128, truncation=True, return_tensors="pt")
    assert llama_inputs.input_ids[0, 0] == tokenizer_4.bos_token_id
    llama, info = LlamaForCausalLM.from_pretrained(
        llama_dir,
        output_hidden_states=True,
        output_attentions=True,
        torch_dtype=torch.float32,
        output_loading_info=True,
    )
    assert not info["missing_keys"] and not info["unexpected_keys"]
    out = llama(llama_inputs.input_ids, attention_mask=llama_inputs.attention_mask, output_hidden_states=True)
    assert len(out.hidden_states) == llama.config.num_hidden_layers + 1
    assert out.hidden_states[-1].shape == (1, 128, llama.config.hidden_size)
    assert all(torch.isfinite(h).all() for h in out.hidden_states)


def test_t5_tokenizer_loads_from_either_spiece_model_or_tokenizer_json(tiny_dir, tmp_path, offline):
    """The real tokenizer_3 ships both files; transformers 5 prefers tokenizer.json and can convert spiece.model
    alone (via sentencepiece). Both must give the same ids, and agree with sentencepiece itself."""
    import sentencepiece
    from transformers import T5Tokenizer

    source = tiny_dir / "HiDream-I1-Full" / "tokenizer_3"
    texts = ["A cat holding a sign that says hello", "Convert  the image into a Ghibli style, 123 <extra_id_0>!"]
    encodings = []
    for only in ("spiece.model", "tokenizer.json"):
        folder = tmp_path / only
        folder.mkdir()
        for name in (only, "tokenizer_config.json", "special_tokens_map.json"):
            shutil.copy(source / name, folder / name)
        tokenizer = T5Tokenizer.from_pretrained(folder)
        encodings.append([tokenizer(text).input_ids for text in texts])
    assert encodings[0] == encodings[1]
    processor = sentencepiece.SentencePieceProcessor(model_file=str(source / "spiece.model"))
    assert encodings[0][0] == processor.encode(texts[0]) + [1]


def test_vae_and_transformer_load_and_run(tiny_dir, offline, torch_threads):
    import torch
    from diffusers import AutoencoderKL, HiDreamImageTransformer2DModel

    i1 = tiny_dir / "HiDream-I1-Full"
    vae, info = AutoencoderKL.from_pretrained(i1, subfolder="vae", torch_dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    image = torch.rand(1, 3, 64, 64, generator=torch.Generator().manual_seed(0)) * 2 - 1
    with torch.no_grad():
        latents = vae.encode(image).latent_dist.sample(generator=torch.Generator().manual_seed(1))
        decoded = vae.decode(latents).sample
    assert latents.shape == (1, 16, 8, 8) and decoded.shape == image.shape
    assert torch.isfinite(decoded).all()

    llama_layers = _read_json(tiny_dir / "Llama-3.1-8B-Instruct" / "config.json")["num_hidden_layers"]
    for dtype in (torch.float32, torch.bfloat16):
        transformer, info = HiDreamImageTransformer2DModel.from_pretrained(
            i1, subfolder="transformer", torch_dtype=dtype, output_loading_info=True
        )
        assert not info["missing_keys"] and not info["unexpected_keys"]
        assert transformer.dtype == dtype and transformer.max_seq == 64
        config = dict(transformer.config)
        for height, width in ((8, 8), (8, 16)):  # square, and non-square (padded to max_seq inside)
            inputs = _transformer_inputs(config, llama_layers, height, width)
            inputs = {k: (v.to(dtype) if k != "timesteps" else v) for k, v in inputs.items()}
            with torch.no_grad():
                out = transformer(**inputs, return_dict=False)[0]
            assert out.shape == (1, 16, height, width)
            assert torch.isfinite(out.float()).all() and out.float().abs().sum() > 0


def test_e1_1_loads_and_its_weights_differ_from_i1(tiny_dir, offline):
    from diffusers import HiDreamImageTransformer2DModel
    from safetensors.torch import load_file

    def weights(folder: Path) -> dict:
        state = {}
        for shard in sorted(folder.glob("*.safetensors")):
            state.update(load_file(str(shard)))
        return state

    i1 = weights(tiny_dir / "HiDream-I1-Full" / "transformer")
    e1 = weights(tiny_dir / "HiDream-E1-1" / "transformer")
    assert i1.keys() == e1.keys()
    assert all(i1[k].shape == e1[k].shape for k in i1)
    assert not any(bool((i1[k] == e1[k]).all()) for k in i1)

    _, info = HiDreamImageTransformer2DModel.from_pretrained(
        tiny_dir / "HiDream-E1-1", subfolder="transformer", output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"]


def test_e1_full_file_fits_the_adapter_wrapped_i1_transformer(tiny_dir, offline, torch_threads):
    import torch
    from diffusers import HiDreamImageTransformer2DModel
    from peft import LoraConfig
    from safetensors.torch import load_file

    transformer = HiDreamImageTransformer2DModel.from_pretrained(
        tiny_dir / "HiDream-I1-Full", subfolder="transformer", torch_dtype=torch.float32
    )
    llama_layers = _read_json(tiny_dir / "Llama-3.1-8B-Instruct" / "config.json")["num_hidden_layers"]
    inputs = _transformer_inputs(dict(transformer.config), llama_layers, 8, 8, seed=3)
    with torch.no_grad():
        base = transformer(**inputs, return_dict=False)[0]
    i1_plain = {k: v.clone() for k, v in transformer.state_dict().items() if k in profiles.E1_FULL_PLAIN_KEYS}

    # Exactly the upstream recipe (HiDream-E1 inference.py).
    transformer.add_adapter(
        LoraConfig(
            r=layout.E1_FULL_LORA_RANK,
            lora_alpha=layout.E1_FULL_LORA_ALPHA,
            lora_dropout=0.0,
            target_modules=list(layout.E1_FULL_LORA_TARGETS),
            init_lora_weights="gaussian",
        )
    )
    checkpoint = load_file(str(tiny_dir / "HiDream-E1-Full" / "HiDream-E1-Full.safetensors"))
    info = transformer.load_state_dict(checkpoint, strict=False)
    assert len(info.unexpected_keys) == 0
    wrapped_lora = {k for k in transformer.state_dict() if ".lora_A." in k or ".lora_B." in k}
    assert wrapped_lora == {k for k in checkpoint if "lora" in k}  # every adapter weight comes from the file
    assert {k for k in checkpoint if "lora" not in k} == set(profiles.E1_FULL_PLAIN_KEYS)
    assert all(not torch.equal(checkpoint[k].float(), i1_plain[k]) for k in profiles.E1_FULL_PLAIN_KEYS)
    assert all(checkpoint[k].abs().sum() > 0 for k in checkpoint if ".lora_B." in k)

    with torch.no_grad():
        edited = transformer(**inputs, return_dict=False)[0]
    assert not torch.allclose(edited, base, atol=1e-3)

    # The refine stage of the editing pipeline: adapters off, I1's plain keys back -> the I1 model again.
    transformer.disable_adapters()
    transformer.load_state_dict(i1_plain, strict=False)
    with torch.no_grad():
        restored = transformer(**inputs, return_dict=False)[0]
    torch.testing.assert_close(restored, base)


def test_hidream_text_to_image_pipeline_runs_two_steps(tiny_dir, offline, torch_threads):
    """diffusers' own HiDreamImagePipeline end to end: proves tokenizers, text encoders (incl. the 128-token CLIP
    padding), transformer, scheduler and VAE of the tiny checkpoint fit together."""
    import numpy as np
    import torch
    from diffusers import HiDreamImagePipeline
    from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

    llama_dir = tiny_dir / "Llama-3.1-8B-Instruct"
    tokenizer_4 = PreTrainedTokenizerFast.from_pretrained(llama_dir)
    text_encoder_4 = LlamaForCausalLM.from_pretrained(
        llama_dir, output_hidden_states=True, output_attentions=True, torch_dtype=torch.float32
    )
    pipe = HiDreamImagePipeline.from_pretrained(
        tiny_dir / "HiDream-I1-Full", tokenizer_4=tokenizer_4, text_encoder_4=text_encoder_4, torch_dtype=torch.float32
    )
    assert type(pipe.scheduler).__name__ == "UniPCMultistepScheduler"
    # The pipeline rescales every request to default_sample_size * vae_scale_factor squared pixels (1024^2 for
    # the real model); 8 * 8 = 64 keeps this run at the requested 64x64.
    pipe.default_sample_size = 8
    images = pipe(
        "A cat holding a sign that says hello",
        height=64,
        width=64,
        num_inference_steps=2,
        guidance_scale=5.0,
        generator=torch.Generator().manual_seed(0),
        output_type="np",
    ).images
    assert images.shape == (1, 64, 64, 3)
    assert np.isfinite(images).all() and images.std() > 0
