"""`bench soak` run in-process with a few edits on the offline tiny model (seconds, not minutes)."""

from __future__ import annotations

import json

import pytest

from hidream_ui.bench import soak as bench_soak


@pytest.fixture(scope="module")
def report(tiny_cache):
    # A cache limit the 6 edits exceed (2 files per edit), so "bounded by the limit" can fail.
    return bench_soak.run(edits=6, sample_at=2, every=2, retention=3, cache_max_files=5)


@pytest.mark.slow
def test_report_has_the_figures_and_targets(report):
    json.dumps(report)  # JSON-able as it is
    for key in (
        "benchmark",
        "edits",
        "retention",
        "cache_max_files",
        "sample_at_edit",
        "rss_mb",
        "cache_files",
        "output_files",
        "output_pngs",
        "failures",
        "seconds_total",
        "seconds_per_edit",
        "series",
        "targets",
        "janitor_forced_before_sample",
    ):
        assert key in report, key
    assert report["benchmark"] == "soak" and report["edits"] == 6 and report["sample_at_edit"] == 2
    assert report["janitor_forced_before_sample"] is True
    assert report["rss_mb"]["at_edit_2"] > 0 and report["rss_mb"]["end"] > 0
    assert isinstance(report["rss_mb"]["growth_percent"], float)
    assert report["rss_mb"]["target_growth_percent_max"] == bench_soak.TARGET_RSS_GROWTH_PERCENT
    assert report["targets"]["enforced"] is False
    assert report["seconds_total"] > 0 and report["seconds_per_edit"] > 0


def test_no_edit_failed(report):
    assert report["failures"]["count"] == 0, report["failures"]["first_error"]
    assert report["failures"]["first_error"] is None


def test_file_counts_are_numbers_and_bounded(report):
    for key in ("cache_files", "output_files", "output_pngs"):
        assert isinstance(report[key]["at_edit_2"], int) and isinstance(report[key]["end"], int), key
    # Every edit uploads the picture and gets result files back through gradio's cache.
    assert report["cache_files"]["end"] >= 1
    assert report["cache_files"]["end"] <= report["cache_files"]["limit"]
    # Retention 3 with 6 edits: at most 3 result PNGs (each with its JSON sidecar) stay.
    assert report["output_pngs"]["end"] <= 3
    assert report["output_files"]["end"] <= 6
    assert [s["edit"] for s in report["series"]] == [2, 4, 6]
    assert all(s["output_pngs"] <= 3 for s in report["series"])


@pytest.mark.slow
def test_main_prints_one_json_object(tiny_cache, capsys):
    assert bench_soak.main(["--edits", "2", "--sample-at", "1", "--every", "1", "--retention", "1", "--json"]) == 0
    out = capsys.readouterr().out
    report = json.loads(out)  # nothing but the JSON on stdout
    assert report["edits"] == 2 and report["output_pngs"]["end"] <= 1


def test_bad_flags_exit_2(capsys):
    with pytest.raises(SystemExit) as exc:
        bench_soak.main(["--edits", "0"])
    assert exc.value.code == 2
