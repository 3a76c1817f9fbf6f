"""`BoothGuard`: the app's ASGI middleware, in front of every HTTP request gradio serves.

Two jobs, both things gradio's own routes cannot be asked to do:

* **Cancels reach the work.** Gradio's ``POST /gradio_api/cancel`` (sent by a client's
  `Job.cancel()` and by the browser's ``cancels=``) only cancels the asyncio task that waits on
  the handler's worker thread, and then waits for that thread: the edit ran on to its end. The
  guard reads the request's session and event first and sets that job's cancel token, so the
  work stops after its current step and gradio's wait ends with it.
* **Login throttling.** After `max_failures` failed logins from one address within `window`
  seconds, logins from that address are refused with 429 for `window` seconds.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import deque
from typing import Any, Callable

from hidream_ui.engine.jobs import JobRegistry

logger = logging.getLogger(__name__)

MAX_CANCEL_BODY = 4096  # a cancel body is ~150 bytes of JSON; anything larger is not ours to read


class LoginThrottle:
    """Failed logins per client address in a sliding window; an address over the limit waits."""

    def __init__(self, max_failures: int, window: float = 60.0, clock: Callable[[], float] = time.monotonic):
        self.max_failures = max_failures
        self.window = window
        self._clock = clock
        self._failures: dict[str, deque] = {}
        self._lock = threading.Lock()

    def retry_after(self, address: str) -> float:
        """Seconds until `address` may try again (0: now)."""
        with self._lock:
            failures = self._recent(address)
            if len(failures) < self.max_failures:
                return 0.0
            return max(0.0, failures[-1] + self.window - self._clock())

    def failed(self, address: str) -> None:
        with self._lock:
            self._recent(address).append(self._clock())
            if len(self._failures) > 10_000:  # bound the table against address floods: oldest half goes
                by_age = sorted(self._failures, key=lambda k: self._failures[k][-1] if self._failures[k] else 0.0)
                for key in by_age[:5_000]:
                    del self._failures[key]

    def succeeded(self, address: str) -> None:
        with self._lock:
            self._failures.pop(address, None)

    def _recent(self, address: str) -> deque:
        failures = self._failures.setdefault(address, deque(maxlen=max(1, self.max_failures)))
        now = self._clock()
        while failures and now - failures[0] > self.window:
            failures.popleft()
        return failures


class BoothGuard:
    """ASGI middleware: `Middleware(BoothGuard, jobs=..., throttle=...)` in FastAPI's list."""

    def __init__(self, app: Any, *, jobs: JobRegistry, throttle: LoginThrottle | None = None):
        self.app = app
        self.jobs = jobs
        self.throttle = throttle

    async def __call__(self, scope, receive, send):
        if scope.get("type") != "http" or scope.get("method") != "POST":
            return await self.app(scope, receive, send)
        path = str(scope.get("path", "")).rstrip("/")
        if path.endswith("/gradio_api/cancel"):
            return await self._cancel(scope, receive, send)
        if self.throttle is not None and (path == "/login" or path.endswith("/login")):
            return await self._login(scope, receive, send)
        return await self.app(scope, receive, send)

    # ------------------------------------------------------------------ cancel
    async def _cancel(self, scope, receive, send):
        body, more = b"", True
        messages = []
        while more:
            message = await receive()
            messages.append(message)
            body += message.get("body", b"")
            more = message.get("more_body", False) and len(body) <= MAX_CANCEL_BODY
        try:
            data = json.loads(body) if len(body) <= MAX_CANCEL_BODY else {}
        except ValueError:
            data = {}
        if isinstance(data, dict):
            session, event_id = data.get("session_hash"), data.get("event_id")
            if isinstance(session, str) and (event_id is None or isinstance(event_id, str)):
                stopped = self.jobs.cancel(session, event_id, reason="cancelled by the client")
                if stopped:
                    logger.info("client cancel stopped %d job(s)", stopped)
        replay = iter(messages)

        async def replayed():
            try:
                return next(replay)
            except StopIteration:
                return await receive()

        return await self.app(scope, replayed, send)

    # ------------------------------------------------------------------ login
    async def _login(self, scope, receive, send):
        address = (scope.get("client") or ("?", 0))[0]
        wait = self.throttle.retry_after(address)
        if wait > 0:
            logger.warning("login throttled for %s (%.0f s left)", address, wait)
            body = json.dumps({"detail": f"Too many failed logins from this address: try again in {wait:.0f} s."})
            await send({"type": "http.response.start", "status": 429,
                        "headers": [(b"content-type", b"application/json"),
                                    (b"retry-after", str(int(wait) + 1).encode())]})
            await send({"type": "http.response.body", "body": body.encode()})
            return
        status = {}

        async def watched(message):
            if message.get("type") == "http.response.start":
                status["code"] = message.get("status")
            await send(message)

        await self.app(scope, receive, watched)
        code = status.get("code")
        if code == 200:
            self.throttle.succeeded(address)
        elif code in (400, 401, 403):
            self.throttle.failed(address)


__all__ = ["BoothGuard", "LoginThrottle"]
