"""The result store (hidream_ui/results.py): the engine computes, results are saved after the device
is free again, and the metadata is built once."""

from __future__ import annotations

import json
import threading

import pytest
from helpers import edit_params, random_picture

from hidream_ui import results as results_module
from hidream_ui.config import AppConfig
from hidream_ui.edits import EditRequest, EditResult
from hidream_ui.engine.engine import EditEngine
from hidream_ui.engine.errors import EditCancelled
from hidream_ui.engine.jobs import CancelToken
from hidream_ui.engine.pool import EnginePool


def held(lock) -> bool:
    """Whether another thread holds `lock` now (an RLock has no `locked()` before Python 3.13)."""
    free: list[bool] = []

    def probe() -> None:
        if lock.acquire(blocking=False):
            lock.release()
            free.append(True)

    thread = threading.Thread(target=probe)
    thread.start()
    thread.join()
    return not free


@pytest.fixture
def watch_saves(monkeypatch):
    """Records, for every save, what the caller's `probe()` said at that moment."""
    seen: list = []
    real = results_module.save_result
    probe = {"fn": lambda: None}

    def save(result, out_dir, **kwargs):
        seen.append(probe["fn"]())
        return real(result, out_dir, **kwargs)

    monkeypatch.setattr(results_module, "save_result", save)
    return seen, probe


def test_an_engine_saves_its_result_after_releasing_the_device_lock(tmp_path, tiny_cache, watch_saves):
    seen, probe = watch_saves
    engine = EditEngine(AppConfig(device="cpu", output_dir=tmp_path))
    probe["fn"] = lambda: held(engine._lock)
    result = engine.edit(EditRequest(image=random_picture(), params=edit_params(seed=4)))
    assert seen == [False]  # saved, and not under the lock
    assert result.saved_png is not None and result.saved_png.exists()


def test_a_pool_saves_after_its_engine_is_free_for_the_next_job(tmp_path, tiny_cache, watch_saves):
    seen, probe = watch_saves
    pool = EnginePool.for_config(AppConfig(device="cpu", output_dir=tmp_path))
    probe["fn"] = lambda: (pool.slots[0].busy, held(pool.primary._lock))
    result = pool.edit(EditRequest(image=random_picture(), params=edit_params(seed=5)))
    assert seen == [(False, False)]
    assert result.saved_png is not None and result.saved_png.exists()


def test_the_metadata_is_built_once_and_is_what_the_sidecar_holds(tmp_path, tiny_cache, monkeypatch):
    engine = EditEngine(AppConfig(device="cpu", output_dir=tmp_path))
    calls = []
    real = EditResult.metadata

    def counted(self):
        calls.append(1)
        return real(self)

    monkeypatch.setattr(EditResult, "metadata", counted)
    result = engine.edit(EditRequest(image=random_picture(), params=edit_params(seed=6)))
    assert len(calls) == 1
    assert json.loads(result.saved_json.read_text()) == result.saved_metadata


def test_a_cancel_during_saving_leaves_no_file(tmp_path, tiny_cache, monkeypatch):
    store = results_module.ResultStore.at(tmp_path / "out", retention=None)
    engine = EditEngine(AppConfig(device="cpu", output_dir=tmp_path / "unused"))
    unsaved = engine.edit(EditRequest(image=random_picture(), params=edit_params(seed=7)), save=False)
    token = CancelToken()
    real = results_module.save_result

    def save_then_cancel(result, out_dir, **kwargs):
        saved = real(result, out_dir, **kwargs)
        token.cancel("Stop pressed")
        return saved

    monkeypatch.setattr(results_module, "save_result", save_then_cancel)
    with pytest.raises(EditCancelled, match="Stop pressed"):
        store.save([unsaved, unsaved], token)
    assert list((tmp_path / "out").iterdir()) == []


def test_a_store_names_files_by_the_callers_stem_and_adds_its_entries(tmp_path, tiny_cache):
    engine = EditEngine(AppConfig(device="cpu", output_dir=tmp_path / "unused"))
    unsaved = engine.edit(EditRequest(image=random_picture(), params=edit_params(seed=8)), save=False)
    store = results_module.ResultStore.at(tmp_path / "out", retention=3)
    (saved,) = store.save([unsaved], CancelToken(), stem="line-1", extra={"manifest": {"line": 1}})
    assert saved.saved_png == tmp_path / "out" / "line-1.png"
    assert json.loads(saved.saved_json.read_text())["manifest"] == {"line": 1}
    assert saved.saved_metadata["parent"]["of"] == "pixels"  # set by the store, as for every result


def test_the_result_store_imports_nothing_from_the_engine():
    """results.py sits below engine/ (issue 53): the cancel token is duck-typed, EditCancelled lives
    in hidream_ui/errors.py; imports inside functions count too."""
    import ast
    from pathlib import Path

    tree = ast.parse(Path(results_module.__file__).read_text(encoding="utf-8"))
    imported = [node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module]
    imported += [alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names]
    assert imported and not [name for name in imported if name.startswith("hidream_ui.engine")]
    from hidream_ui.engine import errors, jobs

    assert errors.EditCancelled is EditCancelled and jobs.CancelToken is CancelToken  # the old paths still work
