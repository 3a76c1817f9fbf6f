"""`python -m hidream_ui batch --manifest`: on the local pool (the Ray path: tests/test_ray.py)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from helpers import write_picture
from PIL import Image

from hidream_ui.cli import batch as batch_cli
from hidream_ui.cli.batch_manifest import MASK_UNSUPPORTED, mask_supported, read_manifest
from hidream_ui.config import AppConfig

FAST = {"num_inference_steps": 2, "working_resolution": "draft"}


def write_manifest(folder, lines) -> str:
    path = folder / "manifest.jsonl"
    path.write_text("\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines) + "\n")
    return str(path)


def run(manifest, out, capsys, *extra) -> dict:
    code = batch_cli.main(["--manifest", manifest, "--out", str(out), "--device", "cpu", *extra])
    captured = capsys.readouterr()
    summary = json.loads(captured.out)
    assert (code == 0) == summary["ok"]
    summary["stderr"] = captured.err
    return summary


def rows(out) -> list[dict]:
    return [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]


def pixels(path) -> np.ndarray:
    return np.asarray(Image.open(path).convert("RGB"))


@pytest.fixture()
def folder(tmp_path):
    (tmp_path / "pics").mkdir()
    for seed in range(2):
        write_picture(tmp_path / "pics" / f"p{seed}.png", seed=seed)
    return tmp_path


def test_bad_lines_are_reported_with_their_number_and_skipped(folder, tiny_cache, capsys):
    manifest = write_manifest(
        folder,
        [
            {"image": "pics/p0.png", "instruction": "make it red", **FAST},
            "{not json",
            {"image": "pics/nowhere.png", "instruction": "x"},
            {"image": "pics/p1.png", "instruction": "x", "guidance_scale": 99},
            {"image": "pics/p1.png", "instruction": "x", "guidanse_scale": 2},
            "[1, 2]",
            "",
            {"image": "pics/p1.png", **FAST},
        ],
    )
    summary = run(manifest, folder / "out", capsys)
    assert summary["done"] == 1 and summary["bad_lines"] == 6 and not summary["ok"]
    by_line = {row["line"]: row for row in rows(folder / "out")}
    assert by_line[1]["status"] == "ok" and (folder / "out" / by_line[1]["output"]).is_file()
    expected = {
        2: "not JSON",
        3: "no file at",
        4: "guidance_scale: got 99",
        5: "unknown key(s) 'guidanse_scale'",
        6: "expected a JSON object",
        8: "instruction",
    }
    for line, words in expected.items():
        assert by_line[line]["status"] == "error" and by_line[line]["error"].startswith(f"line {line}: ")
        assert words in by_line[line]["error"], by_line[line]
        assert f"line {line}: " in summary["stderr"]
    assert 7 not in by_line  # a blank line is no item; line numbers still count it
    metadata = json.loads((folder / "out" / by_line[1]["output"]).with_suffix(".json").read_text())
    assert metadata["params"]["instruction"] == "make it red" and metadata["manifest"]["line"] == 1


def test_rerun_skips_finished_items_and_a_changed_setting_runs_again(folder, tiny_cache, capsys):
    lines = [
        {"image": "pics/p0.png", "instruction": "make it red", **FAST},
        {"image": f"{folder}/pics/p1.png", "instruction": "make it blue", "seed": 7, **FAST},
    ]
    out = folder / "out"
    first = run(write_manifest(folder, lines), out, capsys)
    assert first["done"] == 2 and first["skipped"] == 0 and first["ok"]
    outputs = sorted(p.name for p in out.glob("*.png"))
    stamps = {name: (out / name).stat().st_mtime_ns for name in outputs}

    again = run(write_manifest(folder, lines), out, capsys)
    assert again["done"] == 0 and again["skipped"] == 2
    assert "skipping 2 finished item(s)" in again["stderr"]
    assert {row["status"] for row in rows(out)} == {"skipped"}
    assert {name: (out / name).stat().st_mtime_ns for name in outputs} == stamps  # nothing rewritten

    lines[1]["seed"] = 8  # another seed: another settings hash, one new output
    third = run(write_manifest(folder, lines), out, capsys)
    assert third["done"] == 1 and third["skipped"] == 1
    assert len(list(out.glob("*.png"))) == 3
    # A PNG half written by a killed run never counts as finished: only the renamed file does.
    assert not list(out.glob(".*.partial"))


def test_identical_settings_give_identical_pngs(folder, tiny_cache, capsys):
    line = {"image": "pics/p0.png", "instruction": "make it red", "seed": 11, **FAST}
    manifest = write_manifest(folder, [{**line, "id": "a"}, {**line, "id": "b"}, {**line, "seed": 12, "id": "c"}])
    summary = run(manifest, folder / "out", capsys)
    assert summary["done"] == 3
    by_id = {row["input"]["id"]: folder / "out" / row["output"] for row in rows(folder / "out")}
    assert by_id["a"].name.split("-")[-1] == by_id["b"].name.split("-")[-1]  # same settings hash
    assert np.array_equal(pixels(by_id["a"]), pixels(by_id["b"]))
    assert not np.array_equal(pixels(by_id["a"]), pixels(by_id["c"]))  # the seed matters: the check can fail


def test_random_seed_is_drawn_from_the_line_so_a_rerun_finds_it(folder):
    manifest = write_manifest(folder, [{"image": "pics/p0.png", "instruction": "x", "seed": -1}])
    config = AppConfig(device="cpu")
    (first,), _ = read_manifest(Path(manifest), config)
    (second,), _ = read_manifest(Path(manifest), config)
    assert first.params.seed == second.params.seed != -1 and first.stem == second.stem


def test_mask_is_checked_and_reported_until_edits_take_one(folder, tiny_cache, capsys):
    write_picture(folder / "pics" / "m.png", seed=5)
    manifest = write_manifest(
        folder,
        [
            {"image": "pics/p0.png", "instruction": "x", "mask": "pics/m.png", **FAST},
            {"image": "pics/p0.png", "instruction": "x", "mask": "pics/none.png"},
        ],
    )
    summary = run(manifest, folder / "out", capsys)
    by_line = {row["line"]: row for row in rows(folder / "out")}
    assert "mask: no file at" in by_line[2]["error"]
    if not mask_supported():
        assert by_line[1]["status"] == "error" and by_line[1]["error"] == MASK_UNSUPPORTED
        assert summary["done"] == 0
    else:
        assert by_line[1]["status"] == "ok"


def test_ray_flag_without_ray_says_how_to_install(folder, monkeypatch, capsys):
    import sys

    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` then raises ImportError
    manifest = write_manifest(folder, [{"image": "pics/p0.png", "instruction": "x"}])
    code = batch_cli.main(["--manifest", manifest, "--out", str(folder / "out"), "--ray", "auto"])
    summary = json.loads(capsys.readouterr().out)
    assert code == 1 and "pip install 'hidream_ui[ray]'" in summary["error"]
