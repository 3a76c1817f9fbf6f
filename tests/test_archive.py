"""archive: the results zip of a batch, and reading a zip of uploaded images safely.

No model here: results are built by hand and saved with the real `save_result`.
"""

from __future__ import annotations

import io
import json
import zipfile

import numpy as np
import pytest
from helpers import run_info
from PIL import Image

from hidream_ui.archive import (
    MANIFEST_NAME,
    ArchiveError,
    ZipLimits,
    read_zip_images,
    sources_from_uploads,
    write_batch_zip,
)
from hidream_ui.edits import EditParams, EditResult, Timings
from hidream_ui.engine.batch import BatchItem, BatchResult
from hidream_ui.outputs import read_metadata, save_result


def png_bytes(seed: int = 0, size=(24, 16)) -> bytes:
    rng = np.random.default_rng(seed)
    buffer = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)).save(buffer, format="PNG")
    return buffer.getvalue()


def edit_result(instruction: str, seed: int, source: str) -> EditResult:
    image = Image.open(io.BytesIO(png_bytes(seed))).convert("RGB")
    params = EditParams(instruction=instruction, seed=seed, num_inference_steps=2).validated()
    return EditResult(
        image=image,
        source_image=image,
        params=params,
        working_size=(256, 176),
        source_size=image.size,
        timings=Timings(total=0.25, denoise=0.2),
        peak_memory_bytes=None,
        info=run_info(),
        source_name=source,
    )


@pytest.fixture
def batch_result(tmp_path) -> BatchResult:
    out = tmp_path / "outputs"
    items = []
    for index, (source, instruction, seed) in enumerate(
        [("a.png", "make it red", 3), ("a.png", "make it blue", 4), ("b.png", "make it red", 5)]
    ):
        result = save_result(edit_result(instruction, seed, source), out)
        items.append(
            BatchItem(
                index=index,
                source_index=index // 2,
                source_name=source,
                instruction=instruction,
                seed=seed,
                status="ok",
                result=result,
                seconds=0.3,
            )
        )
    items.append(
        BatchItem(
            index=3,
            source_index=1,
            source_name="b.png",
            instruction="make it blue",
            seed=6,
            status="error",
            error="out of memory editing 1 image(s)",
        )
    )
    items.append(
        BatchItem(
            index=4,
            source_index=2,
            source_name="c.png",
            instruction="make it red",
            seed=7,
            status="cancelled",
            error="not started: the batch was cancelled",
        )
    )
    return BatchResult(
        items=items,
        rejected=[("notes.txt", "not a recognised image format")],
        cancelled=True,
        seconds=1.5,
        stats={"text_encoder_calls": 3, "transformer_calls": 4, "batch_sizes": {"256x176": 2}},
    )


def test_zip_holds_exactly_images_sidecars_and_a_matching_manifest(batch_result, tmp_path):
    path = write_batch_zip(batch_result, tmp_path / "zips" / "batch.zip")
    assert path == tmp_path / "zips" / "batch.zip" and path.is_file()
    assert not list(path.parent.glob("*.partial"))
    with zipfile.ZipFile(path) as archive:
        names = set(archive.namelist())
        manifest = json.loads(archive.read(MANIFEST_NAME))
        ok = [item for item in batch_result.items if item.status == "ok"]
        expected = {item.result.saved_png.name for item in ok} | {item.result.saved_json.name for item in ok}
        assert names == expected | {MANIFEST_NAME}

        rows = manifest["items"]
        assert [row["index"] for row in rows] == [item.index for item in batch_result.items]
        for item, row in zip(batch_result.items, rows):
            assert (row["source"], row["instruction"], row["seed"], row["status"]) == (
                item.source_name,
                item.instruction,
                item.seed,
                item.status,
            )
            if item.status != "ok":
                assert row["output"] is None and row["sidecar"] is None and row["error"] == item.error
                continue
            # The PNG in the zip is the saved file, byte for byte, so its settings travel with it.
            png = archive.read(row["output"])
            assert png == item.result.saved_png.read_bytes()
            metadata = read_metadata(png)
            assert metadata["params"]["instruction"] == item.instruction
            assert metadata["params"]["seed"] == item.seed
            assert metadata["source_name"] == item.source_name
            assert json.loads(archive.read(row["sidecar"])) == metadata
            assert row["timings"] == item.result.timings.to_dict()
    assert manifest["rejected"] == [{"name": "notes.txt", "reason": "not a recognised image format"}]
    assert manifest["cancelled"] is True
    assert manifest["counts"] == {"ok": 3, "error": 1, "cancelled": 1, "pending": 0}
    assert manifest["stats"]["batch_sizes"] == {"256x176": 2}


def test_pruned_result_is_reencoded_with_its_metadata(batch_result, tmp_path):
    gone = batch_result.items[1].result
    gone.saved_png.unlink()
    gone.saved_json.unlink()
    with zipfile.ZipFile(write_batch_zip(batch_result, tmp_path / "batch.zip")) as archive:
        row = json.loads(archive.read(MANIFEST_NAME))["items"][1]
        assert row["output"] == gone.saved_png.name
        png = archive.read(row["output"])
        metadata = read_metadata(png)
        assert metadata["params"]["seed"] == gone.params.seed
        assert np.array_equal(np.asarray(Image.open(io.BytesIO(png)).convert("RGB")), np.asarray(gone.image))


def make_zip(members: dict[str, bytes], compression=zipfile.ZIP_DEFLATED) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", compression) as archive:
        for name, data in members.items():
            archive.writestr(name, data)
    return buffer.getvalue()


def test_read_zip_images_keeps_images_and_lists_the_rest(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a path-traversal name would land here or above if anything extracted
    data = make_zip(
        {
            "one.png": png_bytes(1),
            "nested/dir/two.png": png_bytes(2),
            "../../evil.png": png_bytes(3),
            "/abs/root.png": png_bytes(4),
            "readme.txt": b"these are my photos",
            "empty.png": b"",
            "__MACOSX/._one.png": b"\x00\x05\x16\x07",
            "nested/": b"",
        }
    )
    before = sorted(p.name for p in tmp_path.parent.iterdir())
    sources, rejected = read_zip_images(data, name="photos.zip")
    assert [s.name for s in sources] == [
        "photos.zip/one.png",
        "photos.zip/nested/dir/two.png",
        "photos.zip/evil.png",
        "photos.zip/abs/root.png",
    ]
    assert sources[0].data == png_bytes(1) and sources[2].data == png_bytes(3)
    reasons = dict(rejected)
    assert set(reasons) == {"photos.zip/readme.txt", "photos.zip/empty.png"}
    assert "not a recognised image" in reasons["photos.zip/readme.txt"]
    assert "empty" in reasons["photos.zip/empty.png"]
    # Nothing was written anywhere: the zip is read in memory only.
    assert list(tmp_path.iterdir()) == []
    assert sorted(p.name for p in tmp_path.parent.iterdir()) == before


def test_zip_bomb_members_are_refused_by_bytes_actually_read():
    bomb = b"\x00" * (2 * 2**20)  # deflates to a few KB
    data = make_zip({"bomb.png": bomb, "fine.png": png_bytes(1)})
    assert len(data) < 64 * 1024
    limits = ZipLimits(max_member_bytes=256 * 1024)
    sources, rejected = read_zip_images(data, name="x.zip", limits=limits)
    assert [s.name for s in sources] == ["x.zip/fine.png"]
    assert rejected[0][0] == "x.zip/bomb.png" and "too large" in rejected[0][1]

    # A central directory that under-states the size: never accepted (the reader counts the bytes it
    # really decompresses, and zipfile stops at the claimed size and then fails the CRC check).
    lying = bytearray(data)
    info = zipfile.ZipFile(io.BytesIO(data)).getinfo("bomb.png")
    central = lying.rfind(b"PK\x01\x02", 0, len(lying))
    while central != -1:
        name_len = int.from_bytes(lying[central + 28 : central + 30], "little")
        if lying[central + 46 : central + 46 + name_len] == b"bomb.png":
            lying[central + 24 : central + 28] = (1000).to_bytes(4, "little")  # uncompressed size field
            break
        central = lying.rfind(b"PK\x01\x02", 0, central)
    assert info.file_size == len(bomb)
    _, rejected = read_zip_images(bytes(lying), name="x.zip", limits=limits)
    assert [name for name, _ in rejected] == ["x.zip/bomb.png"]

    total = ZipLimits(max_member_bytes=2**20, max_total_bytes=len(png_bytes(1)) + 10)
    sources, rejected = read_zip_images(make_zip({"a.png": png_bytes(1), "b.png": png_bytes(2)}), limits=total)
    assert [s.name for s in sources] == ["upload.zip/a.png"]
    assert "split the zip" in rejected[0][1]


def test_unreadable_zip_and_member_count_are_clear_errors():
    with pytest.raises(ArchiveError, match="bad.zip: not a readable zip"):
        read_zip_images(b"PK\x03\x04 definitely not a zip", name="bad.zip")
    many = make_zip({f"{i}.png": b"x" for i in range(5)})
    with pytest.raises(ArchiveError, match="holds 5 files; at most 4"):
        read_zip_images(many, name="many.zip", limits=ZipLimits(max_members=4))


def test_uploads_expand_zips_and_keep_other_files(tmp_path):
    (tmp_path / "photo.png").write_bytes(png_bytes(1))
    (tmp_path / "more.zip").write_bytes(make_zip({"x.png": png_bytes(2), "y.txt": b"text"}))
    (tmp_path / "renamed.bin").write_bytes(make_zip({"z.png": png_bytes(3)}))  # a zip by content
    (tmp_path / "broken.zip").write_bytes(b"not a zip at all")
    uploads = [(name, tmp_path / name) for name in ("photo.png", "more.zip", "renamed.bin", "broken.zip")]
    sources, rejected = sources_from_uploads(uploads)
    assert [s.name for s in sources] == ["photo.png", "more.zip/x.png", "renamed.bin/z.png"]
    assert sources[0].data == tmp_path / "photo.png"  # plain files go to the engine by path
    assert [name for name, _ in rejected] == ["more.zip/y.txt", "broken.zip"]
    assert "not a readable zip" in dict(rejected)["broken.zip"]


def test_the_zips_of_one_upload_share_one_byte_budget(tmp_path):
    member = png_bytes(1)
    zips = []
    for index in range(3):
        path = tmp_path / f"part{index}.zip"
        with zipfile.ZipFile(path, "w") as archive:
            archive.writestr(f"a{index}.png", member)  # distinct zips (one listed twice is read once)
        zips.append((path.name, path))
    # Room for two members in all: the third zip is not read, whatever its own size.
    sources, rejected = sources_from_uploads(zips, limits=ZipLimits(max_total_bytes=2 * len(member)))
    assert [s.name for s in sources] == ["part0.zip/a0.png", "part1.zip/a1.png"]
    assert [name for name, _ in rejected] == ["part2.zip"] and "split the batch" in rejected[0][1]


def test_a_damaged_lzma_member_is_one_rejected_member():
    """LZMA fails on damaged data with its own error type: the member is rejected, the rest read."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr("good.png", png_bytes(3), compress_type=zipfile.ZIP_DEFLATED)
        archive.writestr("bad.png", png_bytes(4), compress_type=zipfile.ZIP_LZMA)
    data = bytearray(buffer.getvalue())
    with zipfile.ZipFile(io.BytesIO(bytes(data))) as archive:
        info = archive.getinfo("bad.png")
    name_len, extra_len = (
        int.from_bytes(data[info.header_offset + 26 : info.header_offset + 28], "little"),
        int.from_bytes(data[info.header_offset + 28 : info.header_offset + 30], "little"),
    )
    start = info.header_offset + 30 + name_len + extra_len
    data[start + 4 : start + 9] = b"\xff" * 5  # the LZMA properties after zip's 4-byte LZMA header
    sources, rejected = read_zip_images(bytes(data), name="mixed.zip")
    assert [s.name for s in sources] == ["mixed.zip/good.png"]
    assert len(rejected) == 1 and rejected[0][0] == "mixed.zip/bad.png" and "cannot be read" in rejected[0][1], rejected
