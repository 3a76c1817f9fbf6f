"""Issue 21, engine side: region edits (a mask keeps the source outside it), live previews every K
steps, and the edit loop's data (`parent` in the metadata), on the tiny model through the real loader."""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from helpers import edit_params
from PIL import Image

from hidream_ui.config import AppConfig
from hidream_ui.edits import EditParams, EditRequest, RequestError, validated_mask
from hidream_ui.engine.compare import run_compare
from hidream_ui.engine.engine import EditEngine
from hidream_ui.engine.pool import EnginePool
from hidream_ui.imaging import UnreadableImage, open_mask
from hidream_ui.outputs import read_metadata

SIZE = (128, 96)  # width, height: the draft working size halves it (one latent cell = 16 source px)


def source_picture(seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (SIZE[1], SIZE[0], 3), dtype=np.uint8))


def left_half(size=SIZE) -> Image.Image:
    mask = Image.new("L", size, 0)
    mask.paste(255, (0, 0, size[0] // 2, size[1]))
    return mask


def masked(params: EditParams, mask: Image.Image) -> EditParams:
    return dataclasses.replace(params, mask=validated_mask(mask, "left.png")).validated()


@pytest.fixture(scope="module")
def engine(tmp_path_factory, tiny_cache):
    eng = EditEngine(AppConfig(device="cpu", output_dir=tmp_path_factory.mktemp("outputs"), preview_every=3))
    eng.load()
    return eng


# --- region edits --------------------------------------------------------------------------------


def test_a_left_half_mask_keeps_the_right_half_beyond_the_feather(engine):
    source = source_picture()
    params = edit_params("make it blue", steps=6, seed=5)
    free = engine.edit(EditRequest(source, params), save=False)
    region = engine.edit(EditRequest(source, masked(params, left_half())).validated(), save=False)

    src, out, unmasked = (np.asarray(im, dtype=np.int16) for im in (source, region.image, free.image))
    edge, feather = SIZE[0] // 2, region.mask_feather
    assert 4 <= feather < edge // 2
    right = np.s_[:, edge + feather :]
    assert np.abs(out[right] - src[right]).max() <= 2  # beyond the feather: the source's own pixels
    assert np.abs(unmasked[right] - src[right]).mean() > 10  # without the mask the edit changes them
    left = np.s_[:, : edge - feather]
    assert np.abs(out[left] - src[left]).mean() > 10  # inside the mask the edit happened
    # The kept latents steer the edited half too: it is not the unmasked edit cut out.
    assert not np.array_equal(out[left], unmasked[left])


def test_an_all_white_mask_changes_nothing_and_masks_are_reproducible(engine):
    source = source_picture(1)
    params = edit_params("make it blue", steps=4, seed=9)
    plain = engine.edit(EditRequest(source, params), save=False)
    white = engine.edit(EditRequest(source, masked(params, Image.new("L", SIZE, 255))), save=False)
    assert white.image.tobytes() == plain.image.tobytes()  # the blend and the composite are neutral there
    once = engine.edit(EditRequest(source, masked(params, left_half())), save=False)
    again = engine.edit(EditRequest(source, masked(params, left_half())), save=False)
    assert once.image.tobytes() == again.image.tobytes()  # the same noise at every step: same seed, same edit


def test_the_mask_is_saved_beside_the_result_and_named_in_its_metadata(engine):
    result = engine.edit(
        EditRequest(
            source_picture(), masked(edit_params(steps=2, seed=2), left_half()), source_name="photo.png"
        ).validated()
    )
    meta = read_metadata(result.saved_png)
    mask_file = result.saved_png.parent / meta["mask"]["file"]
    assert mask_file.is_file()
    assert hashlib.sha256(mask_file.read_bytes()).hexdigest() == meta["mask"]["sha256"]
    assert meta["mask"]["name"] == "left.png" and meta["mask"]["feather"] == result.mask_feather
    with Image.open(mask_file) as saved:
        assert saved.mode == "L" and saved.size == SIZE and set(np.unique(np.asarray(saved))) == {0, 255}
    assert "mask" not in meta["params"]  # not a setting: the form round trip is unchanged


def test_masks_are_refused_with_the_reason():
    with pytest.raises(RequestError, match="all-black") as caught:
        validated_mask(Image.new("L", SIZE, 0))
    assert caught.value.field == "mask"
    with pytest.raises(RequestError, match="shape"):
        EditRequest(source_picture(), masked(edit_params(), Image.new("L", (50, 50), 255))).validated()
    with pytest.raises(RequestError, match="mask"):
        validated_mask("left.png")  # a path is opened by the caller (imaging.open_mask), never here
    with pytest.raises(UnreadableImage):
        open_mask(b"this is text, not a PNG, whatever its name says")


def test_a_painted_layer_counts_its_opaque_pixels_as_the_region():
    layer = Image.new("RGBA", SIZE, (0, 0, 0, 0))
    layer.paste((255, 40, 40, 255), (0, 0, SIZE[0] // 2, SIZE[1]))  # a red brush on transparency
    buffer = io.BytesIO()
    layer.save(buffer, format="PNG")
    mask = validated_mask(open_mask(buffer.getvalue()))
    assert np.array_equal(np.asarray(mask.image), np.asarray(left_half()))


def png_bytes(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def test_strokes_on_transparency_count_by_their_alpha_however_faint_or_dark():
    # What a brush layer holds: a see-through dark stroke on the left, and under the transparent
    # right half RGB that reads white (as a canvas may leave it). The alpha decides, not the colour.
    layer = Image.new("RGBA", SIZE, (255, 255, 255, 0))
    layer.paste((20, 20, 20, 90), (0, 0, SIZE[0] // 2, SIZE[1]))
    mask = validated_mask(open_mask(png_bytes(layer)))
    assert np.array_equal(np.asarray(mask.image), np.asarray(left_half()))
    # A brush layer painted all over is all region (layer=True: its colour is never read).
    full = Image.new("RGBA", SIZE, (20, 20, 20, 255))
    assert np.asarray(open_mask(png_bytes(full), layer=True)).min() == 255


def test_an_opaque_rgba_mask_counts_by_its_grey_level():
    # A black-and-white mask saved as RGBA (opaque everywhere): its alpha says nothing, white = may change.
    opaque = left_half().convert("RGBA")
    mask = validated_mask(open_mask(png_bytes(opaque)))
    assert np.array_equal(np.asarray(mask.image), np.asarray(left_half()))


def test_compare_applies_the_mask_to_every_cell(tmp_path, tiny_cache):
    pool = EnginePool.for_config(AppConfig(device="cpu", output_dir=tmp_path, preview_every=0))
    path = tmp_path / "src.png"
    source_picture(3).save(path)
    params = masked(edit_params("make it blue", steps=3, seed=4), left_half())
    result = run_compare(pool, str(path), params, "seed", "1, 2", source_name="src.png")
    src = np.asarray(source_picture(3), dtype=np.int16)
    assert len(result.cells) == 2
    names = set()
    for cell in result.cells:
        out = np.asarray(cell.image, dtype=np.int16)
        right = np.s_[:, SIZE[0] // 2 + cell.mask_feather :]
        assert np.abs(out[right] - src[right]).max() <= 2
        names.add(cell.saved_metadata["mask"]["file"])
        assert cell.saved_metadata["parent"] == {
            "file": "src.png",
            "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
            "of": "file",
        }
    assert len(names) == 1 and (tmp_path / names.pop()).is_file()  # one file for the grid's one mask


def test_retention_removes_a_mask_with_the_last_result_that_names_it(tmp_path, tiny_cache):
    pool = EnginePool.for_config(AppConfig(device="cpu", output_dir=tmp_path, retention=1, preview_every=0))
    first = pool.edit(EditRequest(source_picture(), masked(edit_params(steps=1, seed=1), left_half())))
    mask_file = tmp_path / first.saved_metadata["mask"]["file"]
    assert mask_file.is_file()
    pool.edit(EditRequest(source_picture(), edit_params(steps=1, seed=2)))  # retention 1: the first goes
    assert not first.saved_png.exists() and not mask_file.exists()


# --- the edit loop's data --------------------------------------------------------------------------


def test_parent_names_the_source_file_and_an_edit_of_a_result_names_that_result(engine, tmp_path):
    path = tmp_path / "photo.png"
    source_picture(4).save(path)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    first = engine.edit(
        EditRequest(
            engine.open_image(str(path)), edit_params(steps=2, seed=1), source_name="photo.png", source_sha256=digest
        )
    )
    assert first.saved_metadata["parent"] == {"file": "photo.png", "sha256": digest, "of": "file"}
    # "Edit the result": the saved PNG is the next source; its parent is that file, whose name carries
    # the first 8 hex digits of the same hash.
    png = first.saved_png
    second = engine.edit(
        EditRequest(
            engine.open_image(str(png)),
            edit_params(steps=2, seed=2),
            source_name=png.name,
            source_sha256=hashlib.sha256(png.read_bytes()).hexdigest(),
        )
    )
    parent = json.loads(second.saved_json.read_text())["parent"]
    assert parent["file"] == png.name and png.stem.endswith(parent["sha256"][:8])
    # A source handed over as an image: its pixels are hashed.
    third = engine.edit(EditRequest(source_picture(4), edit_params(steps=1, seed=1)))
    assert third.saved_metadata["parent"]["of"] == "pixels"
    assert third.saved_metadata["parent"]["sha256"] != digest


# --- live previews -------------------------------------------------------------------------------


def test_previews_arrive_every_k_steps_change_and_leave_the_result_alone(engine):
    source = source_picture(5)
    params = edit_params("make it blue", steps=10, seed=3)
    shots = []
    with_previews = engine.edit(EditRequest(source, params), save=False, on_preview=shots.append)
    without = engine.edit(EditRequest(source, params), save=False)
    assert [shot.step for shot in shots] == [3, 6, 9]  # every K=3 steps, not after the last one
    assert all(shot.total == 10 for shot in shots)
    latent = (SIZE[0] // 2 // 8, SIZE[1] // 2 // 8)  # draft working size / the VAE's 8
    assert all(shot.image.size == latent and shot.image.mode == "RGB" for shot in shots)
    frames = [np.asarray(shot.image, dtype=np.int16) for shot in shots]
    assert all(np.abs(a - b).mean() > 0 for a, b in zip(frames, frames[1:]))  # they change as it denoises
    assert with_previews.image.tobytes() == without.image.tobytes()  # never part of the result


def test_preview_every_zero_gives_none(tmp_path, tiny_cache):
    eng = EditEngine(AppConfig(device="cpu", output_dir=tmp_path, preview_every=0))
    shots = []
    eng.edit(EditRequest(source_picture(), edit_params(steps=4, seed=1)), save=False, on_preview=shots.append)
    assert shots == [] and eng.previewer is None


def test_the_preview_map_is_fitted_once_at_first_use(engine):
    assert engine.previewer is not None  # the preview tests above asked for it
    fitted = engine.previewer
    engine.edit(EditRequest(source_picture(), edit_params(steps=3, seed=1)), save=False, on_preview=lambda shot: None)
    assert engine.previewer is fitted


class _LinearVae:
    """A VAE whose latents are a known linear function (plus bias) of each 8x8 cell's mean colour:
    the fit must find the inverse map."""

    device, dtype = "cpu", None

    def __init__(self):
        generator = torch.Generator().manual_seed(0)
        self.mix = torch.randn(16, 3, generator=generator)
        self.offset = torch.randn(16, generator=generator)
        self.config = SimpleNamespace(shift_factor=0.2, scaling_factor=1.5)
        self.dtype = torch.float32

    def encode(self, pixels):  # pixels in [-1, 1], (N, 3, H, W)
        cells = torch.nn.functional.avg_pool2d((pixels + 1) / 2, 8)
        latent = torch.einsum("kc,nchw->nkhw", self.mix, cells) + self.offset[None, :, None, None]
        return SimpleNamespace(latent_dist=SimpleNamespace(mode=lambda: latent))


def test_the_preview_map_inverts_a_linear_vae():
    from diffusers.image_processor import VaeImageProcessor

    from hidream_ui.pipeline.previews import fit_latent_rgb, fit_pictures

    vae = _LinearVae()
    pipe = SimpleNamespace(vae=vae, image_processor=VaeImageProcessor(vae_scale_factor=8))
    preview = fit_latent_rgb(pipe)
    assert preview.residual < 1e-3
    picture = fit_pictures(count=1, seed=42)[0]  # not one the map was fitted on
    pixels = pipe.image_processor.preprocess([picture], height=picture.height, width=picture.width)
    latent = (vae.encode(pixels).latent_dist.mode() - vae.config.shift_factor) * vae.config.scaling_factor
    shown = np.asarray(preview.image(latent[0]), dtype=np.int16)
    expected = np.asarray(picture.resize(shown.shape[1::-1], Image.Resampling.BOX), dtype=np.int16)
    assert shown.shape == (picture.height // 8, picture.width // 8, 3)
    assert np.abs(shown - expected).max() <= 2


def test_an_image_editor_value_gives_its_painted_layers_as_the_mask(tmp_path):
    """The handlers take a brush (gr.ImageEditor's value, painted layers) as well as an uploaded file."""
    from hidream_ui.ui.region_input import open_region

    class Gate:  # the app's upload gate hands back the stored path (tests of the gate: test_hardening2_*)
        def path(self, value, field):
            assert field == "mask"
            return value["path"], value.get("orig_name")

    services = SimpleNamespace(gate=Gate(), config=AppConfig())
    painted, empty = tmp_path / "layer.png", tmp_path / "empty.png"
    layer = Image.new("RGBA", SIZE, (0, 0, 0, 0))
    layer.paste((255, 255, 255, 255), (0, 0, SIZE[0] // 2, SIZE[1]))
    layer.save(painted)
    Image.new("RGBA", SIZE, (0, 0, 0, 0)).save(empty)
    value = {
        "background": {"path": str(tmp_path / "bg.png")},
        "layers": [{"path": str(empty)}, {"path": str(painted)}],
        "composite": None,
    }
    mask = open_region(services, value)
    assert np.array_equal(np.asarray(mask.image), np.asarray(left_half()))
    assert open_region(services, {**value, "layers": [{"path": str(empty)}]}) is None  # nothing painted: no mask
    assert open_region(services, {"path": str(painted), "orig_name": "layer.png"}).name == "layer.png"  # a file


@pytest.mark.slow
def test_a_long_edit_spaces_its_previews_out(tmp_path, tiny_cache):
    from hidream_ui.config import PREVIEWS_MAX

    eng = EditEngine(AppConfig(device="cpu", output_dir=tmp_path, preview_every=1))
    shots = []
    eng.edit(EditRequest(source_picture(), edit_params(steps=24, seed=1)), save=False, on_preview=shots.append)
    assert PREVIEWS_MAX == 8 and [shot.step for shot in shots] == [3, 6, 9, 12, 15, 18, 21]  # every 24/8 steps
