"""Issue 19, findings 2 and 3: budgets charged for work done, and nothing decoded before the limit.

* Zips: every byte decompressed counts (a member rejected for a bad CRC as much as one kept), a
  zip listed twice is read once, the expansion is bounded in members and time, and it stops on
  the job's cancel token: `/cancel`, gradio's cancel and a client that went away, over raw HTTP
  against the launched app.
* Images: only named formats open (an ICO named icon.png is refused, naming ICO, without a
  decode), and settings are read from a PNG's chunks without decoding its pixels, wherever the
  text chunk sits.

Hostile files are built here byte by byte (deflated zeros compressed once, PNG rows streamed),
so they cost milliseconds to make and nothing to hold.
"""

from __future__ import annotations

import io
import shutil
import struct
import threading
import time
import zipfile
import zlib
from pathlib import Path

import httpx
import pytest
from gradio_client import Client, handle_file
from helpers import random_picture, run_info, wait_for
from PIL import Image

from hidream_ui.archive import ArchiveError, ZipBudget, ZipLimits, read_zip_images, sources_from_uploads
from hidream_ui.edits import EditParams, EditResult, Timings
from hidream_ui.engine.errors import EditCancelled
from hidream_ui.engine.jobs import CancelToken
from hidream_ui.imaging import ACCEPTED_FORMATS, ImageError, open_image
from hidream_ui.outputs import (
    TEXT_CHUNK_MAX,
    TEXT_READ_MAX,
    MetadataError,
    load_settings,
    metadata_json,
    read_metadata,
)
from hidream_ui.server import gradio_internals
from hidream_ui.ui.layout import ASSETS_DIR

MiB = 2**20

# ---------------------------------------------------------------------------------------------
# Hostile files
# ---------------------------------------------------------------------------------------------


def bomb_zip(members: int, member_bytes: int, *, bad_crc: bool = True) -> bytes:
    """A zip of `members` entries named m000.png..., each `member_bytes` of deflated zeros
    (compressed once and shared); with `bad_crc` each entry's CRC-32 is wrong, so a reader
    inflates it all before zipfile refuses it (the finding: 256 x 64 MiB in a 16.7 MB file)."""
    deflate = zlib.compressobj(9, zlib.DEFLATED, -15)
    block = bytes(MiB)
    parts = [deflate.compress(block) for _ in range(member_bytes // MiB)]
    data = b"".join(parts) + deflate.compress(bytes(member_bytes % MiB)) + deflate.flush()
    crc = 0x12345678 if bad_crc else zlib.crc32(bytes(member_bytes))
    out, central = bytearray(), bytearray()
    for index in range(members):
        name = f"m{index:03d}.png".encode()
        offset = len(out)
        out += (
            struct.pack("<4s2B4HL2L2H", b"PK\x03\x04", 20, 0, 0, 8, 0, 0x21, crc, len(data), member_bytes, len(name), 0)
            + name
            + data
        )
        central += (
            struct.pack(
                "<4s4B4HL2L5H2L",
                b"PK\x01\x02",
                20,
                0,
                20,
                0,
                0,
                8,
                0,
                0x21,
                crc,
                len(data),
                member_bytes,
                len(name),
                0,
                0,
                0,
                0,
                0,
                offset,
            )
            + name
        )
    end = struct.pack("<4s4H2LH", b"PK\x05\x06", 0, 0, members, members, len(central), len(out), 0)
    return bytes(out + central + end)


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">L", len(data)) + kind + data + struct.pack(">L", zlib.crc32(kind + data))


def zero_png(width: int, height: int, *, text_after: dict[str, str] | None = None) -> bytes:
    """A black RGB PNG streamed row by row (never held as an image), with `text_after` as tEXt
    chunks *after* the pixel data, where Pillow only finds them by decoding the whole image."""
    deflate = zlib.compressobj(9)
    row = bytes(1 + 3 * width)
    pixels = b"".join(deflate.compress(row) for _ in range(height)) + deflate.flush()
    out = [
        b"\x89PNG\r\n\x1a\n",
        _chunk(b"IHDR", struct.pack(">2L5B", width, height, 8, 2, 0, 0, 0)),
        _chunk(b"IDAT", pixels),
    ]
    out += [
        _chunk(b"tEXt", key.encode("latin-1") + b"\0" + value.encode("latin-1"))
        for key, value in (text_after or {}).items()
    ]
    return b"".join(out + [_chunk(b"IEND", b"")])


def ico_with_png(png: bytes) -> bytes:
    """An .ico whose directory says 256x256 and whose one entry is `png`, whatever its real size."""
    return struct.pack("<3H", 0, 1, 1) + struct.pack("<4B2H2L", 0, 0, 0, 0, 1, 32, len(png), 22) + png


def our_metadata_text() -> str:
    image = random_picture(0, (40, 24))
    params = EditParams(
        instruction="make it blue", num_inference_steps=9, seed=11, working_resolution="draft"
    ).validated()
    result = EditResult(
        image=image,
        source_image=image,
        params=params,
        working_size=(512, 304),
        source_size=(40, 24),
        timings=Timings(total=0.5),
        peak_memory_bytes=None,
        info=run_info(),
    )
    return metadata_json(result.metadata(), indent=None)


class Inflated:
    """Counts the bytes zipfile hands out of every member (what was really decompressed); with
    `stop_after` it fails the test at once when a reader goes past it (old code would go on for
    minutes), with `on_read` it calls back (a cancel, a slow-down) on every read."""

    def __init__(self, monkeypatch, stop_after: int | None = None, on_read=None):
        self.bytes = 0
        self.reads = 0
        original = zipfile.ZipExtFile.read
        counter = self

        def read(fp, n=-1):
            if counter.on_read is not None:
                counter.on_read(counter)
            data = original(fp, n)
            counter.bytes += len(data)
            counter.reads += 1
            if counter.stop_after is not None and counter.bytes > counter.stop_after:
                raise AssertionError(f"decompressed {counter.bytes:,} bytes, over {counter.stop_after:,}")
            return data

        self.stop_after, self.on_read = stop_after, on_read
        monkeypatch.setattr(zipfile.ZipExtFile, "read", read)


# ---------------------------------------------------------------------------------------------
# Zips: charged for work done
# ---------------------------------------------------------------------------------------------


def test_every_byte_decompressed_counts_whether_the_member_is_kept_or_rejected(tmp_path, monkeypatch):
    """Finding 2, small: 16 members of 4 MiB zeros with bad CRCs and a 16 MiB budget. Each member is
    rejected (bad CRC) after inflating it; they used to be read in full and never charged."""
    limits = ZipLimits(max_member_bytes=4 * MiB, max_total_bytes=16 * MiB)
    path = tmp_path / "bomb.zip"
    path.write_bytes(bomb_zip(16, 4 * MiB))
    inflated = Inflated(monkeypatch, stop_after=2 * limits.max_total_bytes)
    sources, rejected = sources_from_uploads([("bomb.zip", path)], limits=limits)
    assert sources == []
    # The budget is charged as bytes come out, and reading stops at its first byte over.
    assert inflated.bytes <= limits.max_total_bytes + 1, inflated.bytes
    reasons = dict(rejected)
    assert len(reasons) == 16
    assert "Bad CRC" in reasons["bomb.zip/m000.png"] and "cannot be read" in reasons["bomb.zip/m000.png"]
    assert "already decompressed 16 MiB (images or not)" in reasons["bomb.zip/m015.png"]


@pytest.mark.slow
def test_the_reported_zip_bomb_costs_at_most_the_budget(tmp_path, monkeypatch):
    """Finding 2 as reported: a 16.7 MB zip of 256 members of 64 MiB deflated zeros with bad CRCs,
    listed twice, with the app's own limits: at most 512 MiB decompressed (was 32 GiB, ~100 s)."""
    path = tmp_path / "bomb.zip"
    path.write_bytes(bomb_zip(256, 64 * MiB))
    assert 16_000_000 < path.stat().st_size < 17_000_000  # 16.7 MB
    limits = ZipLimits()
    inflated = Inflated(monkeypatch, stop_after=2 * limits.max_total_bytes)
    started = time.monotonic()
    sources, rejected = sources_from_uploads([("bomb.zip", path), ("bomb.zip", path)], limits=limits)
    assert sources == [] and inflated.bytes <= limits.max_total_bytes + 1
    assert time.monotonic() - started < limits.max_seconds
    reasons = [reason for _, reason in rejected]
    assert len(rejected) == 257  # 256 members, and the second listing as one row
    assert sum("cannot be read" in reason for reason in reasons) == 8  # 8 x 64 MiB = the budget
    assert sum("already decompressed 512 MiB" in reason for reason in reasons) == 248
    assert rejected[-1] == ("bomb.zip", "not read again: the same zip as bomb.zip (listed twice in one request)")


def test_a_batch_of_which_nothing_opens_names_a_few_reasons_not_all():
    from hidream_ui.edits import EditSettings, RequestError
    from hidream_ui.engine.batch import BatchRequest, plan_batch

    rejected = [(f"bomb.zip/m{i:03d}.png", "cannot be read from the zip (Bad CRC-32)") for i in range(257)]
    request = BatchRequest(sources=(), instructions=("make it blue",), settings=EditSettings())
    with pytest.raises(RequestError) as info:
        plan_batch(request, open_image, max_items=64, opened=([], rejected))
    message = str(info.value)
    assert len(message) < 1000 and "bomb.zip/m000.png: cannot be read" in message and "and 252 more" in message


def test_a_zip_listed_twice_is_read_once_by_path_or_by_content(tmp_path, monkeypatch):
    member = io.BytesIO()
    random_picture(1).save(member, "PNG")
    first = tmp_path / "photos.zip"
    with zipfile.ZipFile(first, "w") as archive:
        archive.writestr("a.png", member.getvalue())
    copy = tmp_path / "photos (1).zip"
    shutil.copyfile(first, copy)
    other = tmp_path / "other.zip"
    with zipfile.ZipFile(other, "w") as archive:
        archive.writestr("b.png", member.getvalue())
    inflated = Inflated(monkeypatch)
    sources, rejected = sources_from_uploads(
        [("photos.zip", first), ("again.zip", first), ("photos (1).zip", copy), ("other.zip", other)]
    )
    assert [s.name for s in sources] == ["photos.zip/a.png", "other.zip/b.png"]
    assert [name for name, _ in rejected] == ["again.zip", "photos (1).zip"]
    assert all("the same zip as photos.zip" in reason for _, reason in rejected)
    assert inflated.bytes == 2 * len(member.getvalue())


def test_the_expansion_stops_between_chunks_when_its_token_is_cancelled(tmp_path, monkeypatch):
    path = tmp_path / "bomb.zip"
    path.write_bytes(bomb_zip(4, 32 * MiB, bad_crc=False))
    token = CancelToken()

    def cancel_after_a_while(counter):
        if counter.bytes >= 3 * MiB:
            token.cancel("cancelled through /cancel")

    inflated = Inflated(monkeypatch, on_read=cancel_after_a_while)
    with pytest.raises(EditCancelled, match=r"Stopped while reading bomb\.zip \(cancelled through /cancel\)"):
        sources_from_uploads([("bomb.zip", path)], cancel=token)
    assert inflated.bytes <= 3 * MiB + 64 * 1024  # the chunk in hand when the token was set


def test_the_expansion_is_bounded_in_time(tmp_path, monkeypatch):
    path = tmp_path / "slow.zip"
    path.write_bytes(bomb_zip(6, 4 * MiB, bad_crc=False))
    now = {"t": 0.0}
    Inflated(monkeypatch, on_read=lambda counter: now.__setitem__("t", now["t"] + 0.1))  # 100 ms per chunk
    budget = ZipBudget(ZipLimits(max_seconds=10), clock=lambda: now["t"])
    sources, rejected = sources_from_uploads([("slow.zip", path)], budget=budget)
    reasons = dict(rejected)
    assert sources == [] and len(reasons) == 6
    # 4 MiB is 64 chunks (6.4 s): the first member is too large anyway (zeros are no image); the
    # second runs out of time half-way, and the rest are not read.
    assert "not a recognised image" in reasons["slow.zip/m000.png"]
    assert all("took over 10 s; split the batch" in reasons[f"slow.zip/m00{i}.png"] for i in range(1, 6))
    assert budget.spent < 2 * 4 * MiB


def test_a_zip_whose_file_list_is_too_long_is_refused_before_it_is_parsed(tmp_path, monkeypatch):
    path = tmp_path / "empties.zip"
    with zipfile.ZipFile(path, "w") as archive:
        for index in range(1100):  # 256 members may be read: 4 directory entries each at most
            archive.writestr(f"e{index}.png", b"")

    def parsed(self):
        raise AssertionError("zipfile parsed the directory")

    monkeypatch.setattr(zipfile.ZipFile, "_RealGetContents", parsed)
    with pytest.raises(ArchiveError, match="empties.zip: holds 1100 entries; at most 256 files"):
        read_zip_images(path.read_bytes(), name="empties.zip")
    _, rejected = sources_from_uploads([("empties.zip", path)])  # what the Batch tab hands over: a path
    assert "holds 1100 entries" in rejected[0][1]


# ---------------------------------------------------------------------------------------------
# Images: named formats, header first
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def decodes(monkeypatch):
    """Counts pixel decoders created (every tile decode of every Pillow plugin goes through
    `Image._getdecoder`)."""
    calls = []
    original = Image._getdecoder

    def counting(*args, **kwargs):
        calls.append(args[1] if len(args) > 1 else "?")
        return original(*args, **kwargs)

    monkeypatch.setattr(Image, "_getdecoder", counting)
    return calls


def test_an_ico_named_png_is_refused_naming_its_format_without_decoding(tmp_path, decodes):
    """Finding 3: Pillow decodes ICO inside Image.open (an entry saying 256x256 held a 12000x12000
    PNG: +548 MB per read). Here 3000x3000: refused by the edit, batch (zip member) and settings
    readers, with the format named, and no decoder ever made."""
    icon = ico_with_png(zero_png(3000, 3000))
    with pytest.raises(ImageError, match=r"^icon\.png: the file holds ICO data, a format this app does not open"):
        open_image(icon, name="icon.png")
    path = tmp_path / "icon.png"
    path.write_bytes(icon)
    with pytest.raises(MetadataError, match=r"^icon\.png: this image has no hidream_ui settings: it is in ICO"):
        load_settings(path)
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr("icon.png", icon)
    sources, rejected = read_zip_images(buffer.getvalue(), name="icons.zip")
    assert sources == [] and "holds ICO data" in dict(rejected)["icons.zip/icon.png"]
    assert decodes == []


def test_an_opened_image_keeps_none_of_its_files_text_chunks():
    """A 20 KB PNG whose zTXt chunks inflate to 16 MB: PIL reads them at open (its own cap is 64 MB);
    the decoded image a batch holds for its whole run must not carry them along."""
    png = zero_png(32, 32)
    texts = b"".join(_chunk(b"zTXt", f"k{i}".encode() + b"\0\0" + zlib.compress(b"a" * MiB, 9)) for i in range(16))
    hostile = png[:33] + texts + png[33:]  # after IHDR, before the pixels
    assert len(hostile) < 40_000
    image = open_image(hostile, name="chatty.png")
    assert image.size == (32, 32) and image.info == {}


@pytest.mark.parametrize("fmt", ACCEPTED_FORMATS)
def test_every_accepted_format_still_opens(fmt):
    buffer = io.BytesIO()
    random_picture(3, (40, 30)).save(buffer, fmt)
    assert open_image(buffer.getvalue(), name=f"x.{fmt.lower()}").size == (40, 30)


def test_settings_of_a_25_megapixel_png_with_the_text_after_the_pixels_are_read_without_decoding(tmp_path, decodes):
    """Finding 3: reading settings from a 97 KB 25-MP PNG whose text chunk sits after the pixels
    decoded it (+1.2 GB for 16 parallel reads). The chunk walk skips the pixels by seeking."""
    path = tmp_path / "late.png"
    path.write_bytes(zero_png(5000, 5000, text_after={"hidream_ui": our_metadata_text()}))
    assert path.stat().st_size < 200_000
    decodes.clear()  # building the metadata made a picture
    assert load_settings(path).seed == 11
    assert read_metadata(path.read_bytes())["params"]["instruction"] == "make it blue"
    assert decodes == []


def test_the_settings_reader_is_bounded_and_refuses_other_formats(tmp_path):
    huge_text = zero_png(20, 20, text_after={"hidream_ui": "x" * (TEXT_CHUNK_MAX + 1)})
    with pytest.raises(MetadataError, match="the hidream_ui chunk is 1.0 MiB"):
        read_metadata(huge_text)
    # Many text chunks of other names (50,000 x 88 bytes looked at): refused at the total cap.
    chatty = zero_png(20, 20, text_after={f"k{i}": "y" * 80 for i in range(50_000)})

    class Counting(io.BytesIO):
        read_bytes = 0

        def read(self, size=-1):
            data = super().read(size)
            Counting.read_bytes += len(data)
            return data

    with pytest.raises(MetadataError, match="no settings found in the first 4 MiB"):
        read_metadata(Counting(chatty))
    assert Counting.read_bytes <= TEXT_READ_MAX
    jpeg = tmp_path / "photo.png"
    random_picture(2).save(jpeg, "JPEG")
    with pytest.raises(MetadataError, match=r"^photo\.png: this image has no hidream_ui settings: it is in JPEG"):
        read_metadata(jpeg)
    with pytest.raises(ImageError, match="not a readable image"):
        read_metadata(b"<html>not an image</html>")
    damaged = bytearray(zero_png(20, 20, text_after={"hidream_ui": our_metadata_text()}))
    damaged[-40] ^= 0xFF  # inside the text chunk
    with pytest.raises(MetadataError, match="damaged"):
        read_metadata(bytes(damaged))


# ---------------------------------------------------------------------------------------------
# Over HTTP: the job exists before the zip is expanded, and every cancel reaches it
# ---------------------------------------------------------------------------------------------

BATCH_ARGS = ["make it blue", "matrix", "", 3.0, 1.5, 2, 0.3, True, "draft", 1, "fixed", 0, False]


@pytest.fixture(scope="module")
def app(launch_app):
    return launch_app("hardening2_inputs", max_queue=8, max_jobs_per_client=2)


@pytest.mark.slow
@pytest.mark.parametrize("how", ["/cancel", "gradio cancel", "disconnect"])
def test_a_cancel_stops_a_zip_expansion_over_http_and_frees_the_lane(app, tmp_path, monkeypatch, how):
    """Finding 2: `/batch_edit` with files=[zip, zip] held the device lane for minutes, `/cancel`
    answered "nothing of yours is running" and after gradio's cancel the server burnt CPU until
    t=137 s. Each read is slowed down (5 ms) so the expansion is surely running when cancelled."""
    services = app["demo"].hidream_services
    session = f"zip-{how.replace(' ', '-').strip('/')}"
    started = threading.Event()

    def slow(counter):
        started.set()
        time.sleep(0.005)

    inflated = Inflated(monkeypatch, on_read=slow)
    bomb = bomb_zip(64, 64 * MiB)  # 4 MB upload, 4 GiB inside
    with httpx.Client(base_url=app["url"], timeout=60) as http:
        upload = http.post("/gradio_api/upload", files={"files": ("bomb.zip", bomb, "application/zip")})
        assert upload.status_code == 200, upload.text
        stored = {"path": upload.json()[0], "meta": {"_type": "gradio.FileData"}, "orig_name": "bomb.zip"}
        fn_index = next(
            i for i, dep in enumerate(http.get("/config").json()["dependencies"]) if dep.get("api_name") == "batch_edit"
        )
        joined = http.post(
            "/gradio_api/queue/join",
            json={"data": [[stored, stored], *BATCH_ARGS], "fn_index": fn_index, "session_hash": session},
        )
        assert joined.status_code == 200, joined.text
        event_id = joined.json()["event_id"]
        messages = []
        with http.stream("GET", "/gradio_api/queue/data", params={"session_hash": session}) as stream:
            lines = stream.iter_lines()
            assert started.wait(60), "the expansion never started"
            reads_at_cancel = inflated.reads
            cancelled_at = time.monotonic()
            if how == "/cancel":
                answer = http.post("/gradio_api/run/cancel", json={"data": [], "session_hash": session})
                assert answer.status_code == 200, answer.text
                assert answer.json()["data"] == ["stopped 1 job(s)"]
            elif how == "gradio cancel":
                http.post(
                    "/gradio_api/cancel", json={"session_hash": session, "fn_index": fn_index, "event_id": event_id}
                )
            if how != "disconnect":
                for line in lines:  # until gradio says the event ended (bounded by the client timeout)
                    messages.append(line)
                    if "process_completed" in line:
                        break
        # The expansion itself stops (not just gradio's task): the job leaves the registry.
        wait_for(
            lambda: not [job for job in services.jobs.running() if job.session == session],
            what="the batch job to end",
            timeout=15,
        )
        stopped_after = time.monotonic() - cancelled_at
    assert stopped_after < 5, stopped_after
    job = next(job for job in reversed(services.jobs.history) if job.session == session)
    assert job.kind == "batch" and job.token.cancelled
    assert (
        job.token.reason
        == {
            "/cancel": "cancelled through /cancel",
            "gradio cancel": "cancelled by the client",
            "disconnect": "the client went away",
        }[how]
    )
    assert inflated.reads - reads_at_cancel < 200, (reads_at_cancel, inflated.reads)  # not 65,536 reads
    assert inflated.bytes < 512 * MiB
    if how == "/cancel":
        assert "Stopped while reading bomb.zip" in "".join(messages)
    # The lane is free: an honest edit gets through at once.
    wait_for(
        lambda: (gradio_internals.queue_figures(app["demo"], "device") or {}).get("running") == 0,
        what="the device lane to be free",
        timeout=15,
    )
    monkeypatch.undo()
    client = Client(app["url"], verbose=False)
    _, saved, _, _ = client.predict(
        image=handle_file(str(ASSETS_DIR / "apple.png")),
        instruction="make it red",
        num_inference_steps=2,
        working_resolution="draft",
        api_name="/edit",
    )
    assert Path(saved).is_file()
