"""The MCP server of ``--mcp`` (server/mcp_tools.py, server/mcp_schema.py), driven with the `mcp` client
library over streamable HTTP against the real app: the tools it lists (the operator controls only
without --kiosk), an edit through the `edit` tool (its PNG carries the browser's metadata), `recipe`
on that PNG, the keys, and the per-agent job limit (an agent is its API key, not its MCP session).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import json

import pytest
from helpers import random_picture, wait_for

from hidream_ui.edit_fields import EDIT_FORM, FIELD_SPECS
from hidream_ui.server import mcp_schema
from hidream_ui.server.mcp_schema import ToolArgumentError

KEYS = ("mcp-test-key-one-0123456789", "mcp-test-key-two-0123456789")
VISITOR_TOOLS = {"edit", "status", "recipe"}
OPERATOR_TOOLS = {"set_attention", "set_speed", "load_model"}


def png_base64(seed: int = 0, size=(64, 48)) -> str:
    buffer = io.BytesIO()
    random_picture(seed, size).save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode("ascii")


@contextlib.asynccontextmanager
async def mcp_session(url: str, key: str | None = None):
    """An `mcp` client session on the app's /mcp, with `key` as its Bearer token."""
    import httpx2
    from mcp import Client
    from mcp.client.streamable_http import streamable_http_client

    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with httpx2.AsyncClient(headers=headers, timeout=httpx2.Timeout(30, read=600)) as http:
        async with Client(streamable_http_client(url.rstrip("/") + "/mcp", http_client=http)) as client:
            yield client


async def list_without_key(url: str) -> None:
    async with mcp_session(url) as client:
        await client.list_tools()


def leaf_messages(exc: BaseException) -> list[str]:
    """The messages of the exceptions inside `exc` (task groups wrap what they raise)."""
    inner = getattr(exc, "exceptions", None)
    return [message for each in inner for message in leaf_messages(each)] if inner else [str(exc)]


# ---------------------------------------------------------------------------------------------- no app


def test_edit_schema_is_the_edit_forms_fields():
    schema = mcp_schema.edit_schema("e1.1", max_upload_mb=7, rewriter=False)
    props = schema["properties"]
    assert set(props) == {"image", "mask", *EDIT_FORM} - {"randomize_seed"}
    assert schema["required"] == ["image", "instruction"]
    steps = FIELD_SPECS["num_inference_steps"]
    assert (props["num_inference_steps"]["minimum"], props["num_inference_steps"]["maximum"]) == (steps.lo, steps.hi)
    assert props["guidance_scale"]["maximum"] == FIELD_SPECS["guidance_scale"].hi
    assert props["seed"]["default"] == -1 and "random" in props["seed"]["description"]
    assert "7 MB" in props["image"]["description"]
    assert all(props[name]["description"] for name in props)
    # The defaults are the app's variant's (E1-Full guides differently) and the rewriter's switch shows with one.
    full = mcp_schema.edit_schema("e1-full", max_upload_mb=7, rewriter=True)["properties"]
    assert (full["guidance_scale"]["default"], props["guidance_scale"]["default"]) == (5.0, 3.0)
    assert "rewrite" in full and "rewrite" not in props


def test_edit_call_fills_defaults_and_refuses_unknown_arguments():
    call = mcp_schema.edit_call({"image": "x", "instruction": "blue", "num_inference_steps": 3}, "e1.1", rewriter=False)
    assert call.values["num_inference_steps"] == 3
    assert call.values["randomize_seed"] is True and call.values["guidance_scale"] == 3.0
    fixed = mcp_schema.edit_call({"image": "x", "instruction": "blue", "seed": 9}, "e1.1", rewriter=False)
    assert (fixed.values["seed"], fixed.values["randomize_seed"]) == (9, False)
    with pytest.raises(ToolArgumentError, match="unknown argument.*steps"):
        mcp_schema.edit_call({"image": "x", "instruction": "blue", "steps": 3}, "e1.1", rewriter=False)
    with pytest.raises(ToolArgumentError, match="instruction: required"):
        mcp_schema.edit_call({"image": "x"}, "e1.1", rewriter=False)


def test_decode_image_checks_the_size_before_decoding():
    data, name = mcp_schema.decode_image(png_base64(), "image", 1 << 20)
    assert data.startswith(b"\x89PNG") and name == "image.png"
    assert mcp_schema.decode_image("data:image/png;base64," + png_base64(), "mask", 1 << 20)[1] == "mask.png"
    # Too long is refused on the text's length, before any decoding (this text is not even base64).
    with pytest.raises(ToolArgumentError, match=r"image: the image is over 0.000977 MB \(--max-upload-mb\)"):
        mcp_schema.decode_image("!" * 4000, "image", 1024)
    with pytest.raises(ToolArgumentError, match="image: not valid base64"):
        mcp_schema.decode_image("not base64!", "image", 1024)
    # The service's body cap takes an image and a mask of --max-upload-mb each, as base64.
    assert mcp_schema.max_body_bytes(1) >= 2 * (4 * (1 << 20) // 3)


def test_mcp_without_the_package_says_how_to_install(monkeypatch, capsys):
    from hidream_ui.cli import app

    monkeypatch.setattr(app, "mcp_available", lambda: False)
    assert app.main(["--mcp"]) == app.EXIT_CONFIG
    assert 'pip install "hidream_ui[mcp]"' in capsys.readouterr().err


def test_mcp_1x_is_not_enough(monkeypatch):
    from importlib import metadata

    from hidream_ui.cli import app

    monkeypatch.setattr(metadata, "version", lambda name: "1.30.0")
    assert app.mcp_available() is False
    monkeypatch.setattr(metadata, "version", lambda name: "2.3.0")
    assert app.mcp_available() is True


# ---------------------------------------------------------------------------------------------- the app


@pytest.fixture(scope="module")
def keyed_app(launch_app, tmp_path_factory):
    """An app with --mcp, two API keys, one job per client and uploads of at most 1 MB."""
    keys = tmp_path_factory.mktemp("mcp_keys") / "keys.txt"
    keys.write_text("# agents\n" + "\n".join(KEYS) + "\n", encoding="utf-8")
    return launch_app("mcp", mcp=True, api_keys_file=keys, max_jobs_per_client=1, max_upload_mb=1)


@pytest.mark.slow
def test_tools_listed_without_kiosk_and_a_call_needs_a_key(keyed_app):
    import httpx

    async def main():
        async with mcp_session(keyed_app["url"], KEYS[0]) as client:
            tools = {tool.name: tool for tool in (await client.list_tools()).tools}
            speeds = [await client.call_tool("set_speed", {"name": name}) for name in ("warp", "exact")]
            big = base64.b64encode(bytes(1024 * 1024 + 1)).decode("ascii")
            too_big = await client.call_tool("edit", {"image": big, "instruction": "x"})
            return tools, speeds, too_big

    tools, (warp, exact), too_big = asyncio.run(main())
    assert too_big.is_error and too_big.content[0].text == "image: the image is over 1 MB (--max-upload-mb)"
    # Without --kiosk the engine-wide controls are everyone's: through the app's own /set_speed.
    assert warp.is_error and "warp" in warp.content[0].text
    assert not exact.is_error, exact.content[0].text
    assert set(tools) == VISITOR_TOOLS | OPERATOR_TOOLS  # no anonymous `run` tools
    assert tools["edit"].input_schema["properties"]["num_inference_steps"]["maximum"] == 200
    body = {"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": {}}
    url = keyed_app["url"].rstrip("/") + "/mcp"
    answer = httpx.post(url, json=body, headers={"Accept": "application/json, text/event-stream"})
    assert answer.status_code == 401 and answer.json()["error"]["data"]["reason"] == "missing_api_key"
    # The mcp client shows the app's reason (the refusal's body is a JSON-RPC error).
    with pytest.raises(BaseException) as refused:
        asyncio.run(list_without_key(keyed_app["url"]))
    assert "No API key: send 'Authorization: Bearer <key>'." in leaf_messages(refused.value)
    # The body cap (an image and a mask of --max-upload-mb as base64, and the JSON around them) holds
    # before the key is even looked at.
    cap = mcp_schema.max_body_bytes(1)
    over = httpx.post(url, content=b"{" + b" " * cap + b"}", headers={"Content-Type": "application/json"})
    assert over.status_code == 413 and over.json()["jsonrpc"] == "2.0"  # in MCP's shape, not OpenAI's
    assert over.json()["error"]["message"].startswith("The request body is larger than")
    wrong = httpx.post(url, json=body, headers={"Authorization": "Bearer " + "x" * 20})
    assert wrong.status_code == 401 and wrong.json()["error"]["data"]["reason"] == "invalid_api_key"


@pytest.mark.slow
def test_edit_through_the_tool_and_its_recipe(keyed_app):
    from hidream_ui.outputs import read_metadata

    source = png_base64(seed=3)
    arguments = {"image": source, "instruction": "make it blue", "num_inference_steps": 2, "seed": 11}

    async def main():
        async with mcp_session(keyed_app["url"], KEYS[0]) as client:
            edited = await client.call_tool("edit", {**arguments, "working_resolution": "draft"})
            assert not edited.is_error, edited.content[0].text
            recipe = await client.call_tool("recipe", {"image": edited.content[0].data})
            not_ours = await client.call_tool("recipe", {"image": source})
            return edited, recipe, not_ours

    edited, recipe, not_ours = asyncio.run(main())
    image, text = edited.content
    assert (image.type, image.mime_type) == ("image", "image/png")
    png = base64.b64decode(image.data)
    metadata = read_metadata(png)  # what the browser's download carries
    assert metadata["params"]["instruction"] == "make it blue"
    assert metadata["params"]["num_inference_steps"] == 2 and metadata["params"]["seed"] == 11
    answer = json.loads(text.text)
    assert answer["seed"] == 11 and answer["recipe"] == metadata["params"]
    assert not recipe.is_error and recipe.structured_content["params"] == metadata["params"]
    assert not_ours.is_error and "no hidream_ui settings" in not_ours.content[0].text
    # The result was saved like a browser's: in --output-dir, with its sidecar.
    assert any(keyed_app["config"].output_dir.glob("*.png"))


@pytest.mark.slow
def test_an_agent_is_its_key_and_a_cancelled_call_stops_its_edit(keyed_app):
    from hidream_ui.cli.app import per_client_message
    from hidream_ui.outputs import read_metadata

    config = keyed_app["config"]
    long_edit = {"image": png_base64(seed=5), "instruction": "a long edit", "num_inference_steps": 200}
    short_edit = {"image": png_base64(seed=6), "instruction": "short", "num_inference_steps": 1}

    async def state(client) -> dict:
        answer = await client.call_tool("status", {})
        assert not answer.is_error, answer.content[0].text
        return answer.structured_content

    async def main():
        async with (
            mcp_session(keyed_app["url"], KEYS[0]) as first,
            mcp_session(keyed_app["url"], KEYS[0]) as again,
            mcp_session(keyed_app["url"], KEYS[1]) as other,
        ):
            running = asyncio.ensure_future(first.call_tool("edit", long_edit))
            for _ in range(3000):  # until the edit runs (the model may load first)
                if (await state(other))["state"] == "editing":
                    break
                await asyncio.sleep(0.05)
            assert (await state(other))["state"] == "editing"
            # Another session of the same key is the same agent: its one job is taken.
            refused = await again.call_tool("edit", short_edit)
            assert refused.is_error and refused.content[0].text == per_client_message(config, 1)
            assert refused.structured_content["error"]["code"] == "per_client_limit"
            # Another key is another agent: admitted (it waits behind the long edit).
            queued = asyncio.ensure_future(other.call_tool("edit", short_edit))
            # The first agent gives up: its edit stops, so the other's runs and the first may edit again.
            running.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await running
            done = await queued
            assert not done.is_error, done.content[0].text
            retried = await again.call_tool("edit", short_edit)
            assert not retried.is_error, retried.content[0].text

    asyncio.run(main())
    wait_for(lambda: keyed_app["engine"].status().state == "idle", "the engine to go idle")
    # The long edit was stopped, not left to run out: a cancelled edit saves nothing.
    saved = [
        read_metadata(png)["params"]["instruction"]
        for png in config.output_dir.glob("*.png")
        if "mask-" not in png.name
    ]
    assert "short" in saved and "a long edit" not in saved


@pytest.mark.slow
def test_kiosk_lists_no_operator_controls(launch_app):
    app = launch_app("mcp_kiosk", mcp=True, kiosk=True, operator=("op", "operator-password"))

    async def main():
        async with mcp_session(app["url"]) as client:
            names = {tool.name for tool in (await client.list_tools()).tools}
            called = await client.call_tool("set_speed", {"name": "fast"})
            status = await client.call_tool("status", {})
            return names, called, status

    names, called, status = asyncio.run(main())
    assert names == VISITOR_TOOLS
    assert called.is_error and "no tool 'set_speed'" in called.content[0].text
    assert not status.is_error and "queue" in status.structured_content
