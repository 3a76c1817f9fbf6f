"""Every use of Gradio's private internals, in one file (pinned by tests/test_hardening.py and tests/test_safety.py).

Gradio has no public way to ask which event is running in this thread, whether its client is
still connected, which files it stored for this app, or how many jobs one session has queued.
The app needs all four to be safe in front of strangers, so they are read here, defensively: a
mismatch (a Gradio upgrade renamed something) degrades to "unknown" (never to a crash and never
to accepting a file), and the tests fail loudly against the installed Gradio so the upgrade is
noticed. Known to match gradio 6.31.

Per-client storage (files.ClientStorage) reads three more: the files a queued or running event
names (`referenced_paths`), the files each call read and produced (`watch_calls`, around the
demo's `process_api`), and the one exception that makes gradio's upload parser delete its spool
files when a body is cut (`upload_abort`); pinned by tests/test_hardening2_storage.py.
"""

from __future__ import annotations

import asyncio
import atexit
import hashlib
import logging
import os
import shutil
import tempfile
import time
import weakref
from pathlib import Path
from typing import Any, Callable, Iterator

from hidream_ui.server.files import CacheEntry, ClientStorage, StorageLimits

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------
# The running event
# ---------------------------------------------------------------------------------------------


def current_event_id() -> str | None:
    """The gradio event id of the handler running in this thread (None outside an event).

    Gradio sets it in a context variable before calling a handler; anyio copies the context into
    the worker thread that runs sync handlers.
    """
    try:
        from gradio.context import LocalContext
    except ImportError:  # pragma: no cover - gradio is a requirement
        return None
    return LocalContext.event_id.get(None)


def _queue(demo: Any) -> Any:
    return getattr(demo, "_queue", None)


def _events(demo: Any) -> Iterator[Any]:
    """Every event gradio knows of for `demo`: running ones, then waiting ones."""
    queue = _queue(demo)
    for job in list(getattr(queue, "active_jobs", None) or []):
        yield from list(job or [])
    for group in list((getattr(queue, "event_queue_per_concurrency_id", None) or {}).values()):
        yield from list(getattr(group, "queue", None) or [])


def event_alive(demo: Any, event_id: str | None) -> bool:
    """False once gradio has given up on the event (its client disconnected, or it was cancelled).

    Gradio marks the events of a session `alive = False` when that session's event stream
    closes. Unknown events count as alive: only a positive "gone" stops work.
    """
    if not event_id:
        return True
    for event in _events(demo):
        if getattr(event, "_id", None) == event_id:
            return bool(getattr(event, "alive", True))
    return True


def logged_in_user(scope: dict) -> str | None:
    """The user an HTTP request (ASGI `scope`) is logged in as, by gradio's own cookie rule; None
    when it is not (or when the app behind the scope is not a gradio app)."""
    from http.cookies import CookieError, SimpleCookie

    app = scope.get("app")
    tokens, cookie_id = getattr(app, "tokens", None), getattr(app, "cookie_id", None)
    if not isinstance(tokens, dict) or cookie_id is None:
        return None
    header = b"; ".join(value for key, value in scope.get("headers", ()) if key == b"cookie")
    try:
        cookies = SimpleCookie(header.decode("latin-1"))
    except CookieError:
        return None
    for name in (f"access-token-{cookie_id}", f"access-token-unsecure-{cookie_id}"):
        if name in cookies:
            return tokens.get(cookies[name].value)
    return None


def sign_in(scope: dict, username: str) -> list[tuple[bytes, bytes]] | None:
    """Logs the client of an HTTP request (ASGI `scope`) in as `username` the way gradio's own
    `/login` does: a fresh token in the app's token table, and the two cookies that carry it.
    Returns the `set-cookie` headers to send, or None when the app behind the scope does not look
    like a gradio app (nothing is changed then). Used by the operator's login (server/operator.py),
    which must work also when gradio has no `auth` of its own (gradio's `/login` then refuses)."""
    import secrets

    app = scope.get("app")
    tokens, cookie_id = getattr(app, "tokens", None), getattr(app, "cookie_id", None)
    if not isinstance(tokens, dict) or cookie_id is None:
        return None
    token = secrets.token_urlsafe(16)
    tokens[token] = username
    return [
        (b"set-cookie", f"access-token-{cookie_id}={token}; HttpOnly; Path=/; SameSite=none; Secure".encode()),
        (b"set-cookie", f"access-token-unsecure-{cookie_id}={token}; HttpOnly; Path=/; SameSite=lax".encode()),
    ]


# ---------------------------------------------------------------------------------------------
# The queue
# ---------------------------------------------------------------------------------------------


def queue_figures(demo: Any, concurrency_id: str) -> dict[str, int] | None:
    """Waiting / running events of one concurrency group (None when gradio's queue is unreadable)."""
    per_group = getattr(_queue(demo), "event_queue_per_concurrency_id", None)
    if not isinstance(per_group, dict):
        return None
    group = per_group.get(concurrency_id)
    if group is None:
        return {"waiting": 0, "running": 0}
    return {"waiting": len(group.queue), "running": int(group.current_concurrency)}


def queue_position(demo: Any, session_hash: str | None, concurrency_id: str) -> int | None:
    """1-based place of `session_hash`'s first waiting event in the `concurrency_id` group's queue
    (None: nothing of that session waits there, or the queue is unreadable)."""
    if not session_hash:
        return None
    group = (getattr(_queue(demo), "event_queue_per_concurrency_id", None) or {}).get(concurrency_id)
    for place, event in enumerate(list(getattr(group, "queue", None) or []), start=1):
        if getattr(event, "session_hash", None) == session_hash and getattr(event, "alive", True):
            return place
    return None


def session_jobs(demo: Any, session_hash: str, concurrency_id: str) -> int:
    """Events of `session_hash` in the `concurrency_id` group, waiting or running."""
    count = 0
    for event in _events(demo):
        fn = getattr(event, "fn", None)
        if (
            getattr(event, "session_hash", None) == session_hash
            and getattr(event, "alive", True)
            and getattr(fn, "concurrency_id", None) == concurrency_id
        ):
            count += 1
    return count


def waiting_jobs(demo: Any, concurrency_id: str) -> int:
    """Events waiting (not yet running) in the `concurrency_id` group."""
    figures = queue_figures(demo, concurrency_id)
    return figures["waiting"] if figures else 0


def admit_jobs(
    demo: Any,
    concurrency_id: str | tuple[str, ...],
    *,
    max_waiting: int,
    per_session: int,
    per_session_message: Callable[[int], str],
    late_inputs: dict[str, tuple[str, ...]] | None = None,
) -> bool:
    """The app's admission policy for the `concurrency_id` group (the device lane; a tuple names
    several lanes, each limited on its own: the rewriter's lane is the other one), enforced
    where gradio itself admits events: the queue's `push`, which the browser, gradio_client and
    the REST `/call/` route all go through.

    * at most `max_waiting` events wait in the lane (gradio's "Queue is full", HTTP 503);
    * a session holds at most `per_session` events there, waiting or running: the refusal is
      gradio's validation answer (HTTP 422), the one path on which both the browser and
      gradio_client show the server's text (`per_session_message(n)`).

    Events of other groups (``/status``, ``/cancel``) are never refused: the app gives gradio's
    queue no `max_size`, which would count them too and refuse them exactly when the queue is
    full. `late_inputs` (api_name -> trailing input names added later, server/lanes.py LATE_INPUTS):
    a `data` list that lacks only those gets None for them, so raw clients of the older shape still
    run. Returns False when the queue does not look as expected (nothing is changed then).
    """
    queue = _queue(demo)
    original = getattr(queue, "push", None)
    fns = getattr(demo, "fns", None)
    if original is None or not isinstance(fns, dict) or getattr(original, "_hidream_admission", False):
        return False
    lock = asyncio.Lock()  # pushes interleave at their awaits: count and push as one step
    lanes = (concurrency_id,) if isinstance(concurrency_id, str) else tuple(concurrency_id)

    async def push(body, request, username):
        fn = fns.get(getattr(body, "fn_index", None))
        _pad_late_inputs(body, fn, late_inputs or {})
        lane = getattr(fn, "concurrency_id", None)
        if lane not in lanes:
            return await original(body, request, username)
        session = getattr(body, "session_hash", None)
        async with lock:
            waiting = waiting_jobs(demo, lane)
            if waiting >= max_waiting:
                return False, f"Queue is full. Max size is {max_waiting} and size is {waiting}.", "queue_full"
            held = session_jobs(demo, session, lane) if session is not None else 0
            if held >= per_session:
                refusal = {
                    "__type__": "validate",
                    "is_valid": False,
                    "message": per_session_message(held),
                    "parameter_name": "queue",
                }
                return False, [refusal], "validator_error"
            return await original(body, request, username)

    push._hidream_admission = True  # type: ignore[attr-defined]
    queue.push = push
    return True


def _pad_late_inputs(body: Any, fn: Any, late_inputs: dict[str, tuple[str, ...]]) -> None:
    late = late_inputs.get(getattr(fn, "api_name", None) or "")
    data, inputs = getattr(body, "data", None), getattr(fn, "inputs", None)
    if not late or not isinstance(data, list) or inputs is None:
        return
    missing = len(inputs) - len(data)
    if 0 < missing <= len(late):
        data.extend([None] * missing)


# ---------------------------------------------------------------------------------------------
# Files gradio stored for this app
# ---------------------------------------------------------------------------------------------

_PRIVATE_CACHE: Path | None = None
# The apps served from this process (usually one; tests launch several): each app's janitor leaves
# the files the others recorded alone, since they share the process's cache folder.
_LIVE_DEMOS: "weakref.WeakSet" = weakref.WeakSet()


def register_demo(demo: Any, live: bool = True) -> None:
    """Marks `demo` as served (or, with `live=False`, as closed) for `prune_cache`."""
    if live:
        _LIVE_DEMOS.add(demo)
    else:
        _LIVE_DEMOS.discard(demo)


def private_cache_folder() -> Path:
    """Gradio's cache folder for this process alone (made once; `GRADIO_TEMP_DIR` points at it).

    Gradio's default cache (/tmp/gradio) is shared by every Gradio app on the machine, and gradio
    accepts, and records as this app's own, any path inside it that a client names: with a shared
    folder one app could then serve, or prune, another app's files. A folder of our own makes
    "inside the cache" mean "ours". Set before the Blocks are built (gradio reads the variable when
    it builds components and on every upload); removed when the process exits.
    """
    global _PRIVATE_CACHE
    if _PRIVATE_CACHE is None:
        base = Path(os.environ.get("GRADIO_TEMP_DIR") or tempfile.gettempdir())
        base.mkdir(parents=True, exist_ok=True)
        _PRIVATE_CACHE = Path(tempfile.mkdtemp(prefix="hidream-ui-gradio-", dir=base))
        os.environ["GRADIO_TEMP_DIR"] = str(_PRIVATE_CACHE)
        atexit.register(shutil.rmtree, _PRIVATE_CACHE, True)
    return _PRIVATE_CACHE


def cache_once(data: bytes, name: str) -> str:
    """The path of `data` stored in the private cache folder as `name`, written only if absent.

    Gradio stores a yielded PIL image by writing it to a path named by its bytes, in place, again on
    every yield: a generator that yields the same image twice (the "before" half of each live
    preview) rewrites a file a client may be downloading, and the download comes back short
    ("Response content shorter than Content-Length"). A file of ours, written once under a
    temporary name and renamed into place, is one gradio copies once and never touches again (its
    file copy skips a target that exists). The folder is named by the bytes as gradio names it, so
    that its copy is this very file; called again after a prune removed it, it writes it anew.
    """
    try:
        from gradio.processing_utils import hash_bytes

        digest = hash_bytes(data)
    except (ImportError, AttributeError):  # pragma: no cover - an upgrade moved it: a copy, still safe
        digest = hashlib.sha256(data).hexdigest()
    folder = private_cache_folder() / digest
    path = folder / name
    if not path.is_file():
        folder.mkdir(parents=True, exist_ok=True)
        fd, staging = tempfile.mkstemp(dir=folder, prefix=f".{name}.")
        try:
            with os.fdopen(fd, "wb") as out:
                out.write(data)
            os.replace(staging, path)
        except BaseException:
            Path(staging).unlink(missing_ok=True)
            raise
    return str(path)


def _kept(demo: Any) -> set[str]:
    """Files gradio keeps for the app's lifetime: the cached copies of the bundled examples."""
    kept: set[str] = set()
    for block in list((getattr(demo, "blocks", None) or {}).values()):
        kept.update(getattr(block, "keep_in_cache", None) or ())
    return kept


def is_app_file(demo: Any, path: str) -> bool:
    """True when `path` is an upload received through this app's upload route, or the cached copy
    of a bundled example. Exact paths as gradio recorded them; nothing else (in particular not the
    other files gradio records per component, which include any cache path a client names)."""
    uploads = getattr(demo, "upload_file_set", None)
    return (isinstance(uploads, set) and path in uploads) or path in _kept(demo)


def cache_files(folder: Path) -> list[Path]:
    """Every file in the cache folder (it is this process's alone), oldest first."""
    files = []
    # os.walk, not Path.rglob: a hash folder removed mid-walk (an upload refused, a prune on another
    # thread) is skipped, where rglob raises and the whole round is lost.
    for root, _, names in os.walk(folder):
        for name in names:
            path = Path(root, name)
            try:
                if path.is_file():
                    files.append((path.lstat().st_ctime, path))
            except OSError:
                continue
    return [path for _, path in sorted(files)]


def app_cache_files(demo: Any, folder: Path) -> list[Path]:
    """The cache folder's files that count against this app's limits, oldest first: all of them
    except the examples' copies and the files another app of this process recorded (usually there
    is no other app; tests launch several)."""
    kept = {os.path.realpath(p) for p in _kept(demo)}
    for other in list(_LIVE_DEMOS):
        if other is not demo:
            kept.update(os.path.realpath(p) for stored in _file_sets(other) for p in list(stored))
            kept.update(os.path.realpath(p) for p in _kept(other))
    return [p for p in cache_files(folder) if os.path.realpath(p) not in kept]


def prune_cache(
    demo: Any,
    folder: Path,
    max_files: int,
    max_age: float,
    *,
    now: float | None = None,
    max_bytes: int | None = None,
    storage: Any = None,
) -> int:
    """Deletes what `storage.plan` (a `files.ClientStorage`) chooses from the cache folder, or,
    without `storage`, the files older than `max_age` seconds, then the oldest beyond `max_files`
    (and `max_bytes`); returns how many went. The examples' cached copies always stay, and so do
    the files that queued or running events name.

    Walks the folder rather than gradio's records: gradio also caches per-session copies (a
    DownloadButton updated mid-stream, for one) that no record of the app lists, and an upload's
    multipart spool files (``tmp*`` at the top: gradio's parser writes them there and renames them
    into a hash folder once complete). Emptied folders go too (also the ones a failed fetch left),
    and deleted paths leave gradio's records and the storage's accounts.
    """
    now = time.time() if now is None else now
    folder = Path(folder)
    walked_from = time.monotonic()
    entries = _entries(app_cache_files(demo, folder), folder)
    if storage is None:  # count and age only: a throwaway policy with nobody charged
        big = max_bytes if max_bytes is not None else 1 << 62
        storage = ClientStorage(
            StorageLimits(
                client_bytes=big,
                client_files=max_files,
                cache_bytes=big,
                cache_files=max_files,
                max_age=max_age,
                grace=0.0,
            )
        )
    chosen = storage.plan(
        entries,
        referenced=referenced_paths(demo),
        now=now,
        max_files=max_files,
        max_age=max_age,
        max_bytes=max_bytes,
        walked_from=walked_from,
    )
    removed: set[str] = set()
    for name in chosen:
        path = Path(name)
        try:
            path.unlink()
        except FileNotFoundError:
            pass
        except OSError as exc:
            logger.warning("cannot remove cached file %s: %s", path, exc)
            continue
        removed.add(name)
        _remove_empty_parents(path.parent, folder)
    _remove_empty_folders(folder, now - getattr(getattr(storage, "limits", None), "grace", 0.0))
    if removed:
        for stored in _file_sets(demo):
            stored.difference_update(removed)
        uploads = getattr(demo, "upload_file_set", None)
        if isinstance(uploads, set):
            uploads.difference_update(removed)
        storage.forget(removed)
    return len(removed)


def _entries(files: list[Path], folder: Path) -> list[Any]:
    entries = []
    for path in files:
        try:
            stat = path.lstat()
        except OSError:
            continue
        spool = path.parent == folder and path.name.startswith("tmp")
        entries.append(CacheEntry(str(path), stat.st_size, stat.st_ctime, stat.st_mtime, spool))
    return entries


def _remove_empty_parents(parent: Path, folder: Path) -> None:
    while parent != folder and folder in parent.parents:
        try:
            parent.rmdir()  # gradio's per-file hash folders, once empty
        except OSError:
            break
        parent = parent.parent


def _remove_empty_folders(folder: Path, older_than: float) -> None:
    """Empty folders under `folder` untouched since `older_than` (a fetch of a URL that failed
    leaves one per try; a folder made just now may be about to receive a file)."""
    for root, dirs, _ in os.walk(folder, topdown=False):
        for name in dirs:
            path = Path(root) / name
            try:
                if path.lstat().st_mtime <= older_than:
                    path.rmdir()
            except OSError:
                continue  # not empty, or gone


def _scope_demo(scope: dict) -> Any:
    get_blocks = getattr(scope.get("app"), "get_blocks", None)
    try:
        return get_blocks() if callable(get_blocks) else None
    except Exception:  # noqa: BLE001 - no Blocks (yet): nothing recorded to consult
        return None


def stored_uploads(scope: dict) -> frozenset[str]:
    """The paths gradio holds as uploads (its upload set) when an upload request begins. Gradio
    stores an upload at cache/<hash of its bytes>/<name>: an upload of bytes and a name already
    stored answers the existing path, which is then not that upload's own to delete."""
    uploads = getattr(_scope_demo(scope), "upload_file_set", None)
    return frozenset(uploads) if isinstance(uploads, set) else frozenset()


def discard_uploads(scope: dict, paths: list[str], existed: "set[str] | frozenset[str]" = frozenset()) -> None:
    """Deletes files an upload route just stored (an upload refused after the fact) and takes them
    out of gradio's records. `scope` is the upload request's: its app names the cache folder.
    Never deleted: `existed` (what `stored_uploads` saw before the route ran) and the examples'
    cached copies, which an upload of the same bytes and name answers with the same path."""
    app = scope.get("app")
    folder = getattr(app, "uploaded_file_dir", None)
    demo = _scope_demo(scope)
    spared = set(existed) | _kept(demo)
    paths = [p for p in paths if p not in spared]
    if not paths or not folder:
        return
    folder = Path(folder)
    for name in paths:
        path = Path(name)
        if folder not in path.parents:
            continue  # never outside the cache, whatever the route answered
        path.unlink(missing_ok=True)
        _remove_empty_parents(path.parent, folder)
    uploads = getattr(demo, "upload_file_set", None)
    if isinstance(uploads, set):
        uploads.difference_update(paths)


def referenced_paths(demo: Any) -> set[str]:
    """Every file path named in the data of a waiting or running event (a FileData's ``path``, or
    an absolute path given as a plain string): those files are in use."""
    paths: set[str] = set()
    for event in _events(demo):
        if getattr(event, "alive", True):
            _collect_paths(getattr(getattr(event, "data", None), "data", None), paths)
    return paths


def _collect_paths(value: Any, into: set[str], depth: int = 0) -> None:
    if depth > 8:  # FileData sits one or two levels down (a list of files, a gallery item)
        return
    if isinstance(value, dict):
        path = value.get("path")
        if isinstance(path, str):
            into.add(path)
        for item in value.values():
            if isinstance(item, (dict, list, tuple)):
                _collect_paths(item, into, depth + 1)
    elif isinstance(value, (list, tuple)):
        for item in value:
            _collect_paths(item, into, depth + 1)
    elif isinstance(value, str) and value.startswith(os.sep) and len(value) < 4096:
        into.add(value)
    elif isinstance(getattr(value, "path", None), str):  # a FileData object
        into.add(value.path)


def watch_calls(demo: Any, record: Callable[..., None], job_lanes: tuple[str, ...] = ()) -> bool:
    """Calls `record(session, address, user, fn, event_id, inputs, outputs)` after each call gradio
    runs for `demo` (queued or not), with the file paths its inputs named and its postprocessed
    outputs hold (gradio's cached copies, the URLs the client will fetch), and marks the session of
    a call on one of `job_lanes` as one that did work (`mark_worked`). Wraps the demo's
    `process_api`, the one method every route goes through. False when it is not there."""
    original = getattr(demo, "process_api", None)
    if original is None or getattr(original, "_hidream_watch", False):
        return False

    async def process_api(*args, **kwargs):
        output = await original(*args, **kwargs)
        try:
            request = kwargs.get("request")
            request = request[0] if isinstance(request, list) and request else request
            if request is None:
                return output  # a call the app makes itself (examples): no client to charge
            client = getattr(request, "client", None)
            inputs: set[str] = set()
            outputs: set[str] = set()
            _collect_paths(kwargs.get("inputs"), inputs)
            _collect_paths(output.get("data") if isinstance(output, dict) else None, outputs)
            fn = kwargs.get("block_fn")
            if getattr(fn, "concurrency_id", None) in job_lanes:
                mark_worked(demo, kwargs.get("session_hash"))
            record(
                kwargs.get("session_hash"),
                getattr(client, "host", None),
                getattr(request, "username", None),
                getattr(fn, "fn_index", fn),
                kwargs.get("event_id"),
                inputs,
                outputs,
            )
        except Exception:  # noqa: BLE001 - accounting must never break a call
            logger.exception("recording a call's files failed")
        return output

    process_api._hidream_watch = True  # type: ignore[attr-defined]
    demo.process_api = process_api
    return True


def upload_abort(message: str) -> Exception:
    """The exception to raise from an upload's `receive` to stop it: gradio's multipart parser
    catches exactly this type mid-body, deletes the spool files it made and answers 413/400
    (any other exception, a disconnect too, leaves the spool files behind)."""
    from starlette.formparsers import MultiPartException

    return MultiPartException(message)


def _file_sets(demo: Any) -> list[set]:
    sets = getattr(demo, "temp_file_sets", None)
    return [s for s in (sets or []) if isinstance(s, set)]


# ---------------------------------------------------------------------------------------------
# Sessions: gradio's per-session state (a section of its own; the cache functions above are another's)
# ---------------------------------------------------------------------------------------------
#
# Gradio builds a `SessionState` the first time a request names a new `session_hash` (any event,
# `/status` included) and keeps it until 10,000 newer ones push it out. Its constructor renders the
# config of every block of the app (about 240 KB and tens of milliseconds here), a snapshot kept
# only for gradio's "deep link" feature, which this app does not offer. The lean state below copies
# nothing until the session changes something: the app's blocks are shared until an event updates
# one for that session, and the deep-link snapshot is rendered when asked for (from the session's
# blocks, without the last values). Sessions idle for long enough are dropped (`expire_sessions`).


def _lean_classes() -> tuple[type, type] | None:
    """(LeanSessionState, LeanStateHolder), built once (gradio is imported lazily); None when this
    gradio's state classes do not look as expected."""
    global _LEAN
    if _LEAN is not None:
        return _LEAN or None
    try:
        from gradio.components import State
        from gradio.state_holder import SessionState, StateHolder
    except ImportError:  # pragma: no cover - gradio is a requirement
        _LEAN = ()
        return None

    class LeanSessionState(SessionState):
        def __init__(self, blocks: Any):  # no super().__init__(): its eager config copy is the cost avoided
            self._root = blocks
            self._shared_config = blocks.default_config
            self._own_config = None
            self.config_values: dict = {}
            self.state_data: dict = {}
            self._state_ttl: dict = {}
            self.is_closed = False
            self.worked = False  # a job ran in this session (`mark_worked`)
            self.STATE_TTL_WHEN_CLOSED = 1 if os.getenv("GRADIO_IS_E2E_TEST", None) else 3600

        # The app's BlocksConfig, shared until this session replaces a block (copy on write).
        @property
        def blocks_config(self):
            return self._own_config if self._own_config is not None else self._shared_config

        @blocks_config.setter
        def blocks_config(self, value):
            self._own_config = value

        @property
        def holds_something(self) -> bool:
            """True once the session has state of its own (State values, updated blocks)."""
            return bool(self.state_data) or self._own_config is not None

        @property
        def worth(self) -> int:
            """What evicting the session would lose: 0 nothing, 1 widget updates or State values
            that page loads and refreshes make (a flood of fresh sessions calling the History
            refresh has those too), 2 a job's work (`mark_worked`: an edit, batch, compare or
            rewrite ran; its result, history and comparison cells are a real visitor's)."""
            if getattr(self, "worked", False):
                return 2
            return 1 if self.state_data or self._own_config is not None else 0

        def __setitem__(self, key: int, value: Any):
            if not isinstance(self.blocks_config.blocks.get(key), State) and self._own_config is None:
                from copy import copy

                self._own_config = copy(self._shared_config)
            super().__setitem__(key, value)
            self.config_values.pop(key, None)

        def _update_config(self, key: int):
            pass  # the deep-link snapshot is rendered on demand (`components`)

        def _update_value_in_config(self, key: int, value: Any):
            pass  # ditto: the last value of every input and output is not kept per session

        @property
        def components(self):
            config = self.blocks_config
            for key, block in list(config.blocks.items()):
                if key in self._root.blocks:
                    rendered = config.config_for_block(key, [], block)
                    if rendered:
                        yield rendered

    class LeanStateHolder(StateHolder):
        def __getitem__(self, session_id: str):
            if session_id not in self.session_data:
                self.session_data[session_id] = LeanSessionState(self.blocks)
            return super().__getitem__(session_id)

        def update(self, session_id: str):
            """Gradio's LRU bound, except that the oldest session of the least worth goes first:
            a flood of fresh sessions (or of page loads) pushes out its own kind before anyone's
            history."""
            with self.lock:
                if session_id in self.session_data:
                    self.session_data.move_to_end(session_id)
                while len(self.session_data) > self.capacity:
                    # The oldest of the least worth (dict order is the order of use).
                    victim = min(
                        (sid for sid in self.session_data if sid != session_id),
                        key=lambda sid: getattr(self.session_data[sid], "worth", 2),
                        default=next(iter(self.session_data)),
                    )
                    del self.session_data[victim]
                    self.time_last_used.pop(victim, None)

    _LEAN = (LeanSessionState, LeanStateHolder)
    return _LEAN


_LEAN: tuple | None = None


def lean_sessions(demo: Any) -> bool:
    """Makes new sessions of `demo` cheap (see above); True when done. Called once the app exists
    (gradio's `App` made the state holder), before requests arrive; False (nothing changed) when
    gradio's state classes differ from what this code knows, or the app renders blocks per session
    (`gr.render` writes into the session's BlocksConfig, which must then be a copy)."""
    classes = _lean_classes()
    holder = getattr(demo, "state_holder", None)
    config = getattr(demo, "default_config", None)
    if classes is None or holder is None or config is None or getattr(config, "renderables", None):
        return False
    from gradio.state_holder import SessionState, StateHolder

    lean_state, lean_holder = classes
    if type(holder) is lean_holder:
        return True
    if type(holder) is not StateHolder or not isinstance(getattr(holder, "session_data", None), dict):
        return False
    # Every attribute gradio's own SessionState has must exist on the lean one (a gradio upgrade
    # that adds one is noticed here, not mid-request).
    if not set(vars(SessionState(demo))) <= set(vars(lean_state(demo))) | {"blocks_config"}:
        logger.warning("gradio's SessionState has changed: sessions stay at gradio's full cost")
        return False
    holder.__class__ = lean_holder  # in place: gradio's App and the Blocks hold this very object
    return True


def mark_worked(demo: Any, session_hash: str | None) -> None:
    """Marks `session_hash` as one that ran a job: evicted last (LeanSessionState.worth)."""
    state = (getattr(getattr(demo, "state_holder", None), "session_data", None) or {}).get(session_hash)
    if state is not None:
        state.worked = True


def session_known(scope: dict, session_hash: Any) -> bool:
    """True when the gradio app behind an HTTP request (ASGI `scope`) holds state for `session_hash`."""
    sessions = getattr(getattr(_scope_demo(scope), "state_holder", None), "session_data", None)
    return isinstance(session_hash, str) and isinstance(sessions, dict) and session_hash in sessions


def session_count(demo: Any) -> int:
    """Sessions gradio holds state for."""
    return len(getattr(getattr(demo, "state_holder", None), "session_data", None) or {})


def expire_sessions(demo: Any, max_idle: float, *, now: float | None = None) -> int:
    """Drops the state of every session no request has named for `max_idle` seconds and that has
    no event waiting or running; returns how many went. Runs on the server's event loop (where
    gradio reads and writes the sessions), so it never races a request."""
    import datetime

    holder = getattr(demo, "state_holder", None)
    last_used = getattr(holder, "time_last_used", None)
    sessions = getattr(holder, "session_data", None)
    if not isinstance(last_used, dict) or not isinstance(sessions, dict):
        return 0
    current = datetime.datetime.now() if now is None else datetime.datetime.fromtimestamp(now)
    cutoff = current - datetime.timedelta(seconds=max_idle)
    busy = {getattr(event, "session_hash", None) for event in _events(demo)}
    idle = [sid for sid, used in list(last_used.items()) if used < cutoff and sid not in busy]
    for sid in idle:
        try:
            holder.delete_state(sid)  # gradio's own clean-up of State values (their delete callbacks)
        except Exception:  # noqa: BLE001 - a failing callback must not keep the session alive
            logger.exception("deleting the state of an idle session failed")
        with holder.lock:
            sessions.pop(sid, None)
            last_used.pop(sid, None)
    return len(idle)


__all__ = [
    "current_event_id",
    "event_alive",
    "logged_in_user",
    "sign_in",
    "queue_figures",
    "session_jobs",
    "waiting_jobs",
    "admit_jobs",
    "is_app_file",
    "cache_files",
    "prune_cache",
    "private_cache_folder",
    "register_demo",
    "app_cache_files",
    "lean_sessions",
    "session_count",
    "expire_sessions",
    "referenced_paths",
    "watch_calls",
    "upload_abort",
    "discard_uploads",
    "stored_uploads",
    "mark_worked",
    "session_known",
]
