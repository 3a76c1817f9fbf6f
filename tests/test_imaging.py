"""imaging: opening and normalising real generated files, and the working-size rules."""

from __future__ import annotations

import io
import math
import random
import struct
import zlib

import numpy as np
import pytest
from PIL import Image, ImageFile

from hidream_ui.geometry import (
    WorkingPlan,
    e11_plan,
    e11_working_size,
    prepare_working_image,
    restore_size,
    to_working_size,
)
from hidream_ui.imaging import ImageError, open_image

RED, BLUE, WHITE = (255, 0, 0), (0, 0, 255), (255, 255, 255)


def _encode(image: Image.Image, fmt: str = "PNG", **kwargs) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **kwargs)
    return buffer.getvalue()


def _noise(size=(64, 48), mode="RGB", seed=0) -> Image.Image:
    rng = np.random.default_rng(seed)
    channels = {"RGB": 3, "L": None}[mode]
    shape = (size[1], size[0]) if channels is None else (size[1], size[0], channels)
    return Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8))


def _png_claiming(width: int, height: int, bit_depth: int = 1, colour_type: int = 0) -> bytes:
    """A PNG whose header claims width x height; the pixel data is a token. Cheap bomb stand-in."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, bit_depth, colour_type, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")


def _px(image: Image.Image, xy) -> tuple[int, int, int]:
    return image.getpixel(xy)


def _close(a, b, tol=3) -> bool:
    return all(abs(x - y) <= tol for x, y in zip(a, b))


# --- inputs of every kind -------------------------------------------------------------------------


def test_accepts_bytes_path_str_fileobj_pil_and_numpy(tmp_path):
    source = _noise()
    data = _encode(source)
    path = tmp_path / "noise.png"
    path.write_bytes(data)
    expected = np.asarray(source)
    with path.open("rb") as fp:
        from_file = open_image(fp)
    results = [
        open_image(data),
        open_image(bytearray(data)),
        open_image(path),
        open_image(str(path)),
        from_file,
        open_image(source),
        open_image(expected),
    ]
    for image in results:
        assert image.mode == "RGB" and image.size == (64, 48)
        assert np.array_equal(np.asarray(image), expected)
    assert results[5] is not source  # the caller's image is never handed back or modified


def test_numpy_shapes_and_dtypes():
    grey = np.full((20, 30), 77, np.uint8)
    assert _px(open_image(grey), (0, 0)) == (77, 77, 77)
    assert _px(open_image(grey[:, :, None]), (5, 5)) == (77, 77, 77)
    rgba = np.zeros((20, 30, 4), np.uint8)
    rgba[..., 0] = 255
    rgba[:, :15, 3] = 255  # left opaque red, right fully transparent
    image = open_image(rgba)
    assert _px(image, (0, 0)) == RED and _px(image, (29, 0)) == WHITE
    floats = np.full((20, 30, 3), 0.5, np.float32)
    assert _close(_px(open_image(floats), (0, 0)), (128, 128, 128), 1)
    wide = np.full((20, 30), 65535, np.uint16)
    assert _px(open_image(wide), (0, 0)) == WHITE
    with pytest.raises(ImageError, match="H x W"):
        open_image(np.zeros((20, 30, 5), np.uint8))
    with pytest.raises(ImageError, match="H x W"):
        open_image(np.zeros((20,), np.uint8))
    with pytest.raises(ImageError, match="dtype"):
        open_image(np.zeros((20, 30), np.complex64))


def test_unsupported_source_type():
    with pytest.raises(ImageError, match="cannot read an image from a int"):
        open_image(42)


# --- damaged and hostile files --------------------------------------------------------------------


def test_corrupt_bytes_name_the_file():
    with pytest.raises(ImageError, match=r"^photo\.png: not a recognised image format"):
        open_image(b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4, name="photo.png")
    with pytest.raises(ImageError, match="empty"):
        open_image(b"", name="x.png")


def test_text_file_is_rejected(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("this is not an image\n" * 20)
    with pytest.raises(ImageError, match=r"^notes\.txt: not a recognised image format"):
        open_image(path)


def test_missing_file(tmp_path):
    with pytest.raises(ImageError, match="gone.png"):
        open_image(tmp_path / "gone.png")


@pytest.mark.parametrize("fmt", ["PNG", "JPEG"])
def test_truncated_file_is_detected_by_full_decode(fmt):
    data = _encode(_noise((256, 256)), fmt)
    # The header is intact, so a lazy open() alone would succeed; only load() finds the damage.
    _ = Image.open(io.BytesIO(data[: len(data) // 2])).size
    with pytest.raises(ImageError, match=r"^half\.img: cannot decode the image"):
        open_image(data[: len(data) // 2], name="half.img")
    assert ImageFile.LOAD_TRUNCATED_IMAGES is False  # we did not flip the global to get here


def test_bomb_over_our_limit_is_rejected_from_the_header():
    limit_before = Image.MAX_IMAGE_PIXELS
    # 8000 x 8000 is below PIL's own limits: only our per-call check stops it.
    with pytest.raises(ImageError) as info:
        open_image(_png_claiming(8000, 8000), name="bomb.png")
    message = str(info.value)
    assert message.startswith("bomb.png: the image is too large")
    assert "8000x8000" in message and "64,000,000 pixels" in message and "40,000,000" in message
    assert Image.MAX_IMAGE_PIXELS == limit_before


def test_bomb_over_pils_hard_limit_gets_our_message():
    with pytest.raises(ImageError) as info:
        open_image(_png_claiming(20000, 20000), name="huge.png")
    assert "400,000,000 pixels" in str(info.value) and "40,000,000" in str(info.value)


def test_real_one_bit_bomb_and_per_call_limit():
    data = _encode(Image.new("1", (7000, 7000)))  # 49 MP, a few KB on disk
    assert len(data) < 100_000
    with pytest.raises(ImageError, match="49,000,000 pixels"):
        open_image(data)
    # The limit is per call: the same file passes with a higher limit, and a small one fails a
    # small image, without touching PIL's global.
    assert open_image(_encode(Image.new("1", (300, 200))), max_pixels=60_000).size == (300, 200)
    with pytest.raises(ImageError, match="the limit is 59,999 pixels"):
        open_image(_encode(Image.new("1", (300, 200))), max_pixels=59_999)


@pytest.mark.parametrize("size", [(1, 1), (15, 400), (400, 15)])
def test_too_small_is_rejected_with_the_minimum(size):
    with pytest.raises(ImageError, match=rf"{size[0]}x{size[1]} px; the minimum is 16 px"):
        open_image(_encode(Image.new("RGB", size)))


def test_min_side_is_configurable():
    assert open_image(_encode(Image.new("RGB", (8, 8))), min_side=8).size == (8, 8)


# --- orientation and colour modes ------------------------------------------------------------------


def test_exif_orientation_6_rotates_and_swaps_size():
    image = Image.new("RGB", (80, 40), RED)
    image.paste(Image.new("RGB", (40, 40), BLUE), (40, 0))  # left red, right blue
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90 CW to display"
    data = _encode(image, "JPEG", exif=exif.tobytes(), quality=95)
    assert Image.open(io.BytesIO(data)).size == (80, 40)
    out = open_image(data)
    assert out.size == (40, 80)
    # Clockwise: the left edge becomes the top edge.
    assert _close(_px(out, (20, 5)), RED, 30) and _close(_px(out, (20, 75)), BLUE, 30)


def test_palette_with_transparency_composites_on_white():
    image = Image.new("P", (32, 32), 0)
    image.putpalette([255, 0, 0, 0, 0, 255] + [0] * 762)
    image.paste(1, (16, 0, 32, 32))
    data = _encode(image, transparency=1)  # palette index 1 (blue) is transparent
    out = open_image(data)
    assert _px(out, (0, 0)) == RED and _px(out, (31, 31)) == WHITE


def test_palette_gif_without_transparency():
    image = Image.new("P", (32, 32), 0)
    image.putpalette([0, 255, 0] + [0] * 765)
    assert _px(open_image(_encode(image, "GIF")), (3, 3)) == (0, 255, 0)


def test_greyscale_and_one_bit():
    assert _px(open_image(_encode(Image.new("L", (20, 20), 90))), (1, 1)) == (90, 90, 90)
    one = Image.new("1", (20, 20), 0)
    one.paste(1, (10, 0, 20, 20))
    out = open_image(_encode(one))
    assert _px(out, (0, 0)) == (0, 0, 0) and _px(out, (19, 0)) == WHITE


def test_la_and_rgba_alpha_is_composited_on_white():
    la = Image.new("LA", (20, 20), (0, 0))  # black, fully transparent
    la.paste((0, 255), (0, 0, 10, 20))  # left half opaque black
    out = open_image(_encode(la))
    assert _px(out, (0, 0)) == (0, 0, 0) and _px(out, (19, 0)) == WHITE
    rgba = Image.new("RGBA", (20, 20), (0, 0, 0, 128))  # half-transparent black over white
    assert _close(_px(open_image(_encode(rgba)), (5, 5)), (127, 127, 127), 1)


def test_cmyk_jpeg_becomes_rgb():
    cmyk = Image.new("CMYK", (32, 32), (0, 255, 255, 0))  # red in CMYK
    cmyk.paste((0, 0, 0, 0), (16, 0, 32, 32))  # white
    data = _encode(cmyk, "JPEG", quality=95)
    assert Image.open(io.BytesIO(data)).mode == "CMYK"
    out = open_image(data)
    assert out.mode == "RGB"
    assert _close(_px(out, (4, 16)), RED, 40) and _close(_px(out, (28, 16)), WHITE, 40)


def test_sixteen_bit_greyscale_is_scaled_not_clipped():
    values = np.zeros((20, 30), np.uint16)
    values[:, :10] = 65535
    values[:, 10:20] = 65000
    values[:, 20:] = 32768
    data = _encode(Image.fromarray(values))
    assert Image.open(io.BytesIO(data)).mode.startswith("I")
    out = open_image(data)
    assert _px(out, (0, 0)) == WHITE
    assert _px(out, (15, 0))[0] in (252, 253)  # 65000 / 257 = 252.9, clipping would give 255
    assert _px(out, (25, 0))[0] in (127, 128)


def test_int32_and_float_modes():
    as_int = Image.fromarray(np.full((20, 20), 200, np.int32))
    assert as_int.mode == "I"
    assert _px(open_image(as_int), (0, 0)) == (200, 200, 200)  # 8-bit data in an "I" image
    wide_int = Image.fromarray(np.full((20, 20), 65535, np.int32))
    assert _px(open_image(wide_int), (0, 0)) == WHITE
    as_float = Image.fromarray(np.full((20, 20), 0.25, np.float32))
    assert as_float.mode == "F"
    assert _px(open_image(as_float), (0, 0))[0] in (63, 64)
    ramp = Image.fromarray(np.linspace(-1000, 1000, 400, dtype=np.float32).reshape(20, 20))
    out = np.asarray(open_image(ramp))[..., 0]
    assert out.min() == 0 and out.max() == 255  # out-of-range floats are stretched, not clipped


def test_animated_gif_gives_first_frame():
    frames = [Image.new("RGB", (24, 24), RED), Image.new("RGB", (24, 24), BLUE)]
    data = _encode(frames[0], "GIF", save_all=True, append_images=frames[1:], duration=50)
    assert Image.open(io.BytesIO(data)).n_frames == 2
    assert _close(_px(open_image(data), (5, 5)), RED, 8)


# --- working sizes ------------------------------------------------------------------------------


def test_square_1024_is_unchanged():
    source = _noise((1024, 1024))
    out, plan = prepare_working_image(source, variant="e1.1")
    assert plan == WorkingPlan((1024, 1024), 0, (1024, 1024), (0, 0, 1024, 1024), (1024, 1024))
    assert np.array_equal(np.asarray(out), np.asarray(source)) and out is not source
    assert e11_working_size(1024, 1024) == (1024, 1024)


def test_halving_for_5000x4000():
    source = Image.new("RGB", (5000, 4000), (10, 200, 30))
    out, plan = prepare_working_image(source, variant="e1.1", image_size=1024)
    assert plan.halvings == 1 and plan.halved_size == (2500, 2000)
    # 2500x2000 scaled to 1 MP: 1144.9 x 915.9 -> 1136 x 912 on the 16-px grid.
    assert plan.working_size == out.size == (1136, 912)
    assert _close(_px(out, (500, 500)), (10, 200, 30), 1)


def test_two_halvings_when_short_side_stays_large():
    assert e11_plan(9000, 8000).halvings == 2  # -> 4500x4000 -> 2250x2000 (2000 < 2048: stop)
    assert e11_plan(9000, 8200).halvings == 3  # -> 4500x4100 -> 2250x2050 -> 1125x1025
    assert e11_plan(4095, 9000).halvings == 1  # -> 2047x4500
    assert e11_plan(2047, 9000).halvings == 0
    assert e11_plan(1000, 1000, image_size=256).halvings == 1  # the threshold follows image_size


def test_e11_candidates_follow_upstream_arithmetic():
    # Hand-computed from upstream's `round(side * scale) // 16 * 16` candidates:
    # 2000x2001: scale 0.51187, sides 1023.75 x 1024.26 -> round -> 1024 x 1024 (a floor-only rule
    # would give 1008 x 1024).
    assert e11_working_size(2000, 2001) == (1024, 1024)
    # 3000x200: scale 1.32199, sides 3965.97 x 264.40 -> 3952 x 256 (rounding side / 16 instead
    # would give 3968 x 256).
    assert e11_working_size(3000, 200) == (3952, 256)
    assert e11_working_size(200, 3000) == (256, 3952)
    # 1000x700: 1223.92 x 856.74 -> (1216, 848); covered at 1216 x 851, cropped 1 px from the top.
    plan = e11_plan(1000, 700)
    assert (plan.working_size, plan.resized_size, plan.crop_box) == ((1216, 848), (1216, 851), (0, 1, 1216, 849))


@pytest.mark.parametrize("size", [(3000, 200), (200, 3000), (1000, 700), (640, 480), (16, 16), (4000, 17)])
def test_extreme_and_common_aspect_ratios(size):
    source = Image.new("RGB", size, (50, 60, 70))
    out, plan = prepare_working_image(source, variant="e1.1")
    w, h = out.size
    assert (w, h) == plan.working_size
    assert w % 16 == 0 and h % 16 == 0 and w >= 16 and h >= 16
    assert w * h <= 1024 * 1024
    left, top, right, bottom = plan.crop_box
    rw, rh = plan.resized_size
    assert 0 <= left and 0 <= top and right <= rw and bottom <= rh and (right - left, bottom - top) == (w, h)
    # The crop removes less than one grid cell (plus rounding) from the covered image.
    assert rw - w <= 16 + 2 and rh - h <= 16 + 2


def test_e11_rule_properties_over_many_sizes():
    rng = random.Random(1234)
    for _ in range(500):
        width, height = rng.randint(16, 9000), rng.randint(16, 9000)
        image_size = rng.choice([512, 768, 1024, 1536])
        plan = e11_plan(width, height, image_size)
        w, h = plan.working_size
        assert w % 16 == 0 and h % 16 == 0 and w * h <= image_size**2, (width, height, image_size)
        hw, hh = plan.halved_size
        assert min(hw, hh) < 2 * image_size
        # Uses most of the budget and keeps the aspect ratio, unless the ratio is extreme.
        if max(width, height) / min(width, height) < 8:
            assert w * h >= 0.9 * image_size**2, (width, height, image_size, plan)
            assert abs(math.log((w / h) / (width / height))) < 0.1, (width, height, plan)
        # Resized keeps the aspect ratio of the halved image to within rounding.
        rw, rh = plan.resized_size
        assert abs(rw / rh - hw / hh) <= max(1 / rh, 1 / rw) * (hw / hh) + 1e-9 or (rw, rh) == (w, h)


def test_degenerate_aspect_ratio_is_clamped_to_the_grid():
    w, h = e11_working_size(16, 2_000_000)
    assert w == 16 and h % 16 == 0 and w * h <= 1024 * 1024
    w, h = e11_working_size(2_000_000, 16, image_size=512)
    assert h == 16 and w % 16 == 0 and w * h <= 512 * 512


def test_e11_draft_and_explicit_side():
    source = Image.new("RGB", (1024, 1024))
    assert prepare_working_image(source, variant="e1.1", working_resolution="draft")[0].size == (512, 512)
    assert prepare_working_image(source, variant="e1.1", working_resolution="768")[0].size == (768, 768)
    out, plan = prepare_working_image(Image.new("RGB", (900, 600)), variant="e1.1", working_resolution=512)
    assert out.size == plan.working_size and out.size[0] * out.size[1] <= 512 * 512


def test_e1_full_plain_resize():
    source = Image.new("RGB", (1000, 400), RED)
    out, plan = prepare_working_image(source, variant="e1-full")
    assert out.size == (768, 768) and plan.crop_box == (0, 0, 768, 768) and plan.halvings == 0
    assert _px(out, (0, 0)) == RED  # stretched, not cropped or padded
    assert prepare_working_image(source, variant="e1-full", working_resolution="draft")[0].size == (512, 512)
    assert prepare_working_image(source, variant="e1-full", working_resolution="1024")[0].size == (1024, 1024)
    assert prepare_working_image(source, variant="e1-full", fixed_size=(640, 640))[0].size == (640, 640)


def test_prepare_rejects_bad_variant_and_resolution():
    source = Image.new("RGB", (64, 64))
    with pytest.raises(ValueError, match="e1.1, e1-full"):
        prepare_working_image(source, variant="e2")
    with pytest.raises(ValueError, match="working_resolution"):
        prepare_working_image(source, variant="e1.1", working_resolution="1000")


def test_apply_plan_checks_the_size():
    with pytest.raises(ValueError, match="plan is for"):
        to_working_size(Image.new("RGB", (10, 10)), e11_plan(20, 20))


def test_restore_size_round_trip():
    working, plan = prepare_working_image(Image.new("RGB", (3000, 200), BLUE), variant="e1.1")
    restored = restore_size(working, plan.source_size)
    assert restored.size == (3000, 200) and _close(_px(restored, (1500, 100)), BLUE, 1)
    same = restore_size(working, working.size)
    assert same is not working and same.size == working.size
    with pytest.raises(ValueError):
        restore_size(working, (0, 10))
