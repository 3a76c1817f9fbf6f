"""Issue 21, the brush: the Edit tab's region editor (gr.ImageEditor over the source) is the `mask`
input of /edit and /edit_rewritten. The handler is driven in-process with editor values whose files
went through the app's real upload route (so its upload gate accepts them), on the tiny model.
The mask as a plain file through the API: test_app_api. In the browser: test_browser_experience."""

from __future__ import annotations

from pathlib import Path

import gradio as gr
import httpx
import numpy as np
import pytest
from PIL import Image

from hidream_ui.edits import EDIT_FORM, EditParams, RequestError
from hidream_ui.outputs import read_metadata
from hidream_ui.ui.edit_handlers import UNPAINTED_REGION, EditHandlers
from hidream_ui.ui.history_entries import added, chains, check_entries, render_entries, signed
from hidream_ui.ui.region_editor import brush_radius
from hidream_ui.ui.region_input import open_region

SIZE = (128, 96)  # width, height


@pytest.fixture(scope="module")
def app(launch_app):
    return launch_app("region_brush")


@pytest.fixture(scope="module")
def handlers(app):
    return EditHandlers(app["engine"], services=app["demo"].hidream_services)


@pytest.fixture(scope="module")
def files(app, tmp_path_factory):
    """Source, a painted layer (left half, a see-through brush colour), an empty layer: uploaded
    through the app's upload route, as the browser sends them."""
    folder = tmp_path_factory.mktemp("brush")
    rng = np.random.default_rng(7)
    Image.fromarray(rng.integers(0, 256, (SIZE[1], SIZE[0], 3), dtype=np.uint8)).save(folder / "noise.png")
    painted = Image.new("RGBA", SIZE, (0, 0, 0, 0))
    painted.paste((225, 29, 72, 140), (0, 0, SIZE[0] // 2, SIZE[1]))
    painted.save(folder / "layer_0.png")
    Image.new("RGBA", SIZE, (0, 0, 0, 0)).save(folder / "empty.png")
    uploaded = {}
    with httpx.Client(base_url=app["url"], timeout=60) as http:
        for name in ("noise.png", "layer_0.png", "empty.png"):
            answer = http.post("/gradio_api/upload", files={"files": (name, (folder / name).read_bytes(), "image/png")})
            assert answer.status_code == 200, answer.text
            uploaded[name] = {"path": answer.json()[0], "orig_name": name, "meta": {"_type": "gradio.FileData"}}
    return uploaded


def editor_value(files, *layers: str) -> dict:
    """What the browser sends for the editor (preprocess=False): files, as gradio stored them."""
    return {"background": files["noise.png"], "layers": [files[name] for name in layers], "composite": None, "id": None}


def run_edit(handlers, image, mask, seed=5, steps=4):
    form = {
        **EditParams.defaults_for("e1.1").to_dict(),
        "instruction": "make it blue",
        "seed": seed,
        "randomize_seed": False,
        "num_inference_steps": steps,
        "working_resolution": "draft",
    }
    *_, last = handlers.edit(
        image, *(form[name] for name in EDIT_FORM), rewrite=False, mask=mask, progress=lambda *args, **kwargs: None
    )
    (_, after), png, _, summary, entry = last
    return after, png, summary, entry


def pixels(image) -> np.ndarray:
    return np.asarray(image.convert("RGB"), dtype=np.int16)


@pytest.mark.slow
def test_a_painted_left_half_keeps_the_right_half_beyond_the_feather(handlers, files):
    after, png, summary, _ = run_edit(handlers, files["noise.png"], editor_value(files, "empty.png", "layer_0.png"))
    meta = read_metadata(png)
    feather = meta["mask"]["feather"]
    src, out = pixels(Image.open(files["noise.png"]["path"])), pixels(after)
    half = SIZE[0] // 2
    assert np.abs(out[:, half + feather :] - src[:, half + feather :]).max() <= 2
    assert np.abs(out[:, : half - feather] - src[:, : half - feather]).mean() > 10  # the painted half did change
    assert meta["mask"]["name"] == "painted region"
    assert "region edit: outside it the source is kept" in summary  # the visitor is told
    assert (Path(png).parent / meta["mask"]["file"]).is_file()  # the mask is stored beside the result


def test_nothing_painted_is_no_mask_and_the_output_is_bit_identical(handlers, files):
    free, free_png, free_summary, _ = run_edit(handlers, files["noise.png"], None, seed=11, steps=2)
    blank, blank_png, summary, _ = run_edit(
        handlers, files["noise.png"], editor_value(files, "empty.png"), seed=11, steps=2
    )
    # Not silently the whole picture (issue 56): a region sent with nothing painted says so; an API
    # caller who sends no mask meant the whole picture and gets no note.
    assert "region edit" not in summary and UNPAINTED_REGION in summary
    assert "region" not in free_summary
    unpainted, _, _, _ = run_edit(handlers, files["noise.png"], editor_value(files), seed=11, steps=2)
    assert "mask" not in read_metadata(blank_png) and "mask" not in read_metadata(free_png)
    assert np.array_equal(np.asarray(blank), np.asarray(free))
    assert np.array_equal(np.asarray(unpainted), np.asarray(free))


def test_a_plain_file_is_still_a_mask(handlers, files, app):
    services = app["demo"].hidream_services
    mask = open_region(services, files["layer_0.png"])  # a file painted on transparency: its alpha
    assert mask.name == "layer_0.png" and mask.image.getbbox() == (0, 0, SIZE[0] // 2, SIZE[1])


def test_layers_the_app_did_not_store_or_that_did_not_arrive_are_refused(handlers, files, tmp_path):
    elsewhere = tmp_path / "layer.png"
    Image.new("RGBA", SIZE, (255, 0, 0, 255)).save(elsewhere)
    value = {**editor_value(files), "layers": [{"path": str(elsewhere), "orig_name": "layer.png"}]}
    with pytest.raises(gr.Error, match="uploaded to this app"):
        run_edit(handlers, files["noise.png"], value)
    # The browser sends an id instead of files when the editor has a change listener: say so, never
    # edit the whole image as if nothing had been painted.
    with pytest.raises(gr.Error, match="the region did not arrive"):
        run_edit(handlers, files["noise.png"], {"background": None, "layers": [], "composite": None, "id": "x1"})
    for layers in ("layer_0.png", [files["empty.png"]] * 9):
        with pytest.raises(gr.Error, match="layers as a list of at most 8"):
            run_edit(handlers, files["noise.png"], {**editor_value(files), "layers": layers})


def test_the_editor_shows_the_source_to_paint_on(handlers, files, tmp_path):
    update = handlers.region_background(files["noise.png"])
    assert update["value"] == {
        "background": files["noise.png"]["path"],
        "layers": [],
        "composite": files["noise.png"]["path"],
    }
    assert update["brush"].default_size == brush_radius(SIZE) == 4
    assert update["brush"].colors == [update["brush"].default_color]  # one colour
    assert handlers.region_background(None)["value"] is None  # no source: nothing to paint on
    stray = tmp_path / "stray.png"
    Image.new("RGB", SIZE).save(stray)
    assert handlers.region_background({"path": str(stray)})["value"] is None  # a path the app did not store


def test_the_editor_is_the_last_input_of_both_edits_and_has_no_change_listener(app):
    config = app["demo"].config
    editor = next(c for c in config["components"] if c.get("props", {}).get("elem_id") == "hui-mask")
    source = next(c for c in config["components"] if c.get("props", {}).get("elem_id") == "hui-source")
    assert editor["type"] == "imageeditor"
    for api_name in ("edit", "edit_rewritten"):
        dependency = next(d for d in config["dependencies"] if d.get("api_name") == api_name)
        assert dependency["inputs"][-1] == editor["id"]
        # Its value reaches the handler as the browser sent it: gradio's ImageEditor.preprocess expects its own model.
        assert next(fn for fn in app["demo"].fns.values() if fn.api_name == api_name).preprocess is False
    triggers = [tuple(t) for d in config["dependencies"] for t in d["targets"]]
    # A change or input listener would make the browser send its layers by id (region_editor.py).
    assert (editor["id"], "change") not in triggers and (editor["id"], "input") not in triggers
    assert (source["id"], "change") in triggers


def gradio_copy(app, path) -> dict:
    """What the browser holds after the app sent `path` to it ("Edit the result", "Edit again"):
    gradio's copy in its cache folder, made by gradio's own function (the one its postprocessing uses)."""
    from gradio.processing_utils import save_file_to_cache

    copy = save_file_to_cache(str(path), cache_dir=str(app["demo"].hidream_services.cache_folder))
    return {"path": copy, "orig_name": Path(copy).name, "meta": {"_type": "gradio.FileData"}}


def test_a_result_handed_back_as_gradios_copy_is_opened_as_the_apps_own_file(app, handlers, files, tmp_path):
    png = run_edit(handlers, files["noise.png"], None, steps=2)[1]
    gate = app["demo"].hidream_services.gate
    copy = gradio_copy(app, png)
    assert copy["path"] != png and gate.path(copy, "image") == (png, Path(png).name)
    # The same name with other bytes in the cache, or the same bytes outside it: refused, never opened.
    forged = Path(app["demo"].hidream_services.cache_folder) / "forged" / Path(png).name
    forged.parent.mkdir()
    Image.new("RGB", SIZE).save(forged)
    outside = tmp_path / Path(png).name
    outside.write_bytes(Path(png).read_bytes())
    for path in (forged, outside):
        with pytest.raises(RequestError, match="uploaded to this app"):
            gate.path({"path": str(path)}, "image")
    # The region editor shows it too (it goes through the same gate).
    assert handlers.region_background(copy)["value"]["background"] == png


def test_two_chained_edits_the_second_names_the_first(app, handlers, files):
    # "Edit the result" twice: each time the browser hands back gradio's copy of the result.
    _, png1, _, entry1 = run_edit(handlers, files["noise.png"], None, seed=1, steps=2)
    _, png2, _, entry2 = run_edit(handlers, gradio_copy(app, png1), None, seed=2, steps=2)
    results, secret = app["demo"].hidream_services.results, "this-browser"

    def sign(entry):  # as add_history signs a finished edit's entry for the browser that made it
        return signed(entry, lambda result: results.ticket(result, secret))

    history = added(added([], sign(entry1["history"])), sign(entry2["history"]))
    checked = check_entries(history, lambda result, ticket: results.stored(result, ticket, secret))
    assert all(entry.available for entry in checked)
    assert chains(checked)[0].parent == 1
    cards = render_entries(checked).split('class="hui-h-card"')[1:]
    assert "edit 2 of a chain of 2 · from result 2: “make it blue”" in cards[0]
    assert read_metadata(png2)["parent"]["sha256"] == entry1["history"]["sha256"]
