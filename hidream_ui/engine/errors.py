"""The engine's errors: every one carries a message written for users (shown as is)."""

from __future__ import annotations


class EngineError(RuntimeError):
    """A user-facing failure: the message is shown as is; the engine stays usable."""


class EditCancelled(EngineError):
    """The edit was stopped through its CancelToken; finished work is kept."""


class OutOfMemory(EngineError):
    """The device ran out of memory; memory was freed and the engine stays usable."""
