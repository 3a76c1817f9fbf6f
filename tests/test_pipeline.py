"""The edit pipeline and engine on the tiny checkpoint, loaded by the real loader."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from helpers import edit_params
from PIL import Image

from hidream_ui.config import AppConfig
from hidream_ui.edits import EditParams, EditRequest
from hidream_ui.engine.engine import EditEngine
from hidream_ui.engine.errors import EditCancelled, EngineError, OutOfMemory
from hidream_ui.engine.jobs import CancelToken
from hidream_ui.outputs import load_settings
from hidream_ui.pipeline.edit_pipeline import PromptEmbeds
from hidream_ui.pipeline.guidance import refine_start_step

STEPS = 3


def picture(width: int, height: int, seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    base = np.zeros((height, width, 3), dtype=np.uint8)
    base[..., 0] = np.linspace(0, 255, width, dtype=np.uint8)[None, :]
    base[..., 1] = np.linspace(255, 0, height, dtype=np.uint8)[:, None]
    base[..., 2] = rng.integers(0, 255, (height, width), dtype=np.uint8)
    return Image.fromarray(base)


def params(instruction: str = "make the sky purple", **overrides) -> EditParams:
    return edit_params(instruction, steps=STEPS, **overrides)


@pytest.fixture(scope="module")
def engine(tmp_path_factory, tiny_cache):
    out = tmp_path_factory.mktemp("outputs")
    eng = EditEngine(AppConfig(device="cpu", output_dir=out))
    eng.load()
    return eng


def test_loaded_from_tiny_checkpoint_through_real_loader(engine):
    model = engine.model
    assert model.sources.kind == "tiny"
    assert model.geometry.max_seq == 2 * 64  # twice the transformer's own max_seq, as 8192 = 2 * 4096
    assert model.pipeline.transformer.max_seq == model.geometry.max_seq
    assert model.swap is None  # refiner "e1": no second weight set at all
    assert engine.status().model_source == "tiny"


@pytest.mark.slow
def test_same_seed_gives_identical_bytes_and_other_seed_differs(engine):
    image = picture(80, 60)
    a = engine.edit(EditRequest(image=image, params=params(seed=7)), save=False)
    b = engine.edit(EditRequest(image=image, params=params(seed=7)), save=False)
    c = engine.edit(EditRequest(image=image, params=params(seed=8)), save=False)
    assert a.image.tobytes() == b.image.tobytes()
    assert a.image.tobytes() != c.image.tobytes()
    assert a.image.size == image.size and a.params.seed == 7


def test_random_seed_is_resolved_and_reported(engine):
    result = engine.edit(EditRequest(image=picture(64, 64), params=params(seed=-1)), save=False)
    assert 0 <= result.params.seed <= 2**32 - 1


def record_predict(monkeypatch, pipe):
    calls = []
    original = pipe.predict

    def spy(hidden, timestep, text, collapse_padding=True):
        calls.append({"shape": tuple(hidden.shape), "text": text, "collapse": collapse_padding})
        return original(hidden, timestep, text, collapse_padding)

    monkeypatch.setattr(pipe, "predict", spy)
    return calls


@pytest.mark.slow
@pytest.mark.parametrize("clip_cfg_norm", [True, False])
def test_stage_switch_step_and_conditioning(engine, monkeypatch, clip_cfg_norm):
    pipe = engine.model.pipeline
    calls = record_predict(monkeypatch, pipe)
    instruction = "Editing Instruction: add snow. Target Image Description: a snowy field."
    steps, strength = 5, 0.4
    result = engine.edit(
        EditRequest(
            image=picture(64, 64),
            params=params(
                instruction, num_inference_steps=steps, refine_strength=strength, clip_cfg_norm=clip_cfg_norm
            ),
        ),
        save=False,
    )
    switch = refine_start_step(steps, strength)
    assert switch == 3 and len(calls) == steps
    w = result.working_size[0] // 8
    pos, neg, target = (engine.encode(t) for t in (instruction, "low resolution, blur", "a snowy field."))
    for i, call in enumerate(calls):
        if i < switch:  # edit stage: noise and source side by side, three guidance branches
            assert call["shape"][0] == 3 and call["shape"][-1] == 2 * w
            order = [pos if clip_cfg_norm else neg, neg, pos]
        else:  # refine stage: no image conditioning, [neg, target]
            assert call["shape"][0] == 2 and call["shape"][-1] == w
            order = [neg, target]
        expected = PromptEmbeds.cat(order)
        assert torch.equal(call["text"].t5, expected.t5)
        assert torch.equal(call["text"].llama, expected.llama)
        assert torch.equal(call["text"].pooled, expected.pooled)


@pytest.mark.slow
def test_no_guidance_runs_single_branch(engine, monkeypatch):
    calls = record_predict(monkeypatch, engine.model.pipeline)
    engine.edit(EditRequest(image=picture(64, 64), params=params(guidance_scale=1.0, refine_strength=0.5)), save=False)
    assert [c["shape"][0] for c in calls] == [1] * STEPS


@pytest.mark.parametrize(
    "size", [(128, 64), (64, 128), (96, 96), (48, 96)], ids=["wide", "tall", "square", "h_equals_2w"]
)
@pytest.mark.slow
def test_collapse_equals_padded(engine, size):
    pipe = engine.model.pipeline
    width, height = size
    gen = torch.Generator().manual_seed(1)
    for hidden_width in (2 * width // 8, width // 8):  # edit stage input (H x 2W) and refine input (H x W)
        hidden = torch.randn(3, 16, height // 8, hidden_width, generator=gen)
        text = PromptEmbeds.cat([engine.encode("make it red")] * 3)
        t = torch.full((3,), 700.0)
        collapsed = pipe.predict(hidden, t, text, collapse_padding=True)
        padded = pipe.predict(hidden, t, text, collapse_padding=False)
        # fp32 rounding differs between 129 and ~9 token sequences: compare relative to the output scale.
        assert (collapsed - padded).abs().max() <= 1e-5 * padded.abs().max()


@pytest.mark.slow
def test_padding_actually_matters(engine):
    """Sanity check that the comparison above can fail: dropping the padded token changes the output."""
    pipe = engine.model.pipeline
    hidden = torch.randn(1, 16, 8, 16, generator=torch.Generator().manual_seed(2))
    text = engine.encode("make it red")
    t = torch.full((1,), 700.0)
    tokens, mask, sizes, ids = pipe._collapsed_tokens(hidden)
    n = sizes[0, 0] * sizes[0, 1]
    out_full = pipe.transformer(
        hidden_states=tokens,
        hidden_states_masks=mask,
        img_sizes=sizes,
        img_ids=ids,
        timesteps=t,
        encoder_hidden_states_t5=text.t5,
        encoder_hidden_states_llama3=text.llama,
        pooled_embeds=text.pooled,
        return_dict=False,
    )[0]
    out_nopad = pipe.transformer(
        hidden_states=tokens[:, :n],
        hidden_states_masks=mask[:, :n],
        img_sizes=sizes,
        img_ids=ids[:, :n],
        timesteps=t,
        encoder_hidden_states_t5=text.t5,
        encoder_hidden_states_llama3=text.llama,
        pooled_embeds=text.pooled,
        return_dict=False,
    )[0]
    assert (out_full - out_nopad).abs().max() > 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("size", [(3000, 200), (200, 3000), (37, 23)])
def test_odd_sizes_edit_and_come_back_at_source_size(engine, size):
    result = engine.edit(EditRequest(image=picture(*size), params=params(num_inference_steps=1)), save=False)
    assert result.image.size == size
    w, h = result.working_size
    assert w % 16 == 0 and h % 16 == 0 and w * h <= 64 * 64


@pytest.mark.slow
def test_text_encoders_run_once_for_repeated_instruction(engine):
    before = engine.counters["text_encoder_calls"]
    for seed in range(3):
        engine.edit(EditRequest(image=picture(64, 64), params=params("a fresh instruction", seed=seed)), save=False)
    # Three texts per edit (instruction, negative prompt, target): only the new instruction is encoded, once.
    assert engine.counters["text_encoder_calls"] - before == 1


@pytest.mark.slow
def test_cancel_stops_within_a_step_and_engine_stays_usable(engine):
    seen = []
    token = CancelToken()  # what Stop, /cancel and a client's disconnect set (the job's token)

    def on_step(info):
        seen.append(info.step)
        if info.step == 1:
            threading.Thread(target=token.cancel).start()

    with pytest.raises(EditCancelled):
        engine.edit(
            EditRequest(image=picture(64, 64), params=params(num_inference_steps=6)), on_step=on_step, cancel=token
        )
    assert 1 <= max(seen) <= 2
    assert engine.status().state == "idle"
    assert engine.edit(EditRequest(image=picture(64, 64), params=params()), save=False).image.size == (64, 64)


@pytest.mark.slow
def test_simulated_out_of_memory_is_reported_and_engine_recovers(engine, monkeypatch):
    pipe = engine.model.pipeline

    def boom(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

    monkeypatch.setattr(pipe, "predict", boom)
    with pytest.raises(OutOfMemory, match="out of memory on cpu"):
        engine.edit(EditRequest(image=picture(64, 64), params=params()), save=False)
    monkeypatch.undo()
    assert engine.status().state == "idle"
    assert engine.edit(EditRequest(image=picture(64, 64), params=params()), save=False).image.size == (64, 64)


@pytest.mark.slow
def test_settings_round_trip_through_saved_png(engine):
    request = EditRequest(
        image=picture(72, 56), params=params("turn it to night", seed=-1, guidance_scale=4.5), source_name="street.png"
    )
    result = engine.edit(request)
    assert result.saved_png.is_file() and result.saved_json.is_file()
    loaded = load_settings(result.saved_png)
    assert loaded == result.params
    rerun = engine.edit(EditRequest(image=request.image, params=loaded), save=False)
    assert rerun.image.tobytes() == result.image.tobytes()


@pytest.mark.slow
def test_full_edit_is_the_same_under_every_cpu_strategy(engine):
    request = EditRequest(image=picture(80, 48), params=params(seed=11))
    available = [s.name for s in engine.attention_choices() if s.available and s.name != "auto"]
    assert {"sdpa", "math", "chunked"} <= set(available)
    before = engine.attention_request
    try:
        engine.set_attention("sdpa")
        reference = np.asarray(engine.edit(request, save=False).image, dtype=np.int16)
        for name in available:
            assert engine.set_attention(name) == name
            result = engine.edit(request, save=False)
            assert result.info.attention == name
            # Exact kernels: the same picture up to fp32 rounding (at most a step of the 8-bit output).
            assert np.abs(np.asarray(result.image, dtype=np.int16) - reference).max() <= 1, name
    finally:
        engine.set_attention(before)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["cpu", "offload"])
def test_text_encoder_placement_modes_give_the_same_edit(engine, tmp_path, mode):
    request = EditRequest(image=picture(64, 64), params=params("paint it gold", seed=4))
    reference = engine.edit(request, save=False).image
    other = EditEngine(AppConfig(device="cpu", output_dir=tmp_path, text_encoders=mode))
    result = other.edit(request, save=False)
    pipe = other.model.pipeline
    assert pipe.text_encoder_mode == mode
    # Between encodes the encoders live on the host in both modes.
    assert {
        str(e.device) for e in (pipe.text_encoder, pipe.text_encoder_2, pipe.text_encoder_3, pipe.text_encoder_4)
    } == {"cpu"}
    assert result.image.tobytes() == reference.tobytes()


@pytest.mark.slow
def test_several_images_per_prompt_and_one_call_for_a_batch(engine):
    pipe = engine.model.pipeline
    images = [picture(64, 64, seed=s) for s in range(2)]
    gens = [torch.Generator().manual_seed(s) for s in (1, 2, 3, 4)]
    out = pipe(
        image=images,
        prompt=["make it red", "make it blue"],
        num_inference_steps=2,
        num_images_per_prompt=2,
        generator=gens,
        output_type="np",
        prompt_embeds_fn=engine.encode,
    )
    assert out.images.shape == (4, 64, 64, 3)
    assert not np.allclose(out.images[0], out.images[1])  # two seeds for the same prompt
    with pytest.raises(ValueError, match="share a working size"):
        pipe(image=[picture(64, 64), picture(80, 64)], prompt="x", num_inference_steps=1)


def test_working_resolution_beyond_the_token_budget_is_a_clear_error(engine):
    # The tiny model handles a 128 px working side; 256 would need 4x its max_seq.
    with pytest.raises(EngineError, match="needs 512 tokens, more than this model's 128"):
        engine.edit(EditRequest(image=picture(64, 64), params=params(working_resolution="256")), save=False)
    assert engine.status().state == "idle"


def test_the_error_suggests_only_resolutions_this_model_can_take(engine):
    # The tiny model works at 128 px, below the 256 px minimum of a numeric side: only words fit.
    with pytest.raises(EngineError, match="choose 'auto' or 'draft'") as info:
        engine.edit(EditRequest(image=picture(64, 64), params=params(working_resolution="512")), save=False)
    assert "at most 128" not in str(info.value)
    assert engine.working_resolution_choices() == ["auto", "draft"]


def test_working_sides_follow_the_model_geometry():
    from hidream_ui.engine.engine import working_sides
    from hidream_ui.model.geometry import geometry_for

    real = geometry_for("e1.1", {"patch_size": 2, "max_resolution": [128, 128]}, {"block_out_channels": [1] * 4})
    assert real.image_size == 1024 and working_sides(real) == [512, 768, 1024]
    small = geometry_for("e1.1", {"patch_size": 2, "max_resolution": [64, 64]}, {"block_out_channels": [1] * 4})
    assert working_sides(small) == [512]
    # E1-Full takes a side N as N x N within a 4608-token budget: 1024 (8192 tokens) must not be offered.
    full = geometry_for("e1-full", {"patch_size": 2, "max_resolution": [128, 128]}, {"block_out_channels": [1] * 4})
    assert full.max_seq == 4608 and working_sides(full) == [512, 768]


@pytest.mark.slow
def test_a_cancel_token_stops_the_edit_within_one_step(engine):
    from hidream_ui.engine.jobs import CancelToken

    token = CancelToken()

    def on_step(info):
        if info.step == 2:
            token.cancel("test")

    with pytest.raises(EditCancelled, match="after 2 of 8 steps"):
        engine.edit(EditRequest(image=picture(64, 64), params=params(num_inference_steps=8)), on_step, cancel=token)
    assert token.cancelled_at_step == 2 and token.step == 2
    # A token that is already set never starts an edit; a fresh edit is not affected by it.
    with pytest.raises(EditCancelled, match="before it started"):
        engine.edit(EditRequest(image=picture(64, 64), params=params()), cancel=token)
    assert engine.edit(EditRequest(image=picture(64, 64), params=params()), save=False).image.size == (64, 64)


@pytest.mark.slow
def test_out_of_memory_frees_memory_after_the_failing_frames_are_gone(engine, monkeypatch):
    import gc
    import weakref

    pipe = engine.model.pipeline
    held = {}

    def boom(*args, **kwargs):
        activations = torch.ones(1024, 1024)  # what a real forward holds when the allocator gives up
        held["ref"] = weakref.ref(activations)
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

    seen = {}

    def free():
        gc.collect()
        seen["alive_when_freed"] = held["ref"]() is not None

    monkeypatch.setattr(pipe, "predict", boom)
    monkeypatch.setattr(engine, "_free", free)
    with pytest.raises(OutOfMemory) as info:
        engine.edit(EditRequest(image=picture(64, 64), params=params()), save=False)
    assert seen == {"alive_when_freed": False}  # the traceback no longer pinned the tensors
    assert info.value.__cause__ is None and info.value.__context__ is None


@pytest.mark.parametrize("value", [5, ["sdpa"], {"name": "sdpa"}])
def test_an_attention_name_that_is_not_text_is_a_clear_error(engine, value):
    with pytest.raises(EngineError, match="attention must be a strategy name"):
        engine.set_attention(value)


@pytest.mark.slow
def test_a_cancel_during_the_last_step_saves_nothing(engine, tmp_path):
    from hidream_ui.engine.jobs import CancelToken

    token = CancelToken()
    before = sorted(engine.config.output_dir.glob("*.png"))

    def on_step(info):
        if info.step == info.total:  # the request arrives while the last step runs
            token.cancel("test")

    with pytest.raises(EditCancelled, match="after the last step"):
        engine.edit(EditRequest(image=picture(64, 64), params=params(num_inference_steps=3)), on_step, cancel=token)
    assert sorted(engine.config.output_dir.glob("*.png")) == before


def test_the_pipeline_defaults_are_the_edit_schemas_and_it_takes_plain_arguments():
    """The pipeline keeps upstream E1.1's defaults in its signature (pipeline/defaults.py), as a diffusers
    pipeline does; the app's schema reads them from there: both agree, and the refine prompt rule is one."""
    import inspect

    from hidream_ui import edits
    from hidream_ui.pipeline import prompts
    from hidream_ui.pipeline.edit_pipeline import HiDreamEditPipeline

    settings = edits.EditSettings()
    parameters = inspect.signature(HiDreamEditPipeline.__call__).parameters
    shared = [name for name in edits.SETTING_NAMES if name in parameters]
    assert len(shared) == 7, shared  # everything but the working resolution and the step cache (the engine's)
    assert {name: parameters[name].default for name in shared} == {name: getattr(settings, name) for name in shared}
    assert edits.target_prompt is prompts.target_prompt and edits.TARGET_MARKER == prompts.TARGET_MARKER
    assert prompts.target_prompt("Editing Instruction: x. Target Image Description: a red cube.") == "a red cube."
