"""The command-line entry points: help, doctor, edit, make-tiny, bench dispatch."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
from PIL import Image

from hidream_ui import __main__ as cli
from hidream_ui.cli import doctor


def test_help_lists_every_command(capsys):
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    for command in ("app", "edit", "doctor", "bench", "make-tiny"):
        assert command in out


def test_unknown_command_is_an_error(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["paint"])
    assert info.value.code == 2
    assert "unknown command 'paint'" in capsys.readouterr().err


def test_help_does_not_import_torch():
    code = "import sys; from hidream_ui.__main__ import main; main(['--help']); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().endswith("False")


def test_doctor_json_reports_cpu_fp32_and_verified_tiny_model(tiny_cache, capsys):
    assert doctor.main(["--json", "--device", "cpu"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["device"]["type"] == "cpu" and report["dtype"] == "fp32"
    assert report["model"]["kind"] == "tiny" and report["model"]["verified"] is True
    assert report["packages"]["torch"] and report["ok"] is True
    assert any(s["name"] == "sdpa" and s["available"] for s in report["attention"])
    npu = [s for s in report["attention"] if s["name"] == "npu_fusion"][0]
    assert not npu["available"] and npu["reason"]


def test_doctor_names_the_missing_file_and_exits_nonzero(tiny_dir, tmp_path, capsys):
    broken = tmp_path / "models"
    shutil.copytree(tiny_dir, broken)
    missing = broken / "HiDream-I1-Full" / "text_encoder_3" / "config.json"
    missing.unlink()
    assert doctor.main(["--device", "cpu", "--model-dir", str(broken)]) == 1
    out = capsys.readouterr().out
    assert str(missing) in out and "NOT OK" in out


def test_doctor_requested_npu_without_torch_npu_is_a_problem(tiny_cache, capsys):
    assert doctor.main(["--json", "--device", "npu"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert any("torch_npu" in p for p in report["problems"])


@pytest.mark.slow
def test_edit_cli_prints_a_json_summary(tiny_cache, tmp_path, capsys):
    src = tmp_path / "in.png"
    Image.new("RGB", (48, 40), (200, 30, 30)).save(src)
    out = tmp_path / "result.png"
    code = cli.main(
        [
            "edit",
            "--image",
            str(src),
            "--instruction",
            "make it blue",
            "--steps",
            "2",
            "--working-resolution",
            "draft",
            "--device",
            "cpu",
            "--seed",
            "-1",
            "--output-dir",
            str(tmp_path / "outputs"),
            "--out",
            str(out),
        ]
    )
    summary = json.loads(capsys.readouterr().out)
    assert code == 0 and summary["ok"] is True
    assert out.is_file() and Image.open(out).size == (48, 40)
    assert 0 <= summary["seed"] < 2**32 and summary["model_source"] == "tiny" and "noise" in summary["note"]


def test_edit_cli_reports_bad_input_without_traceback(tiny_cache, tmp_path, capsys):
    bad = tmp_path / "bad.png"
    bad.write_bytes(b"not an image at all")
    assert cli.main(["edit", "--image", str(bad), "--instruction", "x", "--device", "cpu"]) == 1
    summary = json.loads(capsys.readouterr().out)
    assert summary["ok"] is False and "bad.png" in summary["error"]


@pytest.mark.slow
def test_make_tiny_cli_twice_gives_identical_bytes(tmp_path):
    import hashlib

    def digest(root):
        return {
            str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*"))
            if p.is_file()
        }

    assert cli.main(["make-tiny", str(tmp_path / "a"), "--seed", "3"]) == 0
    assert cli.main(["make-tiny", str(tmp_path / "b"), "--seed", "3"]) == 0
    a, b = digest(tmp_path / "a"), digest(tmp_path / "b")
    assert a == b and any(k.startswith("HiDream-E1-1/transformer/") for k in a)


def test_bench_without_kind_lists_kinds(capsys):
    assert cli.main(["bench", "--help"]) == 0
    out = capsys.readouterr().out
    for kind in ("load", "edit", "attention", "batch", "app"):
        assert kind in out


def test_the_console_script_runs_the_same_command_table():
    from pathlib import Path

    import tomllib

    pyproject = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text(encoding="utf-8"))
    module_name, _, attribute = pyproject["project"]["scripts"]["hidream-ui"].partition(":")
    import importlib

    assert getattr(importlib.import_module(module_name), attribute) is cli.main


def test_edit_cli_runs_on_the_first_of_devices_not_on_the_auto_device(tmp_path, capsys):
    """`--devices npu:1` (or HIDREAM_DEVICES for the app, inherited here) names where to run: with
    no NPU here the edit must fail naming it, not run quietly on the auto device (the CPU)."""
    src = tmp_path / "in.png"
    Image.new("RGB", (48, 40), (200, 30, 30)).save(src)
    code = cli.main(
        [
            "edit",
            "--image",
            str(src),
            "--instruction",
            "make it blue",
            "--steps",
            "1",
            "--working-resolution",
            "draft",
            "--devices",
            "npu:1",
            "--output-dir",
            str(tmp_path / "out"),
        ]
    )
    summary = json.loads(capsys.readouterr().out)
    assert code == 1 and summary["ok"] is False and "npu" in summary["error"], summary


def test_doctor_says_what_the_offline_model_in_use_can_do(tiny_cache, capsys):
    """The trained default edits its world (the note names its instructions); the random profiles give noise."""
    from hidream_ui.config import from_args
    from hidream_ui.model.tiny import world

    trained = doctor.offline_note(from_args(["--tiny-profile", "trained"], environ={}))
    assert "trained on a world of coloured shapes" in trained and "noise" not in trained
    assert world.instruction_forms("") in trained
    assert doctor.main(["--json", "--device", "cpu", "--tiny-profile", "tiny"]) == 0
    note = json.loads(capsys.readouterr().out)["model"]["note"]
    assert note == doctor.offline_note(from_args(["--tiny-profile", "tiny"], environ={}))
    assert "random-weight" in note and "--tiny-profile tiny" in note


@pytest.mark.slow
def test_edit_cli_names_the_words_the_offline_model_does_not_know(tiny_cache, tmp_path, capsys):
    """On the trained offline model an instruction outside its world still runs; the JSON says which words it
    has never seen (`instruction_note`) beside the usual note on what the model is."""
    from hidream_ui.model.tiny import world

    case = world.example_cases()[0]
    src = tmp_path / "scene.png"
    Image.fromarray(case.source).save(src)
    common = ["--image", str(src), "--steps", "2", "--device", "cpu", "--tiny-profile", "trained"]
    common += ["--output-dir", str(tmp_path / "outputs")]
    assert cli.main(["edit", *common, "--instruction", "make the square pink"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["ok"] and summary["model_source"] == "tiny" and "noise" not in summary["note"]
    assert summary["instruction_note"] == world.vocabulary_note("make the square pink")
    assert cli.main(["edit", *common, "--instruction", "remove the circle"]) == 0
    assert "instruction_note" not in json.loads(capsys.readouterr().out)


def test_plan_plans_the_release_when_nothing_names_a_model(monkeypatch):
    """README's `plan --device-memory 24GB` must not plan the few-MB offline model (every row 0.0 GB)."""
    import argparse

    from hidream_ui.cli.plan import plans_release_by_default

    for name in ("HIDREAM_MODEL_DIR", "HIDREAM_LLAMA", "HIDREAM_I1", "HIDREAM_E1", "HIDREAM_TINY_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    bare = {"model_dir": None, "llama": None, "i1": None, "e1": None, "tiny_profile": None}
    assert plans_release_by_default(argparse.Namespace(**bare))
    assert not plans_release_by_default(argparse.Namespace(**{**bare, "tiny_profile": "trained"}))
    assert not plans_release_by_default(argparse.Namespace(**{**bare, "model_dir": "/models"}))
    monkeypatch.setenv("HIDREAM_TINY_PROFILE", "tiny")
    assert not plans_release_by_default(argparse.Namespace(**bare))
    monkeypatch.delenv("HIDREAM_TINY_PROFILE")
    monkeypatch.setenv("HIDREAM_MODEL_DIR", "/models")
    assert not plans_release_by_default(argparse.Namespace(**bare))


@pytest.mark.slow
def test_plan_with_no_model_named_plans_the_release_at_its_real_size(monkeypatch, capsys):
    from hidream_ui.cli import plan

    monkeypatch.delenv("HIDREAM_TINY_PROFILE", raising=False)
    assert plan.main(["--device-memory", "24GB", "--host-memory", "64GB", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["model"]["kind"] == "release-size" and report["working_size"] == [1024, 1024]
    assert "no --model-dir or --tiny-profile given" in report["model"]["note"]
    assert report["chosen"]["name"] == "encoders-offload" and report["chosen"]["weights"] == "fp8"
    assert min(row["peak"] for row in report["rows"]) > 10**9  # not the offline model's ~0.0 GB
    assert plan.main(["--device-memory", "24GB"]) in (0, 1)  # the text table says what it planned
    out = capsys.readouterr().out
    assert out.startswith("e1.1, the release model at its real size") and "note: no --model-dir" in out
