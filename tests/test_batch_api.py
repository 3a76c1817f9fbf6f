"""`/batch_edit` and `/compare` through gradio_client on the offline tiny model.

The fixture launches the real app (conftest.launch_app); edits run 2 steps at the draft working size.
"""

from __future__ import annotations

import json
import threading
import types
import zipfile

import pytest
from gradio_client import Client, handle_file
from gradio_client.exceptions import AppError
from helpers import wait_for, write_picture
from PIL import Image

from hidream_ui.archive import MANIFEST_NAME
from hidream_ui.outputs import read_metadata

FAST = {"num_inference_steps": 2, "working_resolution": "draft"}


@pytest.fixture(scope="module")
def app(launch_app):
    # The real app (all tabs), with small limits so the limit tests stay cheap.
    return launch_app("batch_api", max_grid_cells=8, max_batch_items=6)


@pytest.fixture(scope="module")
def client(app):
    return Client(app["url"], verbose=False)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("uploads")
    good = [write_picture(folder / f"photo{i}.png", i) for i in range(2)]
    broken = folder / "broken.png"
    broken.write_bytes(b"\x89PNG\r\n\x1a\nthis is not a picture")
    return {"good": good, "broken": broken, "folder": folder}


def batch(client, files, instructions, **kwargs):
    values = {"mode": "matrix", "seed": 5, "seed_policy": "increment", "batch_size": 0, **FAST, **kwargs}
    return client.predict(
        files=[handle_file(str(f)) for f in files], instructions=instructions, **values, api_name="/batch_edit"
    )


@pytest.mark.slow
def test_batch_edit_returns_gallery_report_and_zip(client, files):
    gallery, report, archive = batch(client, [*files["good"], files["broken"]], "make it red\nmake it blue\n\n")
    assert len(gallery) == 4
    expected = [(text, 5 + i) for i, text in enumerate(["make it red", "make it blue"] * 2)]
    captions = [entry["caption"] for entry in gallery]
    assert captions == [f"{text} · seed {seed}" for text, seed in expected]
    # The gallery serves the saved PNGs: settings included.
    for entry, (text, seed) in zip(gallery, expected):
        metadata = read_metadata(entry["image"])
        assert (metadata["params"]["instruction"], metadata["params"]["seed"]) == (text, seed)
    assert "4/4" in report and "broken.png" in report and "Rejected" in report

    with zipfile.ZipFile(archive) as zipped:
        manifest = json.loads(zipped.read(MANIFEST_NAME))
        assert [(row["instruction"], row["seed"], row["status"]) for row in manifest["items"]] == [
            (text, seed, "ok") for text, seed in expected
        ]
        assert [row["name"] for row in manifest["rejected"]] == ["broken.png"]
        pngs = sorted(n for n in zipped.namelist() if n.endswith(".png"))
        assert pngs == sorted(row["output"] for row in manifest["items"])


def test_batch_edit_accepts_a_zip_of_images(client, files, tmp_path):
    bundle = tmp_path / "bundle.zip"
    with zipfile.ZipFile(bundle, "w") as archive:
        archive.write(files["good"][0], "inside/a.png")
        archive.writestr("notes.txt", "not an image")
    gallery, report, _ = batch(client, [bundle], "make it green", seed_policy="fixed")
    assert [entry["caption"] for entry in gallery] == ["make it green · seed 5"]
    assert "bundle.zip/notes.txt" in report


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({"instructions": "one\ntwo\nthree", "mode": "paired"}, "exactly one line per image"),
        ({"instructions": "a\nb\nc\nd"}, "at most 6 items"),  # 2 images x 4 lines > max_batch_items
        ({"instructions": "   \n "}, "at least one instruction"),
        ({"instructions": "x", "guidance_scale": 99}, "guidance_scale"),
    ],
)
def test_batch_edit_refuses_bad_requests_with_a_message(client, files, app, kwargs, fragment):
    edits = app["engine"].counters["edits"]
    instructions = kwargs.pop("instructions")
    with pytest.raises(AppError) as info:
        batch(client, files["good"], instructions, **kwargs)
    assert fragment in str(info.value)
    assert "Traceback" not in str(info.value)
    assert app["engine"].counters["edits"] == edits  # refused before any work


def compare(client, image, **kwargs):
    values = {
        "instruction": "make the sky purple",
        "axis_x": "seed",
        "values_x": "1, 2, 3",
        "axis_y": "steps",
        "values_y": "1, 2",
        "seed": 3,
        **FAST,
        **kwargs,
    }
    return client.predict(image=handle_file(str(image)), **values, api_name="/compare")


@pytest.mark.slow
def test_compare_returns_a_labelled_grid_and_the_cells(client, files):
    grid_path, cells, report = compare(client, files["good"][0])
    assert len(cells) == 6
    assert [entry["caption"] for entry in cells] == [
        f"seed {seed} · steps {steps}" for steps in (1, 2) for seed in (1, 2, 3)
    ]
    for entry, (steps, seed) in zip(cells, [(s, d) for s in (1, 2) for d in (1, 2, 3)]):
        params = read_metadata(entry["image"])["params"]
        assert (params["seed"], params["num_inference_steps"]) == (seed, steps)
    with Image.open(grid_path) as grid:
        width, height = grid.size
    # Three 256 px columns and two 192 px rows (80x60 scaled), plus the label bands.
    assert width > 3 * 256 and height > 2 * 192
    assert "6/6" in report


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({"values_x": "1:9"}, "at most 8 cells"),
        ({"axis_x": "attention", "values_x": "sdpa, warp_drive", "axis_y": "none"}, "one of auto, sdpa"),
        ({"values_x": "1, x"}, "seed values"),
    ],
)
def test_compare_refuses_bad_axes_with_a_message(client, files, app, kwargs, fragment):
    edits = app["engine"].counters["edits"]
    with pytest.raises(AppError) as info:
        compare(client, files["good"][0], **kwargs)
    assert fragment in str(info.value) and "Traceback" not in str(info.value)
    assert app["engine"].counters["edits"] == edits


# ---------------------------------------------------------------------------------------------
# Stop and abandon, driving the Batch tab's generator in-process (deterministic: the engine's
# item callback waits until the test has acted).


class PausingEngine:
    """The real engine, except that run_batch pauses after each finished item until released."""

    def __init__(self, engine):
        self._engine = engine
        self.release = threading.Event()

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def run_batch(self, request, on_item=None, on_step=None, *, cancel=None):
        self.token = cancel

        def paused(item):
            on_item(item)
            # Released by the test, or by a stop (so an abandoned stream can join the worker).
            for _ in range(6000):
                if self.release.wait(0.01) or cancel.cancelled:
                    return
            raise AssertionError("the test never released the batch")

        return self._engine.run_batch(request, on_item=paused, on_step=on_step, cancel=cancel)


def session(name):
    return types.SimpleNamespace(session_hash=name)


@pytest.fixture
def tab(app, files, tmp_path):
    from hidream_ui.ui.batch_tab import BatchTab
    from hidream_ui.ui.services import AppServices

    engine = PausingEngine(app["engine"])
    # In-process callers hand over plain paths: the gate trusts these test folders only.
    services = AppServices.for_config(engine.config, trusted_roots=[files["folder"], tmp_path])
    handlers = BatchTab(engine, engine.config, services)
    yield handlers
    services.close()


def run_tab(tab, files, **kwargs):
    values = dict(
        files=[str(f) for f in files],
        instructions="make it teal",
        mode="matrix",
        negative_prompt="blurry",
        guidance_scale=3.0,
        image_guidance_scale=1.5,
        refine_strength=0.3,
        clip_cfg_norm=True,
        seed=1,
        seed_policy="increment",
        batch_size=1,
        request=session("me"),
        **{**FAST, **kwargs},
    )
    return tab.run(**values)


def test_stop_keeps_finished_items_and_only_stops_its_own_session(tab, files, tmp_path):
    sources = [write_picture(tmp_path / f"s{i}.png", 10 + i) for i in range(3)]
    stream = run_tab(tab, sources)
    gallery, report, archive = next(stream)  # validated, nothing run yet
    assert gallery == [] and "0/3" in report and archive is None
    gallery, report, _ = next(stream)  # the first item finished; the worker waits
    assert len(gallery) == 1 and "1/3" in report
    tab.stop(session("someone else"))  # another user's Stop: ignored
    assert not tab.engine.token.cancelled
    tab.stop(session("me"))
    assert tab.engine.token.cancelled
    tab.engine.release.set()
    *_, (gallery, report, archive) = list(stream)
    assert "Stopped" in report and len(gallery) == 1
    with zipfile.ZipFile(archive) as zipped:
        manifest = json.loads(zipped.read(MANIFEST_NAME))
    assert [row["status"] for row in manifest["items"]] == ["ok", "cancelled", "cancelled"]
    assert manifest["cancelled"] is True


def test_abandoned_stream_stops_the_worker(tab, files, tmp_path):
    import threading

    sources = [write_picture(tmp_path / f"a{i}.png", 20 + i) for i in range(3)]
    edits = tab.engine.counters["edits"]
    stream = run_tab(tab, sources)
    next(stream)
    next(stream)  # the first item finished; the worker waits
    stream.close()  # the browser went away: the run must stop and the worker be gone
    # The worker is not waited for on close (that would stall gradio's event loop): it ends by itself.
    wait_for(lambda: not [t for t in threading.enumerate() if t.name == "hidream-batch"], "the worker to end")
    assert tab.engine.counters["edits"] == edits + 1  # items 2 and 3 never ran
    assert tab.engine.status().state == "idle"
    # The stop does not leak into the next run.
    tab.engine.release.set()
    gallery, report, _ = list(run_tab(tab, sources[:1]))[-1]
    assert len(gallery) == 1 and "Done" in report


def test_report_lists_item_errors_and_rejections_as_inert_markdown():
    from hidream_ui.engine.batch import BatchItem
    from hidream_ui.ui.batch_tab import BatchRun

    run = BatchRun(2, [("x_<b>.png", "x_<b>.png: not a recognised image")])
    run.add(
        BatchItem(
            index=0,
            source_index=0,
            source_name="a*.png",
            instruction="make it *bold*",
            seed=3,
            status="error",
            error="out of memory on cpu",
        )
    )
    text = run.report()
    assert text.startswith("**1/2** done")
    assert "**Errors**" in text and r"- a\*.png × “make it \*bold\*”: out of memory on cpu" in text
    # The file name is said once, and its markup characters are escaped.
    assert r"- x\_\<b\>.png: not a recognised image" in text
