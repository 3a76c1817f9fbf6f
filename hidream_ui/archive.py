"""Zip archives in and out of a batch: the results zip, and reading a zip of source images.

Out: `write_batch_zip` packs every finished item's PNG (bytes as saved, so the metadata chunk
travels with it), its JSON sidecar and a `manifest.json` describing every item (ok, error or
cancelled), the rejected uploads and the batch statistics.

In: `read_zip_images` takes an uploaded zip apart *in memory*. Member names come from whoever
made the zip, so they are only ever used as display names (never as paths to write), and every
member is read through caps that count the bytes actually decompressed: a zip's header sizes can
lie, and a few KB of deflated zeros can claim gigabytes (zip bomb). The zips of one request share
one `ZipBudget`, charged for every byte inflated whether its member is kept or rejected, and
bounded in members, time and by the job's cancel token. Members that are not images are listed as
rejected instead of failing the whole upload.

Standard library + PIL (through `imaging`, for the formats the app opens): no torch, no gradio.
"""

from __future__ import annotations

import hashlib
import io
import json
import lzma
import os
import posixpath
import stat
import struct
import time
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Callable, Iterable, Union

from hidream_ui.engine.batch import BatchResult, BatchSource
from hidream_ui.engine.errors import EditCancelled
from hidream_ui.imaging import ImageError, open_header
from hidream_ui.outputs import encode_png, metadata_json

__all__ = [
    "MANIFEST_NAME",
    "MANIFEST_FORMAT",
    "ArchiveError",
    "ZipBudget",
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
_EOCD_SEARCH = 22 + 0xFFFF  # the end record sits in the last 22 bytes plus a comment of up to 64 KiB
# Directory entries per member that may be read: macOS adds a "__MACOSX/._" twin per file and
# folders have entries of their own, none of which count as members.
_ENTRIES_PER_MEMBER = 4
# Central-directory bytes one member may need: 46 fixed + name + extra + comment, for the entry
# and its twins; 4 KiB is far beyond any archiver's and still keeps a lying directory small to parse.
_DIRECTORY_BYTES_PER_MEMBER = 4096


class ArchiveError(ValueError):
    """The zip itself cannot be used (not a zip, damaged, too many members); the message says why."""


@dataclass(frozen=True)
class ZipLimits:
    """Caps applied while reading the zips of one request (see `ZipBudget`).

    `max_member_bytes` bounds one decompressed member (a 40-megapixel PNG is rarely above
    60 MB); `max_total_bytes` bounds every byte decompressed from the request's zips, kept or
    rejected; `max_members` bounds the entries looked at in all (a zip of 100 000 empty files is
    a cheap way to burn CPU); `max_seconds` bounds the wall-clock time spent expanding them (the
    request holds a place on the device lane meanwhile).
    """

    max_members: int = 256
    max_member_bytes: int = 64 * 2**20
    max_total_bytes: int = 512 * 2**20
    max_seconds: float = 20.0


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
                "counts": {
                    status: sum(1 for item in result.items if item.status == status)
                    for status in ("ok", "error", "cancelled", "pending")
                },
                "stats": result.stats,
            }
            archive.writestr(
                MANIFEST_NAME,
                json.dumps(manifest, indent=2, ensure_ascii=True, allow_nan=False, default=str) + "\n",
                compress_type=zipfile.ZIP_DEFLATED,
            )
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
    metadata = result.saved_metadata or result.metadata()
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


class ZipBudget:
    """What one request may spend expanding its zips, charged for work done, not work kept.

    Every byte decompressed counts, whether its member is kept, rejected (not an image, a bad
    CRC) or stopped half-way (over a cap): a zip of members that all fail costs the same budget
    as one whose members all pass. Also bounded: the members looked at (`limits.max_members` for
    the whole request), the wall-clock time (`limits.max_seconds`), and a cancel token (any object
    with a `cancelled` property, as `engine.jobs.CancelToken`) checked between chunks, so Stop,
    `/cancel` and a client that went away stop the expansion too.
    """

    def __init__(
        self, limits: ZipLimits = ZipLimits(), cancel: Any = None, clock: Callable[[], float] = time.monotonic
    ):
        self.limits = limits
        self.spent = 0  # bytes decompressed so far, kept or not
        self.members = 0  # members looked at so far, every zip of the request
        self._cancel = cancel
        self._clock = clock
        self._deadline = clock() + limits.max_seconds

    @property
    def remaining(self) -> int:
        return self.limits.max_total_bytes - self.spent

    def exhausted(self) -> str | None:
        """Why nothing more may be read (bytes or time spent), or None."""
        if self.remaining <= 0:
            return (
                f"not read: the zips of this request already decompressed "
                f"{self.limits.max_total_bytes // 2**20} MiB (images or not); split the batch"
            )
        return self.out_of_time()

    def out_of_time(self) -> str | None:
        if self._clock() > self._deadline:
            return (
                f"not read: reading the zips of this request took over {self.limits.max_seconds:g} s; split the batch"
            )
        return None

    def check_cancel(self, label: str) -> None:
        if self._cancel is not None and self._cancel.cancelled:
            reason = getattr(self._cancel, "reason", None) or "cancelled"
            raise EditCancelled(f"Stopped while reading {label} ({reason}); nothing was edited.")

    def charge(self, size: int) -> None:
        self.spent += size


def read_zip_images(
    src: ZipSource, *, name: str | None = None, limits: ZipLimits = ZipLimits(), budget: ZipBudget | None = None
) -> tuple[list[BatchSource], list[tuple[str, str]]]:
    """The images inside a zip, read into memory: (sources, rejected).

    `sources` are `BatchSource(display name, bytes)` in the zip's order, ready for a
    `BatchRequest`; only the header of each member is checked here (the engine decodes and
    validates the pixels). `rejected` lists (display name, reason) for members that are not
    images, too large, encrypted or damaged, and for those left unread once `budget` (made from
    `limits` when not given; pass one to share it between the zips of a request) is spent.
    Display names are the member path inside the zip, prefixed with the zip's name and normalised
    (no leading "/", no ".."), never used as a file path. Raises ArchiveError when the zip itself
    is unreadable or has too many members, and `EditCancelled` when the budget's cancel token is set.
    """
    budget = budget if budget is not None else ZipBudget(limits)
    limits = budget.limits
    label = name or _zip_label(src)
    budget.check_cancel(label)
    if isinstance(src, (bytes, bytearray)):
        src = io.BytesIO(bytes(src))
    try:
        _check_directory(src, label, limits.max_members - budget.members)
        archive = zipfile.ZipFile(src)
    except zipfile.BadZipFile as exc:
        raise ArchiveError(f"{label}: not a readable zip file ({exc})") from None
    except FileNotFoundError:
        raise ArchiveError(f"{label}: no such file") from None
    sources: list[BatchSource] = []
    rejected: list[tuple[str, str]] = []
    with archive:
        members = [info for info in archive.infolist() if not info.is_dir() and not _is_junk(info.filename)]
        room = limits.max_members - budget.members
        if len(members) > room:
            raise ArchiveError(_too_many(label, len(members), limits, budget.members))
        budget.members += len(members)
        for info in members:
            display = f"{label}/{_display_name(info.filename)}"
            budget.check_cancel(label)
            spent = budget.exhausted()
            if spent:
                rejected.append((display, spent))
                continue
            if _is_symlink(info):
                rejected.append((display, "a symbolic link, not an image file"))
                continue
            if info.flag_bits & 0x1:
                rejected.append((display, "encrypted; zip it without a password"))
                continue
            cap = min(limits.max_member_bytes, budget.remaining)
            if info.file_size > cap:
                rejected.append((display, _too_large(info.file_size, limits, budget.remaining)))
                continue
            try:
                data = _read_capped(archive, info, cap, budget, label)
            except _TooLarge:
                rejected.append((display, _too_large(None, limits, budget.remaining)))
                continue
            except _OutOfTime as exc:
                rejected.append((display, str(exc)))
                continue
            except (
                zipfile.BadZipFile,
                zipfile.LargeZipFile,
                NotImplementedError,
                OSError,
                EOFError,
                zlib.error,
                lzma.LZMAError,
                struct.error,
                ValueError,
            ) as exc:
                # Each decompressor fails in its own way on damaged data (LZMA's options, a short
                # header): one damaged member is one rejected member, never a failed batch.
                rejected.append((display, f"cannot be read from the zip ({exc})"))
                continue
            reason = _not_an_image(data, display)
            if reason:
                rejected.append((display, reason))
                continue
            sources.append(BatchSource(name=display, data=data))
    return sources, rejected


class _TooLarge(Exception):
    pass


class _OutOfTime(Exception):
    pass


def _read_capped(archive: zipfile.ZipFile, info: zipfile.ZipInfo, cap: int, budget: ZipBudget, label: str) -> bytes:
    # Counts what is really decompressed (the header's file_size is only a claim), charges it to
    # the budget as it goes, and stops at the first byte over `cap`: zipfile inflates no more than
    # each read asks for, so a bomb costs `cap` + 1 bytes, never its claimed size.
    out = bytearray()
    with archive.open(info) as fp:
        while True:
            budget.check_cancel(label)
            late = budget.out_of_time()  # bytes are bounded by `cap`, below
            if late:
                raise _OutOfTime(late)
            want = min(_CHUNK, cap - len(out) + 1)
            try:
                chunk = fp.read(want)
            except BaseException:
                # A bad CRC is found at the end, after the last piece was inflated and before it is
                # handed over: charged all the same (at most what was asked for).
                budget.charge(want)
                raise
            if not chunk:
                return bytes(out)
            budget.charge(len(chunk))
            out += chunk
            if len(out) > cap:
                raise _TooLarge()


def _too_large(size: int | None, limits: ZipLimits, remaining: int) -> str:
    claimed = f" ({size / 2**20:.1f} MiB)" if size is not None else ""
    if remaining < limits.max_member_bytes:
        return (
            f"too large{claimed}: the zips of one request may decompress to "
            f"{limits.max_total_bytes // 2**20} MiB in all (images or not); split the zip"
        )
    return f"too large{claimed}: at most {limits.max_member_bytes // 2**20} MiB per image"


def _too_many(label: str, count: int, limits: ZipLimits, before: int) -> str:
    if before:
        return (
            f"{label}: holds {count} files; the zips of one request may hold {limits.max_members} files in "
            f"all and the ones before it hold {before} (split the batch)"
        )
    return f"{label}: holds {count} files; at most {limits.max_members} are read from one zip (split it)"


def _check_directory(src: Any, label: str, room: int) -> None:
    """Refuses a zip whose central directory is larger than `room` members can need, before
    zipfile parses it: parsing builds one object per entry, and 50 MB of empty entries is half a
    million of them. Reads the end record only; a zip it cannot read is left to zipfile."""
    if isinstance(src, (str, os.PathLike)):
        try:
            with open(src, "rb") as fp:
                return _check_directory(fp, label, room)
        except OSError:
            return  # zipfile reports the missing or unreadable file
    fp = src
    try:
        fp.seek(0, os.SEEK_END)
        size = fp.tell()
        tail_start = max(0, size - _EOCD_SEARCH)
        fp.seek(tail_start)
        tail = fp.read()
        fp.seek(0)
    except (OSError, ValueError, AttributeError):
        return
    at = tail.rfind(b"PK\x05\x06")
    if at < 0 or at + 22 > len(tail):
        return
    entries = int.from_bytes(tail[at + 10 : at + 12], "little")
    directory = int.from_bytes(tail[at + 12 : at + 16], "little")
    # 0xFFFF / 0xFFFFFFFF: the real figure is in a zip64 record; the member count is checked after parsing.
    if entries != 0xFFFF and entries > max(room, 1) * _ENTRIES_PER_MEMBER:
        raise ArchiveError(
            f"{label}: holds {entries} entries; at most {room} files are read from "
            "the zips of one request (split the zip)"
        )
    if directory != 0xFFFFFFFF and directory > max(room, 1) * _DIRECTORY_BYTES_PER_MEMBER:
        raise ArchiveError(
            f"{label}: its file list is {directory / 2**20:.1f} MiB, too long for the "
            f"{room} files that may still be read (split the zip)"
        )


def _not_an_image(data: bytes, display: str) -> str | None:
    if not data:
        return "empty file"
    try:
        # Header only, and only the formats the engine opens (none that decodes inside open()); the
        # engine decodes the pixels with its own checks (pixel limit from the header) later.
        with open_header(io.BytesIO(data), display):
            return None
    except ImageError as exc:
        return str(exc).removeprefix(f"{display}: ")


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


def sources_from_uploads(
    uploads: Iterable[tuple[str, str | os.PathLike]],
    *,
    limits: ZipLimits = ZipLimits(),
    cancel: Any = None,
    budget: ZipBudget | None = None,
) -> tuple[list[BatchSource], list[tuple[str, str]]]:
    """Batch sources from uploaded files given as (display name, path): zips are expanded in memory
    (see `read_zip_images`; all the zips of one upload share one `ZipBudget` of bytes decompressed,
    members, time and the `cancel` token), anything else is passed on by path for the engine to open.

    A zip listed twice (the same stored file, or another file with the same content) is read once:
    the second listing is rejected, naming the first. Images listed twice stay (paired mode may
    pair one image with two lines); each decode is charged to the batch's pixel budget.
    A zip that cannot be read is one rejected entry, not an error: the other uploads still run.
    Zips are recognised by content, not by extension (renamed downloads are common).
    Raises `EditCancelled` when `cancel` is set while the zips are read.
    """
    budget = budget if budget is not None else ZipBudget(limits, cancel)
    sources: list[BatchSource] = []
    rejected: list[tuple[str, str]] = []
    seen = _SeenZips(budget)
    for display, path in uploads:
        budget.check_cancel(display)
        if not _looks_like_zip(path):
            sources.append(BatchSource(name=display, data=path))
            continue
        first = seen.duplicate_of(path, display)
        if first is not None:
            rejected.append((display, f"not read again: the same zip as {first} (listed twice in one request)"))
            continue
        spent = budget.exhausted()
        if spent:
            rejected.append((display, spent))
            continue
        try:
            inner, refused = read_zip_images(path, name=display, budget=budget)
        except ArchiveError as exc:
            rejected.append((display, str(exc)))
            continue
        if not inner and not refused:
            rejected.append((display, "the zip holds no files"))
        sources.extend(inner)
        rejected.extend(refused)
    return sources, rejected


class _SeenZips:
    """The zips of one request so far, by stored path and by content (hashed only when two zips
    have the same size, so a request of distinct zips costs no hashing)."""

    def __init__(self, budget: ZipBudget):
        self._budget = budget
        self._paths: dict[str, str] = {}  # real path -> display name of its first listing
        self._sizes: dict[int, list[list]] = {}  # size -> [[path, display, digest or None], ...]

    def duplicate_of(self, path: str | os.PathLike, display: str) -> str | None:
        real = os.path.realpath(path)
        if real in self._paths:
            return self._paths[real]
        try:
            size = os.path.getsize(path)
        except OSError:
            return None  # the zip reader reports the unreadable file
        digest = None
        for entry in self._sizes.get(size, []):
            if entry[2] is None:
                entry[2] = self._digest(entry[0], entry[1])
            if digest is None:
                digest = self._digest(path, display)
            if digest is not None and digest == entry[2]:
                return entry[1]
        self._paths[real] = display
        self._sizes.setdefault(size, []).append([path, display, digest])
        return None

    def _digest(self, path: str | os.PathLike, display: str) -> str | None:
        sha = hashlib.sha256()
        try:
            with open(path, "rb") as fp:
                while chunk := fp.read(1 << 20):
                    self._budget.check_cancel(display)
                    sha.update(chunk)
        except OSError:
            return None
        return sha.hexdigest()


def _looks_like_zip(path: str | os.PathLike) -> bool:
    try:
        with open(path, "rb") as fp:
            head = fp.read(4)
    except OSError:
        return False  # the engine reports an unreadable file with its own message
    # Local file header, or the end-of-central-directory record of an empty zip. A damaged file
    # named .zip goes to the zip reader too, whose message ("not a readable zip") fits better.
    return head in (b"PK\x03\x04", b"PK\x05\x06") or str(path).lower().endswith(".zip")
