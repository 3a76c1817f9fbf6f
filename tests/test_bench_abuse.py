"""`bench abuse`: the hostile files say what they claim, the verdict follows the recorded figures
(issue 19's probes and issue 58's: pure functions of what a probe measured), and one cheap probe runs
end to end against a real app (its measurements, not its verdict)."""

from __future__ import annotations

import io
import json
import struct
import zipfile
import zlib

import pytest
from PIL import Image

from hidream_ui.bench import (
    KINDS,
    abuse_app,
    abuse_booth,
    abuse_client,
    abuse_files,
    abuse_history,
    abuse_probes,
    abuse_samplers,
)
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
    assert ico[offset : offset + length] == png
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


@pytest.mark.parametrize(
    "bad",
    [
        lambda: abuse_files.zip_bomb(0, 10),
        lambda: abuse_files.zip_bomb(1, 1 << 32),
        lambda: abuse_files.png_of_zeros(0, 5),
        lambda: abuse_files.ico_with_png(b"", declared=300),
    ],
)
def test_impossible_files_are_refused(bad):
    with pytest.raises(ValueError):
        bad()


# ---------------------------------------------------------------------------------------------
# The verdict, from recorded observations
# ---------------------------------------------------------------------------------------------

GOOD = {
    "probe": "x",
    "check": True,
    "honest_edit_completed": True,
    "status_max_s": 0.2,
    "rss_growth_mb": 12.0,
    "cache_growth_mb": 1.0,
    "other_client_files_removed": 0,
    "error": None,
}


def test_a_record_that_meets_every_target_held():
    assert bench_abuse.held(GOOD) and bench_abuse.failed_targets(GOOD) == []
    assert bench_abuse.held({**GOOD, "check": None})  # a probe with no check of its own


@pytest.mark.parametrize(
    "change, miss",
    [
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
    ],
)
def test_missing_any_target_is_not_held(change, miss):
    record = {**GOOD, **change}
    assert not bench_abuse.held(record)
    assert miss in bench_abuse.failed_targets(record)


def test_the_table_names_each_probe_and_its_misses():
    record = {
        **GOOD,
        "probe": "zip-bomb",
        "held": False,
        "status_max_s": 5.0,
        "sent": "a zip",
        "check_text": "busy 120 s",
        "notes": ["n1"],
    }
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
    assert list(abuse_probes.PROBES) == [
        "run-bypass",
        "zip-bomb",
        "ico-decode",
        "cache-evict",
        "long-name",
        "login-bypass",
        "sessions",
        "engine-settings",
        "low",
    ]


def test_an_app_that_refuses_its_flags_is_reported_and_nothing_is_left(tiny_cache):
    app = bench_abuse.AbuseApp(["--no-such-flag"])
    root = app.root
    with app, pytest.raises(bench_abuse.AppRefused, match="no-such-flag"):
        app.start(timeout=60)
    assert app.process.poll() is not None and not root.exists()


# ---------------------------------------------------------------------------------------------
# One cheap probe, end to end (figures present and sane; the verdict is whatever it is)
# ---------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_one_probe_end_to_end_reports_every_figure(tiny_cache, capsys):
    code = bench_abuse.main(["--quick", "--probe", "engine-settings", "--json", "--timeout", "120"])
    report = json.loads(capsys.readouterr().out)  # nothing but the JSON on stdout
    (record,) = report["probes"]
    assert code == (0 if record["held"] else 1)
    assert record["error"] is None, record
    for key in (
        "probe",
        "sent",
        "held",
        "honest_edit_completed",
        "status_max_s",
        "rss_growth_mb",
        "cache_growth_mb",
        "other_client_files_removed",
        "notes",
    ):
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

    from hidream_ui.bench.abuse_samplers import StatusSampler

    sampler = StatusSampler.__new__(StatusSampler)  # no app: samples are fed by hand
    sampler.every, sampler._stop = 0.2, threading.Event()
    since = time.monotonic()
    sampler.samples = [(since - 1.0, 0.8, None)]  # in flight before the probe started
    assert sampler.max_seconds(since) is None
    threading.Timer(0.3, lambda: sampler.samples.append((time.monotonic(), 0.05, {"state": "idle"}))).start()
    sampler.wait_for_sample(since)
    assert sampler.max_seconds(since) == 0.05


# ---------------------------------------------------------------------------------------------
# Issue 58's probes: their verdicts from recorded figures, and the harness pieces they use
# ---------------------------------------------------------------------------------------------


def test_issue_58_probes_are_registered_after_issue_19s_and_take_either_spelling():
    assert list(bench_abuse.PROBES)[:9] == list(abuse_probes.PROBES)
    assert list(bench_abuse.PROBES)[9:13] == ["results-flood", "kiosk-lockout", "session-flood", "history-cpu"]
    assert bench_abuse.probe_name("kiosk_lockout") == "kiosk-lockout"
    # Their own budgets unless --probe-budget says otherwise; issue 19's keep the defaults.
    assert bench_abuse.budget_for("kiosk-lockout", quick=False) == 600.0
    assert bench_abuse.budget_for("kiosk-lockout", quick=False, override=30.0) == 30.0
    assert bench_abuse.budget_for("zip-bomb", quick=True) == bench_abuse.QUICK_BUDGET
    assert bench_abuse.PROBES["session-flood"].session_capacity(True) < 10_000


def _cache(files_max=60, cap=60, mb_max=1.0, cap_mb=4000.0, samples=10):
    return {
        "cache_samples": samples,
        "cache_files_max": files_max,
        "cache_max_files": cap,
        "cache_mb_max": mb_max,
        "cache_max_mb": cap_mb,
    }


def test_cache_figures_count_samples_and_seconds_over_either_cap():
    mb = 1 << 20
    samples = [(0.0, 10, mb), (1.0, 61, mb), (1.5, 60, mb), (2.0, 59, 5 * mb), (4.0, 62, mb)]
    figures = abuse_samplers.cache_figures(samples, max_files=60, max_bytes=4 * mb)
    assert figures["cache_files_first"] == 10 and figures["cache_files_max"] == 62 and figures["cache_files_end"] == 62
    assert figures["cache_mb_max"] == 5.0 and figures["cache_max_mb"] == 4.0
    assert figures["cache_samples_over_cap"] == 3  # 61 files, 5 MB, 62 files (the last counts no time)
    assert figures["cache_seconds_over_cap"] == pytest.approx(0.5 + 2.0)
    assert figures["cache_longest_over_cap_s"] == pytest.approx(2.0)  # 59 files but 5 MB: over until 4.0
    assert not abuse_booth.within_caps(figures)
    empty = abuse_samplers.cache_figures([], 60, 4 * mb)
    assert empty["cache_samples"] == 0 and not abuse_booth.within_caps(empty)
    assert abuse_booth.within_caps(_cache()) and not abuse_booth.within_caps(_cache(files_max=61))
    assert not abuse_booth.within_caps(_cache(mb_max=4000.5))


def test_cache_caps_follow_the_apps_flags_else_its_defaults():
    from hidream_ui.config import AppConfig

    defaults = AppConfig()
    assert abuse_booth.cache_caps(["--cache-max-files", "60"]) == (60, defaults.cache_max_mb * MIB)
    assert abuse_booth.cache_caps([]) == (defaults.cache_max_files, defaults.cache_max_mb * MIB)


def test_the_cache_count_leaves_out_what_the_app_held_when_it_started():
    app = bench_abuse.AbuseApp([])
    try:
        folder = app.gradio_tmp / "hidream-ui-gradio-x" / "h1"
        folder.mkdir(parents=True)
        (folder / "example.png").write_bytes(b"e" * 100)
        app.exempt_files = {str(folder / "example.png")}
        (folder / "upload.png").write_bytes(b"u" * 10)
        (app.gradio_tmp / "tmpspool").write_bytes(b"s" * 5)
        assert app.cache_counts() == (2, 15)
    finally:
        app.close()


def test_the_cache_sampler_samples_until_stopped():
    class FakeApp:
        counts = iter(range(1, 10_000))

        def cache_counts(self):
            return next(self.counts), 0

    with abuse_samplers.CacheSampler(FakeApp(), max_files=3, max_bytes=1, every=0.01) as sampler:
        import time

        time.sleep(0.1)
    figures = sampler.figures()
    assert figures["cache_samples"] >= 3 and figures["cache_files_max"] == figures["cache_files_end"]
    assert figures["cache_samples_over_cap"] == figures["cache_samples"] - 3  # 1, 2 and 3 are within 3


FLOOD_GOOD = {"newcomer": {"upload_status": 200, "edit": "ran", "ok": True}, "honest_saw_503": False, **_cache()}


@pytest.mark.parametrize(
    "change, held",
    [
        ({}, True),
        ({"newcomer": {"upload_status": 503, "edit": None, "ok": False}}, False),  # the issue's finding
        ({"newcomer": {"upload_status": 200, "edit": "refused (503: full)", "ok": False}}, False),
        ({"honest_saw_503": True}, False),
        (_cache(files_max=134), False),  # 17 -> 134 files against a cap of 60
        ({"cache_samples": 0}, False),
    ],
)
def test_results_flood_holds_only_when_the_newcomer_gets_in_and_the_cache_stays_capped(change, held):
    assert abuse_booth.results_flood_check({**FLOOD_GOOD, **change}) is held


def test_a_503_is_what_the_results_flood_looks_for():
    assert abuse_booth._is_full({"upload_status": 503})
    assert abuse_booth._is_full({"upload_status": 200, "edit": "refused (503: The server's upload space is full)"})
    assert not abuse_booth._is_full({"upload_status": 200, "edit": "ran"})


KIOSK_GOOD = {
    "edits_wanted": 300,
    "uploads_ok": 300,
    "edits_ran": 300,
    "newcomers": [{"ok": True}, {"ok": True}],
    **_cache(files_max=900, cap=1000),
}


@pytest.mark.parametrize(
    "change, held",
    [
        ({}, True),
        ({"uploads_ok": 200, "edits_ran": 200}, False),  # the 201st upload got 429 for an hour
        ({"edits_ran": 299}, False),
        ({"edits_wanted": 300, "uploads_ok": 120, "edits_ran": 120}, False),  # the budget ran out
        ({"newcomers": [{"ok": True}, {"ok": False}]}, False),
        ({"newcomers": []}, False),
        (_cache(files_max=1001, cap=1000), False),
    ],
)
def test_the_kiosk_holds_only_when_every_picture_and_every_newcomer_succeeds_within_the_caps(change, held):
    assert abuse_booth.kiosk_check({**KIOSK_GOOD, **change}) is held


SESSION_FLOOD_GOOD = {
    "session_capacity": 300,
    "flood_sessions_after_honest_job": 450,
    "flood_refused_429": 80,
    "edit_result_before": "picture",
    "edit_result_after": "picture",
}


@pytest.mark.parametrize(
    "change, held",
    [
        ({}, True),
        ({"edit_result_after": "no picture (ran)"}, False),  # the issue's finding: "Edit the result" did nothing
        ({"edit_result_before": "no picture (ran)"}, False),  # the control failed: the check proves nothing
        ({"flood_sessions_after_honest_job": 299}, False),  # Gradio's LRU alone would have kept it
        ({"session_capacity": None, "flood_sessions_after_honest_job": 0}, True),  # uncapped: refused by the limit
        ({"session_capacity": None, "flood_refused_429": 0}, False),
    ],
)
def test_the_session_flood_holds_when_the_honest_session_survives_a_flood_that_would_evict_it(change, held):
    assert abuse_history.session_flood_check({**SESSION_FLOOD_GOOD, **change}) is held


def test_edit_the_result_counts_only_when_it_returned_a_picture():
    picture = {
        "path": "/tmp/gradio/x/result.png",
        "url": "http://127.0.0.1/file=x",
        "meta": {"_type": "gradio.FileData"},
    }
    ok = abuse_client.CallResult(True, 200, data=[picture, "The result is the source now"])
    assert abuse_history.edit_result_picture(ok)
    assert abuse_history.edit_result_picture(
        abuse_client.CallResult(True, 200, data=[{"__type__": "update", "value": picture}, ""])
    )
    gone = abuse_client.CallResult(True, 200, data=[{"__type__": "update"}, {"__type__": "update"}])
    assert not abuse_history.edit_result_picture(gone)
    assert not abuse_history.edit_result_picture(abuse_client.CallResult(False, 404, "gone"))


HISTORY_GOOD = {"single_request_cpu_s": 0.05, "flood_cpu_s_per_request": 0.08, "flood_answered": 40}


@pytest.mark.parametrize(
    "change, held",
    [
        ({}, True),
        ({"single_request_cpu_s": 2.8}, False),  # the issue's finding
        ({"flood_cpu_s_per_request": abuse_history.HISTORY_CPU_TARGET_S}, False),
        ({"flood_cpu_s_per_request": None, "flood_answered": 0}, False),
        ({"adapted": HISTORY_GOOD}, True),
        ({"adapted": {**HISTORY_GOOD, "single_request_cpu_s": 0.7}}, False),  # cheap only while refused by count
        ({"adapted": {**HISTORY_GOOD, "flood_answered": 0, "flood_cpu_s_per_request": None}}, False),
    ],
)
def test_history_cpu_holds_when_a_large_refresh_costs_the_server_little(change, held):
    assert abuse_history.history_cpu_check({**HISTORY_GOOD, **change}) is held


def test_the_history_payloads_have_the_issues_size_and_shape():
    dep = {"inputs": [1, 2]}
    data = abuse_history.history_data(dep, [{"params": {}}] * abuse_history.HISTORY_ENTRIES)
    encoded = json.dumps(data).encode()
    assert 850 * 1024 < len(encoded) < 870 * 1024 and data[1] == ""  # ~859 KB, under --max-body-kb 1024
    adapted = abuse_history.history_data(dep, abuse_history.adapted_history())
    assert abs(len(json.dumps(adapted)) - len(encoded)) < 32 * 1024  # as many bytes...
    assert len(adapted[0]) * 2 < 5000  # ...in few objects (an entry and its params)


def test_a_pre_encoded_body_is_the_same_json_request():
    payload = {"fn_index": 68, "session_hash": "s", "event_data": None}
    data = [[{"params": {}}] * 3, ""]
    body = abuse_client._body(payload, None, json.dumps(data).encode())
    assert json.loads(body["content"]) == {**payload, "data": data}
    assert body["headers"]["content-type"] == "application/json"
    assert abuse_client._body(payload, data, None) == {"json": {**payload, "data": data}}


@pytest.mark.parametrize(
    "rounds, median",
    [
        ([(100.0, 100.5, 80)] * 5, 6.4),
        # One round in which the allocator grew an arena (or the server did something else): the
        # median is the other rounds' figure; the mean would have been 41 KB.
        ([(100.0, 100.5, 80), (100.5, 101.0, 80), (101.0, 116.0, 80), (116.0, 116.5, 80), (116.5, 117.0, 80)], 6.4),
        ([(100.0, 100.0, 80), (100.0, 100.0, 0)], 0.0),  # a round that admitted nothing is left out
    ],
)
def test_the_session_cost_is_the_median_of_its_rounds(rounds, median):
    figures = abuse_probes.session_cost_kb(rounds)
    assert figures["kb_per_session"] == median
    assert len(figures["kb_per_session_rounds"]) == sum(1 for *_, n in rounds if n)


def test_the_sessions_check_keeps_its_20_kb_target():
    good = {"kb_per_session": 6.4, "kb_per_session_rounds": [6.4] * 5, "sessions": 500, "sessions_wanted": 500}
    assert abuse_probes.sessions_check(good)
    assert not abuse_probes.sessions_check({**good, "kb_per_session": abuse_probes.SESSION_TARGET_KB})
    assert not abuse_probes.sessions_check({**good, "sessions": 400})  # the budget ran out
    assert not abuse_probes.sessions_check({**good, "kb_per_session_rounds": [6.4, 6.4]})  # too few rounds
    assert abuse_probes.SESSION_TARGET_KB == 20.0 and bench_abuse.TARGET_RSS_GROWTH_MB == 200.0


def test_the_child_launcher_caps_the_session_table_after_the_app_made_it_lean(monkeypatch):
    from types import SimpleNamespace

    from hidream_ui.bench import abuse_child
    from hidream_ui.server import gradio_internals

    calls = []
    monkeypatch.setattr(gradio_internals, "lean_sessions", lambda demo: calls.append(demo) or True)
    abuse_child.install(7, None)
    demo = SimpleNamespace(state_holder=SimpleNamespace(capacity=10_000, session_data={}))
    assert gradio_internals.lean_sessions(demo) is True
    assert calls == [demo] and demo.state_holder.capacity == 7
    app = bench_abuse.AbuseApp([], session_capacity=7)
    try:
        assert app.command()[1:3] == ["-m", "hidream_ui.bench.abuse_child"]
        env = app._env()
        assert env[abuse_app.SESSION_CAPACITY_ENV] == "7" and env[abuse_app.SESSION_LOG_ENV]
        assert bench_abuse.AbuseApp([]).command()[1:4] == ["-m", "hidream_ui", "app"]
    finally:
        app.close()
