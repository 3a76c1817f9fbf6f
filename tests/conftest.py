"""Shared fixtures: one offline tiny checkpoint per test session, built by the real builder."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from hidream_ui.bench import free_port  # noqa: F401 - test modules import it from here too

# The `slow` marker: `python -m pytest -m "not slow" tests` is the fast subset; `.ci/run` runs all. A test is
# slow when it starts a browser, Ray or a training run (issue 53's rule), or when it runs the model end to end
# many times or measures something whole (a MagCache calibration, the quality floor, a benchmark, a flood of
# edits): those carry `@pytest.mark.slow` where they are defined (the ones that took 1 s or more in a full
# `--durations` run here). Modules wholly slow, and why:
SLOW_MODULES = {
    "test_browser.py": "drives Chromium",
    "test_browser_experience.py": "drives Chromium at two widths",
    "test_ray.py": "starts a Ray cluster and Serve replicas",
    "test_tiny_trained.py": "trains the offline model (several short runs)",
}
# Fixtures that start a browser or Ray: any test that uses one is slow, wherever it lives.
SLOW_FIXTURES = {"browser": "drives Chromium", "page": "drives Chromium", "ray_cluster": "starts Ray"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        module = Path(str(item.fspath)).name
        reason = SLOW_MODULES.get(module) or next(
            (SLOW_FIXTURES[name] for name in getattr(item, "fixturenames", ()) if name in SLOW_FIXTURES), None
        )
        if reason:
            item.add_marker(pytest.mark.slow(reason=reason))


# The CLI's offline default is the trained model (config.OFFLINE_DEFAULT_PROFILE); tests run the random
# `tiny` one, the fast one whose outputs they pin, unless a test names a profile or clears this.
os.environ.setdefault("HIDREAM_TINY_PROFILE", "tiny")


@pytest.fixture(scope="session")
def tiny_cache(tmp_path_factory) -> Path:
    """Points HIDREAM_MODEL_CACHE at a per-session folder (unless CI chose one) and builds the tiny model there.

    The engine finds the checkpoint exactly as the app does with no model configured.
    """
    from hidream_ui.env_names import model_cache_variable

    # A folder named by the deprecated HIDREAM_UI_CACHE moves to the new name, so a test that sets the new
    # one alone never meets two names set to different folders (refused, env_names.py).
    root = model_cache_variable() or str(tmp_path_factory.mktemp("hidream_ui_cache"))
    os.environ.pop("HIDREAM_UI_CACHE", None)
    os.environ["HIDREAM_MODEL_CACHE"] = root
    from hidream_ui.model.tiny.build import ensure_tiny

    ensure_tiny(profile="tiny", seed=0)
    return Path(root)


@pytest.fixture(scope="session")
def tiny_dir(tiny_cache) -> Path:
    """The tiny checkpoint folder (four upstream folders inside)."""
    from hidream_ui.model.tiny.build import ensure_tiny

    return ensure_tiny(profile="tiny", seed=0)


@pytest.fixture(scope="module")
def launch_app(tiny_cache, tmp_path_factory):
    """Launches the real app (hidream_ui.cli.app.launch) on a free port; closed when the module ends.

    Module scope on purpose: a live app keeps its server loop, queue and cache janitor ticking on threads of
    this process, and every tick takes the GIL from whatever test runs then. Kept for the whole session,
    twenty of them made the later tests' many small torch calls 5 to 20 times slower.

    Returns `start(name, **config_overrides) -> {"url", "engine", "config", "demo"}`: one app (and one
    engine) per caller, so modules never share engine state.
    """
    from hidream_ui.cli.app import launch
    from hidream_ui.config import AppConfig
    from hidream_ui.engine.pool import EnginePool
    from hidream_ui.ui.services import is_public

    started = []

    def start(name: str, **overrides):
        values = {
            "device": "cpu",
            "output_dir": tmp_path_factory.mktemp(f"{name}_outputs"),
            "port": free_port(),
            "max_queue": 8,
            **overrides,
        }
        config = AppConfig(**values)
        engine = EnginePool.for_config(config, hide_paths=is_public(config))  # as the app builds it
        demo, url = launch(config, engine=engine, prevent_thread_lock=True, quiet=True)
        started.append(demo)
        return {"url": url, "engine": engine, "config": config, "demo": demo}

    yield start
    for demo in started:
        demo.close()
