"""The engine's errors, under the path most modules import them from (their home is
`hidream_ui/errors.py`, below the engine and the result store)."""

from __future__ import annotations

from hidream_ui.errors import EditCancelled, EngineError, OutOfMemory

__all__ = ["EditCancelled", "EngineError", "OutOfMemory"]
