"""outputs: PNG + sidecar saving, reading settings back, unique names, retention."""

from __future__ import annotations

import datetime as dt
import io
import json

import numpy as np
import pytest
from helpers import run_info
from PIL import Image

from hidream_ui.edits import EditParams, EditResult, Timings
from hidream_ui.imaging import ImageError
from hidream_ui.outputs import (
    METADATA_KEY,
    SUMMARY_KEY,
    MetadataError,
    load_settings,
    read_metadata,
    save_result,
    write_sidecar,
)

NOON = dt.datetime(2025, 1, 2, 12, 0, 0)


def _result(seed: int = 11, instruction: str = "make the sky purple", colour_seed: int = 0) -> EditResult:
    rng = np.random.default_rng(colour_seed)
    image = Image.fromarray(rng.integers(0, 256, (24, 40, 3), dtype=np.uint8))
    params = EditParams(
        instruction=instruction,
        guidance_scale=4.25,
        num_inference_steps=9,
        seed=seed,
        working_resolution="draft",
        clip_cfg_norm=False,
    ).validated()
    return EditResult(
        image=image,
        source_image=image,
        params=params,
        working_size=(512, 304),
        source_size=(40, 24),
        timings=Timings(total=0.5),
        peak_memory_bytes=None,
        info=run_info(dtype="torch.float32"),
        source_name="cat.png",
    )


def _ours(directory):
    return sorted(p.name for p in directory.glob("*.png"))


def test_save_read_load_round_trip(tmp_path):
    result = _result()
    saved = save_result(result, tmp_path / "out")
    assert saved is not result and result.saved_png is None
    assert saved.saved_png.parent == tmp_path / "out" and saved.saved_png.suffix == ".png"
    assert saved.saved_json == saved.saved_png.with_suffix(".json")
    expected = result.metadata()

    for source in (saved.saved_png, str(saved.saved_png), saved.saved_png.read_bytes(), saved.saved_json):
        assert read_metadata(source) == expected
    with Image.open(saved.saved_png) as image:
        assert read_metadata(image) == expected
        assert np.array_equal(np.asarray(image.convert("RGB")), np.asarray(result.image))
    assert load_settings(saved.saved_png) == result.params
    assert load_settings(saved.saved_json) == result.params


def test_png_chunks_and_sidecar_content(tmp_path):
    saved = save_result(_result(seed=4242), tmp_path)
    with Image.open(saved.saved_png) as image:
        chunks = dict(image.text)
    assert json.loads(chunks[METADATA_KEY]) == saved.metadata()
    summary = chunks[SUMMARY_KEY]
    assert "\n" not in summary
    assert summary.startswith("make the sky purple | Negative: low resolution, blur | ")
    assert "Seed: 4242" in summary and "Steps: 9" in summary and "Size: 512x304" in summary
    sidecar = json.loads(saved.saved_json.read_text(encoding="utf-8"))
    assert sidecar == saved.metadata()
    assert sidecar["format"] == "hidream_ui/1"
    assert sidecar["params"]["seed"] == 4242 and sidecar["source_name"] == "cat.png"
    assert sidecar["working_size"] == [512, 304] and sidecar["device"] == "cpu"
    assert "-s4242-" in saved.saved_png.name


def test_non_latin_instruction_round_trips(tmp_path):
    saved = save_result(_result(instruction="把天空变成紫色\n  please"), tmp_path)
    assert load_settings(saved.saved_png).instruction == "把天空变成紫色\n  please"
    with Image.open(saved.saved_png) as image:
        assert image.text[SUMMARY_KEY].startswith("把天空变成紫色 please |")


def test_unique_names_in_the_same_instant(tmp_path):
    result = _result()
    first = save_result(result, tmp_path, now=NOON)
    second = save_result(result, tmp_path, now=NOON)  # same time, same content, same hash
    third = save_result(result, tmp_path)  # real clock, back to back
    fourth = save_result(result, tmp_path)
    paths = [r.saved_png for r in (first, second, third, fourth)]
    assert len(set(paths)) == 4 and all(p.is_file() for p in paths)
    assert second.saved_png.name == first.saved_png.stem + "-1.png"
    assert all(read_metadata(p) == result.metadata() for p in paths)


def test_never_overwrites_foreign_files(tmp_path):
    (tmp_path / "mine.png").write_bytes(b"someone else's picture")
    saved = save_result(_result(), tmp_path, stem="mine")
    assert saved.saved_png.name == "mine-1.png"
    assert (tmp_path / "mine.png").read_bytes() == b"someone else's picture"

    (tmp_path / "other.json").write_text('{"not": "ours"}')
    saved = save_result(_result(), tmp_path, stem="other")
    assert (saved.saved_png.name, saved.saved_json.name) == ("other-1.png", "other-1.json")
    assert not (tmp_path / "other.png").exists()  # no orphan PNG left behind
    assert (tmp_path / "other.json").read_text() == '{"not": "ours"}'


def test_retention_deletes_only_the_oldest_of_ours(tmp_path):
    # Not ours: any name, a pattern-matching PNG without our metadata, and a JPEG.
    Image.new("RGB", (20, 20)).save(tmp_path / "holiday.png")
    impostor = tmp_path / "20000101-000000-000000-s1-deadbeef.png"
    Image.new("RGB", (20, 20)).save(impostor)
    (tmp_path / "20000101-000000-000000-s1-deadbeef.json").write_text("{}")
    (tmp_path / "notes.json").write_text("{}")

    saved = [
        save_result(_result(seed=i, colour_seed=i), tmp_path, retention=2, now=NOON + dt.timedelta(seconds=i))
        for i in range(4)
    ]
    # Make the oldest remaining one's sidecar foreign: retention must delete its PNG only.
    saved[2].saved_json.write_text('{"owner": "someone else"}')
    newest = save_result(_result(seed=9, colour_seed=9), tmp_path, retention=2, now=NOON + dt.timedelta(hours=1))

    remaining = set(_ours(tmp_path))
    assert remaining == {"holiday.png", impostor.name, saved[3].saved_png.name, newest.saved_png.name}
    for old in saved[:3]:
        assert not old.saved_png.exists()
    assert not saved[0].saved_json.exists() and not saved[1].saved_json.exists()
    assert saved[2].saved_json.read_text() == '{"owner": "someone else"}'
    assert (tmp_path / "notes.json").exists() and impostor.with_suffix(".json").exists()
    assert saved[3].saved_json.exists() and newest.saved_json.exists()


def test_retention_none_keeps_everything(tmp_path):
    for i in range(3):
        save_result(_result(seed=i), tmp_path, retention=None, now=NOON + dt.timedelta(seconds=i))
    assert len(_ours(tmp_path)) == 3


@pytest.mark.parametrize(
    "kwargs", [{"retention": 0}, {"retention": -3}, {"retention": True}, {"stem": "a/b"}, {"stem": ".."}]
)
def test_bad_save_arguments(tmp_path, kwargs):
    with pytest.raises(ValueError):
        save_result(_result(), tmp_path, **kwargs)


def test_read_metadata_without_ours_is_a_clear_error(tmp_path):
    plain = io.BytesIO()
    Image.new("RGB", (20, 20)).save(plain, "PNG")
    with pytest.raises(MetadataError, match="no hidream_ui settings"):
        read_metadata(plain.getvalue())
    jpeg = tmp_path / "photo.jpg"
    Image.new("RGB", (20, 20)).save(jpeg)
    with pytest.raises(MetadataError, match=r"^photo\.jpg: this image has no hidream_ui settings"):
        load_settings(jpeg)
    with pytest.raises(ImageError, match="not a readable image"):
        read_metadata(b"definitely not a png")
    with pytest.raises(ValueError):  # ImageError and MetadataError are both ValueErrors
        read_metadata(tmp_path / "missing.png")


def test_read_metadata_rejects_broken_or_foreign_metadata(tmp_path):
    saved = save_result(_result(), tmp_path)
    meta = json.loads(saved.saved_json.read_text())
    newer = tmp_path / "newer.json"
    newer.write_text(json.dumps({**meta, "format": "hidream_ui/9"}))
    with pytest.raises(MetadataError, match="hidream_ui/9"):
        read_metadata(newer)
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    with pytest.raises(MetadataError, match="not valid JSON"):
        read_metadata(broken)
    bad_params = tmp_path / "bad.json"
    bad_params.write_text(json.dumps({**meta, "params": {**meta["params"], "seed": "abc"}}))
    with pytest.raises(ValueError, match="seed"):
        load_settings(bad_params)


def test_write_sidecar(tmp_path):
    meta = _result().metadata()
    path = write_sidecar(tmp_path / "a.json", meta)
    text = path.read_text(encoding="utf-8")
    assert json.loads(text) == meta and text.endswith("\n")
    with pytest.raises(FileExistsError):
        write_sidecar(path, {"format": "hidream_ui/1"})
    write_sidecar(path, {"x": 1}, exclusive=False)
    assert json.loads(path.read_text()) == {"x": 1}
    with pytest.raises(ValueError):
        write_sidecar(tmp_path / "nan.json", {"x": float("nan")})


def test_extra_metadata_is_added_and_may_not_replace_the_results_own(tmp_path):
    saved = save_result(_result(), tmp_path, stem="item-0123", extra={"manifest": {"line": 3}})
    assert saved.saved_png.name == "item-0123.png"
    assert json.loads(saved.saved_json.read_text())["manifest"] == {"line": 3} == saved.saved_metadata["manifest"]
    assert read_metadata(saved.saved_png)["manifest"] == {"line": 3}
    with pytest.raises(ValueError, match="'params'"):
        save_result(_result(), tmp_path, stem="other", extra={"params": {}})
    assert not (tmp_path / "other.png").exists()


def test_retention_keeps_a_mask_that_a_manifest_result_still_names(tmp_path):
    """Manifest outputs (`<id>-<hash>`) are never pruned, so the mask they name must stay."""
    named = '{"format": "hidream_ui/1", "mask": {"file": "mask-0123456789abcdef.png"}}\n'
    (tmp_path / "mask-0123456789abcdef.png").write_bytes(b"mask")
    for i in range(2):
        saved = save_result(_result(seed=i), tmp_path, retention=None, now=NOON + dt.timedelta(seconds=i))
        if i == 0:
            saved.saved_json.write_text(named)  # the oldest timestamped result names the mask
    (tmp_path / "item-0123456789abcdef.json").write_text(named)  # and so does a manifest result
    newest = save_result(_result(seed=9), tmp_path, retention=1, now=NOON + dt.timedelta(hours=1))
    assert [name for name in _ours(tmp_path) if not name.startswith("mask-")] == [newest.saved_png.name]
    assert (tmp_path / "mask-0123456789abcdef.png").is_file()


def test_metadata_nested_too_deeply_is_a_clear_error_not_a_recursion_crash(tmp_path):
    from PIL import PngImagePlugin

    info = PngImagePlugin.PngInfo()
    info.add_text("hidream_ui", "[" * 100_000)
    png = io.BytesIO()
    Image.new("RGB", (20, 20)).save(png, "PNG", pnginfo=info)
    with pytest.raises(MetadataError, match="nested too deeply"):
        read_metadata(png.getvalue())
    sidecar = tmp_path / "deep.json"
    sidecar.write_text("[" * 100_000)
    with pytest.raises(MetadataError, match="nested too deeply"):
        read_metadata(sidecar)
