"""Shared fixtures: one offline tiny checkpoint per test session, built by the real builder."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_cache(tmp_path_factory) -> Path:
    """Points HIDREAM_UI_CACHE at a per-session folder (unless CI chose one) and builds the tiny model there.

    The engine finds the checkpoint exactly as the app does with no model configured.
    """
    root = os.environ.get("HIDREAM_UI_CACHE")
    if not root:
        root = str(tmp_path_factory.mktemp("hidream_ui_cache"))
        os.environ["HIDREAM_UI_CACHE"] = root
    from hidream_ui.tiny import ensure_tiny

    ensure_tiny(profile="tiny", seed=0)
    return Path(root)


@pytest.fixture(scope="session")
def tiny_dir(tiny_cache) -> Path:
    """The tiny checkpoint folder (four upstream folders inside)."""
    from hidream_ui.tiny import ensure_tiny

    return ensure_tiny(profile="tiny", seed=0)
