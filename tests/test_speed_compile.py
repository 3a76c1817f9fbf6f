"""`--compile blocks` on the tiny model: inductor on CPU vs eager, torchair through an injected fake,
and the eager fallback (compile errors never kill the app)."""

from __future__ import annotations

import pytest
import torch
from helpers import edit_params, random_picture

from hidream_ui.config import AppConfig
from hidream_ui.edits import EditRequest
from hidream_ui.engine.engine import EditEngine
from hidream_ui.pipeline.edit_pipeline import PromptEmbeds
from hidream_ui.pipeline.speed import compile as speed_compile
from hidream_ui.pipeline.speed.compile import compile_blocks, compiled_blocks, uncompile_blocks
from hidream_ui.pipeline.speed.moe import apply_moe


@pytest.fixture(scope="module")
def engine(tiny_cache, tmp_path_factory):
    eng = EditEngine(AppConfig(device="cpu", output_dir=tmp_path_factory.mktemp("compile_out")))
    eng.load()
    return eng


@pytest.fixture
def call(engine):
    """One edit-shaped transformer call (3 branches) on fixed inputs; restores eager + exact after."""
    pipe = engine.model.pipeline
    transformer = pipe.transformer
    hidden = torch.randn(3, transformer.config.in_channels, 8, 16, generator=torch.Generator().manual_seed(0))
    text = PromptEmbeds.cat([engine.encode("make it blue")] * 3)
    t = torch.full((3,), 600.0)

    def run():
        with torch.no_grad():
            return pipe.predict(hidden, t, text)

    yield run
    uncompile_blocks(transformer)
    registry = transformer._diffusers_hook
    if registry.get_hook(speed_compile.GUARD_HOOK) is not None:
        registry.remove_hook(speed_compile.GUARD_HOOK, recurse=False)
    apply_moe(transformer, "diffusers")
    torch._dynamo.reset()


@pytest.mark.slow
def test_compiled_blocks_match_eager_on_cpu(engine, call):
    transformer = engine.model.pipeline.transformer
    apply_moe(transformer, "sync-free")
    eager = call()
    state = compile_blocks(transformer, "cpu")
    assert state.backend == "inductor" and state.active
    blocks = len(transformer.double_stream_blocks) + len(transformer.single_stream_blocks)
    assert compiled_blocks(transformer) == blocks
    compiled = call()
    again = call()
    assert state.error is None and state.active and state.warmup_seconds is not None
    assert (compiled - eager).abs().max().item() <= 1e-5 * max(1.0, eager.abs().max().item())
    assert torch.equal(compiled, again)


class FakeTorchair:
    """The two names of torchair the compile path uses; the backend records what it is given."""

    def __init__(self, fail: bool = False):
        self.fail = fail
        self.configs = []
        self.graphs = []

    def CompilerConfig(self):  # noqa: N802 - torchair's name
        config = type("CompilerConfig", (), {})()
        self.configs.append(config)
        return config

    def get_npu_backend(self, compiler_config=None):
        assert compiler_config is self.configs[-1]

        def backend(gm, example_inputs):
            if self.fail:
                raise RuntimeError("fake torchair: unsupported op aten.something")
            self.graphs.append(gm)
            return gm.forward

        return backend


@pytest.mark.slow
def test_torchair_backend_on_npu_through_a_fake(engine, call):
    transformer = engine.model.pipeline.transformer
    apply_moe(transformer, "sync-free")
    eager = call()
    fake = FakeTorchair()
    state = compile_blocks(transformer, "npu", torchair=fake)
    out = call()
    assert state.backend == "torchair" and state.active and state.error is None
    assert len(fake.configs) == 1 and fake.graphs  # torchair compiled the block graphs
    assert all(isinstance(g, torch.fx.GraphModule) for g in fake.graphs)
    assert (out - eager).abs().max().item() <= 1e-5 * max(1.0, eager.abs().max().item())


def test_a_compiler_failure_falls_back_to_eager_with_the_reason(engine, call):
    transformer = engine.model.pipeline.transformer
    apply_moe(transformer, "sync-free")
    eager = call()
    state = compile_blocks(transformer, "npu", torchair=FakeTorchair(fail=True))
    out = call()
    assert not state.active and compiled_blocks(transformer) == 0
    assert "compile failed, running eager" in state.error and "unsupported op" in state.error
    assert torch.equal(out, eager)


def test_no_backend_leaves_the_model_eager(engine, call):
    class Broken:
        def CompilerConfig(self):  # noqa: N802
            raise RuntimeError("CANN not loaded")

    state = compile_blocks(engine.model.pipeline.transformer, "npu", torchair=Broken())
    assert not state.active and "CANN not loaded" in state.error
    assert compiled_blocks(engine.model.pipeline.transformer) == 0


def test_engine_compiles_at_load_shows_compiling_and_survives_a_failure(tiny_cache, tmp_path, monkeypatch):
    from hidream_ui.pipeline.speed import runtime

    def failing_backend(device_type, torchair=None):
        def backend(gm, example_inputs):
            raise RuntimeError("inductor exploded")

        return backend, "inductor"

    monkeypatch.setattr(speed_compile, "compiler_backend", failing_backend)
    engine = EditEngine(AppConfig(device="cpu", output_dir=tmp_path, compile="blocks"))
    seen = []
    real_warm_up = runtime.warm_up_call

    def spy(*args, **kwargs):
        seen.append(engine.status().state)
        return real_warm_up(*args, **kwargs)

    monkeypatch.setattr(runtime, "warm_up_call", spy)
    try:
        engine.load()
        assert seen == ["compiling"]
        status = engine.status()
        assert status.state == "idle"
        assert status.speed["moe"] == "sync-free"  # --moe auto with --compile blocks
        assert not status.speed["compiled"] and "inductor exploded" in status.speed["compile_error"]
        result = engine.edit(EditRequest(image=random_picture(4, (64, 64)), params=edit_params(steps=2)), save=False)
        assert result.info.speed["compile"] == "blocks (eager fallback)"
        assert result.info.speed["moe"] == "sync-free"
    finally:
        torch._dynamo.reset()
