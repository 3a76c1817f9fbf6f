"""`BoothGuard`: the app's ASGI middleware, in front of every HTTP request gradio serves.

Three jobs, all things gradio's own routes cannot be asked to do:

* **Cancels reach the work.** Gradio's ``POST /gradio_api/cancel`` (sent by a client's
  `Job.cancel()` and by the browser's ``cancels=``) only cancels the asyncio task that waits on
  the handler's worker thread, and then waits for that thread: the edit ran on to its end. The
  guard reads the request's session and event first and sets that job's cancel token, so the
  work stops after its current step and gradio's wait ends with it. Only a request that names
  the event, and with `--auth` only a logged-in one, can do that.
* **Login throttling.** Every login attempt counts as a failure until it succeeds, so parallel
  guesses count too. After `max_failures` within `window` seconds from one address, or for one
  user name (addresses can be spoofed behind a proxy), logins are refused with 429 for the rest
  of the window.
* **Upload size.** Gradio's `max_file_size` bounds each file of an upload, not the request: the
  guard refuses upload requests over `max_upload_bytes` in all (HTTP 413), by their declared
  length or while they stream.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import deque
from typing import Callable
from urllib.parse import parse_qs

from hidream_ui.engine.jobs import JobRegistry
from hidream_ui.ui import gradio_internals

logger = logging.getLogger(__name__)

MAX_SMALL_BODY = 64 * 1024  # cancel and login bodies are a few hundred bytes; larger ones are not read


class LoginThrottle:
    """Login attempts per key (an address, a user name) in a sliding window; a key over the limit
    waits until its oldest counted attempt leaves the window."""

    def __init__(self, max_failures: int, window: float = 60.0, clock: Callable[[], float] = time.monotonic):
        self.max_failures = max_failures
        self.window = window
        self._clock = clock
        self._failures: dict[str, deque] = {}
        self._lock = threading.Lock()

    def begin(self, *keys: str) -> tuple[float, float | None]:
        """(seconds to wait, None) when any key is over the limit; else (0, attempt id): the
        attempt now counts as a failure for every key until `succeeded(attempt, *keys)`."""
        with self._lock:
            now = self._clock()
            waits = [self._wait(self._recent(key, now), now) for key in keys]
            if max(waits, default=0.0) > 0:
                return max(waits), None
            for key in keys:
                self._recent(key, now).append(now)
            self._bound()
            return 0.0, now

    def succeeded(self, attempt: float, *keys: str) -> None:
        """A good login forgives the key's failures (the attempt itself included)."""
        with self._lock:
            for key in keys:
                self._failures.pop(key, None)

    def retry_after(self, key: str) -> float:
        with self._lock:
            now = self._clock()
            return self._wait(self._recent(key, now), now)

    def _wait(self, failures: deque, now: float) -> float:
        if len(failures) < self.max_failures:
            return 0.0
        return max(0.0, failures[-self.max_failures] + self.window - now)

    def _recent(self, key: str, now: float) -> deque:
        failures = self._failures.setdefault(key, deque())
        while failures and now - failures[0] > self.window:
            failures.popleft()
        return failures

    def _bound(self) -> None:
        if len(self._failures) > 10_000:  # bound the table against address floods: the oldest half goes
            by_age = sorted(self._failures, key=lambda k: self._failures[k][-1] if self._failures[k] else 0.0)
            for key in by_age[:5_000]:
                del self._failures[key]


class BoothGuard:
    """ASGI middleware: `Middleware(BoothGuard, jobs=..., throttle=..., ...)` in FastAPI's list."""

    def __init__(self, app, *, jobs: JobRegistry, throttle: LoginThrottle | None = None,
                 require_login: bool = False, max_upload_bytes: int | None = None):
        self.app = app
        self.jobs = jobs
        self.throttle = throttle
        self.require_login = require_login
        self.max_upload_bytes = max_upload_bytes

    async def __call__(self, scope, receive, send):
        if scope.get("type") != "http" or scope.get("method") != "POST":
            return await self.app(scope, receive, send)
        path = str(scope.get("path", "")).rstrip("/")
        if path.endswith("/gradio_api/cancel"):
            return await self._cancel(scope, receive, send)
        if path.endswith("/gradio_api/upload") and self.max_upload_bytes is not None:
            return await self._upload(scope, receive, send)
        if self.throttle is not None and (path == "/login" or path.endswith("/login")):
            return await self._login(scope, receive, send)
        return await self.app(scope, receive, send)

    # ------------------------------------------------------------------ cancel
    async def _cancel(self, scope, receive, send):
        body, replayed = await _read_small_body(receive)
        try:
            data = json.loads(body) if body else {}
        except ValueError:
            data = {}
        if isinstance(data, dict):
            session, event_id = data.get("session_hash"), data.get("event_id")
            allowed = not self.require_login or gradio_internals.logged_in_user(scope) is not None
            if allowed and isinstance(session, str) and isinstance(event_id, str) and event_id:
                stopped = self.jobs.cancel(session, event_id, reason="cancelled by the client")
                if stopped:
                    logger.info("client cancel stopped %d job(s)", stopped)
        return await self.app(scope, replayed, send)

    # ------------------------------------------------------------------ upload
    async def _upload(self, scope, receive, send):
        limit = self.max_upload_bytes
        declared = _content_length(scope)
        if declared is not None and declared > limit:
            return await _refuse(send, 413, f"The upload is larger than {limit // (1024 * 1024)} MB in all.")
        received = 0
        started = False
        too_big = False

        async def counted():
            nonlocal received, too_big
            message = await receive()
            received += len(message.get("body", b""))
            if received > limit:
                too_big = True
                return {"type": "http.disconnect"}  # the upload route stops reading and stores nothing
            return message

        async def watched(message):
            nonlocal started
            if too_big:
                return  # the answer is ours (below), whatever the route says about the cut body
            started = started or message.get("type") == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted, watched)
        except Exception:  # noqa: BLE001 - a route that chokes on the cut body is expected; refused below
            if not too_big:
                raise
        if too_big and not started:
            await _refuse(send, 413, f"The upload is larger than {limit // (1024 * 1024)} MB in all.")

    # ------------------------------------------------------------------ login
    async def _login(self, scope, receive, send):
        body, replayed = await _read_small_body(receive)
        fields = parse_qs(body.decode("utf-8", "replace")) if body else {}
        user = (fields.get("username") or [""])[0].strip()
        keys = [f"address:{(scope.get('client') or ('?', 0))[0]}"] + ([f"user:{user}"] if user else [])
        wait, attempt = self.throttle.begin(*keys)
        if attempt is None:
            logger.warning("login throttled for %s (%.0f s left)", keys, wait)
            await _refuse(send, 429, f"Too many failed logins: try again in {wait:.0f} s.",
                          [(b"retry-after", str(int(wait) + 1).encode())])
            return
        status = {}

        async def watched(message):
            if message.get("type") == "http.response.start":
                status["code"] = message.get("status")
            await send(message)

        await self.app(scope, replayed, watched)
        if status.get("code") == 200:
            self.throttle.succeeded(attempt, *keys)


async def _read_small_body(receive):
    """(body, a `receive` that replays it) for a request whose body we read before the route;
    larger bodies are passed on unread past MAX_SMALL_BODY."""
    messages, body, more = [], b"", True
    while more and len(body) <= MAX_SMALL_BODY:
        message = await receive()
        messages.append(message)
        body += message.get("body", b"")
        more = message.get("more_body", False)
    replay = iter(messages)

    async def replayed():
        try:
            return next(replay)
        except StopIteration:
            return await receive()

    return (body if len(body) <= MAX_SMALL_BODY else b""), replayed


def _content_length(scope) -> int | None:
    for key, value in scope.get("headers", ()):
        if key == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


async def _refuse(send, status: int, detail: str, headers: list | None = None) -> None:
    body = json.dumps({"detail": detail}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), *(headers or [])]})
    await send({"type": "http.response.body", "body": body})


__all__ = ["BoothGuard", "LoginThrottle"]
