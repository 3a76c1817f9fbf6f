"""The field's step caches on HiDream (pipeline/speed/library.py, cachedit.py): diffusers' FirstBlockCache
(`fbcache:T`), TaylorSeer (`taylorseer:N`), MagCache (`magcache:T`) and cache-dit's DBCache + TaylorSeer
(`dbcache:T`, optional extra), on the tiny model (2 double + 2 single blocks).

The expected counts follow each library's schedule; the edit here has 8 steps, so 5 edit-stage calls
and 3 refine-stage calls (refine strength 0.3): a cache that was not reset at the switch would give
other counts.
"""

from __future__ import annotations

import builtins
import importlib.util

import pytest
import torch
from diffusers.hooks import HookRegistry, ModelHook
from helpers import edit_params, random_picture

from hidream_ui.config import AppConfig, ConfigError, from_args
from hidream_ui.edits import EditRequest, RequestError
from hidream_ui.engine.engine import EditEngine
from hidream_ui.pipeline.guidance import refine_start_step
from hidream_ui.pipeline.speed.cache import apply_step_cache, step_cache_spec
from hidream_ui.pipeline.speed.settings import CacheSpec, parse_cache

STEPS = 8
STAGES = (refine_start_step(STEPS, 0.3), STEPS - refine_start_step(STEPS, 0.3))  # (5, 3)
LIBRARY_MODES = ("fbcache:10", "taylorseer:2", "magcache:10")


def _has_cache_dit() -> bool:
    return importlib.util.find_spec("cache_dit") is not None


def _modes():
    modes = list(LIBRARY_MODES)
    # cache-dit is an optional extra (requirements-cache-dit.txt), not in CI's requirements.
    modes.append(
        pytest.param(
            "dbcache:10",
            marks=pytest.mark.skipif(
                not _has_cache_dit(), reason="cache-dit is an optional extra (pip install 'hidream_ui[cache-dit]')"
            ),
        )
    )
    return modes


# ------------------------------------------------------------------ grammar and refusals


@pytest.mark.parametrize(
    "text, spec",
    [
        ("fbcache:0.1", CacheSpec("fbcache", threshold=0.1)),
        (" TaylorSeer:3 ", CacheSpec("taylorseer", interval=3)),
        ("magcache:0.06", CacheSpec("magcache", threshold=0.06)),
        ("dbcache:0.08", CacheSpec("dbcache", threshold=0.08)),
    ],
)
def test_new_cache_values_parse_and_round_trip(text, spec):
    assert parse_cache(text) == spec
    assert parse_cache(str(spec)) == spec


@pytest.mark.parametrize(
    "bad",
    [
        "taylorseer:0",
        "taylorseer:1.5",
        "fbcache:0",
        "magcache:-1",
        "magcache:nan",
        "fbcache:11",
        "taylorseer",
        "tayloerseer:2",
        "dbcache:inf",
    ],
)
def test_bad_cache_values_are_refused_naming_the_value(bad):
    with pytest.raises(ValueError, match=f"cache={bad!r}"):
        parse_cache(bad)
    with pytest.raises(ConfigError, match="cache="):
        from_args(["--cache", bad], environ={})
    with pytest.raises(RequestError, match="cache"):
        edit_params(cache=bad)


def test_speed_axis_takes_the_new_modes():
    from hidream_ui.engine.compare import parse_axis_values

    assert parse_axis_values("speed", "exact, fbcache:0.1, taylorseer:2, magcache:0.06") == (
        "none",
        "fbcache:0.1",
        "taylorseer:2",
        "magcache:0.06",
    )


@pytest.fixture
def no_cache_dit(monkeypatch):
    """cache-dit made unimportable, whether or not it is installed."""
    real_find, real_import = importlib.util.find_spec, builtins.__import__

    def find_spec(name, *args, **kwargs):
        return None if name.split(".")[0] == "cache_dit" else real_find(name, *args, **kwargs)

    def fake_import(name, *args, **kwargs):
        if name.split(".")[0] == "cache_dit":
            raise ModuleNotFoundError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    monkeypatch.setattr(builtins, "__import__", fake_import)


def test_dbcache_without_cache_dit_says_how_to_install_it(no_cache_dit, tmp_path):
    hint = r"pip install 'hidream_ui\[cache-dit\]'"
    with pytest.raises(ConfigError, match="needs the optional package cache-dit.*" + hint):
        from_args(["--cache", "dbcache:0.1"], environ={})
    with pytest.raises(RequestError, match="cache-dit"):
        edit_params(cache="dbcache:0.1")
    from hidream_ui.pipeline.speed.cachedit import CacheDitMissing, import_cache_dit

    with pytest.raises(CacheDitMissing, match=hint):
        import_cache_dit()
    assert parse_cache("dbcache:0.1").kind == "dbcache"  # the grammar stays: only its use is refused
    from hidream_ui.engine.errors import EngineError

    with pytest.raises(EngineError, match="cache-dit"):  # the Speed setting / /set_speed
        EditEngine(AppConfig(device="cpu", output_dir=tmp_path)).set_speed("dbcache:0.1")


# ------------------------------------------------------------------ on the tiny model


@pytest.fixture(scope="module")
def engine(tiny_cache, tmp_path_factory):
    eng = EditEngine(AppConfig(device="cpu", output_dir=tmp_path_factory.mktemp("caches_out")))
    eng.load()
    return eng


@pytest.fixture
def transformer(engine):
    tr = engine.model.pipeline.transformer
    yield tr
    apply_step_cache(tr, "none")


def _latents(pipe, images=None, prompts=None, seeds=None):
    images = images or [random_picture(0, (64, 64))]
    prompts = prompts or ["make it blue"] * len(images)
    generators = [torch.Generator().manual_seed(s) for s in (seeds or range(7, 7 + len(images)))]
    return pipe(
        image=images, prompt=prompts, num_inference_steps=STEPS, generator=generators, output_type="latent"
    ).images


def _blocks(transformer) -> int:
    return len(transformer.double_stream_blocks) + len(transformer.single_stream_blocks)


def _taylorseer_predicted(calls: int, interval: int, warmup: int = 3) -> int:
    """Calls TaylorSeer predicts in a stage (diffusers' rule: warm-up, then one full call in `interval`)."""
    return sum(1 for s in range(warmup, calls) if (s - warmup - 1) % interval != 0)


@pytest.mark.slow
def test_each_mode_skips_blocks_by_its_schedule_and_restarts_at_the_refine_switch(engine, transformer):
    pipe = engine.model.pipeline
    blocks = _blocks(transformer)
    exact = _latents(pipe)
    expected_skipped_calls = {
        "fbcache:10": STEPS - len(STAGES),  # T=10: every call but a stage's first reuses the cache
        "taylorseer:2": sum(_taylorseer_predicted(n, 2) for n in STAGES),  # 1 + 0
        # MagCache (Flux ratios, T=10: the error never decides): 20% of a stage always runs, then at most
        # 3 skipped calls in a row: 5 calls -> 1 full, 3 skipped, 1 full; 3 calls -> 1 full, 2 skipped.
        "magcache:10": 3 + 2,
    }
    for mode, skipped_calls in expected_skipped_calls.items():
        apply_step_cache(transformer, mode)
        out = _latents(pipe)
        stats = pipe.step_cache_stats
        per_call = blocks - 1 if mode.startswith("fbcache") else blocks  # FBCache always runs the first block
        assert stats.calls == STEPS, mode
        assert stats.full_calls == STEPS - skipped_calls, (mode, stats.to_dict())
        assert stats.blocks_skipped == skipped_calls * per_call, (mode, stats.to_dict())
        assert stats.blocks_run + stats.blocks_skipped == STEPS * blocks
        assert torch.isfinite(out).all() and not torch.equal(out, exact), mode
        assert torch.equal(_latents(pipe), out), f"{mode}: a second edit must start afresh"
        assert pipe.step_cache_stats.to_dict() == stats.to_dict()
    apply_step_cache(transformer, "none")
    assert torch.equal(_latents(pipe), exact)  # every hook removed: exact again, bit for bit


@pytest.mark.parametrize("mode", ["taylorseer:1", "fbcache:0.000001"])
def test_settings_that_never_skip_are_bit_identical(engine, transformer, mode):
    pipe = engine.model.pipeline
    exact = _latents(pipe)
    apply_step_cache(transformer, mode)
    assert torch.equal(_latents(pipe), exact)
    assert pipe.step_cache_stats.blocks_skipped == 0 and pipe.step_cache_stats.full_calls == STEPS


@pytest.mark.slow
@pytest.mark.parametrize("mode", _modes())
def test_a_batch_equals_its_items_alone(engine, transformer, mode):
    """Per-branch state: every row (guidance branch, image) reuses only its own residual / factors.
    The thresholds here skip whenever the schedule allows, so the batch's one decision per call is
    the one each image makes alone."""
    pipe = engine.model.pipeline
    apply_step_cache(transformer, mode)
    images = [random_picture(1, (64, 64)), random_picture(2, (64, 64))]
    prompts = ["make it blue", "add a hat"]
    both = _latents(pipe, images, prompts, seeds=[7, 8])
    assert pipe.step_cache_stats.blocks_skipped > 0
    alone = [_latents(pipe, [im], [p], seeds=[seed]) for im, p, seed in zip(images, prompts, [7, 8])]
    for i in range(2):
        # Up to GEMM rounding, which TaylorSeer's extrapolation amplifies (~1e-5 here); a residual taken
        # from another row would move the latents by their own scale (~1).
        torch.testing.assert_close(both[i : i + 1], alone[i], rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("mode", _modes())
def test_engine_edit_records_the_mode_and_what_it_skipped(engine, transformer, mode):
    image = random_picture(3, (64, 64))
    result = engine.edit(EditRequest(image=image, params=edit_params(steps=STEPS, seed=5, cache=mode)), save=False)
    assert result.params.cache == mode
    assert result.info.speed["cache"] == mode and result.info.speed["skipped_fraction"] > 0
    assert step_cache_spec(transformer) == parse_cache(mode)


@pytest.mark.skipif(not _has_cache_dit(), reason="cache-dit is an optional extra (pip install 'hidream_ui[cache-dit]')")
def test_dbcache_skips_after_its_warmup_and_is_removed_without_a_trace(engine, transformer):
    pipe = engine.model.pipeline
    blocks = _blocks(transformer)
    exact = _latents(pipe)
    forwards = {id(m): vars(m).get("forward") for m in transformer.modules()}
    apply_step_cache(transformer, "dbcache:10")
    out = _latents(pipe)
    stats = pipe.step_cache_stats
    # 3 warm-up calls per stage, then every call cached; F1B0: the first block of each list still runs.
    cached_calls = sum(max(0, n - 3) for n in STAGES)
    assert stats.blocks_skipped == cached_calls * (blocks - 2), stats.to_dict()
    assert not torch.equal(out, exact) and torch.equal(_latents(pipe), out)
    apply_step_cache(transformer, "dbcache:0.000001")  # never below: every block runs, same numbers
    assert torch.equal(_latents(pipe), exact) and pipe.step_cache_stats.blocks_skipped == 0
    apply_step_cache(transformer, "none")
    assert torch.equal(_latents(pipe), exact)
    for module in transformer.modules():  # cache-dit's HiDream patch undone: diffusers' own forwards
        assert (
            vars(module).get("forward") in (None, forwards[id(module)])
            or vars(module)["forward"].__func__ is type(module).forward
        ), type(module).__name__
        assert "_block_id" not in vars(module)


@pytest.mark.skipif(not _has_cache_dit(), reason="cache-dit is an optional extra (pip install 'hidream_ui[cache-dit]')")
def test_dbcache_with_compile_or_an_offloading_plan_is_refused_at_start():
    with pytest.raises(ConfigError, match="cache=dbcache:0.1 cannot run with compile='blocks'"):
        from_args(["--cache", "dbcache:0.1", "--compile", "blocks"], environ={})
    for plan in ("blocks", "sequential"):
        with pytest.raises(ConfigError, match="memory plan that offloads the transformer"):
            from_args(["--cache", "dbcache:0.1", "--memory", plan], environ={})
    assert from_args(["--cache", "dbcache:0.1", "--memory", "full"], environ={}).cache == "dbcache:0.1"
    assert from_args(["--cache", "fbcache:0.1", "--memory", "blocks"], environ={}).cache == "fbcache:0.1"


@pytest.mark.skipif(not _has_cache_dit(), reason="cache-dit is an optional extra (pip install 'hidream_ui[cache-dit]')")
def test_dbcache_is_refused_where_it_would_drop_hooks(engine, transformer):
    registry = HookRegistry.check_if_exists_or_initialize(transformer)
    registry.register_hook(ModelHook(), "hidream_ui_compile_guard")
    try:
        with pytest.raises(ValueError, match="cannot run with --compile blocks"):
            apply_step_cache(transformer, "dbcache:0.1")
    finally:
        registry.remove_hook("hidream_ui_compile_guard", recurse=False)
    assert step_cache_spec(transformer) == CacheSpec()


# ------------------------------------------------------------------ E1-Full's LoRA and the memory plans


@pytest.fixture(scope="module")
def lora_engines(tiny_cache, tmp_path_factory):
    """E1-Full (LoRA on in the edit stage, off in refine) resident, and with its blocks streamed."""
    out = tmp_path_factory.mktemp("caches_lora")
    engines = {
        plan: EditEngine(AppConfig(device="cpu", variant="e1-full", memory=plan, weights="bf16", output_dir=out))
        for plan in ("full", "blocks")
    }
    for eng in engines.values():
        eng.load()
    return engines


@pytest.mark.slow
@pytest.mark.parametrize("mode", LIBRARY_MODES)
def test_library_caches_compose_with_the_lora_and_the_offloading_plan(lora_engines, mode):
    image = random_picture(4, (64, 64))
    results = {
        plan: eng.edit(EditRequest(image=image, params=edit_params(steps=STEPS, seed=3, cache=mode)), save=False)
        for plan, eng in lora_engines.items()
    }
    for plan, result in results.items():
        assert result.info.speed["skipped_fraction"] > 0, plan
    # Streaming the blocks changes where the weights live, not the numbers, with or without a cache.
    assert results["full"].image.tobytes() == results["blocks"].image.tobytes()


@pytest.mark.skipif(not _has_cache_dit(), reason="cache-dit is an optional extra (pip install 'hidream_ui[cache-dit]')")
def test_dbcache_runs_with_the_lora_and_leaves_it_exact_afterwards(lora_engines):
    engine = lora_engines["full"]

    def request(cache):
        return EditRequest(image=random_picture(4, (64, 64)), params=edit_params(steps=STEPS, seed=3, cache=cache))

    exact = engine.edit(request("none"), save=False)
    cached = engine.edit(request("dbcache:10"), save=False)
    assert cached.info.speed["skipped_fraction"] > 0
    assert cached.image.tobytes() != exact.image.tobytes()
    assert engine.edit(request("none"), save=False).image.tobytes() == exact.image.tobytes()


@pytest.mark.skipif(not _has_cache_dit(), reason="cache-dit is an optional extra (pip install 'hidream_ui[cache-dit]')")
def test_dbcache_is_refused_with_an_offloading_plan(lora_engines):
    request = EditRequest(image=random_picture(4, (64, 64)), params=edit_params(steps=2, cache="dbcache:0.1"))
    with pytest.raises(ValueError, match="cache=dbcache cannot run with a memory plan that offloads the transformer"):
        lora_engines["blocks"].edit(request, save=False)


@pytest.mark.skipif(not _has_cache_dit(), reason="cache-dit is an optional extra (pip install 'hidream_ui[cache-dit]')")
def test_cache_dit_logs_never_reach_stdout(capsys):
    """`edit` prints its JSON summary on stdout; cache-dit's own log handler writes to stdout."""
    import logging

    from hidream_ui.pipeline.speed.cachedit import import_cache_dit

    import_cache_dit()
    logger = logging.getLogger("CACHE_DIT")
    # Both levels up for the probe: a quiet CLI run earlier in this process (CACHE_DIT_LOG_LEVEL=error)
    # may have set the handler's level when cache-dit was first imported.
    saved = [(obj, obj.level) for obj in (logger, *logger.handlers)]
    for obj, _ in saved:
        obj.setLevel(logging.INFO)
    try:
        logger.info("probe from the test")
    finally:
        for obj, level in saved:
            obj.setLevel(level)
    captured = capsys.readouterr()
    assert "probe from the test" not in captured.out and "probe from the test" in captured.err
