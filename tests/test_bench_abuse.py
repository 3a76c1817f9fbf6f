"""`bench abuse`: the hostile files say what they claim, the verdict follows the recorded figures,
and one cheap probe runs end to end against a real app (its measurements, not its verdict: most
probes fail until issue 19's fixes land)."""

from __future__ import annotations

import io
import json
import struct
import zipfile
import zlib

import pytest
from PIL import Image

from hidream_ui.bench import KINDS, abuse_files, abuse_probes
from hidream_ui.bench import abuse as bench_abuse

MIB = 1 << 20


# ---------------------------------------------------------------------------------------------
# The hostile files
# ---------------------------------------------------------------------------------------------


def test_the_zip_bomb_declares_true_sizes_and_every_crc_is_wrong():
    members, size = 5, 3 * MIB
    data = abuse_files.zip_bomb(members, size)
    assert len(data) < 50_000  # deflated zeros: a few KB per member on the wire
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        infos = archive.infolist()
        assert [i.filename for i in infos] == [f"bomb_{n:03d}.png" for n in range(members)]
        true_crc = zlib.crc32(bytes(size))
        for info in infos:
            assert info.compress_type == zipfile.ZIP_DEFLATED
            assert info.file_size == size  # the header does not lie about the size...
            assert info.CRC != true_crc  # ...only about the checksum
            with archive.open(info) as member:
                with pytest.raises(zipfile.BadZipFile, match="CRC"):
                    while member.read(MIB):  # decompressed in full before the CRC is checked
                        pass


def test_deflated_zeros_inflate_to_the_size_asked():
    packed, crc = abuse_files.deflated_zeros(2 * MIB + 7)
    raw = zlib.decompress(packed, -15)
    assert raw == bytes(2 * MIB + 7) and crc == zlib.crc32(raw)


@pytest.mark.filterwarnings("ignore:Image was not the expected size")  # Pillow decodes it in open()
def test_the_ico_declares_256_and_embeds_a_png_of_the_stated_size():
    png = abuse_files.png_of_zeros(700, 500, "RGBA")
    ico = abuse_files.ico_with_png(png)
    reserved, kind, count = struct.unpack("<HHH", ico[:6])
    width, height, _, _, _, _, length, offset = struct.unpack("<BBBBHHII", ico[6:22])
    assert (reserved, kind, count) == (0, 1, 1)
    assert (width, height) == (0, 0)  # 0 means 256 in an ICO directory
    assert ico[offset:offset + length] == png
    embedded = ico[offset:]
    assert embedded[:8] == b"\x89PNG\r\n\x1a\n"
    assert struct.unpack(">II", embedded[16:24]) == (700, 500)  # IHDR width, height
    with Image.open(io.BytesIO(ico)) as image:
        assert image.format == "ICO"


def test_the_late_text_png_has_its_text_after_the_pixels():
    png = abuse_files.png_of_zeros(640, 480, "RGB", text_after={"hidream_ui": '{"params": {}}'})
    kinds = [kind for kind, _ in abuse_files.png_chunks(png)]
    assert kinds == [b"IHDR", b"IDAT", b"tEXt", b"IEND"]
    with Image.open(io.BytesIO(png)) as image:
        assert image.size == (640, 480) and image.mode == "RGB"
        assert "hidream_ui" not in image.info  # not in the header...
        image.load()
        assert image.info["hidream_ui"] == '{"params": {}}'  # ...only once every pixel is decoded
    assert len(png) < 10_000  # small on the wire


def test_text_before_the_pixels_is_in_the_header():
    png = abuse_files.png_of_zeros(8, 8, "L", text_before={"attacker": "x"})
    assert [k for k, _ in abuse_files.png_chunks(png)] == [b"IHDR", b"tEXt", b"IDAT", b"IEND"]
    with Image.open(io.BytesIO(png)) as image:
        assert image.info["attacker"] == "x"


def test_the_chunked_multipart_body_carries_every_part_in_full():
    body = b"".join(abuse_files.multipart_stream("BOUND", [("a.png", 3 * MIB + 1), ("b.png", 10)], block=MIB))
    parts = body.split(b"--BOUND")
    assert parts[-1] == b"--\r\n" and len(parts) == 4  # preamble, two parts, the end
    for part, size in zip(parts[1:3], (3 * MIB + 1, 10)):
        content = part.split(b"\r\n\r\n", 1)[1][:-2]
        assert len(content) == size and content.startswith(b"\x89PNG")


@pytest.mark.parametrize("bad", [lambda: abuse_files.zip_bomb(0, 10), lambda: abuse_files.zip_bomb(1, 1 << 32),
                                 lambda: abuse_files.png_of_zeros(0, 5),
                                 lambda: abuse_files.ico_with_png(b"", declared=300)])
def test_impossible_files_are_refused(bad):
    with pytest.raises(ValueError):
        bad()


# ---------------------------------------------------------------------------------------------
# The verdict, from recorded observations
# ---------------------------------------------------------------------------------------------

GOOD = {"probe": "x", "check": True, "honest_edit_completed": True, "status_max_s": 0.2, "rss_growth_mb": 12.0,
        "cache_growth_mb": 1.0, "other_client_files_removed": 0, "error": None}


def test_a_record_that_meets_every_target_held():
    assert bench_abuse.held(GOOD) and bench_abuse.failed_targets(GOOD) == []
    assert bench_abuse.held({**GOOD, "check": None})  # a probe with no check of its own


@pytest.mark.parametrize("change, miss", [
    ({"check": False}, "check"),
    ({"honest_edit_completed": False}, "honest edit"),
    ({"honest_edit_completed": None}, "honest edit"),
    ({"status_max_s": bench_abuse.TARGET_STATUS_S}, "/status"),
    ({"status_max_s": None}, "/status"),
    ({"rss_growth_mb": bench_abuse.TARGET_RSS_GROWTH_MB}, "RSS"),
    ({"rss_growth_mb": None}, "RSS"),
    ({"other_client_files_removed": 1}, "files removed"),
    ({"other_client_files_removed": None}, "files removed"),
    ({"error": "RuntimeError: boom"}, "harness error"),
])
def test_missing_any_target_is_not_held(change, miss):
    record = {**GOOD, **change}
    assert not bench_abuse.held(record)
    assert miss in bench_abuse.failed_targets(record)


def test_the_table_names_each_probe_and_its_misses():
    record = {**GOOD, "probe": "zip-bomb", "held": False, "status_max_s": 5.0, "sent": "a zip",
              "check_text": "busy 120 s", "notes": ["n1"]}
    report = {"probes": [record], "summary": {"held": 0, "probes": 1}, "seconds_total": 3.0}
    text = bench_abuse.table(report)
    assert "zip-bomb" in text and "misses: /status" in text and "sent: a zip" in text and "note: n1" in text
    assert "0 of 1 probes held" in text


def test_the_command_is_in_the_bench_table_and_bad_flags_exit_2(capsys):
    assert KINDS["abuse"][0] == "hidream_ui.bench.abuse"
    with pytest.raises(SystemExit) as exc:
        bench_abuse.main(["--probe", "no-such-probe"])
    assert exc.value.code == 2
    with pytest.raises(ValueError, match="unknown probe"):
        bench_abuse.run(["no-such-probe"])
    assert list(abuse_probes.PROBES) == ["run-bypass", "zip-bomb", "ico-decode", "cache-evict", "long-name",
                                         "login-bypass", "sessions", "engine-settings", "low"]


def test_an_app_that_refuses_its_flags_is_reported_and_nothing_is_left(tiny_cache):
    app = bench_abuse.AbuseApp(["--no-such-flag"])
    root = app.root
    with app, pytest.raises(bench_abuse.AppRefused, match="no-such-flag"):
        app.start(timeout=60)
    assert app.process.poll() is not None and not root.exists()


# ---------------------------------------------------------------------------------------------
# One cheap probe, end to end (figures present and sane; the verdict is whatever it is)
# ---------------------------------------------------------------------------------------------


def test_one_probe_end_to_end_reports_every_figure(tiny_cache, capsys):
    code = bench_abuse.main(["--quick", "--probe", "engine-settings", "--json", "--timeout", "120"])
    report = json.loads(capsys.readouterr().out)  # nothing but the JSON on stdout
    (record,) = report["probes"]
    assert code == (0 if record["held"] else 1)
    assert record["error"] is None, record
    for key in ("probe", "sent", "held", "honest_edit_completed", "status_max_s", "rss_growth_mb", "cache_growth_mb",
                "other_client_files_removed", "notes"):
        assert key in record, key
    assert record["probe"] == "engine-settings" and record["sent"]
    assert record["held"] == bench_abuse.held(record)
    assert record["honest_edit_completed"] in (True, False)
    assert 0 < record["status_max_s"] < 60
    figures = record["figures"]
    assert figures["rss_before_mb"] > 50 and figures["rss_peak_mb"] >= figures["rss_before_mb"]
    assert record["rss_growth_mb"] == pytest.approx(figures["rss_peak_mb"] - figures["rss_before_mb"], abs=0.2)
    assert isinstance(record["cache_growth_mb"], float)
    assert record["other_client_files_removed"] in (0, 1, 2)
    # What the visitor's calls did to the engine's settings is read back from /status either way.
    assert set(figures["before"]) == set(figures["after"]) == {"attention", "speed"}
    assert isinstance(record["check"], bool) and record["check_text"]
    if "--kiosk" not in record["app_args"]:  # today's app: the probe says so instead of crashing
        assert any(note.startswith("not applicable: app refused --kiosk") for note in record["notes"])
        assert record["check"] is False
    assert report["summary"]["probes"] == 1 and report["targets"]["status_max_s_under"] == 1.0


def test_a_probe_shorter_than_one_status_round_trip_still_gets_its_figure():
    """CI once saw `status_max_s` None: no /status request had started since the (quick) probe began.
    The record now waits for one answered request that started during or after the probe."""
    import threading
    import time

    from hidream_ui.bench.abuse_client import StatusSampler

    sampler = StatusSampler.__new__(StatusSampler)  # no app: samples are fed by hand
    sampler.every, sampler._stop = 0.2, threading.Event()
    since = time.monotonic()
    sampler.samples = [(since - 1.0, 0.8, None)]  # in flight before the probe started
    assert sampler.max_seconds(since) is None
    threading.Timer(0.3, lambda: sampler.samples.append((time.monotonic(), 0.05, {"state": "idle"}))).start()
    sampler.wait_for_sample(since)
    assert sampler.max_seconds(since) == 0.05
