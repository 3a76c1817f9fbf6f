"""One manifest item's work and its output files: the same code on the local pool and in a Ray actor.

A worker turns an `ItemTask` (plain values: it crosses to Ray workers by pickle) into an
`ItemOutput`: the result PNG already encoded with its metadata, never a file. The driver (the
`batch` command's process) writes the files, so Ray workers need no storage shared with it, and
both paths write through `write_output` (identical pixels, identical layout).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from hidream_ui.cli.batch_manifest import MASK_UNSUPPORTED, ManifestItem, mask_supported
from hidream_ui.cli.quiet import LineBar

if TYPE_CHECKING:  # pragma: no cover
    from hidream_ui.engine.jobs import CancelToken
    from hidream_ui.engine.protocol import Engine


@dataclass(frozen=True)
class ItemTask:
    line: int
    image: bytes  # the source file's bytes (read by the driver)
    image_name: str
    params: dict[str, Any]  # EditParams.to_dict(), seed concrete
    mask: str | None
    settings_hash: str

    @classmethod
    def of(cls, item: ManifestItem) -> "ItemTask":
        return cls(
            line=item.line,
            image=item.image.read_bytes(),
            image_name=item.image.name,
            params=item.params.to_dict(),
            mask=str(item.mask) if item.mask else None,
            settings_hash=item.settings_hash,
        )


@dataclass(frozen=True)
class ItemOutput:
    line: int
    ok: bool
    error: str | None = None
    png: bytes | None = None  # encoded with its metadata (outputs.encode_png)
    metadata: dict[str, Any] | None = None
    seed: int | None = None
    engine: str | None = None  # the engine / replica that ran it
    timings: dict[str, float] | None = None
    seconds: float = 0.0


def run_item(
    engine: "Engine", task: ItemTask, cancel: "CancelToken | None" = None, engine_label: str | None = None
) -> ItemOutput:
    """Runs one item on `engine` (unsaved) and encodes its PNG; a failure of this item is an
    ItemOutput with the reason (the batch goes on), never an exception."""
    from hidream_ui.edits import EditParams, EditRequest, RequestError
    from hidream_ui.engine.errors import EngineError
    from hidream_ui.outputs import encode_png

    started = time.perf_counter()
    try:
        params = EditParams.from_dict(dict(task.params))
        if task.mask is not None:
            if not mask_supported():
                return ItemOutput(line=task.line, ok=False, error=MASK_UNSUPPORTED)
            import dataclasses
            from pathlib import Path as _Path

            from hidream_ui.edits import validated_mask
            from hidream_ui.imaging import open_mask

            mask = validated_mask(open_mask(task.mask), _Path(task.mask).name)  # the upload decoder's rules
            params = dataclasses.replace(params, mask=mask).validated()
        image = engine.open_image(task.image, name=task.image_name)
        request = EditRequest(image=image, params=params, source_name=task.image_name).validated()
        result = engine.edit(request, save=False, cancel=cancel)
        metadata = result.metadata()
        metadata["manifest"] = {"line": task.line, "settings_hash": task.settings_hash}
        png = encode_png(result.image, metadata)
    except (RequestError, EngineError, ValueError, OSError) as exc:  # ImageError is a ValueError
        return ItemOutput(line=task.line, ok=False, error=str(exc), seconds=round(time.perf_counter() - started, 4))
    label = engine_label or result.info.engine or result.info.device
    return ItemOutput(
        line=task.line,
        ok=True,
        png=png,
        metadata=metadata,
        seed=result.params.seed,
        engine=label,
        timings=result.timings.to_dict(),
        seconds=round(time.perf_counter() - started, 4),
    )


def output_done(out_dir: Path, item: ManifestItem) -> bool:
    """The item's PNG and sidecar exist (the PNG is renamed into place last, so it is whole)."""
    png = out_dir / item.output_name
    return png.is_file() and png.with_suffix(".json").is_file()


def write_output(out_dir: Path, item: ManifestItem, output: ItemOutput) -> Path:
    """Writes `<stem>.json` then `<stem>.png` (through a temporary name: a run killed mid-write
    leaves no PNG that a rerun would take for finished)."""
    from hidream_ui.outputs import write_sidecar

    png = out_dir / item.output_name
    write_sidecar(png.with_suffix(".json"), output.metadata or {}, exclusive=False)
    partial = png.with_name(f".{png.name}.partial")
    partial.write_bytes(output.png or b"")
    os.replace(partial, png)
    return png


def result_row(item: ManifestItem, status: str, output: ItemOutput | None = None) -> dict[str, Any]:
    """One row of results.jsonl: the input line, the output file, seed, status, error, timings."""
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
        "timings": output.timings if output is not None else None,
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


__all__ = ["ItemBar", "ItemOutput", "ItemTask", "output_done", "result_row", "run_item", "write_output"]
