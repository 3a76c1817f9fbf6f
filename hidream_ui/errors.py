"""The app's user-facing errors: every one carries a message written for users (shown as is).

They live below both `engine/` and `results.py` (the result store raises EditCancelled for a job
stopped before its result was saved), so neither imports the other for them.
`hidream_ui.engine.errors` re-exports them under their old path.
"""

from __future__ import annotations


class EngineError(RuntimeError):
    """A user-facing failure: the message is shown as is; the engine stays usable."""


class EditCancelled(EngineError):
    """The edit was stopped through its CancelToken; finished work is kept."""


class OutOfMemory(EngineError):
    """The device ran out of memory; memory was freed and the engine stays usable."""


__all__ = ["EditCancelled", "EngineError", "OutOfMemory"]
