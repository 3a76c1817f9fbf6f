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


# ------------------------------------------------------------------------ the entrance and the tools, faked


class FakeManager:
    """The MCP session manager's seat: reads the body, answers 200 with a new session id (400 for a body
    MCP would refuse: not JSON), and can hold requests open (`hold`)."""

    def __init__(self):
        self.calls: list[tuple[dict, bytes]] = []
        self._server_instances: dict[str, object] = {}
        self.hold: asyncio.Event | None = None

    async def handle_request(self, scope, receive, send):
        body, more = b"", True
        while more:
            message = await receive()
            body += message.get("body", b"")
            more = message.get("more_body", False)
        self.calls.append((scope, body))
        if self.hold is not None:
            await self.hold.wait()
        kind = dict(scope["headers"]).get(b"content-type", b"")
        status = 200 if kind.startswith(b"application/json") else 400
        session = f"s{len(self.calls)}"
        if status == 200:
            self._server_instances[session] = object()
        headers = [(b"content-type", b"application/json"), (b"mcp-session-id", session.encode())]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": b"{}"})


def entrance(manager, *, per_minute=1000, max_requests=6):
    from hidream_ui.server.api_keys import ApiGate
    from hidream_ui.server.guard import NewSessions
    from hidream_ui.server.mcp_tools import Entrance

    return Entrance(manager, ApiGate(None, public=True), NewSessions(per_minute), max_requests=max_requests)


async def post(app, body: bytes, *, kind=b"application/json", address="10.0.0.1", session=None) -> tuple[int, dict]:
    """One POST /mcp through `app` (a handshake-era opening request unless `session`): (status, JSON body)."""
    headers = [(b"content-type", kind), (b"accept", b"application/json, text/event-stream")]
    if session is not None:
        headers.append((b"mcp-session-id", session.encode()))
    scope = {"type": "http", "method": "POST", "path": "/mcp", "headers": headers, "client": (address, 5)}
    messages = iter([{"type": "http.request", "body": body, "more_body": False}])
    sent: list[dict] = []

    async def receive():
        message = next(messages, None)
        if message is None:
            await asyncio.Event().wait()  # the client stays: no disconnect
        return message

    async def send(message):
        sent.append(message)

    await app(scope, receive, send)
    status = next(message["status"] for message in sent if message["type"] == "http.response.start")
    return status, json.loads(b"".join(message.get("body", b"") for message in sent) or b"{}")


INITIALIZE = json.dumps({"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {}}).encode()


def test_a_body_of_many_json_containers_is_refused_before_mcp_parses_it():
    from hidream_ui.server.mcp_tools import MAX_JSON_CONTAINERS

    manager = FakeManager()
    app = entrance(manager)
    # 4.8 MB of `[]` in one argument held the whole app's event loop for 7 s inside MCP's parser.
    junk = b'{"jsonrpc": "2.0", "id": 1, "params": {"arguments": {"x": [' + b"[]," * MAX_JSON_CONTAINERS + b"[]]}}}"
    status, answer = asyncio.run(post(app, junk))
    assert (status, answer["error"]["data"]["reason"]) == (413, "too_complex") and manager.calls == []
    assert asyncio.run(post(app, INITIALIZE))[0] == 200 and manager.calls[0][1] == INITIALIZE  # replayed whole


def test_sessions_are_counted_and_owned_per_agent(monkeypatch):
    from hidream_ui.server import mcp_tools

    monkeypatch.setattr(mcp_tools, "MAX_SESSIONS_PER_AGENT", 3)
    manager = FakeManager()
    app = entrance(manager, per_minute=3)

    async def main():
        # A page of another site can POST text/plain from its visitors' browsers (MCP refuses it):
        # that must not use up their address's new sessions.
        for _ in range(5):
            assert (await post(app, INITIALIZE, kind=b"text/plain"))[0] == 400
        opened = [await post(app, INITIALIZE) for _ in range(3)]
        assert [status for status, _ in opened] == [200, 200, 200]
        full = await post(app, INITIALIZE)
        other = await post(app, INITIALIZE, address="10.0.0.2")
        manager._server_instances.pop("s6")  # one of the first agent's sessions idled out
        again = await post(app, INITIALIZE, address="10.0.0.1")
        return full, other, again

    (full, refused), (other, _), (again, limited) = asyncio.run(main())
    assert (full, refused["error"]["data"]["reason"], other) == (429, "too_many_open_sessions", 200)
    # Room again for its sessions, but --max-new-sessions (3 a minute here) still counts the address.
    assert again == 429 and limited["error"]["data"]["reason"] == "too_many_sessions"
    # The manager sees each request's agent as its `user`: it answers a session of another agent 404.
    owners = {scope["user"].display_name for scope, _ in manager.calls}
    assert owners == {"address:10.0.0.1", "address:10.0.0.2"}


def test_an_agent_has_a_bounded_number_of_requests_in_flight():
    manager = FakeManager()
    manager.hold = asyncio.Event()
    app = entrance(manager, max_requests=2)
    body = json.dumps({"jsonrpc": "2.0", "id": 1, "method": "tools/list"}).encode()

    async def main():
        held = [asyncio.ensure_future(post(app, body, session="s")) for _ in range(2)]
        while len(manager.calls) < 2:
            await asyncio.sleep(0)
        refused = await asyncio.wait_for(post(app, body, session="s"), 60)  # (a hang, should it be admitted)
        other = asyncio.ensure_future(post(app, body, session="s", address="10.0.0.9"))  # another agent: admitted
        while len(manager.calls) < 3:
            await asyncio.sleep(0)
        manager.hold.set()
        done = await asyncio.gather(*held, other)
        return refused, done, await post(app, body, session="s")

    (status, answer), done, after = asyncio.run(main())
    assert (status, answer["error"]["data"]["reason"]) == (429, "too_many_requests")
    assert [code for code, _ in done] == [200, 200, 200] and after[0] == 200


class FakeLoopback:
    """`Loopback`'s seat: records uploads; its file route refuses the result naming a server path."""

    def __init__(self, *, slots=True):
        self.slots = slots
        self.uploads: list[str] = []

    @contextlib.asynccontextmanager
    async def reserve(self, caller):
        from hidream_ui.server.loopback import CallRefused

        if not self.slots:
            raise CallRefused(429, "per_client_limit", "You already have 1 job(s) queued or running")
        yield 0

    async def upload(self, caller, name, data, content_type):
        self.uploads.append(name)
        return f"/srv/secret-cache/{name}"

    async def call(self, caller, api_name, data, *, cancelled=None, slot=None):
        return [None, {"path": "/srv/secret-cache/result.png"}, 7, "summary"]

    async def fetch(self, caller, path):
        from hidream_ui.server.loopback import CallRefused

        raise CallRefused(403, "file_failed", f"File {path} is not allowed")


def call_tool(loopback, name: str, arguments: dict):
    """`McpTools.call_tool` as a request through the entrance would make it."""
    from types import SimpleNamespace

    import mcp_types as types

    from hidream_ui.server.loopback import Caller
    from hidream_ui.server.mcp_tools import CALLER_KEY, McpTools

    config = SimpleNamespace(variant="e1.1", max_upload_mb=1, max_pixels=1_000_000, kiosk=False)
    tools = McpTools(config, SimpleNamespace(rewriter=None, demo=None), loopback)
    tools._edit_parameters = ["image", "instruction", "mask"]
    ctx = SimpleNamespace(request=SimpleNamespace(scope={CALLER_KEY: Caller(address="10.0.0.1", agent="address:x")}))
    result = asyncio.run(tools.call_tool(ctx, types.CallToolRequestParams(name=name, arguments=arguments)))
    return result.content[0].text, result.structured_content


def test_an_edit_takes_its_slot_then_checks_its_images_before_storing_them():
    busy = FakeLoopback(slots=False)
    text, _ = call_tool(busy, "edit", {"image": "not base64!", "instruction": "x"})
    assert "already have 1 job" in text  # refused before its images were even decoded
    loopback = FakeLoopback()
    icon = base64.b64encode(b"\0\0\1\0\1\0" + bytes(16) + bytes(40)).decode()
    text, _ = call_tool(loopback, "edit", {"image": png_base64(), "instruction": "x", "mask": icon})
    assert "ICO data" in text and loopback.uploads == []  # a refused call leaves nothing in the cache
    from PIL import Image

    flat = io.BytesIO()
    Image.new("L", (1001, 1000)).save(flat, format="PNG")  # over max_pixels (1,000,000), a few KB
    huge = base64.b64encode(flat.getvalue()).decode()
    text, _ = call_tool(loopback, "edit", {"image": huge, "instruction": "x"})
    assert "1,001,000 pixels" in text and loopback.uploads == []


def test_tool_errors_name_no_server_path_and_survive_a_nested_recipe():
    text, structured = call_tool(FakeLoopback(), "edit", {"image": png_base64(), "instruction": "x"})
    assert structured["error"]["code"] == "result_gone" and "/srv" not in text
    buffer = io.BytesIO()
    from PIL import PngImagePlugin

    info = PngImagePlugin.PngInfo()
    info.add_text("hidream_ui", "[" * 100_000 + "]" * 100_000, zip=True)
    random_picture(1, (32, 32)).save(buffer, format="PNG", pnginfo=info)
    text, structured = call_tool(FakeLoopback(), "recipe", {"image": base64.b64encode(buffer.getvalue()).decode()})
    assert structured["error"]["code"] == "no_recipe" and "nested too deeply" in text


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
