"""The result store: where finished edits are saved, after the device is free again.

The engine only computes (`EditEngine.edit(..., save=False)` returns unsaved results); saving a
result (PNG encode with its metadata, hashing, two exclusive file creations and a retention scan
of the output folder) is host work that takes tens of milliseconds per megapixel, and none of it
needs the device. Doing it here, after the engine's lock is released, lets the next job start on
the device while the previous one is still being written.

The metadata is built once, in `outputs.save_result`, and kept on the saved result
(`EditResult.saved_metadata`): the UI's History entry and the batch manifest read it there
instead of building it a second time. Two entries are defined here:

* `parent`: the image the result was made from (`parent_of`): its file name and the sha256 of
  its bytes. "Edit the result" hands the saved PNG back as the source, so the parent of a second
  edit is the first result's PNG: its sha256 is that file's, whose name carries its first 8 hex
  digits (`outputs.save_result`), and History can follow the chain.
* `mask`: a region edit's mask, saved beside the results as `mask-<16 hex of its sha256>.png` (one
  file per distinct mask: every cell of a masked comparison names the same file).

Every result is saved here: the Edit tab, the Batch tab, Compare, `edit` and `batch --manifest`
(locally and on Ray: the driver saves what the actors computed). This module sits below the
engine: it takes the job's cancel token as anything with `cancelled` and `reason` (`CancelCheck`)
and imports nothing from `hidream_ui.engine`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Protocol

from hidream_ui.edits import EditMask, EditResult, cap_name
from hidream_ui.errors import EditCancelled
from hidream_ui.outputs import save_result


class CancelCheck(Protocol):
    """What the store reads of a job's cancel token (`engine.jobs.CancelToken` is one)."""

    @property
    def cancelled(self) -> bool: ...

    reason: str | None


@dataclass(frozen=True)
class ResultStore:
    """Saves results into `out_dir`, keeping at most `retention` of ours there (None: no limit)."""

    out_dir: Path
    retention: int | None = None

    @classmethod
    def at(cls, out_dir: str | os.PathLike, retention: int | None) -> "ResultStore":
        return cls(Path(out_dir), retention or None)

    def save(
        self,
        results: list[EditResult],
        token: CancelCheck,
        *,
        stem: str | None = None,
        extra: Mapping[str, Any] | None = None,
    ) -> list[EditResult]:
        """Saves the results of one pipeline call unless its job was cancelled.

        Checked right before each save and after it (encoding a large PNG takes a while): a cancel
        that arrived meanwhile removes what this call wrote, so a cancelled edit (or batch chunk)
        leaves no file behind and raises EditCancelled. `stem` names the files instead of the
        timestamp (`batch --manifest`: `<id>-<settings hash>`); `extra` adds metadata entries
        (its `manifest` entry); see `outputs.save_result`.
        """
        saved: list[EditResult] = []
        for result in results:
            if not token.cancelled:
                if result.params.mask is not None:
                    save_mask(result.params.mask, self.out_dir)
                result = dataclasses.replace(result, parent=result.parent or parent_of(result))
                saved.append(save_result(result, self.out_dir, retention=self.retention, stem=stem, extra=extra))
            if token.cancelled:
                for done in saved:
                    for path in (done.saved_png, done.saved_json):
                        if path is not None:
                            Path(path).unlink(missing_ok=True)
                raise EditCancelled(f"edit cancelled: {token.reason or 'cancelled'} before its result was saved")
        return saved


def parent_of(result: EditResult) -> dict[str, Any]:
    """The `parent` entry of a result's metadata: {"file": the source's name (None when it had none),
    "sha256": hex digest, "of": what was hashed}. "file": the source file's bytes, as the request
    brought them (`EditRequest.source_sha256`; an earlier result's PNG is its own file); "pixels":
    the decoded RGB pixels (width and height as two 4-byte big-endian numbers, then the bytes), for
    a source handed over as an image (Python callers)."""
    if result.source_sha256:
        return {"file": cap_name(result.source_name), "sha256": result.source_sha256, "of": "file"}
    image = result.source_image.convert("RGB")
    digest = hashlib.sha256(image.width.to_bytes(4, "big") + image.height.to_bytes(4, "big"))
    digest.update(image.tobytes())
    return {"file": cap_name(result.source_name), "sha256": digest.hexdigest(), "of": "pixels"}


def file_sha256(path: str | os.PathLike) -> str:
    """sha256 of a file's bytes (a source's, for `parent`), read in pieces."""
    digest = hashlib.sha256()
    with open(path, "rb") as fp:
        for piece in iter(lambda: fp.read(1 << 20), b""):
            digest.update(piece)
    return digest.hexdigest()


def save_mask(mask: EditMask, out_dir: Path) -> Path:
    """Writes the mask beside the results once (content-addressed: an existing file of that name
    holds the same mask); returns its path. The retention (outputs.prune) deletes it with the
    last result that names it."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / mask.file_name
    try:
        with path.open("xb") as fp:
            fp.write(mask.png)
    except FileExistsError:
        pass
    return path


__all__ = ["CancelCheck", "ResultStore", "file_sha256", "parent_of", "save_mask"]
