"""`bench pool` run in-process on the offline tiny model with a few one-step edits: both apps serve
every job, the pool's two engines take jobs at the same time, and the report says so."""

from __future__ import annotations

import json

import pytest

from hidream_ui.bench import pool as bench_pool


@pytest.mark.slow
def test_bench_pool_measures_one_engine_against_two(tiny_cache):
    report = bench_pool.run(profile="tiny", jobs=4, steps=1)
    json.dumps(report)  # JSON-able as it is
    single, pool = report["single"], report["pool"]
    assert single["engines"] == 1 and pool["engines"] == 2
    assert single["jobs_per_engine"] == {"cpu": 4} and single["max_concurrent_jobs"] == 1
    assert pool["jobs_per_engine"] == {"cpu#1": 2, "cpu#2": 2}
    assert pool["two_jobs_ran_at_once"] and pool["overlap_seconds"] > 0
    assert [job["engine"] for job in pool["jobs"]].count("cpu#1") == 2
    assert all(0 <= job["start"] < job["end"] for job in single["jobs"] + pool["jobs"])
    assert report["throughput_ratio"] == round(single["wall_seconds"] / pool["wall_seconds"], 3)
    assert [row["seed"] for row in report["outputs_per_seed"]] == [0, 1, 2, 3]
    # One thread per engine against two for one engine: equal, or off by a rounding step (README).
    assert all(row["max_abs_difference"] <= 2 for row in report["outputs_per_seed"])
    assert report["identical_outputs"] == sum(row["identical"] for row in report["outputs_per_seed"])
