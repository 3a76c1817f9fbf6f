"""Hostile files for `bench abuse`, built compactly in memory (pure standard library).

Each one is small on the wire and large once decoded, and each says in its bytes exactly what the
finding it reproduces needs (issue 19):

* `zip_bomb`: members of deflated zeros whose CRC-32 is wrong, so a reader decompresses every member
  in full before rejecting it (declared sizes are the true decompressed sizes: no lying header).
* `png_of_zeros`: a PNG of any size whose pixel data is deflated zeros, streamed (a 12000 x 12000
  RGBA image is ~0.6 MB and never exists as pixels here), optionally with a text chunk before or
  after the pixels (a chunk after IDAT is only found by decoding the whole image).
* `ico_with_png`: an .ico whose directory says 256 x 256 and which embeds such a PNG (Pillow decodes
  an ICO's PNG inside `Image.open`, before any size check the app makes).
"""

from __future__ import annotations

import struct
import zlib

__all__ = ["deflated_zeros", "zip_bomb", "png_of_zeros", "png_chunks", "ico_with_png", "multipart_stream"]

_MIB = 1 << 20
_DOS_DATE_1980 = (0 << 9) | (1 << 5) | 1  # 1980-01-01, the earliest DOS date


def _zeros_in_blocks(total: int, block: int = 4 * _MIB):
    zeros = bytes(min(block, max(total, 0)))
    left = total
    while left > 0:
        step = min(left, len(zeros))
        yield zeros if step == len(zeros) else zeros[:step]
        left -= step


def deflated_zeros(size: int) -> tuple[bytes, int]:
    """(raw deflate stream of `size` zero bytes, their true CRC-32)."""
    packer = zlib.compressobj(9, zlib.DEFLATED, -15)
    out, crc = [], 0
    for block in _zeros_in_blocks(size):
        out.append(packer.compress(block))
        crc = zlib.crc32(block, crc)
    out.append(packer.flush())
    return b"".join(out), crc & 0xFFFFFFFF


def zip_bomb(members: int, member_size: int, *, name: str = "bomb_{:03d}.png") -> bytes:
    """A zip of `members` entries, each `member_size` deflated zero bytes with a *wrong* CRC-32.

    Written by hand (zipfile cannot write a wrong CRC); no zip64, so `member_size` < 4 GiB."""
    if members < 1 or not 0 < member_size < 1 << 32:
        raise ValueError(f"members must be >= 1 and member_size in 1..4 GiB (got {members}, {member_size})")
    data, crc = deflated_zeros(member_size)
    wrong = crc ^ 0xFFFFFFFF
    local, central = bytearray(), bytearray()
    for index in range(members):
        filename = name.format(index).encode("ascii")
        offset = len(local)
        local += (
            struct.pack(
                "<IHHHHHIIIHH", 0x04034B50, 20, 0, 8, 0, _DOS_DATE_1980, wrong, len(data), member_size, len(filename), 0
            )
            + filename
            + data
        )
        central += (
            struct.pack(
                "<IHHHHHHIIIHHHHHII",
                0x02014B50,
                20,
                20,
                0,
                8,
                0,
                _DOS_DATE_1980,
                wrong,
                len(data),
                member_size,
                len(filename),
                0,
                0,
                0,
                0,
                0,
                offset,
            )
            + filename
        )
    end = struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, members, members, len(central), len(local), 0)
    return bytes(local + central + end)


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def _text(key: str, value: str) -> bytes:
    return _chunk(b"tEXt", key.encode("latin-1") + b"\0" + value.encode("latin-1"))


_COLOUR_TYPES = {"L": (0, 1), "RGB": (2, 3), "RGBA": (6, 4)}


def png_of_zeros(
    width: int,
    height: int,
    mode: str = "RGB",
    *,
    text_before: dict[str, str] | None = None,
    text_after: dict[str, str] | None = None,
) -> bytes:
    """A valid 8-bit PNG of black (zero) pixels, its IDAT deflated row by row, never held as pixels."""
    if mode not in _COLOUR_TYPES or width < 1 or height < 1:
        raise ValueError(
            f"mode must be one of {', '.join(_COLOUR_TYPES)} and sizes >= 1 (got {mode}, {width}x{height})"
        )
    colour_type, channels = _COLOUR_TYPES[mode]
    row = bytes(1 + width * channels)  # filter byte 0 + zero samples
    rows_per_block = max(1, (4 * _MIB) // len(row))
    packer = zlib.compressobj(9)
    idat = []
    done = 0
    while done < height:
        n = min(rows_per_block, height - done)
        idat.append(packer.compress(row * n))
        done += n
    idat.append(packer.flush())
    parts = [b"\x89PNG\r\n\x1a\n", _chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, colour_type, 0, 0, 0))]
    parts += [_text(k, v) for k, v in (text_before or {}).items()]
    parts.append(_chunk(b"IDAT", b"".join(idat)))
    parts += [_text(k, v) for k, v in (text_after or {}).items()]
    parts.append(_chunk(b"IEND", b""))
    return b"".join(parts)


def png_chunks(data: bytes) -> list[tuple[bytes, int]]:
    """(type, length) of every chunk of a PNG, in file order (for checking what was built)."""
    if data[:8] != b"\x89PNG\r\n\x1a\n":
        raise ValueError("not a PNG signature")
    chunks, at = [], 8
    while at + 8 <= len(data):
        length, kind = struct.unpack(">I4s", data[at : at + 8])
        chunks.append((kind, length))
        at += 12 + length
    return chunks


def ico_with_png(png: bytes, *, declared: int = 256) -> bytes:
    """An .ico with one image whose directory entry declares `declared` x `declared` (256 is written
    as 0, as the format says) and whose data is `png`, whatever size that PNG really is."""
    if not 1 <= declared <= 256:
        raise ValueError(f"an ICO directory declares 1..256 pixels (got {declared})")
    side = 0 if declared == 256 else declared
    header = struct.pack("<HHH", 0, 1, 1)
    entry = struct.pack("<BBBBHHII", side, side, 0, 0, 1, 32, len(png), 6 + 16)
    return header + entry + png


def multipart_stream(boundary: str, files: list[tuple[str, int]], *, field: str = "files", block: int = _MIB):
    """A chunked multipart/form-data body (generator of bytes): each (name, size) a part of `size`
    bytes (a PNG signature, then zeros). Nothing announces the total, so a server learns the size
    only by reading it."""
    head = b"\x89PNG\r\n\x1a\n"
    for filename, size in files:
        yield (
            f'--{boundary}\r\nContent-Disposition: form-data; name="{field}"; filename="{filename}"\r\n'
            f"Content-Type: image/png\r\n\r\n"
        ).encode()
        yield head[:size]
        for piece in _zeros_in_blocks(max(0, size - len(head)), block):
            yield piece
        yield b"\r\n"
    yield f"--{boundary}--\r\n".encode()
