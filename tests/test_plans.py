"""Memory plans (model/plans.py), the planner (model/planner.py) and fp8 storage (model/fp8.py).

The full profile's numbers come from the release's configs through the planner only (nothing is
loaded: 61 GB would not fit this machine). Every plan runs for real on the tiny model on CPU, where
the offloading hooks move nothing but run their full code path.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import edit_params
from PIL import Image

from hidream_ui.config import AppConfig, ConfigError, from_args
from hidream_ui.edits import EditRequest
from hidream_ui.engine.engine import EditEngine
from hidream_ui.engine.errors import EngineError
from hidream_ui.model.planner import choose, estimate, parse_bytes, plan_for, sizes_from_configs
from hidream_ui.model.plans import PLAN_SPECS, PLANS, installed_hooks
from hidream_ui.model.tiny.profiles import RELEASE_CONFIGS

GB = 10**9


@pytest.fixture(scope="module")
def full_sizes():
    return sizes_from_configs(RELEASE_CONFIGS)


def auto_at(sizes, free_gb: float, **kwargs):
    return choose(sizes, free=int(free_gb * GB), working_size=(1024, 1024), element=2, **kwargs)


# ----------------------------------------------------------------------------------------------- planner


def test_full_profile_part_bytes_match_the_release(full_sizes):
    # The figures for the bf16 release: transformer 34.2 GB, Llama (no LM head) 15 GB, T5-XXL 9.5 GB,
    # CLIP-L + CLIP-G 1.6 GB, VAE 0.2 GB.
    assert full_sizes.transformer.total * 2 / GB == pytest.approx(34.2, abs=0.1)
    assert full_sizes.encoders["llama"].total * 2 / GB == pytest.approx(15.0, abs=0.1)
    assert full_sizes.encoders["t5"].total * 2 / GB == pytest.approx(9.5, abs=0.1)
    clips = full_sizes.encoders["clip_l"].total + full_sizes.encoders["clip_g"].total
    assert clips * 2 / GB == pytest.approx(1.6, abs=0.1)
    assert full_sizes.vae.total * 2 / GB == pytest.approx(0.17, abs=0.03)
    # fp8 stores nearly every transformer weight (all but embedders, norms, gates, final layer)
    assert 0.99 < full_sizes.transformer.fp8 / full_sizes.transformer.total < 1.0


def test_auto_picks_full_for_80gb(full_sizes):
    choice = auto_at(full_sizes, 80)
    assert (choice.chosen.name, choice.chosen.weights) == ("full", "bf16")


def test_auto_picks_an_encoder_plan_without_fp8_or_blocks_for_64gb(full_sizes):
    chosen = auto_at(full_sizes, 64).chosen
    assert chosen.name in ("encoders-offload", "encoders-cpu") and chosen.weights == "bf16"
    # ... because full does not fit: the prediction says so, not a rule
    full = estimate(full_sizes, "full", "bf16", (1024, 1024), 2)
    assert full.peak > 64 * GB - 3.2 * GB


def test_auto_picks_fp8_without_blocks_for_24gb(full_sizes):
    chosen = auto_at(full_sizes, 24).chosen
    assert chosen.weights == "fp8" and PLAN_SPECS[chosen.name].transformer == "resident"
    assert chosen.predicted_peak <= 22 * GB  # the goal for a 24 GB card


def test_auto_picks_blocks_for_16gb(full_sizes):
    chosen = auto_at(full_sizes, 16).chosen
    assert chosen.name == "blocks"


def test_each_plan_predicts_less_device_memory_than_the_one_before(full_sizes):
    peaks = [estimate(full_sizes, plan, "bf16", (1024, 1024), 2).peak for plan in PLANS]
    assert peaks[0] > peaks[1] >= peaks[2] > peaks[3] > peaks[4]
    fp8 = estimate(full_sizes, "encoders-cpu", "fp8", (1024, 1024), 2)
    assert fp8.peak < peaks[2] - 15 * GB  # fp8 saves about half of the 34 GB transformer


def test_too_small_a_device_is_refused_with_the_numbers(full_sizes):
    choice = auto_at(full_sizes, 1.5, weights="bf16")
    assert choice.chosen is None
    assert "needs at least" in choice.refusal and "GB" in choice.refusal and "1.5 GB is free" in choice.refusal
    assert "--weights fp8" in choice.refusal and "smaller working resolution" in choice.refusal


def test_smaller_working_size_needs_less(full_sizes):
    big = estimate(full_sizes, "encoders-cpu", "bf16", (1024, 1024), 2)
    small = estimate(full_sizes, "encoders-cpu", "bf16", (512, 512), 2)
    assert small.peak < big.peak and small.host == big.host


def test_refiner_i1_excludes_streamed_transformer_plans(full_sizes):
    choice = auto_at(full_sizes, 16, refiner="i1")
    assert choice.chosen is None or PLAN_SPECS[choice.chosen.name].transformer == "resident"
    notes = {row.plan: row.note for row in choice.rows}
    assert "--refiner i1" in notes["blocks"]


def test_parse_bytes():
    assert parse_bytes("24GB") == 24 * GB
    assert parse_bytes("24GiB") == 24 * 2**30
    assert parse_bytes("16") == 16 * GB
    with pytest.raises(ValueError, match="'lots'"):
        parse_bytes("lots")


# ----------------------------------------------------------------------------------------------- config


def test_memory_flags_and_text_encoders_alias():
    assert from_args(["--memory", "blocks"]).memory == "blocks"
    assert from_args([], {"HIDREAM_MEMORY": "sequential", "HIDREAM_WEIGHTS": "fp8"}).weights == "fp8"
    assert from_args(["--text-encoders", "cpu"]).memory == "encoders-cpu"
    assert from_args(["--text-encoders", "offload"]).memory == "encoders-offload"
    assert from_args(["--text-encoders", "device"]).memory == "auto"
    with pytest.raises(ConfigError, match="memory='huge'"):
        from_args(["--memory", "huge"])
    with pytest.raises(ConfigError, match="weights='int4'"):
        from_args(["--weights", "int4"])
    with pytest.raises(ConfigError, match="text_encoders='cpu' means memory='encoders-cpu'"):
        from_args(["--text-encoders", "cpu", "--memory", "full"])
    with pytest.raises(ConfigError, match="--refiner i1"):
        from_args(["--memory", "blocks", "--refiner", "i1"])
    with pytest.raises(ConfigError, match="does not exist"):
        from_args(["--transformer-file", "/nowhere/x.safetensors"])


# ----------------------------------------------------------------------------------------------- tiny model


def _picture() -> Image.Image:
    rng = np.random.default_rng(3)
    return Image.fromarray(rng.integers(0, 256, (60, 80, 3), dtype=np.uint8))


@pytest.fixture(scope="module")
def reference(tiny_cache, tmp_path_factory):
    engine = EditEngine(
        AppConfig(device="cpu", memory="full", weights="bf16", output_dir=tmp_path_factory.mktemp("plans_out"))
    )
    latents, result = _latents_via_callback(engine)
    return latents, result


def _latents_via_callback(engine: EditEngine):
    """Runs one edit and returns (final latents, result) through the engine's own step callback."""
    captured = {}
    engine.load()
    pipe = engine.model.pipeline
    step = pipe.scheduler.step

    def recording_step(*args, **kwargs):
        out = step(*args, **kwargs)
        captured["latents"] = out[0].detach().clone()
        return out

    pipe.scheduler.step = recording_step
    try:
        result = engine.edit(EditRequest(image=_picture(), params=edit_params(steps=3, seed=11)), save=False)
    finally:
        pipe.scheduler.step = step
    return captured["latents"], result


@pytest.mark.slow
@pytest.mark.parametrize("plan", [p for p in PLANS if p != "full"])
def test_every_plan_gives_the_same_latents_as_full(plan, reference, tmp_path):
    engine = EditEngine(AppConfig(device="cpu", memory=plan, weights="bf16", output_dir=tmp_path))
    latents, result = _latents_via_callback(engine)
    assert torch.equal(latents, reference[0]), f"{plan}: max diff {(latents - reference[0]).abs().max().item()}"
    assert result.image.tobytes() == reference[1].image.tobytes()
    model = engine.model
    assert model.plan.name == plan and result.info.memory_plan["name"] == plan
    hooks = installed_hooks(model.pipeline.transformer)
    spec = PLAN_SPECS[plan]
    if spec.transformer == "resident":
        assert "group_offloading" not in hooks
    else:
        assert hooks.get("group_offloading", 0) > 0
    encoder_hooks = installed_hooks(model.pipeline.text_encoder_4)
    assert ("group_offloading" in encoder_hooks) == (spec.encoders in ("blocks", "leaf"))
    assert engine.status().memory_plan.name == plan


def test_full_plan_installs_no_hooks(reference, tiny_cache, tmp_path):
    engine = EditEngine(AppConfig(device="cpu", output_dir=tmp_path))
    engine.load()
    pipe = engine.model.pipeline
    for name in ("transformer", "vae", "text_encoder", "text_encoder_2", "text_encoder_3", "text_encoder_4"):
        assert installed_hooks(getattr(pipe, name)) == {}
    assert engine.model.plan.requested == "auto" and engine.model.plan.name == "full"
    from hidream_ui.ui.status_panel import render_status

    panel = render_status(engine.status())  # plain words, agreeing with "Computes in" (issue 21)
    assert "Memory plan" in panel
    assert f"everything resident on the device (chosen to fit) · weights in {engine.status().dtype}" in panel
    assert engine.status().to_dict()["memory_plan"]["name"] == "full"


@pytest.mark.slow
def test_fp8_output_close_to_bf16_and_reports_its_error(reference, tmp_path):
    engine = EditEngine(AppConfig(device="cpu", memory="full", weights="fp8", output_dir=tmp_path))
    latents, _ = _latents_via_callback(engine)
    transformer = engine.model.pipeline.transformer
    assert installed_hooks(transformer).get("layerwise_casting", 0) > 0
    stored = {p.dtype for p in transformer.double_stream_blocks.parameters()}
    assert torch.float8_e4m3fn in stored
    assert transformer.x_embedder.proj.weight.dtype == torch.float32  # embedders stay in the compute dtype
    diff = (latents - reference[0]).abs().max().item()
    scale = reference[0].abs().max().item()
    assert 0 < diff < 0.5 * scale, f"fp8 error {diff} vs output scale {scale}"


def test_a_plan_that_cannot_fit_is_refused_before_loading(tiny_cache, tmp_path, monkeypatch):
    import hidream_ui.model.loading as loading

    called = []
    monkeypatch.setattr(loading, "load_model", lambda *a, **k: called.append(1))
    engine = EditEngine(AppConfig(device="cpu", memory="full", weights="bf16", output_dir=tmp_path))
    import hidream_ui.device.memory as memory

    real = memory.snapshot

    def tiny_free(device, backends=None, sync=False):
        import dataclasses

        return dataclasses.replace(real(device, backends, sync), free=1000)

    monkeypatch.setattr(memory, "snapshot", tiny_free)
    with pytest.raises(EngineError, match="needs at least .* 0.0 GB is free"):
        engine.load()
    assert called == []


def test_plan_for_tiny_reads_configs_only(tiny_cache):
    from hidream_ui.device.detect import resolve_device

    config = AppConfig(device="cpu")
    choice = plan_for(config, resolve_device("cpu"), torch.float32, free=10 * GB)
    assert choice.chosen.name == "full" and len(choice.rows) == 10


@pytest.mark.slow
def test_fp8_halves_the_transformers_resident_bytes_measured_in_rss(tmp_path):
    """A transformer big enough for RSS to see (~140 MB in bf16) written by the tiny builder's own writer,
    streamed into bf16 and into fp8 storage, each in a fresh process (bench memory's measurement)."""
    import dataclasses

    from hidream_ui.bench.memory import transformer_load
    from hidream_ui.model.tiny.parts import _write_transformer
    from hidream_ui.model.tiny.profiles import PROFILES

    spec = dataclasses.replace(
        PROFILES["tiny"], name="mid", num_attention_heads=8, attention_head_dim=64, transformer_shards=3
    )
    _write_transformer(tmp_path / "transformer", spec, 0, stream="mid")
    load = transformer_load(tmp_path / "transformer")
    assert load["bf16"]["param_bytes"] > 100 * 2**20
    assert load["param_ratio"] <= 0.52
    assert load["resident_ratio"] <= 0.55, load
    # Streaming: the host never held the bf16 copy on the way to fp8 (bf16 then cast would peak at 1.5x).
    assert load["fp8"]["peak_growth"] <= 0.75 * load["bf16"]["param_bytes"], load


# ----------------------------------------------------------------------------------------------- plan command


def test_plan_command_marks_the_auto_choice(capsys):
    from hidream_ui.cli.plan import main

    # Host RAM counts (issue 25): the streaming plans need 26+ GB of it, so name a host that has it.
    assert main(["--tiny-profile", "full", "--device-memory", "24GB", "--host-memory", "64GB"]) == 0
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if "<- auto" in line]
    assert len(lines) == 1 and "fp8" in lines[0] and "blocks" not in lines[0]
    assert all(plan in out for plan in PLANS)


def test_plan_command_json_and_refusal(capsys):
    import json

    from hidream_ui.cli.plan import main

    assert main(["--tiny-profile", "full", "--device-memory", "80GB", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["chosen"]["name"] == "full" and report["working_size"] == [1024, 1024]
    assert len(report["rows"]) == 10 and report["free"] == 80 * GB
    assert main(["--tiny-profile", "full", "--device-memory", "8GB", "--weights", "bf16", "--memory", "full"]) == 1
    out = capsys.readouterr().out
    assert "needs at least" in out and "8.0 GB is free" in out and "--memory auto" in out


def test_plan_command_names_bad_values(capsys):
    from hidream_ui.cli.plan import main

    assert main(["--device-memory", "lots"]) == 2
    assert "'lots'" in capsys.readouterr().err
    assert main(["--tiny-profile", "full", "--working-resolution", "1000"]) == 2
    assert "'1000'" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------- full profile


@pytest.mark.slow
def test_full_profile_is_made_in_memory_through_the_real_loader(tiny_cache, tmp_path, monkeypatch):
    """The full profile's code path with the release dimensions swapped for small ones (61 GB would not fit
    here): parts made in memory from merged configs, nothing written, placed by the plan, and an edit runs."""
    from types import MappingProxyType

    from hidream_ui.model.tiny import profiles

    small = {part: MappingProxyType({}) for part in profiles.RELEASE_CONFIGS}
    small["t5"] = MappingProxyType({"num_layers": 1})  # a visible override of the tiny config (2 layers)
    monkeypatch.setattr(profiles, "RELEASE_CONFIGS", MappingProxyType(small))
    engine = EditEngine(
        AppConfig(device="cpu", tiny_profile="full", memory="blocks", weights="fp8", output_dir=tmp_path)
    )
    result = engine.edit(EditRequest(image=_picture(), params=edit_params(steps=2, seed=1)), save=False)
    pipe = engine.model.pipeline
    assert pipe.text_encoder_3.config.num_layers == 1
    assert engine.model.sources.tiny_profile == "full" and result.info.memory_plan["name"] == "blocks"
    assert any(p.dtype == torch.float8_e4m3fn for p in pipe.transformer.parameters())
    assert installed_hooks(pipe.transformer).get("group_offloading", 0) > 0
    with pytest.raises(ConfigError, match="tiny_profile='huge'"):
        AppConfig(tiny_profile="huge").replace()


# ----------------------------------------------------------------------------------------------- single file


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["diffusers", "comfyui"])
def test_single_file_transformer_loads_and_edits_like_the_folder(kind, reference, tiny_dir, tmp_path):
    from hidream_ui.model.tiny.profiles import SINGLE_FILE_DIR, SINGLE_FILES

    path = tiny_dir / SINGLE_FILE_DIR / SINGLE_FILES[kind]
    config = from_args(
        [
            "--transformer-file",
            str(path),
            "--device",
            "cpu",
            "--memory",
            "full",
            "--weights",
            "bf16",
            "--output-dir",
            str(tmp_path),
        ]
    )
    latents, _ = _latents_via_callback(EditEngine(config))
    assert torch.equal(latents, reference[0])


@pytest.mark.slow
def test_single_file_with_fp8_streams_the_file(tiny_dir, tmp_path):
    from hidream_ui.model.tiny.profiles import SINGLE_FILE_DIR, SINGLE_FILES

    folder = EditEngine(AppConfig(device="cpu", memory="full", weights="fp8", output_dir=tmp_path))
    single = EditEngine(
        AppConfig(
            device="cpu",
            memory="full",
            weights="fp8",
            output_dir=tmp_path,
            transformer_file=tiny_dir / SINGLE_FILE_DIR / SINGLE_FILES["comfyui"],
        )
    )
    assert torch.equal(_latents_via_callback(folder)[0], _latents_via_callback(single)[0])


def test_transformer_file_is_refused_for_e1_full(tiny_dir):
    from hidream_ui.model.tiny.profiles import SINGLE_FILE_DIR, SINGLE_FILES

    path = tiny_dir / SINGLE_FILE_DIR / SINGLE_FILES["diffusers"]
    with pytest.raises(ConfigError, match="replaces the E1.1 transformer"):
        from_args(["--transformer-file", str(path), "--variant", "e1-full"])
    with pytest.raises(ConfigError, match="must be a .safetensors file"):
        from_args(["--transformer-file", str(tiny_dir / "hidream_ui_tiny.json")])


# ----------------------------------------------------------------------------------------------- bench memory


@pytest.mark.slow
def test_bench_memory_measures_plans_side_by_side(tiny_cache):
    """Two plans through the real benchmark (fresh processes): offload matches full bit for bit, each row has
    the planner's prediction beside the measured figures."""
    from hidream_ui.bench.memory import format_table, run

    report = run("tiny", "cpu", "auto", 1, [("full", "bf16"), ("blocks", "bf16")], transformer_load_too=False)
    rows = {row["plan"]: row for row in report["rows"]}
    assert rows["full"]["max_abs_diff_vs_full"] == 0 and rows["blocks"]["max_abs_diff_vs_full"] == 0
    for row in rows.values():
        assert row["predicted_peak"] > 0 and row["host_peak_growth"] > 0 and row["seconds_per_step"] > 0
        assert row["device_peak"] is None  # CPU: no device allocator
    assert rows["blocks"]["predicted_peak"] < rows["full"]["predicted_peak"]
    assert "blocks" in format_table(report)


# ----------------------------------------------------------------------------------------------- composition


@pytest.mark.slow
def test_fp8_composes_with_e1_full_lora_and_the_refine_weight_swap(tiny_cache, tmp_path):
    lora = EditEngine(AppConfig(device="cpu", memory="full", weights="fp8", variant="e1-full", output_dir=tmp_path))
    lora.edit(EditRequest(image=_picture(), params=edit_params(steps=2, seed=1)), save=False)
    params = dict(lora.model.pipeline.transformer.named_parameters())
    assert {p.dtype for n, p in params.items() if "lora_" in n} == {torch.float32}  # the adapter is not fp8
    assert params["double_stream_blocks.0.block.attn1.to_q.base_layer.weight"].dtype == torch.float8_e4m3fn

    swap = EditEngine(AppConfig(device="cpu", memory="encoders-cpu", weights="fp8", refiner="i1", output_dir=tmp_path))
    swap.edit(EditRequest(image=_picture(), params=edit_params(steps=3, seed=1)), save=False)
    weights = swap.model.swap
    assert weights.swaps >= 2 and weights.active == "edit"
    # The second set is kept in each parameter's own storage dtype (fp8 where fp8 stores).
    assert all(weights.inactive[name].dtype == weights.params[name].dtype for name in weights.inactive)
    assert any(t.dtype == torch.float8_e4m3fn for t in weights.inactive.values())


def test_hub_sources_load_with_the_asked_plan_without_a_prediction(tmp_path):
    from hidream_ui.device.detect import resolve_device
    from hidream_ui.model.planner import resolve_plan

    config = AppConfig(device="cpu", i1="org/i1", e1="org/e1", llama="org/llama", memory="encoders-cpu")
    plan = resolve_plan(config, resolve_device("cpu"), torch.float32)
    assert plan.name == "encoders-cpu" and plan.predicted_peak is None and "no prediction" in plan.reason


def test_fp8_is_refused_with_the_reason_where_the_device_cannot_hold_it(tiny_cache):
    """A (fake) NPU: no torch_npu here, so the real fp8 round trip on "npu:0" fails and its reason is given;
    `auto` then skips the fp8 rows instead of refusing."""
    from fakes import FakeNPUBackend

    from hidream_ui.device.backends import CPUBackend, DeviceInfo
    from hidream_ui.model.plans import PlanRefused

    npu = DeviceInfo(type="npu", index=0, torch_device="npu:0", name="FakeNPU-0")
    backends = {"npu": FakeNPUBackend(), "cpu": CPUBackend()}
    with pytest.raises(PlanRefused, match="cannot hold float8_e4m3fn tensors on npu:0"):
        plan_for(AppConfig(weights="fp8"), npu, torch.bfloat16, backends)
    choice = plan_for(AppConfig(), npu, torch.bfloat16, backends, free=24 * GB)
    assert all("float8" in row.note for row in choice.rows if row.weights == "fp8")
    assert choice.chosen.weights == "bf16"


# ----------------------------------------------------------------------------------------------- --placement


SPLIT = (("transformer", "npu:0"), ("encoders", "npu:1"), ("vae", "npu:1"))


def test_encoders_placed_on_a_second_card_leave_the_transformer_cards_prediction(full_sizes):
    from hidream_ui.model.planner import split_for

    split = split_for(SPLIT, "npu:0")
    assert split.encoders == "away" and split.vae_away and split.others == (("npu:1", ("encoders", "vae")),)
    encoders = full_sizes.encoder_total * 2
    vae = full_sizes.vae.total * 2
    for plan in ("full", "encoders-offload"):
        alone = estimate(full_sizes, plan, "bf16", (1024, 1024), 2)
        placed = estimate(full_sizes, plan, "bf16", (1024, 1024), 2, split=split)
        # full: the encoders' 26 GB (and the VAE) leave the transformer's card; the denoise phase is its peak
        if plan == "full":
            assert alone.peak - placed.peak == pytest.approx(encoders + vae, rel=0.05)
            assert alone.peak - placed.peak > 25 * GB
        assert placed.phases["denoise"] == pytest.approx(
            alone.phases["denoise"] - (encoders if plan == "full" else 0) - vae, rel=1e-6
        )
        assert placed.phases["decode"] < alone.phases["decode"] and placed.host == 0
    # encoders placed on the transformer's own card are resident there whatever the plan says
    same = split_for((("transformer", "npu:0"), ("encoders", "npu:0")), "npu:0")
    assert same.others == () and same.encoders == "resident"
    assert (
        estimate(full_sizes, "encoders-cpu", "bf16", (1024, 1024), 2, split=same).peak
        == estimate(full_sizes, "full", "bf16", (1024, 1024), 2).peak
    )


@pytest.mark.parametrize(
    "free_gb, alone, placed",
    [
        (64, ("encoders-offload", "bf16"), ("full", "bf16")),  # the encoders need not stream: new texts cost nothing
        # exact bf16 storage instead of fp8 (39.2 GB: between the two peaks since the trace recalibration, issue 25)
        (39.2, ("encoders-offload", "fp8"), ("full", "bf16")),
    ],
)
def test_auto_picks_a_faster_plan_when_the_encoders_live_on_a_second_card(full_sizes, free_gb, alone, placed):
    from hidream_ui.model.planner import split_for

    split = split_for(SPLIT, "npu:0")
    without = auto_at(full_sizes, free_gb).chosen
    with_split = auto_at(full_sizes, free_gb, split=split, other_free={"npu:1": 32 * GB})
    assert (without.name, without.weights) == alone
    assert (with_split.chosen.name, with_split.chosen.weights) == placed
    assert "on npu:1 by --placement, not counted here" in with_split.chosen.reason
    (need,) = with_split.devices
    assert need.device == "npu:1" and need.parts == ("encoders", "vae") and need.fits
    assert need.weights == (full_sizes.encoder_total + full_sizes.vae.total) * 2 and need.peak > need.weights


def test_a_second_card_too_small_for_its_placed_parts_is_refused_with_the_numbers(full_sizes):
    from hidream_ui.model.planner import split_for

    choice = auto_at(full_sizes, 80, split=split_for(SPLIT, "npu:0"), other_free={"npu:1": 16 * GB})
    assert choice.chosen is None and choice.devices[0].fits is False
    assert "npu:1 (--placement encoders, vae) needs at least" in choice.refusal
    assert "weights 26.3 GB" in choice.refusal and "16.0 GB is free" in choice.refusal
    # unknown free memory there (a backend without the figure) is not a refusal
    assert auto_at(full_sizes, 80, split=split_for(SPLIT, "npu:0"), other_free={}).chosen.name == "full"


class _TwoCards:
    """A fake NPU backend whose cards have different free memory (index -> bytes)."""

    def __new__(cls, free_by_index):
        from fakes import FakeNPUBackend

        class Cards(FakeNPUBackend):
            def mem_get_info(self, index):
                super().mem_get_info(index)
                return free_by_index[index], self.total

        return Cards(count=2, reserved=0, active=0, total=80 * GB)


def test_the_engine_refuses_before_loading_when_the_placed_card_cannot_hold_the_encoders(tmp_path, monkeypatch):
    """Free memory of both cards is read the way the planner reads the engine's (the backend's figures):
    the encoders' card has 16 GB free, the encoders alone weigh 26 GB, so nothing is loaded."""
    from hidream_ui.device.backends import CPUBackend
    from hidream_ui.model import loading

    called = []
    monkeypatch.setattr(loading, "load_model", lambda *a, **k: called.append(1))
    backends = {"npu": _TwoCards({0: 80 * GB, 1: 16 * GB}), "cpu": CPUBackend()}
    config = from_args(
        [
            "--tiny-profile",
            "full",
            "--placement",
            "transformer=npu:0,encoders=npu:1,vae=npu:1",
            "--dtype",
            "bf16",
            "--weights",
            "bf16",
        ],
        environ={},
    ).replace(output_dir=tmp_path)
    engine = EditEngine(config, backends=backends)
    with pytest.raises(EngineError, match=r"npu:1 \(--placement encoders, vae\) needs at least .* 16.0 GB is free"):
        engine.load()
    assert called == []
    # the same cards the other way round: the transformer's card has room for `full` without the encoders
    from hidream_ui.model.planner import resolve_plan

    backends = {"npu": _TwoCards({0: 40 * GB, 1: 32 * GB}), "cpu": CPUBackend()}
    plan = resolve_plan(config, engine.device, torch.bfloat16, backends)
    assert (plan.name, plan.weights) == ("full", "bf16") and "npu:1 by --placement" in plan.reason


def test_plan_command_shows_one_line_per_placed_device(capsys):
    import json

    from hidream_ui.cli.plan import main

    argv = ["--tiny-profile", "full", "--placement", "transformer=cuda:0,encoders=cuda:1,vae=cuda:1"]
    assert main([*argv, "--device-memory", "40GB", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["chosen"]["name"] == "full" and report["chosen"]["weights"] == "bf16"
    engine, other = report["devices"]
    assert engine["device"] == "cuda:0" and engine["parts"] == ["transformer"] and engine["fits"] is True
    assert other["device"] == "cuda:1" and other["parts"] == ["encoders", "vae"] and other["free"] == 40 * GB
    assert other["fits"] is True and 26 * GB < other["peak"] < 40 * GB
    # a 20 GB second card cannot hold the 26 GB of encoders: refused (exit 1), the table still shown
    assert main([*argv, "--device-memory", "20GB"]) == 1
    out = capsys.readouterr().out
    assert "per device (--placement):" in out and "refused: cuda:1 (--placement encoders, vae) needs at least" in out
    assert [line.split()[0] for line in out.splitlines() if "predicted peak" in line and "of 20.0 GB free" in line] == [
        "cuda:0",
        "cuda:1",
    ]
    # without --placement the report keeps its shape
    assert main(["--tiny-profile", "full", "--device-memory", "40GB", "--host-memory", "64GB", "--json"]) == 0
    assert "devices" not in json.loads(capsys.readouterr().out)


def test_the_full_profile_makes_placed_parts_on_their_own_card(tiny_cache, monkeypatch):
    """The release-size parts are made where they will live: the encoders and the VAE placed on a second card
    are made there, never first on the transformer's card (the planner did not count them there)."""
    from hidream_ui.device.backends import DeviceInfo
    from hidream_ui.model import loading
    from hidream_ui.model.plans import MemoryPlan
    from hidream_ui.model.sources import resolve_sources
    from hidream_ui.model.tiny import in_memory

    seen = {}
    monkeypatch.setattr(in_memory, "release_parts", lambda *a, placement, **k: seen.update(placement) or {})
    config = from_args(
        ["--tiny-profile", "full", "--placement", "transformer=npu:0,encoders=npu:1,vae=npu:1"], environ={}
    )
    card = DeviceInfo(type="npu", index=0, torch_device="npu:0", name="fake", physical_index=0)
    plan = MemoryPlan(name="encoders-cpu", weights="bf16", requested="auto", requested_weights="auto")
    loading._release_parts(config, resolve_sources(config), plan, card, torch.bfloat16)
    assert seen["transformer"] == "npu:0" and seen["vae"] == "npu:1"
    assert {seen[name] for name in ("text_encoder", "text_encoder_2", "text_encoder_3", "text_encoder_4")} == {"npu:1"}
