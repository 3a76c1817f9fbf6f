"""Model sources, verification and the per-stage weight sets (E1.1 refiner, E1-Full LoRA)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors import safe_open

from hidream_ui.config import AppConfig
from hidream_ui.device.detect import resolve_device
from hidream_ui.model.layout import E1_FULL_FILE
from hidream_ui.model.loading import WeightSwap, load_model
from hidream_ui.model.sources import ModelError, resolve_sources, verify_sources

CPU = None


def cpu():
    global CPU
    CPU = CPU or resolve_device("cpu")
    return CPU


def file_tensor(folder, key):
    index = folder / "diffusion_pytorch_model.safetensors.index.json"
    shard = json.loads(index.read_text())["weight_map"][key]
    with safe_open(str(folder / shard), framework="pt") as handle:
        return handle.get_tensor(key).float()


def test_tiny_sources_resolve_and_verify(tiny_dir):
    sources = resolve_sources(AppConfig())
    assert sources.kind == "tiny" and sources.variant == "e1.1"
    assert verify_sources(sources) == []
    full = resolve_sources(AppConfig(variant="e1-full"))
    assert full.e1.endswith("HiDream-E1-Full") and verify_sources(full) == []


def test_verify_names_missing_shard_and_file(tiny_dir, tmp_path):
    broken = tmp_path / "models"
    shutil.copytree(tiny_dir, broken)
    shard = sorted((broken / "HiDream-E1-1" / "transformer").glob("*-00001-of-*.safetensors"))[0]
    shard.unlink()
    (broken / "HiDream-I1-Full" / "vae" / "config.json").unlink()
    problems = verify_sources(resolve_sources(AppConfig(model_dir=broken)))
    text = "\n".join(problems)
    assert shard.name in text and "missing" in text
    assert str(broken / "HiDream-I1-Full" / "vae" / "config.json") in text
    with pytest.raises(ModelError, match=shard.name):
        load_model(AppConfig(model_dir=broken, device="cpu"), cpu(), torch.float32)


def test_state_dict_aliases_parameters_so_a_second_set_must_own_its_tensors():
    """The upstream bug in one line: a state_dict() snapshot changes when the weights are loaded."""
    layer = torch.nn.Linear(4, 4)
    snapshot = layer.state_dict()
    owned = {k: v.clone() for k, v in snapshot.items()}
    layer.load_state_dict({k: torch.full_like(v, 7.0) for k, v in snapshot.items()})
    assert torch.all(snapshot["weight"] == 7.0)  # the "other set" silently became the new weights
    assert not torch.all(owned["weight"] == 7.0)


def test_e11_default_refiner_copies_nothing(tiny_dir):
    model = load_model(AppConfig(device="cpu"), cpu(), torch.float32)
    assert model.swap is None and not model.uses_lora
    key = "double_stream_blocks.0.block.attn1.to_q.weight"
    param = dict(model.pipeline.transformer.named_parameters())[key]
    ptr = param.data_ptr()
    model.use_stage_weights("refine")
    model.use_stage_weights("edit")
    assert param.data_ptr() == ptr
    torch.testing.assert_close(param.detach(), file_tensor(tiny_dir / "HiDream-E1-1" / "transformer", key))


def test_e11_refiner_i1_swaps_to_i1_weights_and_back(tiny_dir):
    model = load_model(AppConfig(device="cpu", refiner="i1"), cpu(), torch.float32)
    swap = model.swap
    assert swap is not None and swap.on_device  # CPU: both sets in memory, pointer swaps
    key = "double_stream_blocks.0.block.attn1.to_q.weight"
    param = dict(model.pipeline.transformer.named_parameters())[key]
    e11 = file_tensor(tiny_dir / "HiDream-E1-1" / "transformer", key)
    i1 = file_tensor(tiny_dir / "HiDream-I1-Full" / "transformer", key)
    assert not torch.equal(e11, i1)
    torch.testing.assert_close(param.detach(), e11)
    # The inactive set owns its storage: no tensor of it is a view of a live parameter.
    live = {p.data_ptr() for p in model.pipeline.transformer.parameters()}
    assert not any(t.data_ptr() in live for t in swap.inactive.values())
    model.use_stage_weights("refine")
    torch.testing.assert_close(param.detach(), i1)
    model.use_stage_weights("edit")
    torch.testing.assert_close(param.detach(), e11)
    assert swap.swaps == 2 and swap.bytes_copied == 0


def test_host_copy_swap_mode_moves_values_both_ways():
    layer = torch.nn.Linear(3, 3)
    original = layer.weight.detach().clone()
    other = torch.randn(3, 3)
    swap = WeightSwap(params={"weight": layer.weight}, inactive={"weight": other.clone()}, on_device=False)
    swap.use("refine")
    torch.testing.assert_close(layer.weight.detach(), other)
    swap.use("edit")
    torch.testing.assert_close(layer.weight.detach(), original)
    assert swap.bytes_copied == 2 * 2 * 9 * 4
    with pytest.raises(ValueError, match="'later'"):
        swap.use("later")


def plain_keys(tiny_dir):
    with safe_open(str(tiny_dir / "HiDream-E1-Full" / E1_FULL_FILE), framework="pt") as handle:
        return {k: handle.get_tensor(k).float() for k in handle.keys() if "lora" not in k}


@pytest.mark.slow
@pytest.mark.parametrize("refiner", ["e1", "i1"])
def test_e1_full_lora_stages_and_plain_keys(tiny_dir, refiner):
    model = load_model(AppConfig(device="cpu", variant="e1-full", refiner=refiner), cpu(), torch.float32)
    assert model.uses_lora
    transformer = model.pipeline.transformer
    params = dict(transformer.named_parameters())
    plain = plain_keys(tiny_dir)
    assert plain, "the tiny E1-Full checkpoint must carry some non-LoRA keys"
    gen = torch.Generator().manual_seed(0)
    text = model.pipeline.encode_text("add a hat")
    hidden = torch.randn(1, 16, 8, 8, generator=gen)
    t = torch.full((1,), 500.0)
    edit_out = model.pipeline.predict(hidden, t, text)
    model.use_stage_weights("refine")
    refine_out = model.pipeline.predict(hidden, t, text)
    for key, value in plain.items():
        name = key if key in params else key.replace(".weight", ".base_layer.weight")
        if refiner == "e1":  # upstream: its "refine" copy aliased the loaded params -> E1-Full values
            torch.testing.assert_close(params[name].detach(), value)
        else:  # documented intent: the original I1 values
            i1 = file_tensor(tiny_dir / "HiDream-I1-Full" / "transformer", key)
            torch.testing.assert_close(params[name].detach(), i1)
    model.use_stage_weights("edit")
    assert not torch.allclose(edit_out, refine_out)  # adapters off in the refine stage
    torch.testing.assert_close(model.pipeline.predict(hidden, t, text), edit_out)
    for key, value in plain.items():
        name = key if key in params else key.replace(".weight", ".base_layer.weight")
        torch.testing.assert_close(params[name].detach(), value)


def test_llama_is_a_base_model_without_eager_attention(tiny_dir):
    """HiDream reads only hidden states: no LM head, and no forced eager attention at load."""
    model = load_model(AppConfig(device="cpu"), cpu(), torch.float32)
    llama = model.pipeline.text_encoder_4
    assert type(llama).__name__ == "LlamaModel"
    assert llama.config._attn_implementation != "eager"
    assert not any("lm_head" in name for name, _ in llama.named_parameters())
