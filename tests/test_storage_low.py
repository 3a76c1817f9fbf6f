"""Issue 58, the LOW findings: a malformed `mask`, a TGA named .png, Gradio's run history, X-Forwarded-For.

Over raw HTTP against the launched app (conftest.launch_app) where a client sees the finding: the
`/edit` call with a bad `mask` gets the per-field message (and the log one line, no traceback); a TGA
uploaded as photo.png is refused naming TGA; `/gradio_api/run-history/*` and `/gradio_api/runs` answer
404 unless the app runs with `run_history`; an `X-Forwarded-For` header from 127.0.0.1 does not choose
the address a per-address limit counts (the operator login's), unless the operator names that proxy.
Names added by the fix are imported inside the tests, so that each test fails on its own on the code
before it.
"""

from __future__ import annotations

import io
import json
import logging

import httpx
import pytest
from PIL import Image

from hidream_ui.config import ConfigError, from_args
from hidream_ui.imaging import ImageError, open_image, sniff_format
from hidream_ui.ui.layout import ASSETS_DIR

FILE_META = {"_type": "gradio.FileData"}
OPERATOR = ("booth-operator", "op-s3cret-pass")
LOGIN_FAILURES = 2


@pytest.fixture(scope="module")
def app(launch_app):
    # The defaults under test: no run history, no trusted proxy. Kiosk mode with an operator gives a
    # per-address login limit (the operator's /operator/login) without a login for visitors' edits.
    return launch_app("low", kiosk=True, operator=OPERATOR, max_login_failures=LOGIN_FAILURES)


@pytest.fixture(scope="module")
def proxied_app(launch_app):
    """An operator who turned run history on and trusts a proxy on 127.0.0.1."""
    return launch_app(
        "low_proxied",
        kiosk=True,
        operator=OPERATOR,
        max_login_failures=LOGIN_FAILURES,
        run_history=True,
        forwarded_allow_ips=("127.0.0.1",),
    )


def client(app, address: str = "127.0.0.1") -> httpx.Client:
    """A raw HTTP client whose connections come from `address` (any 127.x.y.z reaches the app)."""
    return httpx.Client(base_url=app["url"], timeout=60, transport=httpx.HTTPTransport(local_address=address))


def upload(http: httpx.Client, name: str, content: bytes) -> str:
    answer = http.post("/gradio_api/upload", files={"files": (name, content, "image/png")})
    assert answer.status_code == 200, answer.text
    return answer.json()[0]


def edit_call(http: httpx.Client, path: str, name: str, session: str, mask=None) -> dict:
    """A raw queued edit (`/gradio_api/call/edit`), `mask` last; returns {"event", "data"} of its last SSE event."""
    data = [
        {"path": path, "meta": FILE_META, "orig_name": name},
        "make it blue",
        "",
        3.0,
        1.5,
        2,
        0.3,
        True,
        "draft",
        1,
        False,
        True,
        False,
        mask,
    ]
    posted = http.post("/gradio_api/call/edit", json={"data": data, "session_hash": session})
    assert posted.status_code == 200, posted.text
    text = http.get(f"/gradio_api/call/edit/{posted.json()['event_id']}").text
    kinds = [line[6:].strip() for line in text.splitlines() if line.startswith("event:")]
    payloads = [line[5:].strip() for line in text.splitlines() if line.startswith("data:")]
    return {"event": kinds[-1], "data": json.loads(payloads[-1]) if payloads[-1] else None}


def tga_bytes(mode: str = "RGB", **options) -> bytes:
    buffer = io.BytesIO()
    Image.new(mode, (32, 32), "red" if mode != "L" else 128).save(buffer, "TGA", **options)
    return buffer.getvalue()


# ---------------------------------------------------------------------------------------------
# A malformed mask: one log line, and the per-field message
# ---------------------------------------------------------------------------------------------

MALFORMED_MASKS = {
    "a number": 42,
    "a bare path": "left.png",
    "a list": [1, 2],
    "layers that are no list": {"layers": "abc"},
    "a file without gradio's meta": {"path": "left.png"},
    "a path that is no text": {"path": 5},
    "no key of either": {"foo": 1},
}


@pytest.mark.parametrize("label", list(MALFORMED_MASKS))
def test_a_malformed_mask_gets_its_field_message_and_one_log_line(app, label, caplog, capfd):
    mask = MALFORMED_MASKS[label]
    caplog.set_level(logging.INFO, logger="hidream_ui.ui.region_editor")
    with client(app) as http:
        path = upload(http, "apple.png", (ASSETS_DIR / "apple.png").read_bytes())
        capfd.readouterr()  # what came before the call
        answer = edit_call(http, path, "apple.png", f"bad-mask-{abs(hash(label))}", mask=mask)
    assert answer["event"] == "error", answer
    message = (answer["data"] or {}).get("error")
    # Before: {"error": null} for the first five, and an edit of the whole image for the last two.
    assert message and message.startswith("mask: got ") and "gradio.FileData" in message, answer
    records = [r for r in caplog.records if r.name == "hidream_ui.ui.region_editor"]
    assert len(records) == 1 and "\n" not in records[0].getMessage(), [r.getMessage() for r in records]
    assert records[0].getMessage().startswith("refused: mask: got ")
    printed = capfd.readouterr().err
    assert "Traceback" not in printed and "ValidationError" not in printed, printed[-2000:]


def test_the_region_model_refuses_with_the_field_and_keeps_what_it_took():
    import gradio as gr

    from hidream_ui.ui.region_editor import RegionData

    context = {"validate_meta": True}  # as gradio validates an input
    for value in MALFORMED_MASKS.values():
        with pytest.raises(gr.Error) as caught:
            RegionData.model_validate(value, context=context)
        assert caught.value.message.startswith("mask: got ") and not caught.value.print_exception
    file = RegionData.model_validate({"path": "/x/left.png", "meta": FILE_META}, context=context)
    assert file.root.path == "/x/left.png"
    for editor in ({}, {"background": None, "layers": [], "composite": None}, {"id": "e1", "layers": []}):
        assert RegionData.model_validate(editor, context=context).root.layers == []


# ---------------------------------------------------------------------------------------------
# Formats named correctly: a TGA is a TGA, not "CUR data"
# ---------------------------------------------------------------------------------------------


def test_a_tga_named_png_is_refused_as_tga_over_http(app):
    with client(app) as http:
        path = upload(http, "photo.png", tga_bytes())
        answer = edit_call(http, path, "photo.png", "tga-session")
    assert answer["event"] == "error", answer
    message = answer["data"]["error"]
    assert "holds TGA data" in message and "CUR" not in message, message


@pytest.mark.parametrize(
    "mode, options", [("RGB", {}), ("RGBA", {}), ("L", {}), ("RGB", {"compression": "tga_rle"}), ("P", {})]
)
def test_every_kind_of_tga_is_named_tga(mode, options):
    data = tga_bytes(mode, **options)
    with pytest.raises(ImageError, match=r"^photo\.png: the file holds TGA data, a format this app does not open"):
        open_image(data, name="photo.png")


def test_icons_are_still_named_and_need_an_image_count():
    buffer = io.BytesIO()
    Image.new("RGB", (32, 32)).save(buffer, "ICO")
    icon = buffer.getvalue()
    cursor = icon[:2] + b"\2\0" + icon[4:]  # a cursor is an icon directory of type 2
    assert sniff_format(icon[:16]) == "ICO" and sniff_format(cursor[:16]) == "CUR"
    # The same 4 bytes with no image in the directory: an uncompressed TGA's start, never an icon.
    assert sniff_format(b"\0\0\2\0\0\0" + bytes(12)) is None
    assert sniff_format(b"not an image at all, just text") is None


# ---------------------------------------------------------------------------------------------
# Gradio's run history: off unless the operator turns it on
# ---------------------------------------------------------------------------------------------

RUN_HISTORY_ROUTES = [
    ("GET", "/gradio_api/runs"),
    ("GET", "/gradio_api/run-history/buckets"),
    ("GET", "/gradio_api/run-history/records"),
    ("POST", "/gradio_api/run-history/connect"),
    ("GET", "/gradio_api/run-history/records/edit/r1/assets/a1"),
]


def test_run_history_routes_answer_404_by_default(app):
    with client(app) as http:
        codes = {
            route: http.request(method, route, json={} if method == "POST" else None).status_code
            for method, route in RUN_HISTORY_ROUTES
        }
        config = http.get("/config").json()
    assert set(codes.values()) == {404}, codes
    assert config.get("run_history") is False  # the page does not record runs in the browser either


def test_run_history_is_there_when_the_operator_turns_it_on(proxied_app):
    with client(proxied_app) as http:
        page = http.get("/gradio_api/runs")
        # An empty body: refused for the body or the missing token, never looked up on the hub.
        connect = http.post("/gradio_api/run-history/connect", json={})
        config = http.get("/config").json()
    assert page.status_code == 200 and connect.status_code != 404, (page.status_code, connect.status_code)
    assert config.get("run_history") is True


def test_run_history_flag_and_variable():
    assert from_args([]).run_history is False
    assert from_args(["--run-history"]).run_history is True
    assert from_args([], {"HIDREAM_RUN_HISTORY": "1"}).run_history is True
    assert from_args([], {"HIDREAM_RUN_HISTORY": "off"}).run_history is False
    with pytest.raises(ConfigError, match="HIDREAM_RUN_HISTORY='sometimes'"):
        from_args([], {"HIDREAM_RUN_HISTORY": "sometimes"})


# ---------------------------------------------------------------------------------------------
# X-Forwarded-For: trusted from nobody unless the operator names the proxy
# ---------------------------------------------------------------------------------------------


def operator_logins(app, address: str, forwarded: list[str]) -> list[int]:
    """Wrong operator logins from `address`, each naming another client in X-Forwarded-For and
    another user name (so only a per-address limit can stop them); their status codes."""
    codes = []
    with client(app, address) as http:
        for i, claimed in enumerate(forwarded):
            answer = http.post(
                "/operator/login",
                data={"username": f"guess-{address}-{i}", "password": "wrong"},
                headers={"X-Forwarded-For": claimed},
            )
            codes.append(answer.status_code)
    return codes


def test_x_forwarded_for_from_the_loopback_does_not_choose_the_address(app):
    codes = operator_logins(app, "127.0.0.1", [f"10.58.0.{i}" for i in range(1, 5)])
    # Before: uvicorn believed the header from 127.0.0.1 (its default): four addresses, four 401s, and
    # the per-address limit never fired.
    assert codes == [401] * LOGIN_FAILURES + [429] * (4 - LOGIN_FAILURES), codes


def test_a_named_proxy_is_believed_and_no_one_else(proxied_app):
    through_proxy = operator_logins(proxied_app, "127.0.0.1", [f"10.58.1.{i}" for i in range(1, 5)])
    assert through_proxy == [401] * 4, through_proxy  # four clients behind the proxy, one try each
    not_the_proxy = operator_logins(proxied_app, "127.0.0.4", [f"10.58.2.{i}" for i in range(1, 5)])
    assert not_the_proxy == [401] * LOGIN_FAILURES + [429] * (4 - LOGIN_FAILURES), not_the_proxy


def test_forwarded_allow_ips_flag_variable_and_bad_values():
    assert from_args([]).forwarded_allow_ips == ()
    assert from_args(["--forwarded-allow-ips", "127.0.0.1, 10.0.0.0/8,::1"]).forwarded_allow_ips == (
        "127.0.0.1",
        "10.0.0.0/8",
        "::1",
    )
    assert from_args([], {"HIDREAM_FORWARDED_ALLOW_IPS": "*"}).forwarded_allow_ips == ("*",)
    for value, needle in [
        ("proxy.local", "'proxy.local' is not an IP address or network"),
        ("10.0.0.1/8", "host bits set"),
        ("*,10.0.0.1", "stands alone"),
    ]:
        with pytest.raises(ConfigError, match=needle) as caught:
            from_args(["--forwarded-allow-ips", value])
        assert str(caught.value).startswith(f"--forwarded-allow-ips={value!r}")


def test_the_server_gets_the_setting_whatever_the_environment_says():
    from hidream_ui.cli.app import trust_proxies
    from hidream_ui.config import AppConfig

    environ = {"FORWARDED_ALLOW_IPS": "*"}  # what some container images set for uvicorn
    trust_proxies(AppConfig(), environ)
    assert environ["FORWARDED_ALLOW_IPS"] == ""  # uvicorn: trust nobody
    trust_proxies(AppConfig(forwarded_allow_ips=("127.0.0.1", "10.0.0.0/8")), environ)
    assert environ["FORWARDED_ALLOW_IPS"] == "127.0.0.1,10.0.0.0/8"
