"""The OpenAI-compatible images API (issue 57): `POST /v1/images/edits` and `GET /v1/models` on the
app's own server, called with OpenAI's official SDK (`openai`) where a program would, and with raw
HTTP (a socket) where an abusive or broken client would.

It is not a second way in: the queue's admission (503 with Retry-After), the per-client limit (429),
the body caps (413), a disconnect (the edit stops, nothing is saved) and /status hold for it as for a
browser, and its PNG carries the browser's metadata (the same edit through gradio_client gives the
same pixels).
"""

from __future__ import annotations

import base64
import io
import json
import socket
import threading
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
from gradio_client import Client, handle_file
from helpers import wait_for
from PIL import Image

from hidream_ui.bench.abuse_openai import pixel_bomb
from hidream_ui.config import AppConfig, ConfigError
from hidream_ui.edit_fields import EDIT_FORM
from hidream_ui.edit_values import MAX_PROMPT_CHARS
from hidream_ui.outputs import read_metadata
from hidream_ui.server import gradio_internals, openai_links
from hidream_ui.server.openai_links import ResultLinks
from hidream_ui.server.openai_shapes import (
    MAX_IMAGES,
    OpenAIError,
    app_mask,
    from_refusal,
    parse_edits,
    parse_size,
)
from hidream_ui.ui.layout import ASSETS_DIR

EXAMPLE = ASSETS_DIR / "apple.png"  # 288x288
KEYS = ("k" * 20 + "-one", "k" * 20 + "-two", "k" * 20 + "-three")
FAST = {"num_inference_steps": 2}  # extension fields: the tiny model's edit in well under a second
SLOW = {"num_inference_steps": 200}  # an edit that runs until it is stopped


def png_bytes(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def left_half_mask(size=(288, 288)) -> bytes:
    """OpenAI's mask: the left half transparent (may change), the right half opaque (kept)."""
    mask = Image.new("RGBA", size, (0, 0, 0, 255))
    mask.paste((0, 0, 0, 0), (0, 0, size[0] // 2, size[1]))
    return png_bytes(mask)


def sdk(app, key: str = "unused", **options) -> openai.OpenAI:
    return openai.OpenAI(base_url=app["url"] + "v1", api_key=key, max_retries=0, **options)


def outputs(app) -> list[Path]:
    return sorted(Path(app["config"].output_dir).iterdir())


def status(app) -> dict:
    with httpx.Client(base_url=app["url"], timeout=30) as http:
        return http.post("/gradio_api/run/status", json={"data": []}).json()["data"][0]


def stop_everything(app) -> None:
    for job in app["demo"].hidream_services.jobs.running():
        job.token.cancel("test teardown")


class SlowEdit:
    """An edit that runs until stopped, sent in a thread through the SDK (`key`); `.error` is what the
    SDK raised when it ended."""

    def __init__(self, app, key: str = "unused"):
        self.error: Exception | None = None
        self.client = sdk(app, key)
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        try:
            self.client.images.edit(image=EXAMPLE.open("rb"), prompt="make it blue", extra_body=SLOW)
        except Exception as exc:  # noqa: BLE001 - kept for the test to look at
            self.error = exc


def end(app, *edits: SlowEdit) -> None:
    """Stops the slow edits (and whatever they queued behind) and waits for them and the engine."""

    def ended():
        stop_everything(app)
        return not any(edit.thread.is_alive() for edit in edits)

    wait_for(ended, what="the slow edits to end", timeout=120)
    wait_for(lambda: app["engine"].status().state == "idle", what="the engine to go idle")


def device_queue(app) -> dict:
    return gradio_internals.queue_figures(app["demo"], "device") or {}


# ---------------------------------------------------------------------------------------------
# Shapes (no app)
# ---------------------------------------------------------------------------------------------


def test_openais_mask_becomes_the_apps_transparent_may_change():
    plane = Image.open(io.BytesIO(app_mask(left_half_mask((64, 32)), (64, 32), 10**6)))
    assert plane.mode == "L" and plane.size == (64, 32)
    assert plane.getpixel((0, 0)) == 255 and plane.getpixel((31, 31)) == 255  # transparent: may change
    assert plane.getpixel((32, 0)) == 0 and plane.getpixel((63, 31)) == 0  # opaque: kept
    # A palette image whose transparency is a tRNS entry counts by it too.
    palette = Image.new("P", (8, 8), 0)
    palette.putpalette([0, 0, 0, 255, 255, 255])
    palette.paste(1, (0, 0, 4, 8))
    buffer = io.BytesIO()
    palette.save(buffer, format="PNG", transparency=1)
    assert Image.open(io.BytesIO(app_mask(buffer.getvalue(), (8, 8), 10**6))).getpixel((0, 0)) == 255


@pytest.mark.parametrize(
    "mask, says",
    [
        (png_bytes(Image.new("L", (16, 16), 0)), "no alpha channel"),
        (png_bytes(Image.new("RGB", (16, 16), (255, 255, 255))), "no alpha channel"),
        (png_bytes(Image.new("RGBA", (8, 16), (0, 0, 0, 0))), "the mask is 8x16, the image 16x16"),
        (png_bytes(Image.new("RGBA", (16, 16), (0, 0, 0, 255))), "no transparent pixel"),
        (b"not a picture", "not an image"),
        (pixel_bomb(40_000), "more than 1,000,000 pixels"),
    ],
    ids=["grey", "rgb", "other-size", "opaque", "not-an-image", "pixel-bomb"],
)
def test_a_mask_that_cannot_be_used_is_a_400_naming_what_is_wrong(mask, says):
    with pytest.raises(OpenAIError) as refused:
        app_mask(mask, (16, 16), 10**6)
    assert refused.value.status == 400 and refused.value.param == "mask" and says in refused.value.message
    assert refused.value.body()["error"]["type"] == "invalid_request_error"


def icon_holding(picture: Image.Image) -> bytes:
    """An ICO whose directory says 256x256 but whose one image is `picture` (a PNG of any size):
    Pillow's ICO reader decodes it whole inside `Image.open`."""
    import struct

    png = png_bytes(picture)
    return struct.pack("<HHH", 0, 1, 1) + struct.pack("<BBBBHHII", 0, 0, 0, 0, 1, 32, len(png), 22) + png


def test_images_and_masks_open_as_the_app_opens_uploads_so_no_icon_is_decoded_on_open(monkeypatch):
    from PIL import IcoImagePlugin

    from hidream_ui.server.openai_shapes import image_size

    opened = []
    monkeypatch.setattr(IcoImagePlugin.IcoImageFile, "_open", lambda self: opened.append(1) or 1 / 0)
    icon = icon_holding(Image.new("RGBA", (2000, 2000), (0, 0, 0, 0)))  # 16 MB decoded, 8 KB sent
    for param, check in (
        ("image", lambda: image_size(icon, "image", 10**7)),
        ("mask", lambda: app_mask(icon, (16, 16), 10**7)),
    ):
        with pytest.raises(OpenAIError) as refused:
            check()
        assert (refused.value.status, refused.value.param, refused.value.code) == (400, param, f"invalid_{param}")
        assert "not an image this server can read" in refused.value.message
    assert opened == []  # Pillow's ICO reader never ran: only the app's formats are tried


def test_an_exif_turned_image_is_the_size_the_app_sees_and_its_mask_turns_with_it():
    from hidream_ui.server.openai_shapes import image_size

    def turned(picture: Image.Image, kind: str) -> bytes:
        exif = Image.Exif()
        exif[0x0112] = 6  # a quarter turn clockwise: the app shows the picture 32 wide, 64 high
        buffer = io.BytesIO()
        picture.save(buffer, format=kind, exif=exif.tobytes())
        return buffer.getvalue()

    assert image_size(turned(Image.new("RGB", (64, 32)), "JPEG"), "image", 10**6) == (32, 64)
    mask = Image.new("RGBA", (64, 32), (0, 0, 0, 255))
    mask.paste((0, 0, 0, 0), (0, 0, 64, 8))  # the top rows as stored: the right column once turned
    plane = Image.open(io.BytesIO(app_mask(turned(mask, "PNG"), (32, 64), 10**6)))
    assert plane.size == (32, 64) and plane.getpixel((31, 0)) == 255 and plane.getpixel((0, 0)) == 0


def busy_route(monkeypatch):
    """The route over a loopback whose one slot for the test client is busy, and the list of what
    it looked at (image, mask): no app and no gradio behind it."""
    from starlette.testclient import TestClient

    from hidream_ui.server import openai_api
    from hidream_ui.server.api_keys import ApiGate
    from hidream_ui.server.loopback import Loopback

    looked = []
    monkeypatch.setattr(openai_api, "image_size", lambda *args: looked.append("image") or (288, 288))
    monkeypatch.setattr(openai_api, "app_mask", lambda *args: looked.append("mask") or b"")
    config = AppConfig(device="cpu", max_jobs_per_client=1, max_upload_mb=1)
    box = Loopback(
        lambda: None, slots=1, fn_index=lambda name: 0, per_client_message=lambda n: f"at most {n} per client"
    )
    images = openai_api.OpenAIImages(config, box, ApiGate(None, public=True))
    assert box._slots.take("address:testclient") == 0  # the caller's one slot is busy
    return TestClient(images.app()), looked


def edit_with_mask(client, **headers):
    files = {"image": ("a.png", EXAMPLE.read_bytes(), "image/png"), "mask": ("m.png", left_half_mask(), "image/png")}
    return client.post("/v1/images/edits", files=files, data={"prompt": "make it blue"}, headers=headers)


def test_a_caller_with_every_slot_busy_is_refused_before_its_body_is_read(monkeypatch):
    client, looked = busy_route(monkeypatch)
    with client:
        answer = edit_with_mask(client)
    assert answer.status_code == 429 and answer.json()["error"]["code"] == "per_client_limit"
    assert looked == []  # neither the image nor the mask was looked at: the body was never parsed


def test_a_page_of_another_site_cannot_send_edits_from_its_visitors_browsers(monkeypatch):
    client, looked = busy_route(monkeypatch)
    with client:
        refused = edit_with_mask(client, **{"Sec-Fetch-Site": "cross-site", "Origin": "https://elsewhere.example"})
        # The app's own page (any port of its host) and programs (no Sec-Fetch-Site) get on to the queue.
        own_site = [edit_with_mask(client, **{"Sec-Fetch-Site": site}) for site in ("same-origin", "same-site")]
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "cross_site"
    assert [answer.status_code for answer in own_site] == [429, 429] and looked == []


def test_a_result_the_app_would_not_serve_is_a_500_that_names_no_server_path():
    import contextlib

    from starlette.testclient import TestClient

    from hidream_ui.server import openai_api
    from hidream_ui.server.api_keys import ApiGate
    from hidream_ui.server.loopback import CallRefused

    secret = "/srv/private-cache/0123abcd/result.png"

    class Pruned:
        """A loopback whose edit ran but whose result was pruned before it was read back."""

        @contextlib.asynccontextmanager
        async def reserve(self, caller):
            yield 0

        async def upload(self, caller, name, data, content_type="image/png"):
            return "/srv/private-cache/upload/a.png"

        async def call(self, caller, api_name, data, **options):
            return [None, {"path": secret}, 7, "edited"]

        async def fetch(self, caller, path):
            raise CallRefused(403, "file_failed", f"File not allowed: {path}.")  # gradio's own words

    images = openai_api.OpenAIImages(AppConfig(device="cpu"), Pruned(), ApiGate(None, public=True))
    with TestClient(images.app()) as client:
        answer = client.post(
            "/v1/images/edits",
            files={"image": ("a.png", EXAMPLE.read_bytes(), "image/png")},
            data={"prompt": "make it blue"},
        )
    assert answer.status_code == 500 and answer.json()["error"]["code"] == "server_error"
    assert "/srv" not in answer.text and "private-cache" not in answer.text


def test_errors_have_openais_shape_and_status():
    queue_full = from_refusal(503, "queue_full", "Queue is full. Max size is 1 and size is 1.")
    assert queue_full.status == 503 and queue_full.headers() == {"Retry-After": "10"}
    assert queue_full.body() == {
        "error": {
            "message": "Queue is full. Max size is 1 and size is 1.",
            "type": "server_error",
            "param": None,
            "code": "queue_full",
        }
    }
    limited = from_refusal(429, "per_client_limit", "You already have 1 job(s) queued or running")
    assert (limited.status, limited.type, limited.code) == (429, "rate_limit_error", "per_client_limit")
    assert from_refusal(429, "too_many_attempts", "wait", 42.4).headers() == {"Retry-After": "42"}
    wrong_key = from_refusal(401, "invalid_api_key", "Incorrect API key provided.")
    assert (wrong_key.status, wrong_key.type, wrong_key.code) == (401, "invalid_request_error", "invalid_api_key")
    assert from_refusal(403, "api_disabled", "x").type == "permission_error"
    # The app's own field checks name the field: OpenAI's name where it has one.
    steps = from_refusal(400, "edit_failed", "num_inference_steps: got -5; expected a whole number from 1 to 200")
    assert (steps.status, steps.param) == (400, "num_inference_steps")
    assert from_refusal(400, "edit_failed", "instruction: got ''; expected text").param == "prompt"
    assert from_refusal(500, "server_error", "boom").body()["error"]["type"] == "server_error"
    assert from_refusal(418, "odd", "odd").status == 500


def test_an_edit_requests_fields_are_checked_and_named():
    models = ("hidream-e1.1",)

    def parsed(**fields):
        return parse_edits({"prompt": "make it blue", **fields}, models=models, sides=("512", "1024"))

    plain = parsed()
    assert (plain.n, plain.size, plain.response_format, plain.seed, dict(plain.extensions)) == (
        1,
        "auto",
        "b64_json",
        None,
        {},
    )
    full = parsed(n="3", size="512x512", response_format="url", seed="7", model="hidream-e1.1", guidance_scale="4")
    assert (full.n, full.size, full.response_format, full.seed) == (3, "512", "url", 7)
    assert dict(full.extensions) == {"guidance_scale": "4"} and full.seeds(7) == [7, 8, 9]
    assert parsed(seed="-1").seed is None and parsed(user="me", quality="high").n == 1  # ignored fields
    for fields, param, status in [
        ({"model": "dall-e-2"}, "model", 404),
        ({"n": "0"}, "n", 400),
        ({"n": str(MAX_IMAGES + 1)}, "n", 400),
        ({"n": "two"}, "n", 400),
        ({"size": "512x256"}, "size", 400),
        ({"size": "256x256"}, "size", 400),
        ({"response_format": "jpeg"}, "response_format", 400),
        ({"stream": "true"}, "stream", 400),
        ({"output_format": "webp"}, "output_format", 400),
        ({"seed": "x"}, "seed", 400),
        ({"prompt": " "}, "prompt", 400),
        ({"prompt": "x" * (MAX_PROMPT_CHARS + 1)}, "prompt", 400),
        # The Edit form's own checks, before anything is uploaded (a refused edit left its upload behind).
        ({"num_inference_steps": "0"}, "num_inference_steps", 400),
        ({"clip_cfg_norm": "maybe"}, "clip_cfg_norm", 400),
        ({"guidance_scale": "nan"}, "guidance_scale", 400),
    ]:
        with pytest.raises(OpenAIError) as refused:
            parsed(**fields)
        assert (refused.value.status, refused.value.param) == (status, param), fields
    with pytest.raises(OpenAIError, match="one of auto, 512x512, 1024x1024"):
        parse_size("100x100", ("512", "1024"))


def test_result_links_expire_and_stay_bounded():
    now = [100.0]
    links = ResultLinks(ttl=3600, max_links=2, clock=lambda: now[0])
    caller = openai_links.Caller("10.0.0.1", "key:key1")
    first = links.add(caller, "/cache/a.png")
    assert links.get(first).path == "/cache/a.png" and "/cache" not in first and len(first) >= 32
    now[0] += 3599
    assert links.get(first) is not None
    now[0] += 2
    assert links.get(first) is None and links.get("made-up") is None
    tokens = [links.add(caller, f"/cache/{n}.png") for n in range(3)]
    assert links.get(tokens[0]) is None and links.get(tokens[2]) is not None and len(links) == 2


def test_the_key_file_is_checked_before_the_app_starts(tmp_path):
    from hidream_ui.cli.app import launch

    short = tmp_path / "keys.txt"
    short.write_text("short\n")
    for path, says in ((short, "line 1"), (tmp_path / "missing.txt", "cannot read")):
        with pytest.raises(ConfigError, match=says):
            launch(AppConfig(device="cpu", api_keys_file=path), prevent_thread_lock=True, quiet=True)


# ---------------------------------------------------------------------------------------------
# Over the app, without login: charged per address
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def app(launch_app):
    """A booth: --kiosk (visitors edit; the engine-wide controls are the operator's), one job per
    client, uploads of at most 1 MB. The route edits as a visitor would."""
    return launch_app(
        "openai", kiosk=True, operator=("booth-operator", "op-s3cret-pass"), max_jobs_per_client=1, max_upload_mb=1
    )


@pytest.fixture(autouse=True)
def idle(request):
    """Every test that used an app ends with nothing of it running."""
    yield
    for name in ("app", "login_keyed"):
        if name in request.fixturenames:
            launched = request.getfixturevalue(name)
            stop_everything(launched)
            engine = launched["engine"]
            wait_for(lambda engine=engine: engine.status().state == "idle", what="the engine to go idle")


@pytest.mark.slow
def test_the_routes_edit_inputs_are_the_edit_apis(app):
    from hidream_ui.server.openai_api import MASK_INPUT, REWRITE_INPUT

    names = [p["parameter_name"] for p in app["demo"].get_api_info()["named_endpoints"]["/edit"]["parameters"]]
    assert names == ["image", *EDIT_FORM, REWRITE_INPUT, MASK_INPUT]


@pytest.mark.slow
def test_models_lists_the_one_model_and_an_edit_names_it_or_none(app):
    client = sdk(app)
    listed = client.models.list()
    assert [model.id for model in listed.data] == [f"hidream-e1.1-tiny-{app['config'].tiny_profile}"]
    assert client.models.retrieve(listed.data[0].id).owned_by == "hidream-ui"
    with pytest.raises(openai.NotFoundError) as refused:
        client.images.edit(image=EXAMPLE.open("rb"), prompt="make it blue", model="dall-e-2")
    assert refused.value.code == "model_not_found" and refused.value.param == "model"


@pytest.mark.slow
def test_an_sdk_edit_gives_the_browsers_png_and_its_metadata_reproduces_it(app, tmp_path):
    saved_before = len(outputs(app))
    answer = sdk(app).images.edit(image=EXAMPLE.open("rb"), prompt="make it blue", n=2, extra_body={"seed": 11, **FAST})
    assert [item.seed for item in answer.data] == [11, 12]
    assert [item.revised_prompt for item in answer.data] == ["make it blue"] * 2
    assert answer.size == "288x288" and answer.output_format == "png"
    png = base64.b64decode(answer.data[0].b64_json)
    assert png.startswith(b"\x89PNG") and len(outputs(app)) == saved_before + 4  # two PNGs, two sidecars
    metadata = read_metadata(png)
    assert metadata["params"]["seed"] == 11 and metadata["params"]["num_inference_steps"] == 2
    assert metadata["source_name"] == "apple.png"
    # The settings from the PNG, through the browser's API (gradio_client): the same pixels, and the
    # same metadata but for timings and the like.
    params = {name: value for name, value in metadata["params"].items() if name in EDIT_FORM}
    _, saved, seed, _ = Client(app["url"], verbose=False).predict(
        image=handle_file(str(EXAMPLE)), **params, randomize_seed=False, api_name="/edit"
    )
    assert seed == 11
    with Image.open(saved) as browser, Image.open(io.BytesIO(png)) as api:
        assert np.array_equal(np.asarray(browser), np.asarray(api))
    again = read_metadata(saved)
    same = ("params", "working_size", "source_size", "source_name", "parent", "variant", "model_paths", "refiner")
    assert {key: again[key] for key in same} == {key: metadata[key] for key in same}
    assert again.keys() == metadata.keys()


@pytest.mark.slow
def test_an_openai_mask_keeps_the_opaque_half(app):
    answer = sdk(app).images.edit(
        image=EXAMPLE.open("rb"),
        prompt="make it blue",
        mask=("mask.png", left_half_mask(), "image/png"),
        extra_body={"seed": 5, **FAST},
    )
    png = base64.b64decode(answer.data[0].b64_json)
    metadata = read_metadata(png)
    feather = metadata["mask"]["feather"]
    source = np.asarray(Image.open(EXAMPLE).convert("RGB"), dtype=np.int16)
    result = np.asarray(Image.open(io.BytesIO(png)).convert("RGB"), dtype=np.int16)
    assert np.abs(result[:, 144 + feather :] - source[:, 144 + feather :]).max() <= 2  # opaque: kept
    assert np.abs(result[:, : 144 - feather] - source[:, : 144 - feather]).mean() > 5  # transparent: edited


@pytest.mark.slow
def test_a_url_answer_links_the_png_for_an_hour_and_names_no_server_path(app, monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(openai_links, "_now", lambda: now[0])
    answer = sdk(app).images.edit(
        image=EXAMPLE.open("rb"), prompt="make it blue", response_format="url", extra_body={"seed": 3, **FAST}
    )
    url = answer.data[0].url
    assert answer.data[0].b64_json is None and "/v1/images/results/" in url
    assert "/tmp" not in url and str(app["config"].output_dir) not in url
    fetched = httpx.get(url, timeout=30)
    assert fetched.status_code == 200 and fetched.headers["content-type"] == "image/png"
    assert read_metadata(fetched.content)["params"]["seed"] == 3
    now[0] += 3601
    expired = httpx.get(url, timeout=30)
    assert expired.status_code == 404 and expired.json()["error"]["type"] == "invalid_request_error"
    assert httpx.get(url.rsplit("/", 1)[0] + "/not-a-token", timeout=30).status_code == 404


@pytest.mark.slow
def test_oversized_images_and_bodies_are_refused_413_before_any_work(app):
    client = sdk(app)
    edits, saved = app["engine"].counters["edits"], outputs(app)
    noise = np.random.default_rng(0).integers(0, 256, (700, 700, 3), dtype=np.uint8)
    big = png_bytes(Image.fromarray(noise))  # about 1.4 MB: over --max-upload-mb 1, under the body cap
    assert 1024 * 1024 < len(big) < 2 * 1024 * 1024
    with pytest.raises(openai.APIStatusError) as refused:
        client.images.edit(image=("big.png", big, "image/png"), prompt="make it blue", extra_body=FAST)
    assert refused.value.status_code == 413 and refused.value.param == "image"
    assert "--max-upload-mb" in refused.value.message
    # A body over the whole cap (two uploads and the form): the guard refuses it unread, same shape.
    with pytest.raises(openai.APIStatusError) as refused:
        client.images.edit(image=("big.png", big + big, "image/png"), prompt="x", mask=("m.png", big, "image/png"))
    assert refused.value.status_code == 413 and refused.value.body["code"] == "request_too_large"
    assert app["engine"].counters["edits"] == edits and outputs(app) == saved


@pytest.mark.slow
def test_bad_requests_get_openais_400(app):
    client = sdk(app)
    with pytest.raises(openai.BadRequestError) as refused:
        client.images.edit(
            image=EXAMPLE.open("rb"), prompt="make it blue", mask=("m.png", png_bytes(Image.new("L", (288, 288))))
        )
    assert refused.value.code == "invalid_mask" and "no alpha channel" in refused.value.message
    with pytest.raises(openai.BadRequestError) as refused:
        client.images.edit(image=("notes.png", b"not a picture", "image/png"), prompt="make it blue")
    assert refused.value.param == "image"
    with pytest.raises(openai.BadRequestError) as refused:
        client.images.edit(image=EXAMPLE.open("rb"), prompt="make it blue", extra_body={"num_inference_steps": 0})
    assert refused.value.param == "num_inference_steps" and "from 1 to 200" in refused.value.message
    with pytest.raises(openai.BadRequestError) as refused:
        client.images.edit(image=EXAMPLE.open("rb"), prompt="make it blue", size="1024x1024")
    assert refused.value.param == "size" and "one of auto" in refused.value.message
    answer = httpx.post(app["url"] + "v1/images/edits", json={"prompt": "x"}, timeout=30)
    assert answer.status_code == 400 and "multipart/form-data" in answer.json()["error"]["message"]
    # Nothing but the edit (and the model list) answers under /v1: no engine-wide control of the booth.
    for method, path in (("GET", "v1/embeddings"), ("POST", "v1/images/generations"), ("POST", "v1/models")):
        unknown = httpx.request(method, app["url"] + path, timeout=30)
        assert unknown.status_code in (404, 405) and set(unknown.json()["error"]) == {
            "message",
            "type",
            "param",
            "code",
        }


@pytest.mark.slow
def test_the_per_client_limit_holds_and_status_shows_the_api_edit(app):
    slow = SlowEdit(app)
    try:
        wait_for(lambda: device_queue(app).get("running") == 1, what="the slow edit to run")
        shown = status(app)
        assert shown["queue"]["running"] == 1
        with pytest.raises(openai.RateLimitError) as refused:
            sdk(app).images.edit(image=EXAMPLE.open("rb"), prompt="make it red", extra_body=FAST)
        assert refused.value.code == "per_client_limit" and "at most 1 per client" in refused.value.message
        assert device_queue(app) == {"waiting": 0, "running": 1}
    finally:
        end(app, slow)


@pytest.mark.slow
def test_a_client_that_disconnects_cancels_its_edit_and_nothing_is_saved(app):
    saved = outputs(app)
    request = httpx.Request(
        "POST",
        app["url"] + "v1/images/edits",
        files={"image": ("apple.png", EXAMPLE.read_bytes(), "image/png")},
        data={"prompt": "make it blue", **{name: str(value) for name, value in SLOW.items()}},
    )
    body = request.read()
    host, port = httpx.URL(app["url"]).host, httpx.URL(app["url"]).port
    head = "".join(f"{name}: {value}\r\n" for name, value in request.headers.items() if name.lower() != "host")
    with socket.create_connection((host, port)) as raw:
        raw.sendall(f"POST /v1/images/edits HTTP/1.1\r\nHost: {host}:{port}\r\n{head}\r\n".encode() + body)
        wait_for(lambda: app["engine"].status().state != "idle", what="the edit to start")
        wait_for(lambda: device_queue(app).get("running") == 1, what="the edit to run")
    # The socket is closed: the route sees the disconnect and cancels the edit after its current step.
    wait_for(lambda: device_queue(app) == {"waiting": 0, "running": 0}, what="the edit to stop", timeout=60)
    wait_for(lambda: app["engine"].status().state == "idle", what="the engine to go idle")
    assert outputs(app) == saved
    assert not app["demo"].hidream_services.jobs.running()


# ---------------------------------------------------------------------------------------------
# An app with a login: keys or nothing
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def login_keyed(launch_app, tmp_path_factory):
    keys = tmp_path_factory.mktemp("openai_keys") / "keys.txt"
    keys.write_text("# the booth's scripts\n" + "\n".join(KEYS) + "\n")
    return launch_app(
        "openai_login", auth=("booth", "s3cret-pass"), api_keys_file=keys, max_queue=1, max_jobs_per_client=1
    )


@pytest.mark.slow
def test_a_login_app_without_keys_refuses_programs_403(launch_app):
    app_without_keys = launch_app("openai_login_only", auth=("booth", "s3cret-pass"))
    with pytest.raises(openai.PermissionDeniedError) as refused:
        sdk(app_without_keys).images.edit(image=EXAMPLE.open("rb"), prompt="make it blue")
    assert "--api-keys" in refused.value.message
    with pytest.raises(openai.PermissionDeniedError):
        sdk(app_without_keys).models.list()


@pytest.mark.slow
def test_with_keys_a_good_key_edits_as_its_own_user_and_a_wrong_one_gets_401(login_keyed):
    with pytest.raises(openai.AuthenticationError) as refused:
        sdk(login_keyed, "w" * 24).images.edit(image=EXAMPLE.open("rb"), prompt="make it blue")
    assert refused.value.code == "invalid_api_key" and "w" * 24 not in refused.value.message
    keyless = httpx.get(login_keyed["url"] + "v1/models", timeout=30)
    assert keyless.status_code == 401 and keyless.json()["error"]["code"] == "missing_api_key"
    answer = sdk(login_keyed, KEYS[0]).images.edit(
        image=EXAMPLE.open("rb"), prompt="make it blue", extra_body={"seed": 2, **FAST}
    )
    assert read_metadata(base64.b64decode(answer.data[0].b64_json))["params"]["seed"] == 2


@pytest.mark.slow
def test_a_full_queue_is_a_503_with_retry_after(login_keyed):
    running, waiting = SlowEdit(login_keyed, KEYS[0]), None
    try:
        wait_for(lambda: device_queue(login_keyed).get("running") == 1, what="the first edit to run")
        waiting = SlowEdit(login_keyed, KEYS[1])
        wait_for(lambda: device_queue(login_keyed).get("waiting") == 1, what="the second edit to wait")
        with pytest.raises(openai.InternalServerError) as refused:
            sdk(login_keyed, KEYS[2]).images.edit(image=EXAMPLE.open("rb"), prompt="make it red", extra_body=FAST)
        assert refused.value.status_code == 503 and refused.value.code == "queue_full"
        assert int(refused.value.response.headers["Retry-After"]) >= 1
        assert json.loads(refused.value.response.text)["error"]["type"] == "server_error"
    finally:
        end(login_keyed, *(edit for edit in (running, waiting) if edit is not None))
