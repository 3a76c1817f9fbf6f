"""One engine interface: the app, the CLI and the benchmarks hold an EnginePool (a pool of one for
`--device`) behind the `Engine` protocol; only engine/ (and an engine factory) knows EditEngine."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import hidream_ui
from hidream_ui.config import AppConfig
from hidream_ui.engine import engine as engine_module
from hidream_ui.engine.pool import EnginePool
from hidream_ui.engine.protocol import Engine

PACKAGE = Path(hidream_ui.__file__).parent
# Modules that may name the single-device worker: the engine package itself, and the pool benchmark,
# whose engine factory subclasses it to time each edit (it still hands the app a pool).
MAY_NAME_THE_WORKER = {"engine", "bench/pool.py"}


def _protocol_members() -> set[str]:
    return {name for name in vars(Engine) if not name.startswith("_") and name not in ("config",)}


def test_the_pool_implements_every_member_of_the_engine_protocol():
    members = _protocol_members()
    assert {"edit", "run_batch", "pinned", "labels", "status", "size"} <= members
    missing = [name for name in members if not hasattr(EnginePool, name)]
    assert missing == []
    pool = EnginePool.for_config(AppConfig(device="cpu"))
    assert pool.size == 1 and pool.labels() == ["cpu"]  # a pool of one, named by its device
    for name in members:
        ours, theirs = getattr(EnginePool, name), getattr(Engine, name)
        if callable(ours) and callable(theirs) and not isinstance(theirs, property):
            # Same parameter names (keyword calls must work on any implementation).
            assert list(inspect.signature(ours).parameters) == list(inspect.signature(theirs).parameters), name


def test_only_the_engine_package_names_the_single_device_worker():
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE).as_posix()
        if relative.split("/")[0] in MAY_NAME_THE_WORKER or relative in MAY_NAME_THE_WORKER:
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module == "hidream_ui.engine.engine":
                offenders.append(f"{relative}:{node.lineno} imports {[a.name for a in node.names]}")
    assert offenders == [], "hold an EnginePool (engine/protocol.py Engine), not an EditEngine"


def test_no_process_wide_engine_and_no_engine_level_cancel():
    # Jobs are cancelled through their own token (Stop, /cancel, a disconnect); there is no
    # process-wide engine to reach around the pool.
    assert not hasattr(engine_module, "get_engine") and not hasattr(engine_module, "_ENGINE")
    assert not hasattr(engine_module.EditEngine, "cancel") and not hasattr(EnginePool, "cancel")


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
