"""Speed modes (pipeline/speed/): sync-free MoE, step caching, host-sync counting, config and engine.

Compilation has its own module (test_speed_compile.py): it is the slow part.
"""

from __future__ import annotations

import pytest
import torch
from diffusers.hooks import HookRegistry, ModelHook
from diffusers.models.transformers.transformer_hidream_image import MOEFeedForwardSwiGLU
from helpers import edit_params, random_picture

from hidream_ui.config import AppConfig, ConfigError, from_args
from hidream_ui.edits import EditRequest, RequestError
from hidream_ui.engine.engine import EditEngine
from hidream_ui.engine.pool import EnginePool
from hidream_ui.pipeline.speed.cache import apply_step_cache, reset_step_cache, step_cache_stats
from hidream_ui.pipeline.speed.moe import HOOK_NAME, apply_moe, grouped_state, moe_mode, moe_modules
from hidream_ui.pipeline.speed.settings import SPEED_PRESETS, CacheSpec, parse_cache
from hidream_ui.pipeline.speed.syncs import count_host_syncs


class FixedGate(torch.nn.Module):
    """Stands in for MoEGate: a given routing (top-k experts and weights per token)."""

    def __init__(self, idx, weight):
        super().__init__()
        self.idx, self.weight = idx, weight

    def forward(self, x):
        return self.idx, self.weight, None


def _moe(dim=32, experts=4, active=2, seed=0):
    torch.manual_seed(seed)
    return MOEFeedForwardSwiGLU(dim, 4 * dim, experts, active).eval()


def test_sync_free_moe_equals_diffusers_on_random_routing_with_idle_experts():
    moe = _moe()
    holder = torch.nn.Sequential(moe)
    tokens = 2 * 37
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 37, 32, generator=gen)
    # Random top-2 routing over experts 0, 1 and 3 only: expert 2 receives no token at all.
    choices = torch.tensor([0, 1, 3])
    idx = torch.stack([choices[torch.randperm(3, generator=gen)[:2]] for _ in range(tokens)])
    weight = torch.rand(tokens, 2, generator=gen)
    moe.gate = FixedGate(idx, weight)
    with torch.no_grad():
        expected, syncs_diffusers = count_host_syncs(moe, x)
        apply_moe(holder, "sync-free")
        assert moe_mode(holder) == "sync-free"
        got, syncs_free = count_host_syncs(moe, x)
    assert 2 not in idx
    assert syncs_diffusers.total >= 1 and syncs_diffusers.by_kind["cpu"] == 1  # bincount().cpu()
    assert syncs_free.total == 0
    relative = ((got - expected).abs().max() / expected.abs().max()).item()
    assert relative <= 1e-6
    assert not torch.equal(got, torch.zeros_like(got))


def test_sync_free_moe_on_the_real_gate_and_back_to_diffusers_bit_for_bit():
    moe = _moe(seed=3)
    holder = torch.nn.Sequential(moe)
    x = torch.randn(3, 20, 32, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        exact = moe(x)
        apply_moe(holder, "sync-free")
        apply_moe(holder, "sync-free")  # idempotent
        free = moe(x)
        apply_moe(holder, "diffusers")
        again = moe(x)
    assert ((free - exact).abs().max() / exact.abs().max()).item() <= 1e-6
    assert torch.equal(again, exact)
    with pytest.raises(ValueError, match="moe='fast'"):
        apply_moe(holder, "fast")


def _hook(moe):
    return moe._diffusers_hook.get_hook(HOOK_NAME)


def _relative(got, expected) -> float:
    return ((got - expected).abs().max() / expected.abs().max()).item()


def test_sync_free_moe_runs_grouped_on_views_of_one_buffer_per_weight_kind():
    moe = _moe(seed=4)
    holder = torch.nn.Sequential(moe)
    x = torch.randn(2, 33, 32, generator=torch.Generator().manual_seed(2))
    before = {kind: [getattr(e, kind).weight.detach().clone() for e in moe.experts] for kind in ("w1", "w3", "w2")}
    with torch.no_grad():
        expected = moe(x)
        apply_moe(holder, "sync-free")
        got, syncs = count_host_syncs(moe, x)
    assert syncs.total == 0
    assert _relative(got, expected) <= 1e-6
    assert grouped_state(holder) == {"grouped_calls": 1, "dense_calls": 0, "dense_reasons": []}
    for kind, values in before.items():
        weights = [getattr(e, kind).weight for e in moe.experts]
        # One storage per kind (the stacked buffer), each expert a view at its own offset, values unchanged.
        assert len({w.untyped_storage().data_ptr() for w in weights}) == 1
        assert len({w.data_ptr() for w in weights}) == len(weights)
        assert all(torch.equal(w, v) for w, v in zip(weights, values))


def test_grouped_moe_follows_a_weight_swap_and_finds_its_views_again():
    moe = _moe(seed=6)
    holder = torch.nn.Sequential(moe)
    x = torch.randn(1, 40, 32, generator=torch.Generator().manual_seed(3))
    apply_moe(holder, "sync-free")
    params = [getattr(e, kind).weight for e in moe.experts for kind in ("w1", "w3", "w2")]
    other = [torch.randn_like(p) for p in params]

    def swap():  # what WeightSwap.use does on a device with room: exchange the storages
        for i, p in enumerate(params):
            other[i], p.data = p.data, other[i]

    with torch.no_grad():
        first = moe(x)
        swap()
        swapped = moe(x)
        apply_moe(holder, "diffusers")
        swapped_reference = moe(x)
        apply_moe(holder, "sync-free")
        swap()
        back = moe(x)
    experts = _hook(moe).experts
    assert _relative(swapped, swapped_reference) <= 1e-6
    assert not torch.allclose(swapped, first)
    assert torch.equal(back, first)
    assert len(experts.stacks) == 2 and experts.misses_in_a_row == 0 and experts.dense_reason is None
    assert grouped_state(holder)["dense_calls"] == 0


def test_grouped_moe_goes_dense_with_its_reason_when_weights_move_or_linears_are_hooked():
    moe = _moe(seed=7)
    holder = torch.nn.Sequential(moe)
    x = torch.randn(1, 24, 32, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        expected = moe(x)
        apply_moe(holder, "sync-free")
        for _ in range(3):  # what group offloading does at every onload: new storage for every weight
            for expert in moe.experts:
                for kind in ("w1", "w3", "w2"):
                    weight = getattr(expert, kind).weight
                    weight.data = weight.data.clone()
            got = moe(x)
    assert _relative(got, expected) <= 1e-6
    state = grouped_state(holder)
    assert state["dense_calls"] >= 1
    assert state["dense_reasons"] == ["the expert weights move between calls (offloading)"]

    hooked = _moe(seed=8)
    HookRegistry.check_if_exists_or_initialize(hooked.experts[1].w3).register_hook(ModelHook(), "a_lora_or_cast")
    holder = torch.nn.Sequential(hooked)
    with torch.no_grad():
        expected = hooked(x)
        apply_moe(holder, "sync-free")
        got = hooked(x)
    assert _relative(got, expected) <= 1e-6
    assert grouped_state(holder) == {
        "grouped_calls": 0,
        "dense_calls": 1,
        "dense_reasons": ["an expert linear is wrapped or hooked (LoRA, fp8 casting or offloading)"],
    }


def test_host_sync_counter_sees_reads_and_data_dependent_shapes():
    x = torch.arange(6.0)
    n = torch.tensor(3)
    _, count = count_host_syncs(lambda: (x.sum().item(), x.cpu(), x[x > 2], x.nonzero(), x[:n], x.to("cpu"), x * 2))
    # x.to("cpu") is the same device here: no transfer.
    assert count.by_kind == {"item": 1, "cpu": 1, "bool_index": 1, "nonzero": 1, "tensor_slice": 1}
    _, none = count_host_syncs(lambda: torch.topk(x, 2).indices.argsort())
    assert none.total == 0


# ------------------------------------------------------------------ settings


@pytest.mark.parametrize(
    "text,spec",
    [
        ("none", CacheSpec()),
        ("exact", CacheSpec()),
        ("interval:2", CacheSpec("interval", interval=2)),
        (" Interval:3 ", CacheSpec("interval", interval=3)),
        ("fast", parse_cache(SPEED_PRESETS["fast"])),
        ("first-block:0.05", CacheSpec("first-block", threshold=0.05)),
        ("taylorseer:4@14", CacheSpec("taylorseer", interval=4, max_steps=14)),
        (" NONE@8 ", CacheSpec(max_steps=8)),
        ("magcache:0.24@20", CacheSpec("magcache", threshold=0.24, max_steps=20)),
    ],
)
def test_cache_grammar(text, spec):
    assert parse_cache(text) == spec
    assert parse_cache(str(spec)) == spec


@pytest.mark.parametrize(
    "bad",
    [
        "interval",
        "interval:0",
        "interval:x",
        "first-block:0",
        "first-block:-1",
        "deepcache",
        "interval:2.5",
        "first-block:nan",
        "interval:2@0",
        "interval:2@x",
        "interval:2@201",
        "@14",
        "interval@2",
        "interval:2@3@4",
    ],
)
def test_bad_cache_values_are_named(bad):
    with pytest.raises(ValueError, match=f"cache={bad!r}"):
        parse_cache(bad)
    with pytest.raises(ConfigError, match="cache="):
        from_args(["--cache", bad], environ={})
    with pytest.raises(RequestError, match="cache"):
        edit_params(cache=bad)


def test_speed_flags_and_env():
    config = from_args(
        [], environ={"HIDREAM_MOE": "sync-free", "HIDREAM_COMPILE": "blocks", "HIDREAM_CACHE": "interval:2"}
    )
    assert (config.moe, config.compile, config.cache) == ("sync-free", "blocks", "interval:2")
    assert from_args(["--cache", "none"], environ={"HIDREAM_CACHE": "interval:2"}).cache == "none"
    with pytest.raises(ConfigError, match="moe='fast'"):
        from_args(["--moe", "fast"], environ={})
    with pytest.raises(ConfigError, match="compile='graph'"):
        from_args(["--compile", "graph"], environ={})
    with pytest.raises(ConfigError, match="needs moe 'sync-free'"):
        from_args(["--compile", "blocks", "--moe", "diffusers"], environ={})


# ------------------------------------------------------------------ on the tiny model


@pytest.fixture(scope="module")
def engine(tiny_cache, tmp_path_factory):
    eng = EditEngine(AppConfig(device="cpu", output_dir=tmp_path_factory.mktemp("speed_out")))
    eng.load()
    return eng


def _latents(pipe, steps=8, images=None, prompts=None, seeds=None, **kw):
    images = images or [random_picture(0, (64, 64))]
    prompts = prompts or ["make it blue"] * len(images)
    generators = [torch.Generator().manual_seed(s) for s in (seeds or range(7, 7 + len(images)))]
    return pipe(
        image=images, prompt=prompts, num_inference_steps=steps, generator=generators, output_type="latent", **kw
    ).images


@pytest.fixture
def transformer(engine):
    tr = engine.model.pipeline.transformer
    yield tr
    apply_step_cache(tr, "none")
    apply_moe(tr, "diffusers")


def _stage_calls(steps, refine_strength=0.3):
    from hidream_ui.pipeline.guidance import refine_start_step

    switch = refine_start_step(steps, refine_strength)
    return [n for n in (switch, steps - switch) if n]


def test_sync_free_moe_in_the_transformer_and_its_syncs(engine, transformer):
    pipe = engine.model.pipeline
    hidden = torch.randn(3, transformer.config.in_channels, 8, 16, generator=torch.Generator().manual_seed(0))
    text = engine.encode("make it blue")
    from hidream_ui.pipeline.edit_pipeline import PromptEmbeds

    text3 = PromptEmbeds.cat([text] * 3)
    t = torch.full((3,), 500.0)
    with torch.no_grad():
        exact, before = count_host_syncs(pipe.predict, hidden, t, text3)
        apply_moe(transformer, "sync-free")
        free, after = count_host_syncs(pipe.predict, hidden, t, text3)
    assert ((free - exact).abs().max() / exact.abs().max()).item() <= 1e-6
    assert before.by_kind["cpu"] - after.by_kind.get("cpu", 0) == len(moe_modules(transformer))
    assert after.by_kind.get("cpu", 0) == 0
    assert after.total == 0, after.by_kind  # nor the attention's padding check: no host read at all


def test_sync_free_forward_without_padding_makes_no_host_read_and_stays_close(engine, transformer):
    """An input that fills max_seq has no padded token: exact mode skips the bias after one host read
    of the mask; sync-free makes an all-zero bias instead (same values, no read)."""
    from hidream_ui.pipeline.edit_pipeline import PromptEmbeds

    pipe = engine.model.pipeline
    # Non-square (the collapsed path, as an edit's side-by-side latent) with exactly max_seq tokens.
    p = transformer.config.patch_size
    rows = 4
    hidden = torch.randn(
        3,
        transformer.config.in_channels,
        rows * p,
        transformer.max_seq // rows * p,
        generator=torch.Generator().manual_seed(1),
    )
    text3 = PromptEmbeds.cat([engine.encode("make it blue")] * 3)
    t = torch.full((3,), 500.0)
    with torch.no_grad():
        exact, before = count_host_syncs(pipe.predict, hidden, t, text3)
        apply_moe(transformer, "sync-free")
        free, after = count_host_syncs(pipe.predict, hidden, t, text3)
        apply_moe(transformer, "diffusers")
        again, _ = count_host_syncs(pipe.predict, hidden, t, text3)
    assert before.total > len(moe_modules(transformer)) and after.total == 0, (before.by_kind, after.by_kind)
    assert ((free - exact).abs().max() / exact.abs().max()).item() <= 1e-6
    assert torch.equal(again, exact)  # back to exact: the unbiased path again, bit for bit


@pytest.mark.slow
def test_interval_1_is_bit_identical_and_none_installs_nothing(engine, transformer):
    pipe = engine.model.pipeline
    exact = _latents(pipe)
    assert step_cache_stats(transformer) is None
    apply_step_cache(transformer, "interval:1")
    cached = _latents(pipe)
    assert torch.equal(cached, exact)
    stats = pipe.step_cache_stats
    assert stats.blocks_skipped == 0 and stats.full_calls == stats.calls == 8
    apply_step_cache(transformer, "none")
    assert torch.equal(_latents(pipe), exact)
    assert pipe.step_cache_stats is None


@pytest.mark.parametrize("k", [2, 3])
def test_interval_skips_the_stated_fraction_and_restarts_at_the_refine_switch(engine, transformer, k):
    pipe = engine.model.pipeline
    steps = 8
    blocks = len(transformer.double_stream_blocks) + len(transformer.single_stream_blocks)
    exact = _latents(pipe, steps)
    apply_step_cache(transformer, f"interval:{k}")
    out = _latents(pipe, steps)
    stats = pipe.step_cache_stats
    # Every stage starts with a full call (the cache is reset at the switch), then one in k.
    stages = _stage_calls(steps)
    full = sum(-(-n // k) for n in stages)
    cached = steps - full
    assert len(stages) == 2
    assert stats.full_calls == full
    assert stats.blocks_skipped == cached * (blocks - 2)  # only the first and the last block run
    assert stats.skipped_fraction == pytest.approx(cached * (blocks - 2) / (steps * blocks))
    assert not torch.equal(out, exact)
    assert torch.isfinite(out).all()


def test_first_block_threshold_decides(engine, transformer):
    pipe = engine.model.pipeline
    steps = 6
    blocks = len(transformer.double_stream_blocks) + len(transformer.single_stream_blocks)
    exact = _latents(pipe, steps)
    apply_step_cache(transformer, "first-block:10")  # every change is below 10: skip whenever allowed
    _latents(pipe, steps)
    stats = pipe.step_cache_stats
    stages = _stage_calls(steps)
    assert stats.full_calls == len(stages)  # one full call per stage, the rest reuse it
    assert stats.blocks_skipped == (steps - len(stages)) * (blocks - 1)
    apply_step_cache(transformer, "first-block:0.000001")  # random weights: every step changes more
    assert torch.equal(_latents(pipe, steps), exact)
    assert pipe.step_cache_stats.blocks_skipped == 0


def test_cache_resets_on_request_and_when_the_call_changes(engine, transformer):
    pipe = engine.model.pipeline
    from hidream_ui.pipeline.edit_pipeline import PromptEmbeds

    apply_step_cache(transformer, "interval:4")
    text = engine.encode("make it blue")
    hidden = torch.randn(2, transformer.config.in_channels, 8, 16)
    t = torch.full((2,), 500.0)
    two = PromptEmbeds.cat([text] * 2)
    with torch.no_grad():
        pipe.predict(hidden, t, two)
        pipe.predict(hidden, t, two)
        assert step_cache_stats(transformer).full_calls == 1
        reset_step_cache(transformer)
        pipe.predict(hidden, t, two)
        assert step_cache_stats(transformer).full_calls == 2
        pipe.predict(hidden[:1], t[:1], text)  # another batch: nothing cached may be reused
        assert step_cache_stats(transformer).full_calls == 3
        other = PromptEmbeds.cat([engine.encode("make it red")] * 2)
        pipe.predict(hidden, t, other)  # another text
        assert step_cache_stats(transformer).full_calls == 4


def test_cache_is_per_branch_a_batch_equals_its_items(engine, transformer):
    """Each guidance branch and each image of a batch reuses only its own residual."""
    pipe = engine.model.pipeline
    apply_step_cache(transformer, "interval:2")
    images = [random_picture(1, (64, 64)), random_picture(2, (64, 64))]
    prompts = ["make it blue", "add a hat"]
    both = _latents(pipe, 6, images, prompts, seeds=[7, 8])
    alone = [_latents(pipe, 6, [im], [p], seeds=[seed]) for im, p, seed in zip(images, prompts, [7, 8])]
    for i in range(2):
        torch.testing.assert_close(both[i : i + 1], alone[i], rtol=1e-4, atol=1e-5)
    assert pipe.step_cache_stats.blocks_skipped > 0


def test_engine_records_the_cache_mode_and_skipped_fraction(engine, transformer):
    from hidream_ui.outputs import load_settings

    image = random_picture(3, (64, 64))
    exact = engine.edit(EditRequest(image=image, params=edit_params(steps=4, seed=5)), save=False)
    assert exact.info.speed is None and exact.params.cache == "none"
    # 8 steps: enough calls for any preset to skip some (TaylorSeer warms up for 3 calls per stage).
    fast = engine.edit(EditRequest(image=image, params=edit_params(steps=8, seed=5, cache="fast")))
    preset = SPEED_PRESETS["fast"]
    assert fast.params.cache == preset
    assert fast.info.speed["cache"] == preset and fast.info.speed["skipped_fraction"] > 0
    meta = fast.metadata()
    assert meta["params"]["cache"] == preset
    assert meta["speed"]["skipped_fraction"] == fast.info.speed["skipped_fraction"]
    assert load_settings(fast.saved_png).cache == preset
    again = engine.edit(EditRequest(image=image, params=edit_params(steps=4, seed=5)), save=False)
    assert again.image.tobytes() == exact.image.tobytes()  # the exact default is untouched afterwards
    assert engine.status().speed["last_cache"] == "none"


def test_a_step_cap_runs_at_most_its_steps_and_the_metadata_says_so(engine, transformer):
    """`CACHE@S` (a preset chosen at fewer steps): the edit runs min(its steps, S); params and metadata record
    the count that ran, so the result reproduces from its own settings."""
    from hidream_ui.outputs import load_settings

    image = random_picture(4, (64, 64))
    capped = engine.edit(EditRequest(image=image, params=edit_params(steps=5, seed=6, cache="interval:2@3")))
    assert capped.params.num_inference_steps == 3 and capped.params.cache == "interval:2@3"
    assert capped.info.speed["cache"] == "interval:2@3"
    plain = engine.edit(EditRequest(image=image, params=edit_params(steps=3, seed=6, cache="interval:2")), save=False)
    assert capped.image.tobytes() == plain.image.tobytes()
    settings = load_settings(capped.saved_png)
    assert settings.num_inference_steps == 3 and settings.cache == "interval:2@3"
    replay = engine.edit(EditRequest(image=image, params=settings), save=False)
    assert replay.image.tobytes() == capped.image.tobytes()
    fewer = engine.edit(EditRequest(image=image, params=edit_params(steps=2, seed=6, cache="none@3")), save=False)
    assert fewer.params.num_inference_steps == 2  # below the cap: the edit's own count
    exact = engine.edit(EditRequest(image=image, params=edit_params(steps=2, seed=6)), save=False)
    assert fewer.image.tobytes() == exact.image.tobytes()  # `none@S` installs no cache


# ------------------------------------------------------------------ the Compare tab's speed axis


def test_speed_axis_values():
    from hidream_ui.engine.compare import parse_axis_values

    assert parse_axis_values("speed", "exact, fast, interval:3, first-block : 0.05") == (
        "none",
        SPEED_PRESETS["fast"],
        "interval:3",
        "first-block:0.05",
    )
    with pytest.raises(RequestError, match="speed values"):
        parse_axis_values("speed", "exact, warp")
    with pytest.raises(RequestError, match="listed twice"):
        parse_axis_values("speed", "exact, none")


def test_compare_over_speed_records_each_cells_mode(engine, transformer):
    from hidream_ui.engine.compare import run_compare

    image = random_picture(5, (64, 64))
    base = edit_params(steps=4, seed=9)
    pool = EnginePool(engine.config, [engine])  # as the app holds it
    result = run_compare(pool, image, base, "speed", "exact, interval:2")
    exact_cell, fast_cell = result.cells
    assert (exact_cell.params.cache, fast_cell.params.cache) == ("none", "interval:2")
    assert exact_cell.info.speed is None and fast_cell.info.speed["skipped_fraction"] > 0
    plain = engine.edit(EditRequest(image=image, params=base), save=False)
    assert exact_cell.image.tobytes() == plain.image.tobytes()


def test_a_failing_speed_setup_leaves_no_half_configured_model(tiny_cache, tmp_path, monkeypatch):
    """An error while the speed modes are applied after loading must not leave the model published:
    the next load() would hand it out without its attention and speed set up."""

    def broken(self):
        raise RuntimeError("speed setup broke")

    monkeypatch.setattr(EditEngine, "_apply_speed_at_load", broken)
    engine = EditEngine(AppConfig(device="cpu", output_dir=tmp_path))
    with pytest.raises(RuntimeError, match="speed setup broke"):
        engine.load()
    assert not engine.loaded


@pytest.mark.slow
def test_bench_speed_reports_the_grouped_moe_side_by_side(tiny_cache):
    from hidream_ui.bench import speed

    report = speed.run(profile="tiny", cache_profile="tiny", size=32, cache_size=32, steps=2, repeats=2, compile_=False)
    moe = report["moe"]
    assert len(moe["diffusers"]["runs"]) == len(moe["sync-free"]["runs"]) == 2
    assert moe["sync-free"]["host_syncs_per_call"] == 0 and moe["sync-free"]["moe_host_syncs_per_call"] == 0
    grouped = moe["sync-free"]["grouped"]
    # warm-up + 2 runs, per MoE block; the blocks' own sync counting adds one call each
    assert grouped["grouped_calls"] == 4 * moe["moe_blocks"] and grouped["dense_calls"] == 0
    assert moe["max_relative_diff"] <= 1e-5
    assert moe["speedup"] == round(moe["diffusers"]["seconds_per_call"] / moe["sync-free"]["seconds_per_call"], 3)
    assert report["compile"] is None and set(report["cache"]["modes"]) == set(speed.CACHE_MODES)
    # The same list bench quality measures, so each cache's speed and quality come under one name.
    from hidream_ui.bench import quality

    assert speed.CACHE_MODES == ("none", *quality.CACHE_MODES)
    assert {"fbcache:0.1", "taylorseer:2", "magcache:0.06", "dbcache:0.1"} <= set(speed.CACHE_MODES)
    for mode, row in report["cache"]["modes"].items():  # dbcache is skipped (with why) only without cache-dit
        assert ("transformer_speedup" in row) != ("skipped" in row), mode
