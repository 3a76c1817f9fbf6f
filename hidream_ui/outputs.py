"""Saving results: a PNG with the metadata embedded, a JSON sidecar, unique names, retention.

The metadata (``EditResult.metadata()``) is stored twice on purpose: in the PNG as a ``tEXt``
chunk ``hidream_ui`` (so a downloaded or shared PNG still carries its settings and can be dropped
back into the UI) and as a ``.json`` sidecar next to it (easy to grep and diff). A second chunk
``parameters`` holds a one-line human-readable summary, the key image viewers and other diffusion
UIs show.

Files are never overwritten (exclusive create) and retention only ever deletes files whose name
has our pattern *and* whose content carries our metadata, so pointing ``out_dir`` at a folder of
other images is safe.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import hashlib
import io
import json
import logging
import os
import re
import zlib
from pathlib import Path
from typing import IO, Any, Mapping, Union

from PIL import Image, PngImagePlugin

from hidream_ui.edits import EditParams, EditResult
from hidream_ui.imaging import ImageError, sniff_format

__all__ = [
    "METADATA_KEY",
    "SUMMARY_KEY",
    "MetadataError",
    "save_result",
    "prune",
    "read_metadata",
    "read_png_text",
    "load_settings",
    "write_sidecar",
    "metadata_json",
    "summary_line",
    "encode_png",
]

logger = logging.getLogger(__name__)

METADATA_KEY = "hidream_ui"
SUMMARY_KEY = "parameters"
_FORMAT_PREFIX = "hidream_ui/"
_SUPPORTED_FORMATS = (EditResult.METADATA_FORMAT,)

# Names we generate: 20250101-120000-123456-s3-0123abcd[-2].png. Retention only looks at these.
_NAME_RE = re.compile(r"^\d{8}-\d{6}-\d{6}-s\d+-[0-9a-f]{8}(?:-\d+)?\.png$")
_STEM_BAD = re.compile(r"[\\/\x00]")
_MAX_NAME_ATTEMPTS = 1000

MetadataSource = Union[str, os.PathLike, bytes, bytearray, IO[bytes], Image.Image]


class MetadataError(ValueError):
    """The file carries no (or unreadable) hidream_ui metadata."""


# ---------------------------------------------------------------------------------------------
# Encoding
# ---------------------------------------------------------------------------------------------


def metadata_json(metadata: Mapping[str, Any], *, indent: int | None = 2) -> str:
    """The canonical JSON text for a metadata dict (sidecars, PNG chunk, batch zips).

    ASCII-only so that it fits a Latin-1 ``tEXt`` chunk unchanged; NaN is refused because strict
    JSON readers (browsers, jq) cannot parse it.
    """
    return json.dumps(metadata, indent=indent, ensure_ascii=True, allow_nan=False)


def summary_line(metadata: Mapping[str, Any]) -> str:
    """A one-line human-readable summary: instruction, then the settings that change the image."""
    params = metadata.get("params") or {}
    size = metadata.get("working_size")
    parts = [
        f"Steps: {params.get('num_inference_steps')}",
        f"Guidance: {params.get('guidance_scale')}",
        f"Image guidance: {params.get('image_guidance_scale')}",
        f"Refine: {params.get('refine_strength')}",
        f"Seed: {params.get('seed')}",
    ]
    if size:
        parts.append(f"Size: {size[0]}x{size[1]}")
    for key, label in (("variant", "Model"), ("model_source", "Weights")):
        if metadata.get(key):
            parts.append(f"{label}: {metadata[key]}")
    instruction = " ".join(str(params.get("instruction", "")).split())  # one line, always
    negative = " ".join(str(params.get("negative_prompt", "")).split())
    text = instruction + (f" | Negative: {negative}" if negative else "")
    return f"{text} | " + ", ".join(parts)


def encode_png(image: Image.Image, metadata: Mapping[str, Any]) -> bytes:
    """PNG bytes of ``image`` with the metadata and summary text chunks (before the pixel data,
    so readers get them from the header without decoding the image)."""
    info = PngImagePlugin.PngInfo()
    info.add_text(METADATA_KEY, metadata_json(metadata, indent=None))
    # add_text switches to an iTXt (UTF-8) chunk by itself when the summary is not Latin-1.
    info.add_text(SUMMARY_KEY, summary_line(metadata))
    buffer = io.BytesIO()
    image.save(buffer, format="PNG", pnginfo=info)
    return buffer.getvalue()


def write_sidecar(path: str | os.PathLike, metadata: Mapping[str, Any], *, exclusive: bool = True) -> Path:
    """Write ``metadata`` as pretty JSON to ``path``; by default refuse to overwrite."""
    path = Path(path)
    with path.open("x" if exclusive else "w", encoding="utf-8") as fp:
        fp.write(metadata_json(metadata))
        fp.write("\n")
    return path


# ---------------------------------------------------------------------------------------------
# Saving
# ---------------------------------------------------------------------------------------------


def save_result(
    result: EditResult,
    out_dir: str | os.PathLike,
    *,
    retention: int | None = 500,
    stem: str | None = None,
    now: _dt.datetime | None = None,
    extra: Mapping[str, Any] | None = None,
) -> EditResult:
    """Save ``result`` as ``<stem>.png`` + ``<stem>.json`` in ``out_dir`` and apply retention.

    The default stem is ``<local time to the microsecond>-s<seed>-<8 hex of the PNG's sha256>``;
    a taken name gets ``-1``, ``-2``, ... (files are created exclusively, never overwritten).
    ``retention`` keeps at most that many of our result PNGs in ``out_dir`` (``None``: no limit).
    ``now`` fixes the timestamp in the default stem (tests, batch runs that share one time).
    ``extra``: entries added to the metadata after the result's own (the manifest batch's
    ``manifest``); a key the result already has is refused (ValueError naming it).
    Returns a copy of ``result`` with ``saved_png`` and ``saved_json`` set.
    """
    if retention is not None and (isinstance(retention, bool) or not isinstance(retention, int) or retention < 1):
        raise ValueError(f"retention must be a positive integer or None (got {retention!r})")
    if stem is not None and (not stem or _STEM_BAD.search(stem) or stem in (".", "..")):
        raise ValueError(f"stem must be a plain file name without slashes (got {stem!r})")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    metadata = result.metadata()
    clash = sorted(set(extra or {}) & set(metadata))
    if clash:
        raise ValueError(f"extra metadata {', '.join(map(repr, clash))}: the result's own key(s); pick another name")
    metadata.update(extra or {})
    png = encode_png(result.image, metadata)
    if stem is None:
        moment = now or _dt.datetime.now()
        digest = hashlib.sha256(png).hexdigest()[:8]
        stem = f"{moment:%Y%m%d-%H%M%S-%f}-s{result.params.seed}-{digest}"

    png_path, json_path = _create_pair(out_dir, stem, png, metadata)
    saved = dataclasses.replace(result, saved_png=png_path, saved_json=json_path, saved_metadata=metadata)
    if retention is not None:
        prune(out_dir, retention, keep=png_path)
    return saved


def _create_pair(out_dir: Path, stem: str, png: bytes, metadata: Mapping[str, Any]) -> tuple[Path, Path]:
    for attempt in range(_MAX_NAME_ATTEMPTS):
        name = stem if attempt == 0 else f"{stem}-{attempt}"
        png_path, json_path = out_dir / f"{name}.png", out_dir / f"{name}.json"
        try:
            with png_path.open("xb") as fp:
                fp.write(png)
        except FileExistsError:
            continue
        try:
            write_sidecar(json_path, metadata)
        except FileExistsError:
            # Someone else's <name>.json: leave it alone and take the next name for both files.
            png_path.unlink()
            continue
        except BaseException:
            png_path.unlink(missing_ok=True)  # no half-saved results
            raise
        return png_path, json_path
    raise FileExistsError(f"could not find a free file name for {stem!r} in {out_dir} after {_MAX_NAME_ATTEMPTS} tries")


def prune(out_dir: str | os.PathLike, retention: int, *, keep: Path | None = None) -> list[Path]:
    """Delete our oldest result PNGs (and their sidecars) beyond ``retention``; return them.

    Ours means: the generated name pattern, and either our sidecar beside it or our metadata in the
    PNG. The sidecar is asked first: it is read from its first bytes, whatever its size, while a PNG
    whose text chunk Pillow refuses (one over its 1 MB text limit) would otherwise never count as ours
    and stay forever. Files that match the pattern but are neither are skipped (neither deleted nor
    counted). Age is the timestamp in the name (mtimes change when folders are copied), newest kept.
    """
    out_dir = Path(out_dir)
    names = sorted((p for p in out_dir.iterdir() if _NAME_RE.match(p.name) and p.is_file()), reverse=True)
    kept = 0
    deleted: list[Path] = []
    masks: set[str] = set()  # region-edit masks named by deleted results (results.save_mask)
    for path in names:
        if kept < retention or path == keep:
            kept += 1
            continue
        sidecar = path.with_suffix(".json")
        ours_by_sidecar = _is_our_sidecar(sidecar)
        if not ours_by_sidecar and not _is_ours(path):
            logger.info("retention: leaving %s alone (no hidream_ui metadata)", path)
            continue
        try:
            path.unlink()
        except FileNotFoundError:
            continue  # another process pruned it first
        deleted.append(path)
        if ours_by_sidecar:
            masks.update(_mask_names(sidecar))
            sidecar.unlink(missing_ok=True)
    if masks:  # a mask goes with the last result that names it (several cells of a comparison share one)
        # Every sidecar counts, not only those of timestamp-named results: a `batch --manifest`
        # result (`<id>-<hash>.json`, never pruned) may name the same mask file.
        for path in out_dir.glob("*.json"):
            if path.is_file():
                masks.difference_update(_mask_names(path))
        for name in masks:
            (out_dir / name).unlink(missing_ok=True)
    return deleted


_MASK_NAME = re.compile(r'"file"\s*:\s*"(mask-[0-9a-f]{16}\.png)"')


def _mask_names(sidecar: Path) -> set[str]:
    """The mask files a sidecar names (its `mask.file`); empty for a missing or unreadable one."""
    try:
        with sidecar.open("rb") as fp:
            text = fp.read(TEXT_READ_MAX).decode("utf-8", "replace")
    except OSError:
        return set()
    return set(_MASK_NAME.findall(text))


def _is_ours(path: Path) -> bool:
    try:
        with Image.open(path) as image:
            return METADATA_KEY in image.info
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError):
        return False


# Our sidecars start with the format key (`EditResult.metadata` puts it first): read that far only.
_SIDECAR_HEAD = re.compile(r'\s*\{\s*"format"\s*:\s*"' + re.escape(_FORMAT_PREFIX))
_SIDECAR_HEAD_BYTES = 256


def _is_our_sidecar(path: Path) -> bool:
    try:
        with path.open("rb") as fp:
            head = fp.read(_SIDECAR_HEAD_BYTES).decode("utf-8", "replace")
    except OSError:
        return False
    return _SIDECAR_HEAD.match(head) is not None


# ---------------------------------------------------------------------------------------------
# Reading back
# ---------------------------------------------------------------------------------------------


def read_metadata(src: MetadataSource) -> dict[str, Any]:
    """The metadata dict saved with a result: from a PNG (path, bytes, file object, PIL image) or
    from a ``.json`` sidecar path. Raises :class:`MetadataError` when there is none.

    A PNG is read chunk by chunk (:func:`read_png_text`): no pixel is ever decoded, whatever the
    image's size or where its text chunk sits; any other file is refused naming its format."""
    label = _label(src)
    if isinstance(src, (str, os.PathLike)) and Path(src).suffix.lower() == ".json":
        try:
            with open(src, "rb") as fp:
                raw = fp.read(TEXT_READ_MAX + 1)
        except OSError as exc:
            raise MetadataError(f"{label}: cannot read the sidecar ({exc})") from None
        if len(raw) > TEXT_READ_MAX:
            raise MetadataError(f"{label}: the sidecar is over {TEXT_READ_MAX // 2**20} MiB; ours are a few KB")
        try:
            return _check_metadata(json.loads(raw.decode("utf-8")), label)
        except RecursionError:
            raise MetadataError(f"{label}: the sidecar is nested too deeply to be ours") from None
        except ValueError as exc:
            if isinstance(exc, MetadataError):
                raise
            raise MetadataError(f"{label}: the sidecar is not valid JSON ({exc})") from None

    if isinstance(src, Image.Image):
        text = _text_chunk(src)
    elif isinstance(src, (str, os.PathLike)):
        try:
            with open(src, "rb") as fp:
                text = read_png_text(fp, METADATA_KEY, label=label)
        except FileNotFoundError:
            raise ImageError(f"{label}: no such file") from None
        except IsADirectoryError:
            raise ImageError(f"{label}: not a readable image (a folder)") from None
    else:
        if isinstance(src, (bytes, bytearray, memoryview)):
            src = io.BytesIO(bytes(src))
        text = read_png_text(src, METADATA_KEY, label=label)
    if text is None:
        raise MetadataError(
            f"{label}: this image has no {METADATA_KEY} settings; only PNGs saved by this app carry "
            "them (many sites strip PNG text chunks on upload; use the original file or its .json)"
        )
    try:
        data = json.loads(text)
    except RecursionError:  # `[[[[...` a client wrote into a PNG: a clear refusal, not a 500
        raise MetadataError(f"{label}: the {METADATA_KEY} chunk is nested too deeply to be ours") from None
    except ValueError as exc:
        raise MetadataError(f"{label}: the {METADATA_KEY} chunk is not valid JSON ({exc})") from None
    return _check_metadata(data, label)


# Reading settings from a PNG reads its chunk headers and its text chunks, nothing else: the pixel
# data is skipped by seeking. Ours are a few KB (strings in the metadata are capped), so these
# bound what one read may cost whatever a client uploads.
TEXT_CHUNK_MAX = 1 * 2**20  # one text chunk (after decompression for zTXt / compressed iTXt)
TEXT_READ_MAX = 4 * 2**20  # every byte read from one file (headers and text chunks; sidecars too)
PNG_MAX_CHUNKS = 100_000  # chunks walked (libpng writes 8 KB IDATs: 800 MB of pixel data)
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_TEXT_TYPES = (b"tEXt", b"zTXt", b"iTXt")
_KEYWORD_MAX = 79  # the PNG spec's limit on a text chunk's keyword


def read_png_text(fp: IO[bytes], key: str, *, label: str = "image") -> str | None:
    """The text of the first ``tEXt``/``zTXt``/``iTXt`` chunk named `key` in the PNG `fp`, or None.

    Walks the chunk structure itself (length, type, CRC) and never decodes pixels: a chunk that is
    not text is skipped by seeking, wherever the text sits (before or after the image data).
    Bounded by :data:`TEXT_CHUNK_MAX`, :data:`TEXT_READ_MAX` and :data:`PNG_MAX_CHUNKS`. Raises
    :class:`MetadataError` for a file of another image format (named) or a text chunk over the
    cap, and :class:`ImageError` for data that is no image at all.
    """
    reader = _BoundedReader(fp, label)
    signature = reader.read(len(PNG_SIGNATURE))
    if signature != PNG_SIGNATURE:
        fmt = sniff_format(signature + reader.read(16 - len(signature))) if len(signature) == 8 else None
        if fmt is not None:
            raise MetadataError(
                f"{label}: this image has no {METADATA_KEY} settings: it is in {fmt} format, and only "
                "PNGs saved by this app carry them"
            )
        raise ImageError(f"{label}: not a readable image (not a PNG file)")
    wanted = key.encode("latin-1")
    for _ in range(PNG_MAX_CHUNKS):
        header = reader.read(8)
        if len(header) < 8:
            return None  # truncated: no (complete) chunk of ours
        length, kind = int.from_bytes(header[:4], "big"), header[4:]
        if kind == b"IEND":
            return None
        if kind not in _TEXT_TYPES:
            reader.skip(length + 4)  # data + CRC
            continue
        head = reader.read(min(length, _KEYWORD_MAX + 1))
        if head.split(b"\0", 1)[0] != wanted or b"\0" not in head:
            reader.skip(length - len(head) + 4)
            continue
        if length > TEXT_CHUNK_MAX:
            raise MetadataError(
                f"{label}: the {key} chunk is {length / 2**20:.1f} MiB; settings chunks of "
                f"this app are a few KB (at most {TEXT_CHUNK_MAX // 2**20} MiB is read)"
            )
        data = head + reader.read(length - len(head))
        crc = reader.read(4)
        if len(data) < length or len(crc) < 4:
            return None
        if zlib.crc32(kind + data) != int.from_bytes(crc, "big"):
            raise MetadataError(f"{label}: the {key} chunk is damaged (CRC mismatch); re-download the file")
        return _text_value(kind, data[len(wanted) + 1 :], label, key)
    raise MetadataError(f"{label}: the PNG has over {PNG_MAX_CHUNKS:,} chunks before its {key} chunk; not read further")


def _text_value(kind: bytes, body: bytes, label: str, key: str) -> str:
    """The text of a tEXt / zTXt / iTXt body (after the keyword and its NUL)."""
    try:
        if kind == b"tEXt":
            return body.decode("latin-1")
        if kind == b"zTXt":  # compression method (0 = deflate), then the deflated Latin-1 text
            return _inflate(body[1:], label, key).decode("latin-1")
        # iTXt: compression flag, method, language tag NUL, translated keyword NUL, UTF-8 text
        flag = body[0]
        rest = body[2:]
        _, _, rest = rest.partition(b"\0")
        _, _, rest = rest.partition(b"\0")
        return (_inflate(rest, label, key) if flag else rest).decode("utf-8")
    except (IndexError, UnicodeDecodeError, zlib.error) as exc:
        raise MetadataError(f"{label}: the {key} chunk is damaged ({exc})") from None


def _inflate(data: bytes, label: str, key: str) -> bytes:
    inflater = zlib.decompressobj()
    out = inflater.decompress(data, TEXT_CHUNK_MAX)  # a deflated chunk can claim any size: capped
    if inflater.unconsumed_tail:
        raise MetadataError(
            f"{label}: the {key} chunk inflates to over {TEXT_CHUNK_MAX // 2**20} MiB; "
            "settings chunks of this app are a few KB"
        )
    return out


class _BoundedReader:
    """Reads from `fp` counting every byte against :data:`TEXT_READ_MAX`; skips by seeking."""

    def __init__(self, fp: IO[bytes], label: str):
        self._fp = fp
        self._label = label
        self._read = 0
        try:
            self._seekable = bool(fp.seekable())
        except (AttributeError, OSError, ValueError):
            self._seekable = False

    def read(self, size: int) -> bytes:
        if self._read + size > TEXT_READ_MAX:
            raise MetadataError(
                f"{self._label}: no settings found in the first {TEXT_READ_MAX // 2**20} MiB of "
                "PNG chunks read; not read further"
            )
        data = self._fp.read(size)
        self._read += len(data)
        return data

    def skip(self, size: int) -> None:
        if self._seekable:
            self._fp.seek(size, os.SEEK_CUR)
            return
        while size > 0:  # a stream (an API caller's file object): read and drop, in pieces
            piece = self._fp.read(min(size, 1 << 16))
            if not piece:
                return
            size -= len(piece)


# Text chunks after the pixel data of a PIL image handed over in-process only appear once it is
# loaded: never for images larger than this. (Files are read by `read_png_text`, which decodes nothing.)
TEXT_SCAN_MAX_PIXELS = 25_000_000


def _text_chunk(image: Image.Image) -> str | None:
    value = image.info.get(METADATA_KEY)
    # The size test first: even `hasattr(image, "text")` decodes the whole image.
    if value is None and image.width * image.height <= TEXT_SCAN_MAX_PIXELS and hasattr(image, "text"):
        # Chunks written after the pixel data only appear once the image is loaded.
        try:
            value = image.text.get(METADATA_KEY)
        except (OSError, SyntaxError, ValueError):
            value = None
    return value if isinstance(value, str) else None


def _check_metadata(data: Any, label: str) -> dict[str, Any]:
    if not isinstance(data, dict) or not isinstance(data.get("params"), dict):
        raise MetadataError(f"{label}: the metadata has no 'params' object")
    fmt = str(data.get("format", ""))
    if fmt not in _SUPPORTED_FORMATS:
        raise MetadataError(
            f"{label}: metadata format {fmt!r} is not supported (this version reads "
            f"{', '.join(_SUPPORTED_FORMATS)}); it was written by another version of hidream_ui"
        )
    return data


def _label(src: object) -> str:
    if isinstance(src, (str, os.PathLike)):
        return Path(src).name
    name = getattr(src, "filename", None) or getattr(src, "name", None)
    return Path(name).name if isinstance(name, str) and name else "image"


def load_settings(src: MetadataSource) -> EditParams:
    """The validated :class:`EditParams` stored with a result (same sources as read_metadata)."""
    return EditParams.from_dict(read_metadata(src)["params"])
