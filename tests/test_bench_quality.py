"""`bench quality` on the random `tiny` profile: the report's structure and that its figures are computed
from the real edits (success is ~0 on random weights; what is checked is how the numbers come about)."""

from __future__ import annotations

import math
import statistics

import numpy as np
import pytest

from hidream_ui.bench import quality, quality_configs, quality_report
from hidream_ui.lab import world
from hidream_ui.pipeline.speed.preset_rules import speed_value
from hidream_ui.pipeline.speed.settings import SPEED_PRESETS

CASES = 2
STEPS = 3  # enough for interval:2 to skip a call in the edit stage (2 steps run every block)
# A step count below exact's, alone and crossed with interval:2, ride along (`--steps-grid 2 --cross interval:2`).
ONLY = ["interval:2", "steps:2", "interval:2@2", "memory:encoders-cpu", "attention:sdpa"]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """No timing is checked here, and two OpenMP threads spin for their share of a busy 2-core machine
    (4x the CPU time, measured). Put back for the other modules."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def report(tiny_cache, one_thread):
    return quality.run(
        cases=CASES,
        profile="tiny",
        device="cpu",
        steps=STEPS,
        only=ONLY,
        per_case=True,
        steps_grid=[STEPS, 2],
        cross=["interval:2"],
    )


@pytest.mark.slow
def test_structure(report):
    assert report["benchmark"] == "quality" and report["profile"] == "tiny" and report["random_weights"] is True
    assert report["cases"] == CASES and report["seed_start"] == world.HELD_OUT_SEED_START
    assert sum(report["cases_by_kind"].values()) == CASES
    assert report["edit"]["num_inference_steps"] == STEPS
    assert not set(report["edit"]) & set(quality.PER_EDIT_FIELDS)
    assert list(report["configurations"]) == ["exact", *ONLY]
    # exact, cache, attention and padding share one engine; the memory plan needs its own load.
    assert report["model_loads"] == 2
    assert report["unavailable"] == {}  # --only named no unavailable configuration
    for name, row in report["configurations"].items():
        assert "error" not in row, (name, row)
        assert row["cases"] == CASES
        assert 0.0 <= row["success_rate"] <= 1.0 and 0.0 <= row["colour_rate"] <= 1.0
        assert set(row["success_by_kind"]) == set(world.EDIT_KINDS)
        for kind, rate in row["success_by_kind"].items():
            assert (rate is None) == (report["cases_by_kind"][kind] == 0), (name, kind)
        assert math.isfinite(row["untouched_psnr_median_db"])
        assert row["seconds_per_edit"] > 0 and row["transformer_seconds_per_edit"] > 0
        assert row["seconds_per_edit"] > row["transformer_seconds_per_edit"]  # the VAE and the rest are outside
        assert row["speedup_vs_exact"] > 0 and row["transformer_speedup_vs_exact"] > 0
    exact = report["configurations"]["exact"]
    assert exact["speedup_vs_exact"] == 1.0 and exact["transformer_speedup_vs_exact"] == 1.0
    assert report["configurations"]["memory:encoders-cpu"]["settings"]["memory"] == "encoders-cpu"
    assert report["steps_grid"] == [2]  # exact's own count is not a configuration of its own
    for name, row in report["configurations"].items():
        assert set(row["fidelity_vs_exact"]) == set(quality.FIDELITY_KEYS), name
        for figures in row["fidelity_vs_exact"].values():
            assert set(figures) == {"median", "p5"} and figures["p5"] <= figures["median"], name
    # Random weights and 2 cases: the targets are missed, and the report says which.
    assert report["targets"]["met"] is False
    assert any("cases" in m for m in report["targets"]["missed"])
    assert any("exact success" in m for m in report["targets"]["missed"])


def test_exact_modes_equal_exact_to_the_case(report):
    rows = report["configurations"]
    for name in ("exact", "memory:encoders-cpu", "attention:sdpa"):
        assert rows[name]["exact_mode"] is True
        # attention:sdpa is what `auto` picks on a CPU: exact run again, so the same pixels.
        assert rows[name]["identical_to_exact_cases"] == CASES, name
        assert rows[name]["max_abs_diff_vs_exact"] == 0, name
        assert rows[name]["equal_to_exact_cases"] == CASES, name
        # Identical pixels: PSNR at its cap, SSIM 1, over the whole picture and the untouched region.
        fidelity = rows[name]["fidelity_vs_exact"]
        for key in ("psnr_db", "untouched_psnr_db"):
            assert fidelity[key] == {"median": quality.PSNR_CAP_DB, "p5": quality.PSNR_CAP_DB}, name
        for key in ("ssim", "untouched_ssim"):
            assert fidelity[key] == {"median": 1.0, "p5": 1.0}, name
    assert report["exact_modes_equal_exact"] is True


def test_cache_mode_is_applied_and_measured(report):
    row = report["configurations"]["interval:2"]
    assert row["exact_mode"] is False and row["settings"]["cache"] == "interval:2"
    assert row["skipped_fraction"] > 0  # the step cache really ran...
    assert row["max_abs_diff_vs_exact"] > 0  # ...and changed the pixels (an approximation)
    assert row["identical_to_exact_cases"] < CASES
    assert row["fidelity_vs_exact"]["psnr_db"]["p5"] < quality.PSNR_CAP_DB
    assert row["fidelity_vs_exact"]["ssim"]["p5"] < 1.0


def test_steps_axis_runs_fewer_steps_against_exact_at_its_own(report):
    rows = report["configurations"]
    alone, crossed = rows["steps:2"], rows["interval:2@2"]
    assert alone["group"] == "steps" and alone["settings"]["steps"] == 2 and alone["settings"]["cache"] == "none"
    assert crossed["group"] == "cache" and crossed["settings"] == {**rows["interval:2"]["settings"], "steps": 2}
    assert rows["exact"]["settings"]["steps"] is None and report["edit"]["num_inference_steps"] == STEPS
    # 2 of exact's 3 steps really ran: the pixels moved, and the speedup is against exact at 3 steps.
    assert alone["max_abs_diff_vs_exact"] > 0 and alone["transformer_speedup_vs_exact"] > 1.0
    per_case = report["per_case"][0]["configurations"]
    assert per_case["steps:2"]["fidelity_vs_exact"]["psnr_db"] < quality.PSNR_CAP_DB
    assert speed_value(crossed["settings"]) == "interval:2@2"
    assert speed_value(alone["settings"]) == "none@2"


def test_fidelity_figures_follow_from_the_per_case_outputs(report):
    for name, row in report["configurations"].items():
        cells = [c["configurations"][name]["fidelity_vs_exact"] for c in report["per_case"]]
        for key in quality.FIDELITY_KEYS:
            values = [cell[key] for cell in cells]
            assert row["fidelity_vs_exact"][key]["median"] == pytest.approx(statistics.median(values), abs=0.01)
            assert row["fidelity_vs_exact"][key]["p5"] == pytest.approx(float(np.percentile(values, 5)), abs=0.01)


def test_figures_follow_from_the_per_case_scores(report):
    rows = report["configurations"]
    assert [c["seed"] for c in report["per_case"]] == list(
        range(world.HELD_OUT_SEED_START, world.HELD_OUT_SEED_START + CASES)
    )
    for name, row in rows.items():
        cells = [c["configurations"][name] for c in report["per_case"]]
        assert row["success_rate"] == pytest.approx(sum(c["success"] for c in cells) / CASES, abs=1e-4)
        assert row["untouched_psnr_median_db"] == pytest.approx(
            statistics.median(c["untouched_psnr_db"] for c in cells), abs=0.01
        )
        exact_cells = [c["configurations"]["exact"] for c in report["per_case"]]
        assert row["equal_to_exact_cases"] == sum(a["success"] == b["success"] for a, b in zip(cells, exact_cells))


def test_scores_are_the_world_rule_on_the_real_edit(report, tiny_cache, tmp_path):
    """Edits the first case again outside the benchmark (same engine settings and seed) and scores it with
    world.score: the benchmark's figures for exact come from that very image."""
    import numpy as np
    from PIL import Image

    from hidream_ui.config import AppConfig
    from hidream_ui.edits import EditParams, EditRequest
    from hidream_ui.engine.pool import EnginePool

    case = world.make_case(world.HELD_OUT_SEED_START)
    engine = EnginePool.for_config(
        AppConfig(tiny_profile="tiny", device="cpu", memory="full", output_dir=tmp_path)
    ).primary
    params = EditParams.from_dict(
        {
            **EditParams.defaults_for("e1.1").to_dict(),
            "instruction": case.instruction,
            "seed": case.seed,
            "num_inference_steps": STEPS,
            "cache": "none",
        }
    )
    out = np.asarray(engine.edit(EditRequest(image=Image.fromarray(case.source), params=params), save=False).image)
    expected = world.score(case, out)
    got = report["per_case"][0]["configurations"]["exact"]
    assert got["success"] == expected["success"] and got["got"] == expected["got"]
    assert got["untouched_psnr_db"] == pytest.approx(min(expected["untouched_psnr_db"], quality.PSNR_CAP_DB), abs=0.01)


def test_table_names_every_configuration(report):
    table = quality_report.format_table(report)
    for name in report["configurations"]:
        assert name in table
    assert "random weights" in table


def test_every_mode_is_listed_on_cpu(tiny_cache):
    from hidream_ui.device.detect import resolve_device, resolve_dtype

    device = resolve_device("cpu")
    configs, unavailable = quality_configs.all_configurations(device, resolve_dtype("auto", device), "tiny")
    names = [c.name for c in configs]
    assert names[0] == "exact"
    for name in (
        "interval:2",
        "interval:3",
        "first-block:0.05",
        "fp8",
        "memory:encoders-offload",
        "memory:encoders-cpu",
        "memory:blocks",
        "memory:sequential",
        "attention:sdpa",
        "attention:math",
        "attention:chunked",
        "padded",
    ):
        assert name in names
    assert "memory:full" not in names  # that is exact's own plan
    assert any(c.name == "attention:flash_attn" for c in unavailable)  # CUDA only: reported, not run
    chosen, why = quality_configs.select(configs, ["cache", "attention:flash_attn"], unavailable)
    missing = {c.name for c in unavailable}
    assert [c.name for c in chosen] == ["exact", *(m for m in quality_configs.CACHE_MODES if m not in missing)]
    for kind in ("interval", "first-block", "fbcache", "taylorseer", "magcache", "dbcache"):  # ours and the field's
        assert any(m.startswith(kind + ":") for m in quality_configs.CACHE_MODES), kind
    assert list(why) == ["attention:flash_attn"]
    with pytest.raises(ValueError, match="'warp:9'"):
        quality_configs.select(configs, ["warp:9"], unavailable)


def test_a_cache_whose_library_is_absent_is_listed_with_its_hint(tiny_cache, monkeypatch):
    from hidream_ui.device.detect import resolve_device, resolve_dtype

    monkeypatch.setattr(quality_configs, "cache_unavailable", lambda spec: "pip it" if spec.kind == "dbcache" else None)
    device = resolve_device("cpu")
    configs, unavailable = quality_configs.all_configurations(
        device, resolve_dtype("auto", device), "tiny", ["interval:2", "dbcache:0.1"]
    )
    assert "interval:2" in [c.name for c in configs] and "dbcache:0.1" not in [c.name for c in configs]
    assert {c.name: why for c, why in unavailable.items()}["dbcache:0.1"] == "pip it"


def _row(
    group: str, success: float, speedup: float | None, psnr: float = 40.0, cache: str = "none", steps: int | None = None
) -> dict:
    return {
        "group": group,
        "success_rate": success,
        "transformer_speedup_vs_exact": speedup,
        "settings": {"cache": cache, "steps": steps},
        "fidelity_vs_exact": {"psnr_db": {"median": psnr, "p5": psnr - 3}},
    }


def test_presets_are_the_fastest_caches_that_keep_each_rule(monkeypatch):
    monkeypatch.setattr(
        quality_report, "SPEED_PRESETS", {"exact": "none", "fast": "interval:2", "faster": "interval:3@14"}
    )
    report = {
        "configurations": {
            "exact": _row("exact", 0.90, 1.0),
            "interval:2": _row("cache", 0.88, 1.9, cache="interval:2"),  # fast: within 3 points, >= 1.8x, >= 30 dB
            "taylorseer:2": _row("cache", 0.875, 2.2, cache="taylorseer:2"),  # fast too, and faster than interval:2
            "taylorseer:3": _row("cache", 0.90, 2.3, psnr=29.0, cache="taylorseer:3"),  # fast but for its 29 dB
            "interval:3@14": _row("cache", 0.85, 2.6, cache="interval:3", steps=14),  # faster: 5 points lost
            "steps:10": _row("steps", 0.83, 2.8, psnr=26.0, steps=10),  # faster, and faster than interval:3@14
            "magcache:0.24": _row("cache", 0.70, 4.0, cache="magcache:0.24"),  # too lossy for either
            "attention:math": _row("attention", 0.90, 3.0),  # neither a cache nor steps: never a preset
            "fbcache:0.1": {"group": "cache", "error": "edit failed"},
        }
    }
    chosen = quality_report.presets(report)
    fast, faster = chosen["fast"], chosen["faster"]
    assert fast["qualifying"] == ["taylorseer:2", "interval:2"] and fast["best"] == "taylorseer:2"
    assert fast["meets_rule"] and fast["best_transformer_speedup"] == 2.2 and fast["best_psnr_vs_exact_db"] == 40.0
    assert fast["best_speed_value"] == "taylorseer:2" and fast["targets"] == {
        "min_transformer_speedup": 2.0,
        "met": True,
    }
    assert fast["current"] == "interval:2" and fast["current_keeps_rule"] is True and fast["current_misses"] == []
    assert faster["qualifying"] == ["steps:10", "interval:3@14"] and faster["best_speed_value"] == "none@10"
    assert faster["targets"]["met"] is False  # 2.8x < 3.0x
    assert faster["current"] == "interval:3@14" and faster["current_keeps_rule"] is True
    # The rule's fidelity part decides: 24 dB is not within `faster`'s 25.
    report["configurations"]["steps:10"] = _row("steps", 0.83, 2.8, psnr=24.0, steps=10)
    assert quality_report.presets(report)["faster"]["qualifying"] == ["interval:3@14"]
    # Nothing fast enough: the best trade-off within the quality part of the rule, marked as missing it.
    report["configurations"]["interval:3@14"] = _row("cache", 0.85, 2.4, cache="interval:3", steps=14)
    slow = quality_report.presets(report)["faster"]
    assert slow["qualifying"] == [] and slow["best"] == "interval:3@14" and slow["meets_rule"] is False
    assert slow["current_keeps_rule"] is False and slow["current_misses"] == ["transformer 2.40x (at least 2.5x)"]
    assert set(slow) >= {
        "current",
        "max_success_drop",
        "min_transformer_speedup",
        "min_psnr_vs_exact_db",
        "best_success_rate",
    }


def test_cache_list_takes_any_cache_value():
    fast = SPEED_PRESETS["fast"]
    assert quality_configs.cache_specs(["fast", fast, "none", "first-block:0.30"]) == [fast, "first-block:0.3"]
    with pytest.raises(ValueError, match="'warp:9'"):
        quality_configs.cache_specs(["warp:9"])


def test_edit_settings_come_from_the_defaults_and_params():
    base = quality.edit_base(5, {"guidance_scale": "2.5"})
    assert base["num_inference_steps"] == 5 and base["guidance_scale"] == 2.5  # coerced by the edit gate
    for params, word in (({"foo": "1"}, "foo"), ({"seed": "1"}, "seed"), ({"guidance_scale": "x"}, "guidance_scale")):
        with pytest.raises(ValueError, match=word):
            quality.edit_base(None, params)


@pytest.mark.parametrize(
    "argv, word",
    [
        (["--param", "guidance_scale"], "FIELD=VALUE"),
        (["--param", "cache=interval:2"], "cache"),
        (["--cases", "0"], "--cases"),
        (["--steps", "0"], "--steps"),
        (["--threads", "0"], "--threads"),
        (["--caches", "interval:0"], "--caches"),
        (["--steps-grid", "20,x"], "--steps-grid"),
        (["--steps-grid", "0"], "--steps-grid"),
        (["--cross", "interval:2"], "--cross needs --steps-grid"),
        (["--record", "--tiny-profile", "tiny"], "--record"),
    ],
)
def test_cli_refuses_bad_numbers(argv, word, capsys):
    with pytest.raises(SystemExit) as exc:
        quality.main(argv)
    assert exc.value.code == 2 and word in capsys.readouterr().err


def test_a_configuration_that_fails_is_reported_and_the_others_go_on(tiny_cache, one_thread, monkeypatch):
    from hidream_ui.engine.errors import EngineError

    real = quality._Engine

    class Failing(real):
        def __init__(self, profile, device, memory, weights, output_dir):
            if memory == "encoders-cpu":
                raise EngineError("no room for the encoders (test)")
            super().__init__(profile, device, memory, weights, output_dir)

    monkeypatch.setattr(quality, "_Engine", Failing)
    report = quality.run(cases=1, profile="tiny", steps=1, only=["memory:encoders-cpu", "attention:sdpa"])
    rows = report["configurations"]
    assert rows["memory:encoders-cpu"]["error"] == "load failed: no room for the encoders (test)"
    assert "success_rate" not in rows["memory:encoders-cpu"]
    assert rows["attention:sdpa"]["identical_to_exact_cases"] == 1 and report["model_loads"] == 1
    assert "no room for the encoders (test)" in quality_report.format_table(report)


@pytest.mark.slow
def test_the_cli_says_what_it_does_before_the_first_case(monkeypatch, capsys):
    """The loads and warm-up edits come before any case: progress lines on stderr say so (the CLI once sat
    silent for minutes), and stdout keeps only the report. Every load fails here, so nothing runs."""
    from hidream_ui.engine.errors import EngineError

    def no_load(*args, **kwargs):
        raise EngineError("no load in this test")

    monkeypatch.setattr(quality, "_Engine", no_load)
    assert quality.main(["--cases", "1", "--only", "attention:sdpa", "--tiny-profile", "tiny", "--json"]) == 1
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert lines[0].startswith("bench quality: 1 held-out case(s) on cpu: importing torch")
    assert "bench quality: loading the tiny model 1/1 (memory full, weights bf16" in lines[1]
    assert "could not load" in lines[-1] and captured.out == ""
