"""Calls of the app's own routes, in-process, on behalf of a caller that is not a browser.

The OpenAI-compatible images route (`server/openai_api.py`) and the MCP tools (`server/mcp_tools.py`)
are not a second way in: each of their calls goes through the very doors a browser uses, as that
caller. `Loopback` speaks Gradio's documented HTTP API (``/gradio_api/upload``, ``/gradio_api/call/
<api_name>``, ``/gradio_api/cancel``, ``/gradio_api/file=``) to the app's whole ASGI stack through
httpx's in-process transport, with the caller's own address as the connection's address and, where
the app has a login, a login of the caller's own. So the guard (body and upload caps, per-client
storage, no remote files), the queue with its admission (``--max-queue``, ``--max-jobs-per-client``),
the login and kiosk rules, and ``/status`` see an API call exactly as they see a browser's.

**Who is charged.** Gradio's admission counts jobs per session. A caller (`Caller.agent`: an API
key, an MCP session, an address) gets at most `slots` sessions of its own, one call at a time each:
so an agent holds at most `slots` jobs however many connections it opens, and a call that finds
all of them busy is refused with the per-client message before anything is uploaded. The session
ids are an HMAC of the agent and the slot under a secret of this process: nobody can guess one and
read another caller's results from gradio's stream, and an agent's sessions stay the same across
its calls (gradio's per-address limit on new sessions counts them once).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import logging
import secrets
import threading
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

logger = logging.getLogger(__name__)

API_PREFIX = "/gradio_api"
CANCEL_WAIT = 60.0  # seconds a cancelled call waits for its event to end (one step of the slowest model)
# A finished event stays in gradio's queue a moment after its answer was streamed: a call that finds
# its slot's session still counted tries again, LINGER_TRIES times LINGER_SECONDS apart.
LINGER_TRIES = 20
LINGER_SECONDS = 0.05


@dataclass(frozen=True)
class Caller:
    """Who makes a call: the connection's address, the agent charged for it, the login it acts as."""

    address: str  # the client's address as the outer request saw it (uvicorn applied --forwarded-allow-ips)
    agent: str  # stable per API key / MCP session / address; never a secret itself (a label or a hash)
    user: str | None = None  # the login the call acts as where the app has one (never the operator)


class CallRefused(Exception):
    """A call the app refused or that failed: `status` (HTTP), `code` (a short reason), the message."""

    def __init__(self, status: int, code: str, message: str, *, retry_after: float | None = None):
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.retry_after = retry_after


@dataclass
class _Slots:
    """Free session slots per agent (bounded: agents with no call in flight are forgotten)."""

    size: int
    busy: dict[str, set[int]] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def take(self, agent: str) -> int | None:
        with self.lock:
            held = self.busy.setdefault(agent, set())
            free = next((slot for slot in range(self.size) if slot not in held), None)
            if free is not None:
                held.add(free)
            return free

    def give(self, agent: str, slot: int) -> None:
        with self.lock:
            held = self.busy.get(agent)
            if held is not None:
                held.discard(slot)
                if not held:
                    del self.busy[agent]


class Loopback:
    """In-process calls of `app_of()` (the app's outermost ASGI app, read when first needed: gradio
    makes it at launch) as a `Caller`.

    `slots`: sessions per agent (``--max-jobs-per-client``); `fn_index`: api_name -> gradio's fn
    index (for cancels); `per_client_message(n)`: the refusal a caller with `n` jobs gets (the
    browser's text).
    """

    def __init__(
        self,
        app_of: Callable[[], Any],
        *,
        slots: int,
        fn_index: Callable[[str], int | None],
        per_client_message: Callable[[int], str],
        sign_in: Callable[[Any, str], list[tuple[bytes, bytes]] | None] | None = None,
    ):
        if slots < 1:
            raise ValueError(f"slots must be at least 1, got {slots}")
        self._app_of = app_of
        self._slots = _Slots(slots)
        self._fn_index = fn_index
        self._per_client_message = per_client_message
        self._sign_in = sign_in
        self._secret = secrets.token_bytes(32)
        self._cookies: dict[str, dict[str, str]] = {}  # user -> gradio login cookie (minted once)
        self._cookie_lock = threading.Lock()
        self._detached: set[asyncio.Future] = set()  # cancels sent after their call's task was dropped

    # ------------------------------------------------------------------ sessions and logins
    def session(self, agent: str, slot: int) -> str:
        """The gradio session id of `agent`'s `slot`: unguessable, the same for every call."""
        return hmac.new(self._secret, f"{agent}\0{slot}".encode(), hashlib.sha256).hexdigest()[:32]

    def _login_cookies(self, user: str | None) -> dict[str, str]:
        if user is None or self._sign_in is None:
            return {}
        with self._cookie_lock:
            if user not in self._cookies:
                headers = self._sign_in({"app": self._gradio_app()}, user) or []
                cookies: dict[str, str] = {}
                for _, value in headers:
                    name, _, rest = value.decode("latin-1").partition("=")
                    cookies[name] = rest.split(";", 1)[0]
                self._cookies[user] = cookies
            return dict(self._cookies[user])

    def _gradio_app(self) -> Any:
        return self._app_of()

    def _client(self, caller: Caller):
        import httpx

        transport = httpx.ASGITransport(app=self._app_of(), client=(caller.address, 0))
        return httpx.AsyncClient(
            transport=transport,
            base_url="http://hidream-ui.internal",
            cookies=self._login_cookies(caller.user),
            timeout=None,  # a queued edit waits as long as the queue is; the caller's disconnect cancels it
        )

    # ------------------------------------------------------------------ calls
    @contextlib.asynccontextmanager
    async def reserve(self, caller: Caller) -> AsyncIterator[int]:
        """Holds one of the caller's session slots for the block (none free: CallRefused 429 with the
        per-client message): calls made with `slot=` run in it one after another, so a request of
        several edits never holds more than one slot, and no other request takes it in between."""
        slot = self._slots.take(caller.agent)
        if slot is None:
            raise CallRefused(429, "per_client_limit", self._per_client_message(self._slots.size))
        try:
            yield slot
        finally:
            self._slots.give(caller.agent, slot)

    async def upload(self, caller: Caller, name: str, data: bytes, content_type: str = "image/png") -> str:
        """Stores `data` through the app's upload route, charged to `caller`; returns the server
        path gradio gives it (what an event may name)."""
        async with self._client(caller) as client:
            answer = await client.post(f"{API_PREFIX}/upload", files={"files": (name, data, content_type)})
        if answer.status_code != 200:
            raise _refusal(answer.status_code, answer.text, "upload")
        paths = answer.json()
        if not isinstance(paths, list) or len(paths) != 1 or not isinstance(paths[0], str):
            # What it answered names server paths: the log's to show, not the caller's.
            logger.warning("the upload route answered %.200r", paths)
            raise CallRefused(500, "upload_failed", "The upload route gave no single file (see the app's log).")
        return paths[0]

    async def call(
        self,
        caller: Caller,
        api_name: str,
        data: list[Any],
        *,
        cancelled: asyncio.Event | None = None,
        slot: int | None = None,
    ) -> list[Any]:
        """Runs the queued event `api_name` with `data` (gradio's simple format: one value per input,
        files as `file_data(path)`) as `caller` and returns its outputs.

        Takes one of the caller's session slots for its duration (none free: 429 with the
        per-client message). `cancelled`, when set while the call waits or runs, cancels the
        event the way a browser's Stop does (the edit stops after its current step) and raises
        CallRefused(499, "cancelled"). `slot`: one the caller holds already (`reserve`).
        """
        async with contextlib.AsyncExitStack() as stack:
            if slot is None:
                slot = await stack.enter_async_context(self.reserve(caller))
            return await self._call(caller, api_name, data, cancelled, slot)

    async def _call(
        self, caller: Caller, api_name: str, data: list[Any], cancelled: asyncio.Event | None, slot: int
    ) -> list[Any]:
        session = self.session(caller.agent, slot)
        async with self._client(caller) as client:
            for attempt in range(LINGER_TRIES):
                answer = await client.post(
                    f"{API_PREFIX}/call/{api_name}", json={"data": data, "session_hash": session}
                )
                if answer.status_code == 200:
                    break
                refused = _refusal(answer.status_code, answer.text, api_name)
                # The slot's session runs one call at a time, so a per-client refusal here is its
                # previous call's event: finished (its answer reached us first) but still in gradio's
                # queue for a moment. Then the session is free again.
                if refused.code != "per_client_limit" or attempt == LINGER_TRIES - 1:
                    raise refused
                await asyncio.sleep(LINGER_SECONDS)
            event_id = answer.json().get("event_id")
            if not isinstance(event_id, str):
                raise CallRefused(500, "queue_failed", f"the queue answered {answer.text[:200]!r}")
            result = asyncio.ensure_future(client.get(f"{API_PREFIX}/call/{api_name}/{event_id}"))
            watcher = asyncio.ensure_future(cancelled.wait()) if cancelled is not None else None
            try:
                try:
                    done, _ = await asyncio.wait(
                        [task for task in (result, watcher) if task is not None],
                        return_when=asyncio.FIRST_COMPLETED,
                    )
                except asyncio.CancelledError:  # the server dropped the request's task: stop the edit too
                    result.cancel()
                    self._detached.add(asyncio.ensure_future(self._cancel_alone(caller, api_name, session, event_id)))
                    raise
                if result not in done:
                    await self._cancel(client, api_name, session, event_id)
                    # The slot is free once the event has ended (after the edit's current step), not
                    # before: the next call of this caller must not find its session still busy.
                    await asyncio.wait([result], timeout=CANCEL_WAIT)
                    result.cancel()
                    raise CallRefused(499, "cancelled", "the caller went away: the edit was stopped")
            finally:
                if watcher is not None:
                    watcher.cancel()
            return _outputs(result.result(), api_name)

    async def _cancel(self, client, api_name: str, session: str, event_id: str) -> None:
        body = {"session_hash": session, "event_id": event_id, "fn_index": self._fn_index(api_name)}
        await client.post(f"{API_PREFIX}/cancel", json=body)

    async def _cancel_alone(self, caller: Caller, api_name: str, session: str, event_id: str) -> None:
        """A cancel sent on a client of its own (the call's task is gone); never raises."""
        try:
            async with self._client(caller) as client:
                await self._cancel(client, api_name, session, event_id)
        except Exception:  # noqa: BLE001 - best effort: gradio's own liveness check stops the job too
            pass
        finally:
            self._detached.discard(asyncio.current_task())

    async def fetch(self, caller: Caller, path: str) -> bytes:
        """The bytes of a file the app serves (a result's PNG), read through the app's file route as
        `caller`: what the app would not serve this caller, this does not read either."""
        async with self._client(caller) as client:
            answer = await client.get(f"{API_PREFIX}/file={path}")
        if answer.status_code != 200:
            raise _refusal(answer.status_code, answer.text, "file")
        return answer.content


def file_data(path: str, name: str | None = None) -> dict[str, Any]:
    """A gradio FileData value naming an uploaded file (what `call`'s data holds for a file input)."""
    value: dict[str, Any] = {"path": path, "meta": {"_type": "gradio.FileData"}}
    if name:
        value["orig_name"] = name
    return value


def _outputs(answer, api_name: str) -> list[Any]:
    """The outputs of a finished event from gradio's `/call/<api_name>/<event_id>` stream."""
    if answer.status_code != 200:
        raise _refusal(answer.status_code, answer.text, api_name)
    event, data = None, None
    for block in answer.text.split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.splitlines() if ": " in line)
        if lines.get("event") in ("complete", "error"):
            event, data = lines["event"], lines.get("data")
    try:
        value = json.loads(data) if data is not None else None
    except ValueError:
        value = data
    if event == "complete" and isinstance(value, list):
        return value
    if event == "complete":  # a cancel completes the event with no outputs
        raise CallRefused(499, "cancelled", "the edit was stopped before it finished")
    message = value.get("error") if isinstance(value, dict) else value
    raise CallRefused(
        400 if message else 500,
        "edit_failed" if message else "server_error",
        str(message) if message else f"{api_name} failed on the server (see the app's log)",
    )


def _refusal(status: int, text: str, what: str) -> CallRefused:
    """CallRefused for an HTTP answer of the app's routes (gradio's or the guard's)."""
    try:
        body = json.loads(text)
    except ValueError:
        body = text
    detail = body.get("detail", body) if isinstance(body, dict) else body
    if isinstance(detail, list):  # the admission's per-client refusal: gradio's validation answer
        messages = [item.get("message") for item in detail if isinstance(item, dict) and item.get("message")]
        detail = "; ".join(messages) or str(detail)
        if status == 422:
            return CallRefused(429, "per_client_limit", detail)
    if isinstance(detail, dict):
        detail = detail.get("error") or json.dumps(detail)
    detail = str(detail)[:500]
    codes = {401: "unauthorized", 404: "not_found", 413: "too_large", 429: "rate_limited", 503: "queue_full"}
    retry = None
    if status == 429 and "try again in" in detail:
        retry = _seconds_in(detail)
    return CallRefused(status, codes.get(status, f"{what}_failed"), detail, retry_after=retry)


def _seconds_in(text: str) -> float | None:
    import re

    found = re.search(r"try again in (\d+)", text)
    return float(found.group(1)) if found else None


__all__ = ["API_PREFIX", "Caller", "CallRefused", "Loopback", "file_data"]
