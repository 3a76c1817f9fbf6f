"""The app's MCP server (``--mcp``): tools an agent can use, at ``/mcp`` (streamable HTTP).

Tools (server/mcp_schema.py says what each takes): ``edit`` (an image as base64, an instruction, every
setting of the Edit form, an optional mask: answers the edited PNG, its seed and its recipe),
``status`` (the app's ``/status`` JSON), ``recipe`` (the settings stored in a PNG this app made), and
the engine-wide controls ``set_attention``, ``set_speed``, ``load_model``, listed only without
``--kiosk`` (with it they are the operator's: never listed, and a call of one is told there is no
such tool; the app's own `@operator_only` would refuse it too).

No tool is a second way in. Every call is made through `Loopback`: the app's own gradio routes, in
process, as the caller, so the queue and its admission (``--max-queue``, ``--max-jobs-per-client``),
the guard (upload caps, per-client storage), the login and the kiosk rules see an agent exactly as
they see a browser.

**Who is charged.** `ApiGate` names the caller of each HTTP request: with ``--api-keys`` its key
(every key a client of its own, acting as the login ``api-<label>`` where the app has a login),
without keys its address (the app then has no login; an app with one and no keys refuses MCP). Not
the MCP session: the 2026-07-28 protocol (the `mcp` 2.x client's default) has none, and sessions are
free to open, so charging per session would let one caller multiply its job slots by opening more.
A key's MCP and ``/v1`` calls share the key's ``--max-jobs-per-client`` jobs. Per agent, too: its
POSTs in flight, its open sessions (each its own), and new sessions per address and minute
(``--max-new-sessions``); a body of thousands of JSON objects is refused before MCP parses it.

**Cancelling.** An MCP client that cancels a call (``notifications/cancelled``, or closing the
request's stream) cancels the handler: the edit is then stopped like a browser's Stop (after its
current step), and its job slot is free again.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import json
import logging
from typing import Any, Awaitable, Callable

import anyio
import mcp_types as types
from mcp.server.auth.middleware.bearer_auth import AuthenticatedUser
from mcp.server.auth.provider import AccessToken
from mcp.server.lowlevel import Server
from mcp.server.streamable_http_manager import StreamableHTTPSessionManager
from mcp.server.transport_security import TransportSecuritySettings
from mcp_types.version import HANDSHAKE_PROTOCOL_VERSIONS

from hidream_ui.server import mcp_schema
from hidream_ui.server.api_keys import ApiGate
from hidream_ui.server.guard import NewSessions
from hidream_ui.server.loopback import Caller, CallRefused, Loopback, file_data
from hidream_ui.server.mcp_schema import ToolArgumentError
from hidream_ui.server.service_routes import Service, jsonrpc_error

logger = logging.getLogger(__name__)

PREFIX = "/mcp"
CALLER_KEY = "hidream_ui.caller"  # where the entrance leaves the request's Caller in its ASGI scope
# One JSON answer per request (not an SSE stream): the edited PNG rides in it as base64, and the
# `mcp` client caps one SSE event at 1 MiB by default, which a full-size result passes.
JSON_RESPONSE = True
MAX_SESSIONS = 1000  # open handshake-era sessions, all callers together (each holds a small task)
# Open sessions of one agent (a key, or an address without keys). Without it one caller fills the whole
# table: --max-new-sessions (120 a minute by default) for the 15 minutes a session idles, and every other
# handshake-era client is refused ("Too many open sessions") until they expire.
MAX_SESSIONS_PER_AGENT = 32
SESSION_IDLE_SECONDS = 15 * 60  # a session with no request for this long is closed
CANCEL_GRACE_SECONDS = 10.0  # how long a cancelled call waits for its edit's cancel to be sent
RECIPE_READERS = 2  # PNG metadata reads at a time (chunk walks, no pixels decoded; bounded anyway)
OPERATOR_TOOLS = ("set_attention", "set_speed", "load_model")
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
REFUSED = -32001  # the JSON-RPC error code of a request refused before MCP reads it (implementation-defined range)
# Objects and lists in one request body. MCP parses a body on the server's event loop, into Python
# objects and then pydantic models, before any tool sees it: 4.8 MB of `[]` in one argument held the
# whole app (every browser too) for 7 s, and a body may be 2 x --max-upload-mb as base64 (133 MB by
# default). A real call holds a few dozen (base64 and the settings hold none); counted as `{` and `[`
# bytes before the body is parsed (brackets inside strings count too: a cheap over-count).
MAX_JSON_CONTAINERS = 1_000
# POSTs one agent may have in flight at once beyond its --max-jobs-per-client edits (status polls, a
# recipe, the listing): each holds its body (up to the cap above) and its parse in memory until it ends.
EXTRA_REQUESTS = 4

Handler = Callable[[Caller, dict, asyncio.Event], Awaitable[types.CallToolResult]]


def service(config, services, loopback: Loopback, gate: ApiGate) -> Service:
    """The MCP service for `ServiceRoutes` (cli/app.py `_services`): its ASGI app at ``/mcp``, its body
    cap and the session manager's lifespan (entered with the app's)."""
    from hidream_ui import __version__

    tools = McpTools(config, services, loopback)
    server = Server(
        "hidream_ui",
        version=__version__,
        title="HiDream image editing",
        instructions=(
            "Edit images with the `edit` tool (base64 image + instruction). `status` shows the device "
            "and the queue; `recipe` reads the settings back from a PNG this app made."
        ),
        on_list_tools=tools.list_tools,
        on_call_tool=tools.call_tool,
    )
    body = mcp_schema.max_body_bytes(config.max_upload_mb)
    manager = StreamableHTTPSessionManager(
        app=server,
        json_response=JSON_RESPONSE,
        security_settings=transport_security(config),
        max_request_body_size=body,
        session_idle_timeout=SESSION_IDLE_SECONDS,
        max_sessions=MAX_SESSIONS,
    )
    entrance = Entrance(
        manager,
        gate,
        NewSessions(config.max_new_sessions),
        max_requests=config.max_jobs_per_client + EXTRA_REQUESTS,
    )
    return Service(
        name="mcp",
        prefix=PREFIX,
        app=entrance,
        max_body_bytes=body,
        lifespan=manager.run,
        refusal_body=jsonrpc_error,  # an MCP client shows a JSON-RPC error's message
    )


def transport_security(config) -> TransportSecuritySettings | None:
    """DNS-rebinding protection (the `mcp` package's Host / Origin checks) where the app listens on
    this machine only and no proxy forwards to it: there a page of another site must not reach it
    through a name that resolves to 127.0.0.1. Elsewhere the Host is whatever name the app is served
    under; the guard, the keys and the login apply there."""
    if config.host not in LOOPBACK_HOSTS or config.forwarded_allow_ips:
        return None
    return TransportSecuritySettings(
        enable_dns_rebinding_protection=True,
        allowed_hosts=["127.0.0.1:*", "localhost:*", "[::1]:*"],
        allowed_origins=["http://127.0.0.1:*", "http://localhost:*", "http://[::1]:*"],
    )


class Entrance:
    """ASGI app in front of the MCP session manager: names the caller of every request (`ApiGate`:
    a key, or the address) and refuses the ones the gate refuses before MCP reads a byte; bounds the
    POSTs one agent has in flight (`max_requests`) and refuses a body of more than
    `MAX_JSON_CONTAINERS` objects and lists before MCP parses it; limits new MCP sessions per address."""

    def __init__(
        self,
        manager: StreamableHTTPSessionManager,
        gate: ApiGate,
        new_sessions: NewSessions,
        *,
        max_requests: int = 2 + EXTRA_REQUESTS,
    ):
        self.manager = manager
        self.gate = gate
        self.new_sessions = new_sessions
        self.max_requests = max_requests
        self._in_flight: dict[str, int] = {}  # agent -> its POSTs in flight (agents with none are forgotten)
        self._sessions: dict[str, set[str]] = {}  # agent -> the session ids it opened (ended ones pruned)

    async def __call__(self, scope, receive, send):
        if scope.get("type") != "http":
            return
        try:
            caller = self.gate.caller(scope)
        except CallRefused as exc:
            return await _refuse(send, exc)
        # `user`: the agent owns the sessions it opens (the manager answers another agent's request
        # naming one "Session not found"), so a session id seen in a log lets nobody else use it.
        scope = {**scope, CALLER_KEY: caller, "user": _owner(caller)}
        if scope.get("method") != "POST":  # a handshake-era GET stream or DELETE: no body, no tool call
            return await self.manager.handle_request(scope, receive, send)
        held = self._in_flight.get(caller.agent, 0)
        if held >= self.max_requests:
            await _drain(receive)  # refused unread: a client still sending would see a reset, not the 429
            message = f"Too many MCP requests of yours at once (at most {self.max_requests}): wait for one to end."
            return await _refuse(send, CallRefused(429, "too_many_requests", message))
        self._in_flight[caller.agent] = held + 1
        try:
            await self._post(caller, scope, receive, send)
        finally:
            left = self._in_flight.get(caller.agent, 1) - 1
            if left > 0:
                self._in_flight[caller.agent] = left
            else:
                self._in_flight.pop(caller.agent, None)

    async def _post(self, caller: Caller, scope, receive, send) -> None:
        body, receive = await _read_body(receive)
        if body is None:
            return  # the client went away, or the guard cut a body over the cap (it answers the 413)
        if body.count(b"{") + body.count(b"[") > MAX_JSON_CONTAINERS:
            logger.warning("refused an MCP request of more than %d JSON objects and lists", MAX_JSON_CONTAINERS)
            message = f"The request holds more than {MAX_JSON_CONTAINERS} JSON objects and lists: send one call."
            return await _refuse(send, CallRefused(413, "too_complex", message))
        # Only a request that can open a session counts (MCP refuses any other Content-Type): a page of
        # another site can POST text/plain from its visitors' browsers, and must not use up their address's
        # new sessions that way.
        if _opens_session(scope) and _json_content(scope):
            if len(self._open_sessions(caller.agent)) >= MAX_SESSIONS_PER_AGENT:
                message = (
                    f"You have {MAX_SESSIONS_PER_AGENT} MCP sessions open (at most {MAX_SESSIONS_PER_AGENT}): "
                    "close one (DELETE) or wait for one to idle out."
                )
                return await _refuse(send, CallRefused(429, "too_many_open_sessions", message))
            wait = self.new_sessions.admit(caller.address, None)
            if wait > 0:
                message = f"Too many new MCP sessions from this address: try again in {wait:.0f} s."
                return await _refuse(send, CallRefused(429, "too_many_sessions", message, retry_after=wait))
            send = self._recording_session(caller.agent, send)
        if not _handshake_era(scope):
            return await _until_disconnect(self.manager.handle_request, scope, receive, send)
        await self.manager.handle_request(scope, receive, send)

    def _open_sessions(self, agent: str) -> set[str]:
        """The sessions `agent` opened that the manager still holds (ended ones are forgotten here)."""
        # The manager's table of live sessions (mcp 2.3's; no public accessor): sessions also end by
        # idling out or by the client's DELETE, which this app does not see.
        live = getattr(self.manager, "_server_instances", None)
        if live is not None and len(self._sessions) > MAX_SESSIONS:  # agents that never came back
            for other in list(self._sessions):
                self._sessions[other] &= live.keys()
                if not self._sessions[other]:
                    del self._sessions[other]
        opened = self._sessions.get(agent, set())
        if live is not None:
            opened &= live.keys()
        if opened:
            self._sessions[agent] = opened
        else:
            self._sessions.pop(agent, None)
        return opened

    def _recording_session(self, agent: str, send):
        """`send`, noting the session id a successful opening answer carries as `agent`'s."""

        async def recording(message):
            if message.get("type") == "http.response.start" and message.get("status", 500) < 400:
                session = dict(message.get("headers", ())).get(b"mcp-session-id")
                if session:
                    self._sessions.setdefault(agent, set()).add(session.decode("latin-1"))
            await send(message)

        return recording


async def _read_body(receive):
    """(the whole body, a `receive` that replays it) of a request (the guard caps its size); the body
    is None when the client went away first (or the guard cut it)."""
    messages, pieces, more = [], [], True
    while more:
        message = await receive()
        if message.get("type") == "http.disconnect":
            return None, receive
        messages.append(message)
        pieces.append(message.get("body", b""))
        more = message.get("more_body", False)
    replay = iter(messages)

    async def replayed():
        message = next(replay, None)
        return message if message is not None else await receive()

    return b"".join(pieces), replayed


async def _drain(receive) -> None:
    """Reads a refused request's body to its end, keeping none of it (the guard caps its size)."""
    while True:
        message = await receive()
        if message.get("type") == "http.disconnect" or not message.get("more_body", False):
            return


def _owner(caller: Caller) -> AuthenticatedUser:
    return AuthenticatedUser(AccessToken(token="", client_id=caller.agent, scopes=[]))


def _json_content(scope) -> bool:
    kind = dict(scope.get("headers", ())).get(b"content-type", b"").decode("latin-1")
    return kind.split(";", 1)[0].strip().lower() == "application/json"


def _handshake_era(scope) -> bool:
    """A request of the handshake-era protocol (sessions, `initialize`): no MCP-Protocol-Version header,
    or one of those versions. The 2026-07-28 era sends its version on every request."""
    version = dict(scope.get("headers", ())).get(b"mcp-protocol-version")
    return version is None or version.decode("latin-1") in HANDSHAKE_PROTOCOL_VERSIONS


def _opens_session(scope) -> bool:
    """A handshake-era POST without a session id: it opens a session (the 2026-07-28 era has none)."""
    headers = dict(scope.get("headers", ()))
    return scope.get("method") == "POST" and b"mcp-session-id" not in headers and _handshake_era(scope)


async def _until_disconnect(app, scope, receive, send) -> None:
    """Runs `app` (one 2026-07-28 request: answered in this task) and cancels it when the client goes
    away: in that era a client cancels a call by closing its request, and nothing else reads the
    connection once the body is in. (A handshake-era client sends `notifications/cancelled`.)"""
    body_read = anyio.Event()

    async def tracked():
        message = await receive()
        if message.get("type") == "http.disconnect" or not message.get("more_body", False):
            body_read.set()
        return message

    async with anyio.create_task_group() as group:

        async def watch() -> None:
            await body_read.wait()
            while (await receive()).get("type") != "http.disconnect":
                pass
            group.cancel_scope.cancel()

        group.start_soon(watch)
        try:
            await app(scope, tracked, send)
        finally:
            group.cancel_scope.cancel()


async def _refuse(send, exc: CallRefused) -> None:
    """An HTTP refusal with a JSON-RPC error body: MCP clients show its message (the reason is in
    `data`), where any other body only gets them a generic "error response"."""
    error = {"code": REFUSED, "message": exc.message, "data": {"reason": exc.code, "status": exc.status}}
    body = json.dumps({"jsonrpc": "2.0", "id": None, "error": error}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if exc.status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    if exc.retry_after is not None:
        headers.append((b"retry-after", str(max(1, round(exc.retry_after))).encode()))
    await send({"type": "http.response.start", "status": exc.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class McpTools:
    """The tools and their handlers. Every handler acts as the request's `Caller` through `Loopback`."""

    def __init__(self, config, services, loopback: Loopback):
        self.config = config
        self.loopback = loopback
        self.variant = config.variant
        self.rewriter = getattr(services, "rewriter", None) is not None
        self.max_upload = config.max_upload_mb * 1024 * 1024
        self.max_pixels = config.max_pixels
        self._recipes: asyncio.Semaphore | None = None  # made on first use (in the server's loop)
        self._edit_parameters: list[str] | None = None
        self.services = services
        self.handlers: dict[str, Handler] = {"edit": self.edit, "status": self.status, "recipe": self.recipe}
        if not config.kiosk:
            self.handlers.update({name: getattr(self, name) for name in OPERATOR_TOOLS})

    # ------------------------------------------------------------------ listing
    def tools(self) -> list[types.Tool]:
        max_mb = self.config.max_upload_mb
        listed = [
            types.Tool(
                name="edit",
                title="Edit an image",
                description=mcp_schema.EDIT_DESCRIPTION,
                input_schema=mcp_schema.edit_schema(self.variant, max_upload_mb=max_mb, rewriter=self.rewriter),
                annotations=types.ToolAnnotations(read_only_hint=False, destructive_hint=False, open_world_hint=False),
            ),
            types.Tool(
                name="status",
                title="App status",
                description=mcp_schema.STATUS_DESCRIPTION,
                input_schema={"type": "object", "properties": {}},
                annotations=types.ToolAnnotations(read_only_hint=True, open_world_hint=False),
            ),
            types.Tool(
                name="recipe",
                title="Settings of a result",
                description=mcp_schema.RECIPE_DESCRIPTION,
                input_schema=mcp_schema.recipe_schema(max_mb),
                annotations=types.ToolAnnotations(read_only_hint=True, open_world_hint=False),
            ),
        ]
        if not self.config.kiosk:
            listed.extend(operator_tools())
        return listed

    async def list_tools(self, ctx, params) -> types.ListToolsResult:
        return types.ListToolsResult(tools=self.tools())

    # ------------------------------------------------------------------ calling
    async def call_tool(self, ctx, params: types.CallToolRequestParams) -> types.CallToolResult:
        handler = self.handlers.get(params.name)
        if handler is None:
            return error_result(
                CallRefused(404, "unknown_tool", f"no tool {params.name!r}; this app offers {', '.join(self.handlers)}")
            )
        request = getattr(ctx, "request", None)
        caller = getattr(request, "scope", {}).get(CALLER_KEY) if request is not None else None
        if not isinstance(caller, Caller):  # not through the Entrance: never served
            return error_result(CallRefused(403, "no_caller", "this request did not come through the app's /mcp"))
        try:
            return await until_done(lambda cancelled: handler(caller, dict(params.arguments or {}), cancelled))
        except CallRefused as exc:
            return error_result(exc)
        except ToolArgumentError as exc:
            return error_result(CallRefused(400, "invalid_argument", str(exc)))
        except Exception:  # noqa: BLE001 - the agent gets an answer; the log gets the traceback
            logger.exception("MCP tool %s failed", params.name)
            return error_result(CallRefused(500, "server_error", f"{params.name} failed on the server (see its log)"))

    # ------------------------------------------------------------------ tools
    async def edit(self, caller: Caller, arguments: dict, cancelled: asyncio.Event) -> types.CallToolResult:
        call = mcp_schema.edit_call(arguments, self.variant, rewriter=self.rewriter)
        values = dict(call.values)
        # The caller's job slot first: an agent with every job slot busy is refused before its images
        # are decoded or stored. Then each image's header, as the app reads it (off the event loop):
        # an image the edit would refuse is refused before it is stored in the app's cache.
        async with self.loopback.reserve(caller) as slot:
            image, name = await self._decode(call.image, "image")
            mask = await self._decode(call.mask, "mask") if call.mask is not None else None
            stored = await self.loopback.upload(caller, name, image, _content_type(name))
            values["image"] = file_data(stored, name)
            if mask is not None:
                stored = await self.loopback.upload(caller, mask[1], mask[0], _content_type(mask[1]))
                values["mask"] = file_data(stored, mask[1])
            if cancelled.is_set():
                raise CallRefused(499, "cancelled", "the caller went away before the edit started")
            data = mcp_schema.ordered(values, self.edit_parameters())
            outputs = await self.loopback.call(caller, "edit", data, cancelled=cancelled, slot=slot)
        png_file, seed, summary = _edit_outputs(outputs)
        try:
            png = await self.loopback.fetch(caller, png_file)
        except CallRefused as exc:  # gradio's refusal names the server path it refused: the log's, not the agent's
            logger.warning("the result of an MCP edit could not be read back (%s): %s", exc.status, exc.message)
            raise CallRefused(
                500, "result_gone", "the edit's result is no longer kept by the server (see its log)"
            ) from None
        recipe = await self._read_recipe(png)
        answer = {"seed": seed, "summary": summary, "recipe": recipe["params"]}
        return types.CallToolResult(
            content=[
                types.ImageContent(type="image", data=_b64(png), mime_type="image/png"),
                types.TextContent(type="text", text=json.dumps(answer, indent=1)),
            ],
            structured_content=answer,
        )

    async def status(self, caller: Caller, arguments: dict, cancelled: asyncio.Event) -> types.CallToolResult:
        _no_arguments("status", arguments)
        # Its own sessions: /status never waits in the queue, and must answer while the agent's
        # edits hold every job slot it has (that is when it asks).
        outputs = await self.loopback.call(dataclasses.replace(caller, agent=caller.agent + "/status"), "status", [])
        return _json_result(outputs[0] if outputs else None)

    async def recipe(self, caller: Caller, arguments: dict, cancelled: asyncio.Event) -> types.CallToolResult:
        unknown = sorted(set(arguments) - {"image"})
        if unknown:
            raise ToolArgumentError(f"unknown argument(s) {', '.join(unknown)}; the recipe tool takes image")
        if self._recipes is None:
            self._recipes = asyncio.Semaphore(RECIPE_READERS)
        async with self._recipes:  # decoded (up to --max-upload-mb) and read RECIPE_READERS at a time
            png, _ = await anyio.to_thread.run_sync(
                mcp_schema.decode_image, arguments.get("image"), "image", self.max_upload
            )
            return _json_result(await self._read_recipe(png, gated=False))

    async def _decode(self, value: object, field: str) -> tuple[bytes, str]:
        """`mcp_schema.decode_image` with the header check, on a worker thread (a 50 MB base64 text
        takes a while to decode, and the event loop serves every browser too)."""
        return await anyio.to_thread.run_sync(mcp_schema.decode_image, value, field, self.max_upload, self.max_pixels)

    async def _read_recipe(self, png: bytes, *, gated: bool = True) -> dict[str, Any]:
        """{"params": the validated settings, "metadata": everything the PNG's metadata holds}, read
        by the app's own reader (`outputs.read_metadata`, `EditParams.from_dict`) on a worker thread."""
        from hidream_ui.edits import EditParams, RequestError
        from hidream_ui.imaging import ImageError
        from hidream_ui.outputs import MetadataError, read_metadata

        def read() -> dict[str, Any]:
            metadata = read_metadata(png)
            return {"params": EditParams.from_dict(metadata["params"]).to_dict(), "metadata": metadata}

        if self._recipes is None:
            self._recipes = asyncio.Semaphore(RECIPE_READERS)
        async with self._recipes if gated else contextlib.nullcontext():
            try:
                return await anyio.to_thread.run_sync(read)
            except (MetadataError, ImageError, RequestError, KeyError) as exc:
                raise CallRefused(
                    400, "no_recipe", str(exc) if not isinstance(exc, KeyError) else "no params"
                ) from None
            except RecursionError:  # json.loads of a chunk nested thousands deep: the agent's error, not ours
                raise CallRefused(
                    400, "no_recipe", "image: the hidream_ui chunk is not valid JSON (nested too deeply)"
                ) from None

    async def set_attention(self, caller: Caller, arguments: dict, cancelled: asyncio.Event) -> types.CallToolResult:
        name = _text_argument("set_attention", arguments, "name", required=True)
        engine = _text_argument("set_attention", arguments, "engine", default="all", allowed=("name", "engine"))
        return _json_result((await self.loopback.call(caller, "set_attention", [name, engine]))[0])

    async def set_speed(self, caller: Caller, arguments: dict, cancelled: asyncio.Event) -> types.CallToolResult:
        name = _text_argument("set_speed", arguments, "name", required=True, allowed=("name",))
        return _json_result((await self.loopback.call(caller, "set_speed", [name]))[0])

    async def load_model(self, caller: Caller, arguments: dict, cancelled: asyncio.Event) -> types.CallToolResult:
        _no_arguments("load_model", arguments)
        return _json_result((await self.loopback.call(caller, "load_model", [], cancelled=cancelled))[0])

    def edit_parameters(self) -> list[str]:
        """The `/edit` inputs' names in their order (gradio's API info of the running app)."""
        if self._edit_parameters is None:
            demo = getattr(self.services, "demo", None)
            if demo is None:
                raise CallRefused(503, "not_ready", "the app is still starting")
            info = demo.get_api_info()["named_endpoints"]["/edit"]["parameters"]
            self._edit_parameters = [parameter["parameter_name"] for parameter in info]
        return self._edit_parameters


def operator_tools() -> list[types.Tool]:
    """The engine-wide controls (never listed with --kiosk)."""
    operator = types.ToolAnnotations(read_only_hint=False, destructive_hint=False, open_world_hint=False)
    return [types.Tool(**fields, annotations=operator) for fields in mcp_schema.operator_tool_fields()]


async def until_done(run: Callable[[asyncio.Event], Awaitable[types.CallToolResult]]) -> types.CallToolResult:
    """Runs `run(cancelled)` to its end; when the MCP request is cancelled meanwhile (the client's
    ``notifications/cancelled``, or its stream closed), sets `cancelled` (`Loopback` then stops the
    edit the way a browser's Stop does) and waits a little for that before the cancel goes on."""
    cancelled = asyncio.Event()
    task = asyncio.ensure_future(run(cancelled))
    # Retrieved here even when nobody awaits it any more (a cancel whose edit outlived the grace).
    task.add_done_callback(lambda done: done.cancelled() or done.exception())
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        cancelled.set()
        with anyio.CancelScope(shield=True), anyio.move_on_after(CANCEL_GRACE_SECONDS):
            with contextlib.suppress(Exception):
                await task
        raise


def error_result(exc: CallRefused) -> types.CallToolResult:
    """A tool error the agent reads (MCP's `isError`): the app's message, with its HTTP status and code."""
    error: dict[str, Any] = {"status": exc.status, "code": exc.code, "message": exc.message}
    if exc.retry_after is not None:
        error["retry_after"] = exc.retry_after
    return types.CallToolResult(
        content=[types.TextContent(type="text", text=exc.message)], structured_content={"error": error}, is_error=True
    )


def _json_result(value: Any) -> types.CallToolResult:
    structured = value if isinstance(value, dict) else {"result": value}
    return types.CallToolResult(
        content=[types.TextContent(type="text", text=json.dumps(value, indent=1, default=str))],
        structured_content=structured,
    )


def _edit_outputs(outputs: list[Any]) -> tuple[str, Any, str]:
    """(the result PNG's server path, the seed, the summary) of `/edit`'s outputs: [slider, png, seed,
    summary, ...]."""
    if len(outputs) < 4 or not isinstance(outputs[1], dict) or not isinstance(outputs[1].get("path"), str):
        raise CallRefused(500, "server_error", "the edit finished without a result PNG (see the app's log)")
    return outputs[1]["path"], outputs[2], str(outputs[3] or "")


def _no_arguments(tool: str, arguments: dict) -> None:
    if arguments:
        raise ToolArgumentError(f"the {tool} tool takes no arguments, got {', '.join(sorted(arguments))}")


def _text_argument(
    tool: str, arguments: dict, name: str, *, required: bool = False, default: str | None = None, allowed=()
) -> str:
    unknown = sorted(set(arguments) - set(allowed or (name,)))
    if allowed and unknown:
        raise ToolArgumentError(f"unknown argument(s) {', '.join(unknown)}; the {tool} tool takes {', '.join(allowed)}")
    value = arguments.get(name, default)
    if value is None and required:
        raise ToolArgumentError(f"{name}: required")
    if not isinstance(value, str):
        raise ToolArgumentError(f"{name}: expected text, got {type(value).__name__}")
    return value


def _content_type(name: str) -> str:
    extension = name.rpartition(".")[2]
    return {"jpg": "image/jpeg", "tiff": "image/tiff"}.get(extension, f"image/{extension}")


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


__all__ = ["CALLER_KEY", "OPERATOR_TOOLS", "PREFIX", "Entrance", "McpTools", "service", "transport_security"]
