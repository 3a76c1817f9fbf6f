"""The Speed presets are the rules' choice on the recorded run of the shipped weights, and say what they cost.

The record (assets/tiny_trained/quality.json) is `bench quality --record`'s report on the shipped weights; this
module re-applies today's rules (pipeline/speed/preset_rules.py) to it. Retrain the weights without recording
again, change a rule, or change a preset by hand, and a test here fails.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from hidream_ui.bench import quality, quality_report
from hidream_ui.lab import world
from hidream_ui.model.tiny import quality_record, trained
from hidream_ui.pipeline.speed.preset_rules import PRESET_RULES, rule_misses, speed_value
from hidream_ui.pipeline.speed.settings import SPEED_PRESETS, parse_cache
from hidream_ui.ui.speed_setting import speed_info

DOCS = Path(__file__).resolve().parent.parent / "docs"


@pytest.fixture(scope="module")
def record():
    found = quality_record.read()
    assert found is not None, f"no record: run `{_command()}`"
    return found


def _command() -> str:
    return "python -m hidream_ui bench quality --record --json (see docs/speed.md)"


def test_the_record_is_a_full_run_on_the_shipped_weights(record):
    assert record[quality_record.DIGEST_KEY] == trained.asset_digest(quality_record.default_folder()), (
        f"the weights changed since the record was made: {_command()}"
    )
    assert record["profile"] == "trained" and record["random_weights"] is False
    assert record["cases"] >= quality.DEFAULT_CASES and record["seed_start"] == world.HELD_OUT_SEED_START
    assert record[quality_record.COMMAND_KEY].startswith("python -m hidream_ui bench quality ")
    assert "--record" in record[quality_record.COMMAND_KEY]
    assert record["configurations"]["exact"]["fidelity_vs_exact"]["psnr_db"]["median"] == quality.PSNR_CAP_DB


@pytest.mark.parametrize("preset", sorted(PRESET_RULES))
def test_each_preset_is_what_its_rule_picks_on_the_record(record, preset):
    chosen = quality_report.presets(record)[preset]  # today's rules on the recorded rows
    value = str(parse_cache(SPEED_PRESETS[preset]))
    assert chosen["best"] is not None, f"nothing in the record keeps {preset}'s quality rule"
    assert value == chosen["best_speed_value"], (
        f"{preset} = {value}, but the rule picks {chosen['best_speed_value']} on the record "
        f"(qualifying, fastest first: {chosen['qualifying']})"
    )
    name, row = quality_record.configuration_of(record, value)
    misses = rule_misses(preset, row, record["configurations"]["exact"]["success_rate"])
    assert (misses == []) == chosen["meets_rule"]
    # When nothing keeps the whole rule, the preset says so where people choose it.
    assert ("misses its rule" in speed_info(record)) == any(
        not quality_report.presets(record)[p]["meets_rule"] for p in PRESET_RULES
    )


def test_the_speed_setting_quotes_the_record(record):
    info = speed_info(record)
    for preset in PRESET_RULES:
        name, row = quality_record.configuration_of(record, SPEED_PRESETS[preset])
        assert f"{preset}: transformer {row['transformer_speedup_vs_exact']:.1f}x" in info
        assert f"{row['fidelity_vs_exact']['psnr_db']['median']:.0f} dB from exact" in info
    assert f"offline model, {record['cases']} edits" in info
    assert "not measured" in speed_info({"configurations": {}})  # a record without the preset's row


def test_docs_speed_quotes_each_preset_from_the_record(record):
    text = (DOCS / "speed.md").read_text(encoding="utf-8")
    for preset in PRESET_RULES:
        words = quality_record.preset_words(preset, record)
        assert words is not None and words in text, f"docs/speed.md should say: {words}"


def test_preset_words_follow_the_row(record):
    value = SPEED_PRESETS["fast"]
    name, row = quality_record.configuration_of(record, value)
    assert speed_value(row["settings"]) == str(parse_cache(value))
    changed = {
        **record,
        "configurations": {
            **record["configurations"],
            name: {**row, "success_rate": 0.0, "transformer_speedup_vs_exact": 1.1},
        },
    }
    words = quality_record.preset_words("fast", changed)
    assert "transformer 1.10x" in words and "misses its rule" in words and "points fewer" in words


def test_every_figure_docs_speed_quotes_about_the_candidates_is_the_records(record):
    """The prose of "Which cache the presets are" names figures of other candidates; each is the record's."""
    import re

    text = (DOCS / "speed.md").read_text(encoding="utf-8")
    section = " ".join(text[text.index("### Which cache the presets are") :].split())  # lines joined
    rows = record["configurations"]
    exact = rows["exact"]["success_rate"]

    def check(name, speedup, points=None, psnr=None, end_to_end=False):
        row = rows[name]
        key = "speedup_vs_exact" if end_to_end else "transformer_speedup_vs_exact"
        assert f"{row[key]:.2f}" == speedup, (name, speedup)
        if points is not None:
            assert float(points) == pytest.approx(round(100 * (row["success_rate"] - exact), 1)), (name, points)
        if psnr is not None:
            assert f"{row['fidelity_vs_exact']['psnr_db']['median']:.1f}" == psnr, (name, psnr)

    found = 0
    for name, speedup, points, psnr in re.findall(
        r"`([a-z-]+:[\d.@]+)` (\d+\.\d\d)x, ([+-]?[\d.]+), ([\d.]+) dB", section
    ):
        check(name, speedup, points, psnr)
        found += 1
    for steps, speedup, points, psnr in re.findall(r"(\d+) steps (\d+\.\d\d)x, ([+-]?[\d.]+), ([\d.]+) dB", section):
        check(f"steps:{steps}", speedup, points, psnr)
        found += 1
    for name, speedup, points in re.findall(r"`([a-z-]+:[\d.@]+)` (\d+\.\d\d)x at ([+-]?[\d.]+)(?: points)?", section):
        check(name, speedup, points)
        found += 1
    for name, speedup in re.findall(r"`([a-z-]+:[\d.@]+)` (\d+\.\d\d)x and", section) + re.findall(
        r"and `([a-z-]+:[\d.@]+)` (\d+\.\d\d)x: the VAE", section
    ):
        check(name, speedup, end_to_end=True)
        found += 1
    assert found == 13  # the section's figures were all read (a changed phrasing must change this test too)
