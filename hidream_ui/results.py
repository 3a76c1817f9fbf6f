"""The result store: where finished edits are saved, after the device is free again.

The engine only computes (`EditEngine.edit(..., save=False)` returns unsaved results); saving a
result (PNG encode with its metadata, hashing, two exclusive file creations and a retention scan
of the output folder) is host work that takes tens of milliseconds per megapixel, and none of it
needs the device. Doing it here, after the engine's lock is released, lets the next job start on
the device while the previous one is still being written.

The metadata is built once, in `outputs.save_result`, and kept on the saved result
(`EditResult.saved_metadata`): the UI's History entry and the batch manifest read it there
instead of building it a second time.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from hidream_ui.edits import EditResult
from hidream_ui.engine.errors import EditCancelled
from hidream_ui.engine.jobs import CancelToken
from hidream_ui.outputs import save_result


@dataclass(frozen=True)
class ResultStore:
    """Saves results into `out_dir`, keeping at most `retention` of ours there (None: no limit)."""

    out_dir: Path
    retention: int | None = None

    @classmethod
    def at(cls, out_dir: str | os.PathLike, retention: int | None) -> "ResultStore":
        return cls(Path(out_dir), retention or None)

    def save(self, results: list[EditResult], token: CancelToken) -> list[EditResult]:
        """Saves the results of one pipeline call unless its job was cancelled.

        Checked right before each save and after it (encoding a large PNG takes a while): a cancel
        that arrived meanwhile removes what this call wrote, so a cancelled edit (or batch chunk)
        leaves no file behind and raises EditCancelled.
        """
        saved: list[EditResult] = []
        for result in results:
            if not token.cancelled:
                saved.append(save_result(result, self.out_dir, retention=self.retention))
            if token.cancelled:
                for done in saved:
                    for path in (done.saved_png, done.saved_json):
                        if path is not None:
                            Path(path).unlink(missing_ok=True)
                raise EditCancelled(f"edit cancelled: {token.reason or 'cancelled'} before its result was saved")
        return saved


__all__ = ["ResultStore"]
