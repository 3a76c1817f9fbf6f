"""One manifest item's work and its saving: the same code on the local pool and in a Ray actor.

A worker turns an `ItemTask` into an `ItemOutput` holding the UNSAVED result (`run_item`:
`Engine.edit(..., save=False)`, as every executor computes). The driver (the `batch` command's
process) saves every result through `results.ResultStore` (`save_item`), the one save path of the
app: the PNG and its sidecar, the mask file the metadata names, `parent`, retention, exactly as
the Edit tab saves, plus the `manifest` entry. Ray workers therefore need no storage shared with
the driver: the task carries the source's and the mask's bytes there, and the result comes back
by pickle. Locally the task carries the paths and nothing is converted (no dict round trip).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from hidream_ui.cli.batch_manifest import ManifestItem
from hidream_ui.cli.quiet import LineBar

if TYPE_CHECKING:  # pragma: no cover
    from hidream_ui.edits import EditParams, EditResult
    from hidream_ui.engine.jobs import CancelToken
    from hidream_ui.engine.protocol import Engine
    from hidream_ui.results import ResultStore


@dataclass(frozen=True)
class ItemTask:
    """One item ready to run: plain values (a Ray task crosses to its actor by pickle)."""

    line: int
    source: bytes | Path  # the image: its path locally, its bytes on Ray (read by the driver)
    source_name: str
    source_sha256: str  # of the file's bytes: the result's `parent`
    params: "EditParams"  # validated, seed concrete, no mask yet
    mask: bytes | Path | None  # like `source`
    mask_name: str | None

    @classmethod
    def of(cls, item: ManifestItem, *, carry_bytes: bool = False) -> "ItemTask":
        """The item's task; `carry_bytes`: the files' bytes instead of their paths (Ray)."""

        def where(path: Path | None) -> bytes | Path | None:
            return path.read_bytes() if carry_bytes and path is not None else path

        return cls(
            line=item.line,
            source=where(item.image),
            source_name=item.image.name,
            source_sha256=item.source_sha256,
            params=item.params,
            mask=where(item.mask),
            mask_name=item.mask.name if item.mask else None,
        )


@dataclass(frozen=True)
class ItemOutput:
    line: int
    ok: bool
    error: str | None = None
    result: "EditResult | None" = None  # unsaved (run_item), then saved (save_item)
    engine: str | None = None  # the engine / replica that ran it
    seconds: float = 0.0


def run_item(
    engine: "Engine", task: ItemTask, cancel: "CancelToken | None" = None, engine_label: str | None = None
) -> ItemOutput:
    """Runs one item on `engine` and returns its unsaved result; a failure of this item is an
    ItemOutput with the reason (the batch goes on), never an exception. The mask is opened and
    checked as the `edit` command checks one (the upload decoder's rules)."""
    import dataclasses

    from hidream_ui.edits import EditRequest, RequestError, validated_mask
    from hidream_ui.engine.errors import EngineError
    from hidream_ui.imaging import open_mask

    started = time.perf_counter()
    try:
        params = task.params
        if task.mask is not None:
            mask = validated_mask(open_mask(task.mask, name=task.mask_name), task.mask_name)
            params = dataclasses.replace(params, mask=mask).validated()
        request = EditRequest(
            image=engine.open_image(task.source, name=task.source_name),
            params=params,
            source_name=task.source_name,
            source_sha256=task.source_sha256,
        ).validated()
        result = engine.edit(request, save=False, cancel=cancel)
    except (RequestError, EngineError, ValueError, OSError) as exc:  # ImageError is a ValueError
        return ItemOutput(line=task.line, ok=False, error=str(exc), seconds=round(time.perf_counter() - started, 4))
    return ItemOutput(
        line=task.line,
        ok=True,
        result=result,
        engine=engine_label or result.info.engine or result.info.device,
        seconds=round(time.perf_counter() - started, 4),
    )


def save_item(store: "ResultStore", item: ManifestItem, output: ItemOutput, token: "CancelToken") -> ItemOutput:
    """Saves the item's result as `<stem>.png` + `<stem>.json` through the result store (mask
    file, `parent`, sidecar, retention: the Edit tab's save) with the `manifest` entry; a file
    that cannot be written makes the item an error."""
    from hidream_ui.errors import EngineError

    if not output.ok or output.result is None:
        return output
    extra = {"manifest": {"line": item.line, "settings_hash": item.settings_hash}}
    try:
        (saved,) = store.save([output.result], token, stem=item.stem, extra=extra)
    except (OSError, EngineError) as exc:  # EditCancelled: the batch was stopped before this save
        return ItemOutput(line=output.line, ok=False, error=f"saving {item.output_name} failed: {exc}")
    return ItemOutput(line=output.line, ok=True, result=saved, engine=output.engine, seconds=output.seconds)


def output_done(out_dir: Path, item: ManifestItem) -> bool:
    """The item's PNG is there with a whole sidecar naming its settings hash. The store writes the
    PNG first and the sidecar last, so a run killed mid-save leaves no sidecar that reads."""
    png = out_dir / item.output_name
    if not png.is_file():
        return False
    try:
        metadata = json.loads(png.with_suffix(".json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(metadata, dict) and (metadata.get("manifest") or {}).get("settings_hash") == item.settings_hash


def clear_partial(out_dir: Path, item: ManifestItem) -> None:
    """Removes what a killed run left of an unfinished item (a PNG without its sidecar, or a torn
    sidecar), so the store saves it under its own name again (it never overwrites a file)."""
    png = out_dir / item.output_name
    png.unlink(missing_ok=True)
    png.with_suffix(".json").unlink(missing_ok=True)


def result_row(item: ManifestItem, status: str, output: ItemOutput | None = None) -> dict[str, Any]:
    """One row of results.jsonl: the input line, the output file, seed, status, error, timings."""
    result = output.result if output is not None else None
    return {
        "line": item.line,
        "input": item.raw,
        "output": item.output_name if status in ("ok", "skipped") else None,
        "seed": item.params.seed,
        "settings_hash": item.settings_hash,
        "status": status,
        "error": output.error if output is not None else None,
        "engine": output.engine if output is not None else None,
        "seconds": output.seconds if output is not None else None,
        "timings": result.timings.to_dict() if result is not None else None,
    }


class ItemBar(LineBar):
    """One line on stderr for the whole batch: `batch ██████░░░░ 12/40 items · 1 error · 31.0 s · ETA 72 s`.

    The ETA counts only items run in this process (skipped ones took no time)."""

    def __init__(self, total: int, label: str = "batch", stream: IO[str] | None = None):
        super().__init__(label, stream)
        self.total = max(0, total)
        self.done = 0
        self.errors = 0

    def render(self) -> str:
        elapsed = time.perf_counter() - self.started
        eta = f" · ETA {elapsed / self.done * (self.total - self.done):.0f} s" if 0 < self.done < self.total else ""
        errors = f" · {self.errors} error{'s' if self.errors != 1 else ''}" if self.errors else ""
        return f"{self.bar(self.done, self.total)} {self.done}/{self.total} items{errors} · {elapsed:.1f} s{eta}"

    def advance(self, ok: bool) -> None:
        self.done += 1
        self.errors += 0 if ok else 1
        self.show(self.render())


__all__ = [
    "ItemBar",
    "ItemOutput",
    "ItemTask",
    "clear_partial",
    "output_done",
    "result_row",
    "run_item",
    "save_item",
]
