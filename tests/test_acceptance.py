"""`python -m hidream_ui acceptance` end to end on CPU with the tiny model (issue 25)."""

from __future__ import annotations

import json
import zipfile

import pytest
import torch

from hidream_ui.cli import acceptance


@pytest.mark.slow
def test_acceptance_end_to_end_on_cpu(tiny_cache, tmp_path, monkeypatch, capsys):
    out = tmp_path / "acc"

    # A step running out of memory is recorded and the run goes on (the MoE step stands in for one).
    def oom(self):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(acceptance.Runner, "moe", oom)
    code = acceptance.main(
        ["--out", str(out), "--steps", "1", "--working-resolution", "draft", "--image-side", "32", "--device", "cpu"]
    )
    assert code == 0, capsys.readouterr()
    report = json.loads((out / "report.json").read_text(encoding="utf-8"))
    steps = report["steps"]
    assert list(steps) == list(acceptance.STEP_NAMES)
    assert steps["moe"]["status"] == "oom" and "out of memory" in steps["moe"]["error"]
    # What CPU cannot measure is marked so, with the reason.
    assert steps["memory"]["status"] == "skipped" and "accelerator" in steps["memory"]["reason"]
    assert steps["compile"]["status"] == "skipped" and "accelerator" in steps["compile"]["reason"]
    assert not report["summary"]["error"]
    assert steps["doctor"]["status"] == "ok"
    assert steps["exactness"]["status"] == "ok" and len(steps["exactness"]["edits"]) == 2
    assert steps["exactness"]["close"], steps["exactness"]
    assert set(steps["speed"]["settings"]) == {"exact", "fast", "faster"}
    assert all(s["seconds_per_step"] > 0 for s in steps["speed"]["settings"].values())
    strategies = steps["attention"]["strategies"]
    assert strategies["sdpa"]["status"] == "ok" and strategies["sdpa"]["seconds_per_step"] > 0
    assert strategies["sdpa_flash"]["status"] == "skipped" and strategies["sdpa_flash"]["reason"]
    assert len(steps["samples"]["images"]) == 3
    md = (out / "report.md").read_text(encoding="utf-8")
    assert "| memory | skipped |" in md and "| moe | oom |" in md
    with zipfile.ZipFile(out / "acceptance.zip") as archive:
        names = set(archive.namelist())
    assert {"report.json", "report.md", "samples/sample-1.png", "samples/sample-2.png", "samples/sample-3.png"} <= names


def test_acceptance_names_bad_flags(capsys, tmp_path):
    assert acceptance.main(["--out", str(tmp_path), "--only", "doctor,warp"]) == 2
    assert "warp" in capsys.readouterr().err


def test_acceptance_is_a_command():
    from hidream_ui.__main__ import COMMANDS

    assert COMMANDS["acceptance"][0] == "hidream_ui.cli.acceptance"


@pytest.mark.slow
def test_memory_step_on_an_accelerator_measures_each_fitting_plan(tiny_cache, monkeypatch):
    """The memory step's flow where an accelerator is (faked: no edit runs): plans that do not fit are skipped
    with the planner's reason, each fitting plan gets its own engine, an OOM in one is recorded and the next
    still runs, and the prediction is taken at the size the edit ran at."""
    import argparse
    import dataclasses as dc

    from hidream_ui.config import AppConfig
    from hidream_ui.device import detect
    from hidream_ui.device.backends import DeviceInfo
    from hidream_ui.model import planner
    from hidream_ui.model.planner import PlanChoice, PlanEstimate

    gpu = DeviceInfo(type="cuda", index=0, torch_device="cuda:0", name="fake")
    monkeypatch.setattr(detect, "resolve_device", lambda name, backends=None: gpu)
    monkeypatch.setattr(detect, "resolve_dtype", lambda name, device: torch.bfloat16)
    rows = (
        PlanEstimate("full", "bf16", 90, 0, 1.0, {}, fits=False),
        PlanEstimate("full", "fp8", 60, 0, 1.0, {}, fits=True),
        PlanEstimate("blocks", "fp8", 10, 40, 0.5, {}, fits=True),
        PlanEstimate("sequential", "bf16", 5, 60, 0.15, {}, fits=False, note="needs 60 GB of host RAM"),
    )
    asked = {}
    monkeypatch.setattr(
        planner,
        "plan_for",
        lambda config, device, dtype: (
            asked.update(memory=config.memory, weights=config.weights)
            or PlanChoice(rows=rows, chosen=None, refusal=None, free=80)
        ),
    )
    monkeypatch.setattr(
        planner,
        "estimate",
        lambda sizes, plan, weights, size, element, prefetch: dc.make_dataclass("E", ["peak"])(
            peak={"full": 66, "blocks": 11}[plan] * size[0]
        ),
    )
    config = AppConfig(device="cuda", memory="full", weights="bf16")
    args = argparse.Namespace(image=None, image_side=32, steps=1, working_resolution="draft")
    runner = acceptance.Runner(config, args)
    engines = []
    monkeypatch.setattr(acceptance.Runner, "engine", lambda self, **changes: engines.append(changes) or changes)

    def timed(self, engine, **params):
        if engine["memory"] == "full":
            raise torch.OutOfMemoryError("CUDA out of memory")
        return {"seconds_per_step": 0.5, "working_size": [2, 2], "peak_memory_bytes": 20}

    monkeypatch.setattr(acceptance.Runner, "timed", timed)
    out = acceptance._guarded(runner.memory)
    assert asked == {"memory": "auto", "weights": "auto"}  # every plan, not only the configured one
    by_plan = {(p["plan"], p["weights"]): p for p in out["plans"]}
    assert by_plan[("full", "bf16")]["status"] == "skipped" and "does not fit" in by_plan[("full", "bf16")]["reason"]
    assert by_plan[("sequential", "bf16")]["reason"] == "needs 60 GB of host RAM"
    assert by_plan[("full", "fp8")]["status"] == "oom"
    blocks = by_plan[("blocks", "fp8")]
    assert blocks["status"] == "ok" and blocks["predicted_peak"] == 22 and blocks["measured_peak"] == 20
    assert blocks["predicted_over_measured"] == 1.1
    assert engines == [{"memory": "full", "weights": "fp8"}, {"memory": "blocks", "weights": "fp8"}]
