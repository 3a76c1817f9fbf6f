"""Zip archives in and out of a batch: the results zip, and reading a zip of source images.

Out: `write_batch_zip` packs every finished item's PNG (bytes as saved, so the metadata chunk
travels with it), its JSON sidecar and a `manifest.json` describing every item (ok, error or
cancelled), the rejected uploads and the batch statistics.

In: `read_zip_images` takes an uploaded zip apart *in memory*. Member names come from whoever
made the zip, so they are only ever used as display names (never as paths to write), and every
member is read through a size cap that counts the bytes actually decompressed: a zip's header
sizes can lie, and a few KB of deflated zeros can claim gigabytes (zip bomb). Members that are
not images are listed as rejected instead of failing the whole upload.

Pure standard library + PIL: no torch, no gradio.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import posixpath
import stat
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Iterable, Union

from PIL import Image, UnidentifiedImageError

from hidream_ui.engine.batch import BatchResult, BatchSource
from hidream_ui.outputs import encode_png, metadata_json

__all__ = [
    "MANIFEST_NAME",
    "MANIFEST_FORMAT",
    "ArchiveError",
    "ZipLimits",
    "write_batch_zip",
    "read_zip_images",
    "sources_from_uploads",
]

MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = "hidream_ui-batch/1"

ZipSource = Union[str, os.PathLike, bytes, bytearray, IO[bytes]]

# Folders and files that archivers add on their own (macOS resource forks, Finder state,
# Windows thumbnails): not the user's images, so skipped silently rather than "rejected".
_JUNK_DIRS = ("__MACOSX/",)
_JUNK_NAMES = (".DS_Store", "Thumbs.db", "desktop.ini")
_CHUNK = 1 << 16


class ArchiveError(ValueError):
    """The zip itself cannot be used (not a zip, damaged, too many members); the message says why."""


@dataclass(frozen=True)
class ZipLimits:
    """Caps applied while reading an uploaded zip.

    `max_member_bytes` bounds one decompressed member (a 40-megapixel PNG is rarely above
    60 MB); `max_total_bytes` bounds everything read from one zip; `max_members` bounds the
    entries looked at (a zip of 100 000 empty files is a cheap way to burn CPU).
    """

    max_members: int = 256
    max_member_bytes: int = 64 * 2**20
    max_total_bytes: int = 512 * 2**20


# ---------------------------------------------------------------------------------------------
# Writing the results zip
# ---------------------------------------------------------------------------------------------


def write_batch_zip(result: BatchResult, path: str | os.PathLike) -> Path:
    """Writes the results of `result` to the zip at `path` (replaced if it exists); returns the path.

    Layout: `<name>.png` + `<name>.json` per finished item (the names the results were saved
    under) and `manifest.json`. Each manifest row is `BatchItem.manifest_row()` plus `sidecar`;
    `output` / `sidecar` name members of this zip (null for items without a result).
    An item whose saved files are gone (retention pruned them, or it was never saved) is
    re-encoded from the result in memory with the same metadata, so the zip is always complete.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = []
    used: set[str] = set()
    # Written next to the target and renamed at the end: a reader never sees half a zip, and
    # a failure leaves no broken file behind.
    partial = path.with_name(path.name + ".partial")
    try:
        with zipfile.ZipFile(partial, "w") as archive:
            for item in result.items:
                row = item.manifest_row()
                row.setdefault("output", None)  # every row has the same columns, result or not
                row["sidecar"] = None
                if item.result is not None:
                    png_name, json_name = _member_names(item, used)
                    png_bytes, metadata = _result_files(item.result)
                    # PNG data is already deflated: storing it saves time and loses nothing.
                    archive.writestr(png_name, png_bytes, compress_type=zipfile.ZIP_STORED)
                    archive.writestr(json_name, metadata_json(metadata) + "\n", compress_type=zipfile.ZIP_DEFLATED)
                    row["output"], row["sidecar"] = png_name, json_name
                rows.append(row)
            manifest = {
                "format": MANIFEST_FORMAT,
                "items": rows,
                "rejected": [{"name": name, "reason": reason} for name, reason in result.rejected],
                "cancelled": result.cancelled,
                "seconds": result.seconds,
                "counts": {status: sum(1 for item in result.items if item.status == status)
                           for status in ("ok", "error", "cancelled", "pending")},
                "stats": result.stats,
            }
            archive.writestr(MANIFEST_NAME, json.dumps(manifest, indent=2, ensure_ascii=True, allow_nan=False,
                                                       default=str) + "\n",
                             compress_type=zipfile.ZIP_DEFLATED)
        os.replace(partial, path)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    return path


def _member_names(item, used: set[str]) -> tuple[str, str]:
    saved = item.result.saved_png
    stem = Path(saved).stem if saved is not None else f"item-{item.index:04d}-s{item.seed}"
    name, attempt = stem, 0
    while f"{name}.png" in used or name + ".png" == MANIFEST_NAME:
        attempt += 1
        name = f"{stem}-{attempt}"
    used.add(f"{name}.png")
    return f"{name}.png", f"{name}.json"


def _result_files(result) -> tuple[bytes, dict]:
    """(PNG bytes, metadata) of a result: the saved file when it still exists, else re-encoded."""
    metadata = result.metadata()
    if result.saved_png is not None:
        try:
            png = Path(result.saved_png).read_bytes()
        except FileNotFoundError:
            pass
        else:
            if result.saved_json is not None:
                try:
                    metadata = json.loads(Path(result.saved_json).read_text(encoding="utf-8"))
                except (OSError, ValueError):
                    pass  # the in-memory metadata is the same content; the sidecar is a convenience copy
            return png, metadata
    return encode_png(result.image, metadata), metadata


# ---------------------------------------------------------------------------------------------
# Reading a zip of source images
# ---------------------------------------------------------------------------------------------


def read_zip_images(src: ZipSource, *, name: str | None = None,
                    limits: ZipLimits = ZipLimits()) -> tuple[list[BatchSource], list[tuple[str, str]]]:
    """The images inside a zip, read into memory: (sources, rejected).

    `sources` are `BatchSource(display name, bytes)` in the zip's order, ready for a
    `BatchRequest`; only the header of each member is checked here (the engine decodes and
    validates the pixels). `rejected` lists (display name, reason) for members that are not
    images, too large, encrypted or damaged. Display names are the member path inside the zip,
    prefixed with the zip's name and normalised (no leading "/", no ".."), never used as a
    file path. Raises ArchiveError when the zip itself is unreadable or has too many members.
    """
    label = name or _zip_label(src)
    if isinstance(src, (bytes, bytearray)):
        src = io.BytesIO(bytes(src))
    try:
        archive = zipfile.ZipFile(src)
    except zipfile.BadZipFile as exc:
        raise ArchiveError(f"{label}: not a readable zip file ({exc})") from None
    except FileNotFoundError:
        raise ArchiveError(f"{label}: no such file") from None
    sources: list[BatchSource] = []
    rejected: list[tuple[str, str]] = []
    with archive:
        members = [info for info in archive.infolist() if not info.is_dir() and not _is_junk(info.filename)]
        if len(members) > limits.max_members:
            raise ArchiveError(f"{label}: holds {len(members)} files; at most {limits.max_members} are read "
                               "from one zip (split it)")
        budget = limits.max_total_bytes
        for info in members:
            display = f"{label}/{_display_name(info.filename)}"
            if _is_symlink(info):
                rejected.append((display, "a symbolic link, not an image file"))
                continue
            if info.flag_bits & 0x1:
                rejected.append((display, "encrypted; zip it without a password"))
                continue
            cap = min(limits.max_member_bytes, budget)
            if info.file_size > cap:
                rejected.append((display, _too_large(info.file_size, limits, budget)))
                continue
            try:
                data = _read_capped(archive, info, cap)
            except _TooLarge:
                rejected.append((display, _too_large(None, limits, budget)))
                continue
            except (zipfile.BadZipFile, zipfile.LargeZipFile, NotImplementedError, OSError, EOFError) as exc:
                rejected.append((display, f"cannot be read from the zip ({exc})"))
                continue
            budget -= len(data)
            reason = _not_an_image(data)
            if reason:
                rejected.append((display, reason))
                continue
            sources.append(BatchSource(name=display, data=data))
    return sources, rejected


class _TooLarge(Exception):
    pass


def _read_capped(archive: zipfile.ZipFile, info: zipfile.ZipInfo, cap: int) -> bytes:
    # Counts what is really decompressed: the header's file_size is only a claim.
    out = bytearray()
    with archive.open(info) as fp:
        while True:
            chunk = fp.read(_CHUNK)
            if not chunk:
                return bytes(out)
            out += chunk
            if len(out) > cap:
                raise _TooLarge()


def _too_large(size: int | None, limits: ZipLimits, budget: int) -> str:
    claimed = f" ({size / 2**20:.1f} MiB)" if size is not None else ""
    if budget < limits.max_member_bytes:
        return (f"too large{claimed}: the zip's files may add up to {limits.max_total_bytes // 2**20} MiB "
                "uncompressed; split the zip")
    return f"too large{claimed}: at most {limits.max_member_bytes // 2**20} MiB per image"


def _not_an_image(data: bytes) -> str | None:
    if not data:
        return "empty file"
    try:
        # Header only (PIL opens lazily): cheap, and the engine decodes the pixels with its own
        # checks (decompression-bomb limit, truncation) later.
        with Image.open(io.BytesIO(data)):
            return None
    except (UnidentifiedImageError, Image.DecompressionBombError, OSError, SyntaxError, ValueError):
        return "not a recognised image (PNG, JPEG, WebP, ...)"


def _is_junk(filename: str) -> bool:
    if any(filename.startswith(prefix) or f"/{prefix}" in filename for prefix in _JUNK_DIRS):
        return True
    base = posixpath.basename(filename)
    return base in _JUNK_NAMES or base.startswith("._")


def _is_symlink(info: zipfile.ZipInfo) -> bool:
    return stat.S_ISLNK(info.external_attr >> 16)


def _display_name(filename: str) -> str:
    """A member name made harmless for display: forward slashes, no drive, no "." / ".." parts."""
    parts = [part for part in filename.replace("\\", "/").split("/") if part not in ("", ".", "..")]
    if parts and len(parts[0]) == 2 and parts[0][1] == ":":  # "C:" from a Windows archiver
        parts = parts[1:]
    return "/".join(parts) or "unnamed"


def _zip_label(src: object) -> str:
    if isinstance(src, (str, os.PathLike)):
        return Path(src).name
    filename = getattr(src, "name", None)
    return Path(filename).name if isinstance(filename, str) and filename else "upload.zip"


# ---------------------------------------------------------------------------------------------
# Uploads -> sources
# ---------------------------------------------------------------------------------------------


def sources_from_uploads(uploads: Iterable[tuple[str, str | os.PathLike]], *,
                         limits: ZipLimits = ZipLimits()) -> tuple[list[BatchSource], list[tuple[str, str]]]:
    """Batch sources from uploaded files given as (display name, path): zips are expanded in memory
    (see `read_zip_images`; all the zips of one upload share `limits.max_total_bytes`), anything
    else is passed on by path for the engine to open.

    A zip that cannot be read is one rejected entry, not an error: the other uploads still run.
    Zips are recognised by content, not by extension (renamed downloads are common).
    """
    sources: list[BatchSource] = []
    rejected: list[tuple[str, str]] = []
    budget = limits.max_total_bytes  # shared by every zip of the request, not one budget each
    for display, path in uploads:
        if _looks_like_zip(path):
            if budget <= 0:
                rejected.append((display, f"not read: the zips of this upload already hold "
                                          f"{limits.max_total_bytes // 2**20} MiB; split the batch"))
                continue
            try:
                inner, refused = read_zip_images(path, name=display,
                                                 limits=dataclasses.replace(limits, max_total_bytes=budget))
            except ArchiveError as exc:
                rejected.append((display, str(exc)))
                continue
            if not inner and not refused:
                rejected.append((display, "the zip holds no files"))
            budget -= sum(len(source.data) for source in inner if isinstance(source.data, (bytes, bytearray)))
            sources.extend(inner)
            rejected.extend(refused)
        else:
            sources.append(BatchSource(name=display, data=path))
    return sources, rejected


def _looks_like_zip(path: str | os.PathLike) -> bool:
    try:
        with open(path, "rb") as fp:
            head = fp.read(4)
    except OSError:
        return False  # the engine reports an unreadable file with its own message
    # Local file header, or the end-of-central-directory record of an empty zip. A damaged file
    # named .zip goes to the zip reader too, whose message ("not a readable zip") fits better.
    return head in (b"PK\x03\x04", b"PK\x05\x06") or str(path).lower().endswith(".zip")
