"""`BoothGuard`: the app's ASGI middleware, in front of every HTTP request gradio serves.

Four jobs, all things gradio's own routes cannot be asked to do:

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
  The user name is read with starlette's own form parser, the one gradio's login route uses (the
  last of several ``username`` fields wins for both); login bodies over `MAX_LOGIN_BODY` and
  login forms carrying files are refused (and counted against the address).
* **Body size.** Gradio's `max_file_size` bounds each file of an upload, not the request: the
  guard refuses upload requests over `max_upload_bytes` in all, and every other request body over
  `max_body_bytes` (HTTP 413), by their declared length or while they stream; and, with a
  `client_storage.ClientStorage`, an upload larger than a client's whole quota (413), of a client whose
  jobs in progress fill its quota (429), or into a cache filled by jobs in progress and uploads
  in flight (503). A client merely at its quota is never refused: its oldest files age out. A
  refused or broken-off upload leaves no file behind.
* **No remote files.** Gradio downloads a file a request names by URL (a ``gradio.FileData``
  whose ``path`` is ``http(s)://...``) into its cache, with no size limit, leaving a folder per
  try. The guard reads JSON bodies (bounded by `max_body_bytes`) and refuses such payloads with
  HTTP 400 before gradio sees them.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from collections import deque
from typing import Callable

import anyio

from hidream_ui.engine.jobs import JobRegistry
from hidream_ui.server import gradio_internals
from hidream_ui.server.gradio_seam import override

logger = logging.getLogger(__name__)

MAX_REMEMBERED = 10_000  # addresses and session ids `NewSessions` keeps (floods forget the oldest)
# The routes on which a request names a session (gradio builds its state on first use): joining the
# queue, an unqueued call (`/run/`), the REST `/call/` (which makes a session per call when none is named).
_SESSION_ROUTES = ("/gradio_api/queue/join", "/gradio_api/run/", "/gradio_api/call/")
MAX_LOGIN_BODY = 64 * 1024
# Objects and lists in one JSON body. Parsing is paid on the server's event loop (by the guard, then
# by gradio's route and its walk for files) before any handler can cap a list: a 860 KB body of
# 55,000 `{"params": {}}` History entries cost 0.7 CPU-s there. The largest body the app sends (a
# History of 30 entries, a batch's files) holds a few hundred; counted as `{` and `[` bytes, a cheap
# over-count (brackets inside strings count too) that stays far above that.
MAX_JSON_CONTAINERS = 5_000  # a login form is a few hundred bytes; larger ones are refused unread (413)
# A file a client names by URL: gradio would download it (any scheme:// is refused; gradio itself
# fetches http(s) and refuses the rest as paths outside its cache).
_URL = re.compile(r"^\s*[A-Za-z][A-Za-z0-9+.\-]*://")
FILE_DATA_TYPE = "gradio.FileData"  # gradio's marker of a file in a payload ({"path", "meta": {"_type"}})


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


class NewSessions:
    """New sessions per address in a sliding minute. A session is new the first time a request names
    it (gradio then builds its state); `admit` answers the seconds to wait (0: admitted). Sessions
    admitted lately are remembered (bounded), so that a page's first few calls count once."""

    def __init__(self, per_minute: int, window: float = 60.0, clock: Callable[[], float] = time.monotonic):
        self.per_minute = per_minute
        self.window = window
        self._clock = clock
        self._opened: dict[str, deque] = {}  # address -> times it opened a session, oldest first
        self._recent: dict[str, None] = {}  # session hashes admitted lately, oldest first
        self._lock = threading.Lock()

    def admit(self, address: str, session: str | None) -> float:
        with self._lock:
            if session is not None and session in self._recent:
                return 0.0
            now = self._clock()
            opened = self._opened.setdefault(address, deque())
            while opened and now - opened[0] > self.window:
                opened.popleft()
            if len(opened) >= self.per_minute:
                return max(0.0, opened[0] + self.window - now)
            opened.append(now)
            if session is not None:
                self._recent[session] = None
                while len(self._recent) > MAX_REMEMBERED:
                    self._recent.pop(next(iter(self._recent)))
            if len(self._opened) > MAX_REMEMBERED:  # an address flood: forget the longest idle half
                idle = sorted(self._opened, key=lambda a: self._opened[a][-1] if self._opened[a] else 0.0)
                for old in idle[: MAX_REMEMBERED // 2]:
                    del self._opened[old]
            return 0.0


@override("http_routes")  # gradio's routes, by path and body (gradio_seam)
class BoothGuard:
    """ASGI middleware: `Middleware(BoothGuard, jobs=..., throttle=..., ...)` in FastAPI's list."""

    def __init__(
        self,
        app,
        *,
        jobs: JobRegistry,
        throttle: LoginThrottle | None = None,
        require_login: bool = False,
        max_upload_bytes: int | None = None,
        max_body_bytes: int | None = None,
        storage=None,
        new_sessions: NewSessions | None = None,
        service_bodies: dict[str, tuple[int, Callable[[str], dict]]] | None = None,
    ):
        self.app = app
        # Routes of the app's own that are not gradio's (the OpenAI-compatible images route, MCP), by
        # path prefix: their bodies are capped at the given size (an image rides in the body, so the
        # JSON cap of gradio's routes does not fit them) and refused in the service's own error shape
        # (prefix -> (cap, message -> JSON body): OpenAI's, JSON-RPC's). Their
        # work reaches gradio only through the app's own routes again (server/loopback.py), where
        # every other rule of the guard applies.
        self.service_bodies = dict(service_bodies or {})
        self.new_sessions = new_sessions  # per-address limit on new sessions (None: no limit)
        self.storage = storage  # client_storage.ClientStorage: per-client upload accounting (None: size limit only)
        self.jobs = jobs
        self.throttle = throttle
        self.require_login = require_login
        self.max_upload_bytes = max_upload_bytes
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope.get("type") != "http" or scope.get("method") in ("GET", "HEAD", "OPTIONS"):
            return await self.app(scope, receive, send)
        path = str(scope.get("path", "")).rstrip("/")
        if sum(1 for key, _ in scope.get("headers", ()) if key == b"content-type") > 1:
            # Parsers disagree on which of two Content-Types wins (starlette the first, a dict the
            # last): a body the guard reads one way and a route another escapes the guard's checks.
            return await _refuse(send, 400, "A request carries one Content-Type header, not several.")
        if path.endswith("/gradio_api/upload"):
            if self.max_upload_bytes is None:
                return await self.app(scope, receive, send)
            return await self._upload(scope, receive, send)
        service = next(
            (rule for prefix, rule in self.service_bodies.items() if path == prefix or path.startswith(prefix + "/")),
            None,
        )  # the rule of `Service.owns`: /v1x is not the /v1 service's, and keeps the guard's JSON checks
        if service is not None:
            cap, shape = service
            detail = f"The request body is larger than {_size(cap)} (--max-upload-mb)."
            return await _capped(self.app, scope, receive, send, cap, detail, shape=shape)
        if self.throttle is not None and (path == "/login" or path.endswith("/login")):
            return await self._login(scope, receive, send)
        inner = self.app if _is_form(scope) else self._json
        if self.max_body_bytes is None:
            return await inner(scope, receive, send)
        return await _capped(
            inner,
            scope,
            receive,
            send,
            self.max_body_bytes,
            f"The request body is larger than {_size(self.max_body_bytes)} (files go through the upload route).",
        )

    # ------------------------------------------------------------------ JSON bodies (cancel, remote files)
    async def _json(self, scope, receive, send):
        """Reads a (JSON) body whole (the caller bounds it), acts on a cancel, refuses files named
        by URL, then hands the body on unchanged."""
        body, replayed, _ = await _read_body(receive)
        if body is None:
            return  # the client went away, or the body went over the cap (`_capped` answers 413)
        if body.count(b"{") + body.count(b"[") > MAX_JSON_CONTAINERS:
            logger.warning("refused a request of more than %d JSON objects and lists", MAX_JSON_CONTAINERS)
            return await _refuse(
                send,
                413,
                f"The request holds more than {MAX_JSON_CONTAINERS} objects and lists: "
                "send less (a History holds at most 30 entries).",
            )
        try:
            data = json.loads(body) if body else None
        except (ValueError, RecursionError):
            data = None  # gradio's own parser refuses it just the same
        remote = _remote_file(data)
        if remote is not None:
            logger.warning("refused a request naming a remote file: %.200s", remote)
            return await _refuse(
                send,
                400,
                f"Files cannot be named by URL ({remote[:200]!r}): upload the file "
                "through the upload route and send the path it returns.",
            )
        if str(scope.get("path", "")).rstrip("/").endswith("/gradio_api/cancel") and isinstance(data, dict):
            self._cancel(scope, data)
        wait = self._new_session_wait(scope, data)
        if wait > 0:
            return await _refuse(
                send,
                429,
                f"Too many new sessions from your address: try again in {wait:.0f} s.",
                [(b"retry-after", str(int(wait) + 1).encode())],
            )
        return await self.app(scope, replayed, send)

    def _new_session_wait(self, scope, data) -> float:
        """Seconds a request that opens a new session must wait (0: it may go on, or opens none)."""
        if self.new_sessions is None:
            return 0.0
        path = str(scope.get("path", ""))
        if not any(route in path for route in _SESSION_ROUTES):
            return 0.0
        session = data.get("session_hash") if isinstance(data, dict) else None
        session = session if isinstance(session, str) else None
        if session is not None and gradio_internals.session_known(scope, session):
            return 0.0
        wait = self.new_sessions.admit(str((scope.get("client") or ("?", 0))[0]), session)
        if wait > 0:
            logger.warning("new session refused for %s (%.0f s left in its minute)", scope.get("client"), wait)
        return wait

    def _cancel(self, scope, data: dict) -> None:
        session, event_id = data.get("session_hash"), data.get("event_id")
        allowed = not self.require_login or gradio_internals.logged_in_user(scope) is not None
        if allowed and isinstance(session, str) and isinstance(event_id, str) and event_id:
            stopped = self.jobs.cancel(session, event_id, reason="cancelled by the client")
            if stopped:
                logger.info("client cancel stopped %d job(s)", stopped)

    # ------------------------------------------------------------------ upload
    async def _upload(self, scope, receive, send):
        """The upload route, bounded: by size in all, by the client's storage quota, by the cache's
        room. Stopping a body midway goes through `gradio_internals.upload_abort`, the one way that
        makes gradio's parser delete the spool files it already wrote (a plain disconnect leaves them,
        hundreds of MB of `tmp*` in the cache); a client that goes away mid-body is stopped the same
        way. The route's answer is held back until it is complete, so that an upload that takes its
        client past the file quota can still be undone and refused."""
        limit = self.max_upload_bytes
        too_big_text = f"The upload is larger than {limit // (1024 * 1024)} MB in all."
        declared = _content_length(scope)
        if declared is not None and declared > limit:
            return await _refuse(send, 413, too_big_text)
        storage = self.storage
        key = None
        if storage is not None:
            key = storage.client_key((scope.get("client") or (None, 0))[0], gradio_internals.logged_in_user(scope))
            refusal = storage.refusal(key, declared)
            if refusal is not None and await anyio.to_thread.run_sync(storage.prune_before_refusing):
                refusal = storage.refusal(key, declared)
            if refusal is not None:
                logger.warning("upload refused for %s: %s", key, refusal.message)
                return await _refuse(send, refusal.status, refusal.message)
        upload = storage.begin_upload(key, declared) if storage is not None else None
        # What gradio already held before this route ran: an answered path among these (an identical
        # earlier upload, whose bytes and name give the same path) is not this upload's to delete.
        existed = gradio_internals.stored_uploads(scope) if storage is not None else frozenset()
        received = 0
        body_done = False
        refused: tuple[int, str] | None = None
        held: list[dict] = []  # the route's answer, sent once it is complete and accepted

        async def counted():
            nonlocal received, body_done, refused
            message = await receive()
            if body_done:
                return message
            if message.get("type") == "http.disconnect":
                raise gradio_internals.upload_abort("the client went away before the upload was complete")
            size = len(message.get("body", b""))
            received += size
            body_done = not message.get("more_body", False)
            if received > limit:
                refused = (413, too_big_text)
            elif upload is not None and (over := storage.receive(upload, size)) is not None:
                refused = (over.status, over.message)
            if refused is not None:
                raise gradio_internals.upload_abort(refused[1])
            return message

        async def buffered(message):
            if refused is None:
                held.append(message)

        try:
            await self.app(scope, counted, buffered)
        except Exception:  # noqa: BLE001 - a route that chokes on the cut body is expected; refused below
            if refused is None:
                raise
        finally:
            if upload is not None:
                storage.end_upload(upload)
        if refused is not None:
            return await _refuse(send, *refused)
        if storage is not None:
            refusal = self._charge_upload(scope, key, held, existed)
            if refusal is not None:
                return await _refuse(send, *refusal)
        for message in held:
            await send(message)

    def _charge_upload(
        self, scope, key: str, held: list[dict], existed: frozenset = frozenset()
    ) -> tuple[int, str] | None:
        """Charges a stored upload (the paths the route answered) to `key`; undoes it and returns
        the refusal when the request alone is more than a client may keep (a client merely at its
        quota is not refused: its least recently used files age out). `existed`: the paths gradio
        held before the route ran (never deleted here)."""
        start = next((m for m in held if m.get("type") == "http.response.start"), {})
        if start.get("status") != 200:
            return None
        try:
            paths = json.loads(b"".join(m.get("body", b"") for m in held if m.get("type") == "http.response.body"))
        except ValueError:
            return None
        if not isinstance(paths, list):
            return None
        new, over = self.storage.record_upload(key, [p for p in paths if isinstance(p, str)])
        if not over:
            return None
        alone = self.storage.uncharge(key, new)
        # Another upload in flight may have stored the very same path (same bytes, same name) after
        # this one began, and not be charged for it yet: its file is left to the janitor (charged to
        # nobody, it goes first under the caps, or by age) rather than deleted under it. This runs
        # in one stretch with no await, so "in flight" covers every upload not charged yet.
        if self.storage.receiving:
            alone = []
        gradio_internals.discard_uploads(scope, alone, existed)
        limits = self.storage.limits
        return 413, (
            f"This upload has {len(paths)} file(s): more than one client may keep on this server (at most "
            f"{limits.quota_files} per client, those your jobs in progress use included): upload fewer."
        )

    # ------------------------------------------------------------------ login
    async def _login(self, scope, receive, send):
        address = f"address:{(scope.get('client') or ('?', 0))[0]}"
        declared = _content_length(scope)
        if declared is not None and declared > MAX_LOGIN_BODY:
            body, replayed, over = b"", receive, True
        else:
            body, replayed, over = await _read_body(receive, MAX_LOGIN_BODY)
        if body is None:
            return  # the client went away mid-body: nobody to answer
        if over:
            user, refusal = None, (413, f"A login form is at most {_size(MAX_LOGIN_BODY)}.")
        else:
            user, refusal = await _login_user(scope, body)
        # A refused form cannot log in, but it is a try all the same: it counts against the address.
        keys = [address] + ([f"user:{user}"] if user else [])
        wait, attempt = self.throttle.begin(*keys)
        if attempt is None:
            logger.warning("login throttled for %s (%.0f s left)", keys, wait)
            await _refuse(
                send,
                429,
                f"Too many failed logins: try again in {wait:.0f} s.",
                [(b"retry-after", str(int(wait) + 1).encode())],
            )
            return
        if refusal is not None:
            return await _refuse(send, *refusal)
        status = {}

        async def watched(message):
            if message.get("type") == "http.response.start":
                status["code"] = message.get("status")
            await send(message)

        await self.app(scope, replayed, watched)
        # A login that worked: gradio's answers 200, the operator's (server/operator.py) 303 to the app.
        if status.get("code") in (200, 303):
            self.throttle.succeeded(attempt, *keys)


async def _login_user(scope, body: bytes) -> tuple[str | None, tuple[int, str] | None]:
    """(the user name gradio's login route will read from `body`, None) or (None, (status, why))
    for a form the guard refuses. Parsed by starlette's form parser with FastAPI's defaults, the
    parser behind gradio's `OAuth2PasswordRequestForm`, so both read the same value (for a
    repeated field, the last; urlencoded and multipart alike: the browser's login form is
    multipart)."""
    from starlette.datastructures import UploadFile
    from starlette.exceptions import HTTPException
    from starlette.requests import Request

    async def whole():
        return {"type": "http.request", "body": body, "more_body": False}

    try:
        form = await Request(scope, whole).form()
    except HTTPException as exc:  # starlette's answer to a malformed multipart body
        return None, (400, f"The login form cannot be read: {exc.detail}")
    except ValueError as exc:  # a form the parser rejects outright
        return None, (400, f"The login form cannot be read: {exc}")
    try:
        if any(isinstance(value, UploadFile) for _, value in form.multi_items()):
            return None, (400, "A login form carries a user name and a password, not files.")
        user = form.get("username")
        return (user.strip() if isinstance(user, str) else None), None
    finally:
        await form.close()


async def _capped(app, scope, receive, send, limit: int, detail: str, *, shape=None) -> None:
    """Runs `app` with a body of at most `limit` bytes: a larger declared length is refused (HTTP
    413, `detail`) before reading; a body that grows past it while streaming is cut (the route
    sees the client go away) and refused."""
    declared = _content_length(scope)
    if declared is not None and declared > limit:
        return await _refuse(send, 413, detail, shape=shape)
    received = 0
    started = False
    too_big = False

    async def counted():
        nonlocal received, too_big
        message = await receive()
        received += len(message.get("body", b""))
        if received > limit:
            too_big = True
            return {"type": "http.disconnect"}  # the route stops reading and stores nothing
        return message

    async def watched(message):
        nonlocal started
        if too_big:
            return  # the answer is ours (below), whatever the route says about the cut body
        started = started or message.get("type") == "http.response.start"
        await send(message)

    try:
        await app(scope, counted, watched)
    except Exception:  # noqa: BLE001 - a route that chokes on the cut body is expected; refused below
        if not too_big:
            raise
    if too_big and not started:
        await _refuse(send, 413, detail, shape=shape)


async def _read_body(receive, limit: int | None = None):
    """(body, a `receive` that replays it, over) for a request the guard reads before the route.
    Reading stops past `limit` (`over` is then True and the body partial); the body is None when
    the client went away (or `_capped` cut it)."""
    messages, body, more = [], b"", True
    while more and (limit is None or len(body) <= limit):
        message = await receive()
        messages.append(message)
        if message.get("type") == "http.disconnect":
            return None, receive, False
        body += message.get("body", b"")
        more = message.get("more_body", False)
    replay = iter(messages)

    async def replayed():
        try:
            return next(replay)
        except StopIteration:
            return await receive()

    return body, replayed, limit is not None and len(body) > limit


def _remote_file(data) -> str | None:
    """The first file `data` (a parsed JSON body) names by URL, the way gradio finds files in a
    payload (a dict with a string ``path`` and ``meta._type`` = gradio.FileData); None when none."""
    stack = [data]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            meta, path = item.get("meta"), item.get("path")
            if (
                isinstance(meta, dict)
                and meta.get("_type") == FILE_DATA_TYPE
                and isinstance(path, str)
                and _URL.match(path)
            ):
                return path
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return None


def _is_form(scope) -> bool:
    """True for a form body (urlencoded or multipart): FastAPI may parse any other body as JSON."""
    for key, value in scope.get("headers", ()):
        if key == b"content-type":
            kind = value.split(b";")[0].strip().lower()
            return kind in (b"multipart/form-data", b"application/x-www-form-urlencoded")
    return False


def _size(limit: int) -> str:
    # Rounded, not floored: a 2.25 MB cap must not be told as "larger than 2 MB".
    return f"{round(limit / (1024 * 1024), 2):g} MB" if limit >= 1024 * 1024 else f"{round(limit / 1024, 2):g} KB"


def _content_length(scope) -> int | None:
    for key, value in scope.get("headers", ()):
        if key == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


async def _refuse(send, status: int, detail: str, headers: list | None = None, *, shape=None) -> None:
    # `shape`: a service route's own error shape (message -> JSON body); gradio's `detail` otherwise.
    body = json.dumps(shape(detail) if shape is not None else {"detail": detail}).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), *(headers or [])],
        }
    )
    await send({"type": "http.response.body", "body": body})


__all__ = ["BoothGuard", "LoginThrottle", "NewSessions", "MAX_JSON_CONTAINERS", "MAX_LOGIN_BODY"]
