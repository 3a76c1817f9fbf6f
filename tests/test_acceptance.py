"""`python -m hidream_ui acceptance` end to end on CPU with the tiny model (issue 25)."""

from __future__ import annotations

import json
import zipfile

import torch

from hidream_ui.cli import acceptance


def test_acceptance_end_to_end_on_cpu(tiny_cache, tmp_path, monkeypatch, capsys):
    out = tmp_path / "acc"

    # A step running out of memory is recorded and the run goes on (the MoE step stands in for one).
    def oom(self):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(acceptance.Runner, "moe", oom)
    code = acceptance.main(["--out", str(out), "--steps", "1", "--working-resolution", "draft", "--image-side", "32",
                            "--device", "cpu"])
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
    assert {"report.json", "report.md", "samples/sample-1.png", "samples/sample-2.png",
            "samples/sample-3.png"} <= names


def test_acceptance_names_bad_flags(capsys, tmp_path):
    assert acceptance.main(["--out", str(tmp_path), "--only", "doctor,warp"]) == 2
    assert "warp" in capsys.readouterr().err


def test_acceptance_is_a_command():
    from hidream_ui.__main__ import COMMANDS

    assert COMMANDS["acceptance"][0] == "hidream_ui.cli.acceptance"
