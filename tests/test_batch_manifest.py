"""`python -m hidream_ui batch --manifest`: on the local pool (the Ray path: tests/test_ray.py)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
from helpers import write_picture
from PIL import Image

from hidream_ui.cli import batch as batch_cli
from hidream_ui.cli.batch_manifest import read_manifest
from hidream_ui.config import AppConfig
from hidream_ui.edits import EditParams, EditRequest, validated_mask
from hidream_ui.engine.pool import EnginePool
from hidream_ui.imaging import open_image, open_mask
from hidream_ui.results import file_sha256

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
    # Every result went through the one save path: its sidecar names the line it came from.
    assert all(
        json.loads(p.with_suffix(".json").read_text())["manifest"]["settings_hash"] in p.name for p in out.glob("*.png")
    )


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


def left_half_mask(path: Path, like: Path) -> None:
    with Image.open(like) as source:
        mask = Image.new("L", source.size, 0)
    mask.paste(255, (0, 0, mask.width // 2, mask.height))
    mask.save(path)


@pytest.mark.slow
def test_a_masked_line_is_saved_as_the_edit_tab_saves_it(folder, tiny_cache, capsys):
    """One save path (issue 53): the mask file the metadata names, `parent`, the sidecar's keys."""
    source, mask_path = folder / "pics" / "p0.png", folder / "pics" / "m.png"
    left_half_mask(mask_path, source)
    line = {"image": "pics/p0.png", "instruction": "make it red", "mask": "pics/m.png", "seed": 5, **FAST}
    manifest = write_manifest(folder, [line, {**line, "mask": "pics/none.png"}])
    summary = run(manifest, folder / "out", capsys)
    by_line = {row["line"]: row for row in rows(folder / "out")}
    assert "mask: no file at" in by_line[2]["error"] and summary["done"] == 1
    png = folder / "out" / by_line[1]["output"]
    meta = json.loads(png.with_suffix(".json").read_text())

    # What the Edit tab hands the engine for the same upload (ui/edit_handlers.py `EditHandlers.run`), saved by it.
    config = AppConfig(device="cpu", output_dir=folder / "edit")
    values = {key: value for key, value in line.items() if key not in ("image", "mask")}
    params = EditParams.from_dict({**EditParams.defaults_for(config.variant).to_dict(), **values})
    params = dataclasses.replace(params, mask=validated_mask(open_mask(mask_path), "m.png")).validated()
    request = EditRequest(open_image(source), params, source_name="p0.png", source_sha256=file_sha256(source))
    tab = EnginePool.for_config(config, limit=1).edit(request.validated())
    reference = json.loads(tab.saved_json.read_text())

    assert set(meta) - {"manifest"} == set(reference) and meta["manifest"]["line"] == 1
    assert meta["params"] == reference["params"] and meta["mask"] == reference["mask"]
    assert meta["parent"] == reference["parent"] == {"file": "p0.png", "sha256": file_sha256(source), "of": "file"}
    mask_file = folder / "out" / meta["mask"]["file"]
    assert mask_file.is_file() and hashlib.sha256(mask_file.read_bytes()).hexdigest() == meta["mask"]["sha256"]
    assert mask_file.read_bytes() == (folder / "edit" / reference["mask"]["file"]).read_bytes()
    assert json.loads(Image.open(png).info["hidream_ui"]) == meta  # the PNG carries the sidecar's metadata
    assert np.array_equal(pixels(png), pixels(tab.saved_png))


@pytest.mark.slow
def test_a_half_saved_item_runs_again_under_its_own_name(folder, tiny_cache, capsys):
    lines = [{"image": "pics/p0.png", "instruction": "make it red", **FAST}]
    out = folder / "out"
    assert run(write_manifest(folder, lines), out, capsys)["done"] == 1
    (png,) = out.glob("*.png")
    whole = pixels(png)
    png.write_bytes(png.read_bytes()[:100])  # a run killed while it saved: a torn PNG, no sidecar
    png.with_suffix(".json").unlink()
    again = run(write_manifest(folder, lines), out, capsys)
    assert again["done"] == 1 and again["skipped"] == 0
    assert sorted(p.name for p in out.glob("*.png")) == [png.name] and np.array_equal(pixels(png), whole)
    assert json.loads(png.with_suffix(".json").read_text())["manifest"]["line"] == 1


def test_ray_flag_without_ray_says_how_to_install(folder, monkeypatch, capsys):
    import sys

    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` then raises ImportError
    manifest = write_manifest(folder, [{"image": "pics/p0.png", "instruction": "x"}])
    code = batch_cli.main(["--manifest", manifest, "--out", str(folder / "out"), "--ray", "auto"])
    summary = json.loads(capsys.readouterr().out)
    assert code == 1 and "pip install 'hidream_ui[ray]'" in summary["error"]
