"""One engine interface: the app, the CLI and the benchmarks hold an executor (`EnginePool` in process, a
pool of one for `--device`; `RayEngine` with `--ray`) behind `engine/protocol.py` `Engine`. The
interface never hands out a worker (`EditEngine`) or its model, and each executor declares what it can
do (`capabilities`), so the UI shows only what works."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest
from test_import_graph import _imports  # the import-graph test's reader: skips `if TYPE_CHECKING:` blocks

import hidream_ui
from hidream_ui.config import AppConfig
from hidream_ui.engine import engine as engine_module
from hidream_ui.engine.pool import EnginePool
from hidream_ui.engine.protocol import ALL_CAPABILITIES, CAPABILITY_NAMES, Capabilities, Engine

PACKAGE = Path(hidream_ui.__file__).parent
WORKER_MODULE = "hidream_ui.engine.engine"
WORKER_CLASSES = {"EditEngine", "Worker"}


def _protocol_members() -> set[str]:
    return {name for name in vars(Engine) if not name.startswith("_") and name not in ("config",)}


def test_the_pool_implements_every_member_of_the_engine_interface():
    members = _protocol_members()
    assert {"edit", "run_batch", "run_exclusive", "capabilities", "model_facts", "labels", "status", "size"} <= members
    assert getattr(EnginePool, "__abstractmethods__", None) == frozenset()  # nothing left unimplemented
    pool = EnginePool.for_config(AppConfig(device="cpu"))
    assert pool.size == 1 and pool.labels() == ["cpu"]  # a pool of one, named by its device
    for name in members:
        ours, theirs = getattr(EnginePool, name), getattr(Engine, name)
        if callable(ours) and callable(theirs) and not isinstance(theirs, property):
            # Same parameter names (keyword calls must work on any implementation).
            assert list(inspect.signature(ours).parameters) == list(inspect.signature(theirs).parameters), name


def test_the_interface_never_hands_out_a_worker_or_its_model():
    members = _protocol_members()
    assert not {"pinned", "model", "primary", "engines"} & members
    for name in members:  # no member's annotation names the worker or the loaded model
        member = getattr(Engine, name)
        function = member.fget if isinstance(member, property) else member
        if callable(function):
            returns = str(inspect.signature(function).return_annotation)
            assert not {"EditEngine", "Worker", "LoadedModel"} & set(returns.replace('"', " ").split()), name
    # The pool keeps its held worker to engine/ (Compare), and answers questions about the model with data.
    assert not hasattr(EnginePool, "pinned") and not hasattr(EnginePool, "model")
    assert EnginePool.for_config(AppConfig(device="cpu")).model_facts() is None  # nothing loaded yet


def _runtime_worker_imports(path: Path) -> list[str]:
    """`file:line names` for each import of a worker class that can run (TYPE_CHECKING blocks never do)."""
    found = []
    for node in _imports(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.ImportFrom) and node.module == WORKER_MODULE:
            names = [alias.name for alias in node.names]
            if WORKER_CLASSES & set(names) or "*" in names:
                found.append(f"{node.lineno} from {node.module} import {', '.join(names)}")
        elif isinstance(node, ast.ImportFrom) and node.module == "hidream_ui.engine":
            if any(alias.name == "engine" for alias in node.names):  # `from hidream_ui.engine import engine`
                found.append(f"{node.lineno} from hidream_ui.engine import engine")
        elif isinstance(node, ast.Import) and any(alias.name == WORKER_MODULE for alias in node.names):
            found.append(f"{node.lineno} import {WORKER_MODULE}")
    return found


@pytest.mark.slow
def test_only_the_engine_package_imports_a_worker_class():
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE).as_posix()
        if relative.startswith("engine/"):
            continue
        offenders += [f"{relative}:{where}" for where in _runtime_worker_imports(path)]
    assert offenders == [], "hold an executor (engine/protocol.py Engine), never a worker (EditEngine)"


def test_the_worker_import_check_sees_what_it_must_and_skips_type_checking(tmp_path):
    module = tmp_path / "module.py"
    module.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from hidream_ui.engine.engine import EditEngine\n"
        "def f():\n    from hidream_ui.engine.engine import Worker\n"
        "import hidream_ui.engine.engine\n"
        "from hidream_ui.engine.engine import working_sides\n"
    )
    assert sorted(_runtime_worker_imports(module)) == [
        "5 from hidream_ui.engine.engine import Worker",
        "6 import hidream_ui.engine.engine",
    ]


def test_executors_declare_their_capabilities_with_reasons():
    pool = EnginePool.for_config(AppConfig(device="cpu"))
    assert pool.capabilities == ALL_CAPABILITIES
    assert all(pool.capabilities.has(name) for name in CAPABILITY_NAMES) and pool.capabilities.missing == {}

    from hidream_ui.engine.ray_serve import RAY_CAPABILITIES, RayEngine  # Ray itself is imported lazily

    ray = RayEngine(AppConfig(device="cpu"), "127.0.0.1:1")  # nothing connects before load()
    assert ray.capabilities is RAY_CAPABILITIES
    assert not ray.capabilities.compare and not ray.capabilities.attention and not ray.capabilities.local_rewriter
    assert "Ray replicas serve one edit each" in ray.capabilities.missing["compare"]
    for name, reason in ray.capabilities.missing.items():  # one readable line each
        assert not ray.capabilities.has(name) and reason.strip() and "\n" not in reason, name
    assert ray.capabilities.speed and ray.capabilities.batch  # what it does serve stays declared
    assert getattr(RayEngine, "__abstractmethods__", None) == frozenset()


def test_a_missing_capability_is_refused_at_once_with_its_reason(tmp_path):
    from helpers import random_picture

    from hidream_ui.edits import EditParams
    from hidream_ui.engine.compare import run_compare
    from hidream_ui.engine.errors import EngineError
    from hidream_ui.engine.ray_serve import RayEngine

    ray = RayEngine(AppConfig(device="cpu", output_dir=tmp_path), "127.0.0.1:1")
    reason = ray.capabilities.missing["compare"]
    with pytest.raises(EngineError, match="Ray replicas serve one edit each"):
        run_compare(ray, random_picture(1), EditParams("make it blue"), "seed", "1, 2")
    assert not ray.loaded and reason  # refused before connecting to any cluster
    for call in (lambda: ray.set_attention("math"), lambda: ray.run_exclusive("rewriting", print)):
        with pytest.raises(EngineError, match="not available with --ray"):
            call()


def test_capabilities_refuse_a_missing_one_without_a_reason():
    with pytest.raises(ValueError, match="without a reason"):
        Capabilities(compare=False)
    with pytest.raises(ValueError, match="expected one of"):
        Capabilities.without(teleport="no")
    assert Capabilities.without(compare="why").missing == {"compare": "why"}


def test_no_process_wide_engine_and_no_engine_level_cancel():
    # Jobs are cancelled through their own token (Stop, /cancel, a disconnect); there is no
    # process-wide engine to reach around the pool.
    assert not hasattr(engine_module, "get_engine") and not hasattr(engine_module, "_ENGINE")
    assert not hasattr(engine_module.EditEngine, "cancel") and not hasattr(EnginePool, "cancel")


@pytest.mark.slow
def test_a_pool_of_one_runs_a_batch_without_threads(tmp_path, tiny_cache, monkeypatch):
    import threading

    from helpers import random_picture

    from hidream_ui.edits import EditSettings
    from hidream_ui.engine.batch import BatchRequest, BatchSource

    started = []
    real_start = threading.Thread.start

    def counting_start(self):
        started.append(self.name)
        return real_start(self)

    pool = EnginePool.for_config(AppConfig(device="cpu", output_dir=tmp_path))
    pool.load()  # the load's own background bookkeeping is not the batch's
    monkeypatch.setattr(threading.Thread, "start", counting_start)
    batch = BatchRequest(
        sources=(BatchSource("a.png", random_picture(1)),),
        instructions=("make it blue",),
        settings=EditSettings(num_inference_steps=1, working_resolution="draft"),
        seed=3,
    )
    result = pool.run_batch(batch)
    assert [item.status for item in result.items] == ["ok"]
    assert started == []


def test_the_app_asks_a_ray_head_before_it_serves_but_building_the_engine_connects_nothing():
    """docs/cluster.md: a head that refuses stops the app at start with one line; the engine itself
    (constructed by tests, bench and the app alike) connects nothing before load()."""
    from hidream_ui.cli.app import ray_engine
    from hidream_ui.config import ConfigError
    from hidream_ui.engine.ray_serve import RayEngine

    RayEngine(AppConfig(device="cpu"), "127.0.0.1:1")  # no head there, and no error: nothing was asked
    with pytest.raises(ConfigError, match=r"^--ray 127\.0\.0\.1:1: nothing is listening at 127\.0\.0\.1:1"):
        ray_engine(AppConfig(device="cpu", ray="127.0.0.1:1"))
