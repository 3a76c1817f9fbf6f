"""The files gradio stored for this app: its private cache folder, which files are this app's own,
the pruning of the folder, uploads refused after the fact, and the files each call read and wrote.

Per-client storage (`client_storage.ClientStorage`) reads three things here: the files a queued or
running event names (`referenced_paths`), the files each call read and produced (`watch_calls`,
around the demo's `process_api`), and the one exception that makes gradio's upload parser delete
its spool files when a body is cut (`upload_abort`); pinned by tests/test_hardening2_storage.py.

Overrides registered in `gradio_seam` (`cached_image_names`, `app_file_records`, `queued_files`,
`call_watch`, `upload_abort`). A mismatch degrades to "not this app's file" (never to accepting one).
"""

from __future__ import annotations

import atexit
import hashlib
import logging
import os
import shutil
import tempfile
import time
import weakref
from pathlib import Path
from typing import Any, Callable

from hidream_ui.server.client_storage import ClientStorage
from hidream_ui.server.gradio_queue import queued_events
from hidream_ui.server.gradio_seam import override, warn_if_unchecked
from hidream_ui.server.gradio_sessions import mark_worked, scope_demo
from hidream_ui.server.storage_limits import CacheEntry, StorageLimits

logger = logging.getLogger(__name__)


_PRIVATE_CACHE: Path | None = None
# The apps served from this process (usually one; tests launch several): each app's janitor leaves
# the files the others recorded alone, since they share the process's cache folder.
_LIVE_DEMOS: "weakref.WeakSet" = weakref.WeakSet()


def register_demo(demo: Any, live: bool = True) -> None:
    """Marks `demo` as served (or, with `live=False`, as closed) for `prune_cache`. Serving one logs,
    once, the overrides the installed Gradio was not checked against (`gradio_seam`)."""
    if live:
        warn_if_unchecked()
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


@override("cached_image_names")
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


@override("app_file_records")
def kept_files(demo: Any) -> set[str]:
    """Files gradio keeps for the app's lifetime: the cached copies of the bundled examples."""
    kept: set[str] = set()
    for block in list((getattr(demo, "blocks", None) or {}).values()):
        kept.update(getattr(block, "keep_in_cache", None) or ())
    return kept


@override("app_file_records")
def is_app_file(demo: Any, path: str) -> bool:
    """True when `path` is an upload received through this app's upload route, or the cached copy
    of a bundled example. Exact paths as gradio recorded them; nothing else (in particular not the
    other files gradio records per component, which include any cache path a client names)."""
    uploads = getattr(demo, "upload_file_set", None)
    return (isinstance(uploads, set) and path in uploads) or path in kept_files(demo)


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


@override("app_file_records")
def app_cache_files(demo: Any, folder: Path) -> list[Path]:
    """The cache folder's files that count against this app's limits, oldest first: all of them
    except the examples' copies and the files another app of this process recorded (usually there
    is no other app; tests launch several)."""
    kept = {os.path.realpath(p) for p in kept_files(demo)}
    for other in list(_LIVE_DEMOS):
        if other is not demo:
            kept.update(os.path.realpath(p) for stored in _file_sets(other) for p in list(stored))
            kept.update(os.path.realpath(p) for p in kept_files(other))
    return [p for p in cache_files(folder) if os.path.realpath(p) not in kept]


@override("app_file_records")
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
    """Deletes what `storage.plan` (a `client_storage.ClientStorage`) chooses from the cache folder, or,
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


@override("app_file_records")
def stored_uploads(scope: dict) -> frozenset[str]:
    """The paths gradio holds as uploads (its upload set) when an upload request begins. Gradio
    stores an upload at cache/<hash of its bytes>/<name>: an upload of bytes and a name already
    stored answers the existing path, which is then not that upload's own to delete."""
    uploads = getattr(scope_demo(scope), "upload_file_set", None)
    return frozenset(uploads) if isinstance(uploads, set) else frozenset()


@override("app_file_records")
def discard_uploads(scope: dict, paths: list[str], existed: "set[str] | frozenset[str]" = frozenset()) -> None:
    """Deletes files an upload route just stored (an upload refused after the fact) and takes them
    out of gradio's records. `scope` is the upload request's: its app names the cache folder.
    Never deleted: `existed` (what `stored_uploads` saw before the route ran) and the examples'
    cached copies, which an upload of the same bytes and name answers with the same path."""
    app = scope.get("app")
    folder = getattr(app, "uploaded_file_dir", None)
    demo = scope_demo(scope)
    spared = set(existed) | kept_files(demo)
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


@override("queued_files")
def referenced_paths(demo: Any) -> set[str]:
    """Every file path named in the data of a waiting or running event (a FileData's ``path``, or
    an absolute path given as a plain string): those files are in use."""
    paths: set[str] = set()
    for event in queued_events(demo):
        if getattr(event, "alive", True):
            collect_paths(getattr(getattr(event, "data", None), "data", None), paths)
    return paths


def collect_paths(value: Any, into: set[str], depth: int = 0) -> None:
    if depth > 8:  # FileData sits one or two levels down (a list of files, a gallery item)
        return
    if isinstance(value, dict):
        path = value.get("path")
        if isinstance(path, str):
            into.add(path)
        for item in value.values():
            if isinstance(item, (dict, list, tuple)):
                collect_paths(item, into, depth + 1)
    elif isinstance(value, (list, tuple)):
        for item in value:
            collect_paths(item, into, depth + 1)
    elif isinstance(value, str) and value.startswith(os.sep) and len(value) < 4096:
        into.add(value)
    elif isinstance(getattr(value, "path", None), str):  # a FileData object
        into.add(value.path)


@override("call_watch")
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
            collect_paths(kwargs.get("inputs"), inputs)
            collect_paths(output.get("data") if isinstance(output, dict) else None, outputs)
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


@override("upload_abort")
def upload_abort(message: str) -> Exception:
    """The exception to raise from an upload's `receive` to stop it: gradio's multipart parser
    catches exactly this type mid-body, deletes the spool files it made and answers 413/400
    (any other exception, a disconnect too, leaves the spool files behind)."""
    from starlette.formparsers import MultiPartException

    return MultiPartException(message)


@override("app_file_records")
def _file_sets(demo: Any) -> list[set]:
    sets = getattr(demo, "temp_file_sets", None)
    return [s for s in (sets or []) if isinstance(s, set)]


__all__ = [
    "private_cache_folder",
    "register_demo",
    "cache_once",
    "kept_files",
    "is_app_file",
    "cache_files",
    "app_cache_files",
    "prune_cache",
    "stored_uploads",
    "discard_uploads",
    "referenced_paths",
    "collect_paths",
    "watch_calls",
    "upload_abort",
]
