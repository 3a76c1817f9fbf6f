"""Shared fixtures: one offline tiny checkpoint per test session, built by the real builder."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from hidream_ui.bench import free_port  # noqa: F401 - test modules import it from here too

# The CLI's offline default is the trained model (config.OFFLINE_DEFAULT_PROFILE); tests run the random
# `tiny` one, the fast one whose outputs they pin, unless a test names a profile or clears this.
os.environ.setdefault("HIDREAM_TINY_PROFILE", "tiny")


@pytest.fixture(scope="session")
def tiny_cache(tmp_path_factory) -> Path:
    """Points HIDREAM_UI_CACHE at a per-session folder (unless CI chose one) and builds the tiny model there.

    The engine finds the checkpoint exactly as the app does with no model configured.
    """
    root = os.environ.get("HIDREAM_UI_CACHE")
    if not root:
        root = str(tmp_path_factory.mktemp("hidream_ui_cache"))
        os.environ["HIDREAM_UI_CACHE"] = root
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
