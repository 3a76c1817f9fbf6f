"""Every use of Gradio's private internals, in one file (pinned by tests/test_hardening.py and tests/test_safety.py).

Gradio has no public way to ask which event is running in this thread, whether its client is
still connected, which files it stored for this app, or how many jobs one session has queued.
The app needs all four to be safe in front of strangers, so they are read here, defensively: a
mismatch (a Gradio upgrade renamed something) degrades to "unknown" (never to a crash and never
to accepting a file), and the tests fail loudly against the installed Gradio so the upgrade is
noticed. Known to match gradio 6.31.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from pathlib import Path
from typing import Any, Callable, Iterator

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


def session_jobs(demo: Any, session_hash: str, concurrency_id: str) -> int:
    """Events of `session_hash` in the `concurrency_id` group, waiting or running."""
    count = 0
    for event in _events(demo):
        fn = getattr(event, "fn", None)
        if (getattr(event, "session_hash", None) == session_hash and getattr(event, "alive", True)
                and getattr(fn, "concurrency_id", None) == concurrency_id):
            count += 1
    return count


def waiting_jobs(demo: Any, concurrency_id: str) -> int:
    """Events waiting (not yet running) in the `concurrency_id` group."""
    figures = queue_figures(demo, concurrency_id)
    return figures["waiting"] if figures else 0


def admit_jobs(demo: Any, concurrency_id: str, *, max_waiting: int, per_session: int,
               per_session_message: Callable[[int], str]) -> bool:
    """The app's admission policy for the `concurrency_id` group (the device lane), enforced
    where gradio itself admits events: the queue's `push`, which the browser, gradio_client and
    the REST `/call/` route all go through.

    * at most `max_waiting` events wait in the lane (gradio's "Queue is full", HTTP 503);
    * a session holds at most `per_session` events there, waiting or running: the refusal is
      gradio's validation answer (HTTP 422), the one path on which both the browser and
      gradio_client show the server's text (`per_session_message(n)`).

    Events of other groups (``/status``, ``/cancel``) are never refused: the app gives gradio's
    queue no `max_size`, which would count them too and refuse them exactly when the queue is
    full. Returns False when the queue does not look as expected (nothing is changed then).
    """
    queue = _queue(demo)
    original = getattr(queue, "push", None)
    fns = getattr(demo, "fns", None)
    if original is None or not isinstance(fns, dict) or getattr(original, "_hidream_admission", False):
        return False
    lock = asyncio.Lock()  # pushes interleave at their awaits: count and push as one step

    async def push(body, request, username):
        fn = fns.get(getattr(body, "fn_index", None))
        if getattr(fn, "concurrency_id", None) != concurrency_id:
            return await original(body, request, username)
        session = getattr(body, "session_hash", None)
        async with lock:
            waiting = waiting_jobs(demo, concurrency_id)
            if waiting >= max_waiting:
                return False, f"Queue is full. Max size is {max_waiting} and size is {waiting}.", "queue_full"
            held = session_jobs(demo, session, concurrency_id) if session is not None else 0
            if held >= per_session:
                refusal = {"__type__": "validate", "is_valid": False, "message": per_session_message(held),
                           "parameter_name": "queue"}
                return False, [refusal], "validator_error"
            return await original(body, request, username)

    push._hidream_admission = True  # type: ignore[attr-defined]
    queue.push = push
    return True


# ---------------------------------------------------------------------------------------------
# Files gradio stored for this app
# ---------------------------------------------------------------------------------------------


def _file_sets(demo: Any) -> list[set]:
    sets = getattr(demo, "temp_file_sets", None)
    return [s for s in (sets or []) if isinstance(s, set)]


def is_app_file(demo: Any, path: str) -> bool:
    """True when gradio stored `path` for this app: an upload received through it, or a copy it
    made of an example or a result. Exact paths as gradio recorded them; nothing else."""
    return any(path in files for files in _file_sets(demo))


def _kept(demo: Any) -> set[str]:
    kept: set[str] = set()
    for block in list((getattr(demo, "blocks", None) or {}).values()):
        kept.update(getattr(block, "keep_in_cache", None) or ())
    return kept


def cache_files(demo: Any) -> list[str]:
    """The files gradio stored for this app that still exist (examples included)."""
    files = set()
    for stored in _file_sets(demo):
        files.update(list(stored))
    return sorted(f for f in files if os.path.isfile(f))


def prune_cache(demo: Any, max_files: int, max_age: float, *, now: float | None = None) -> int:
    """Deletes this app's cached files older than `max_age` seconds, then the oldest beyond
    `max_files`; returns how many went. Examples (gradio's keep-in-cache set) always stay.

    Also removes the hash folders gradio made for them once empty. Files of other apps that
    share the cache folder are never touched: only the paths gradio recorded for this app.
    """
    now = time.time() if now is None else now
    kept = _kept(demo)
    holders: dict[str, list[set]] = {}  # one cached file can be recorded by several components
    for stored in _file_sets(demo):
        for path in list(stored):
            if path not in kept:
                holders.setdefault(path, []).append(stored)
    entries = []
    for path, sets in holders.items():
        try:
            entries.append((os.lstat(path).st_ctime, path))
        except OSError:
            for stored in sets:
                stored.discard(path)  # already gone
    entries.sort(reverse=True)  # newest first
    removed = 0
    for index, (created, path) in enumerate(entries):
        if index < max_files and now - created <= max_age:
            continue
        try:
            os.remove(path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            logger.warning("cannot remove cached file %s: %s", path, exc)
            continue
        for stored in holders[path]:
            stored.discard(path)
        removed += 1
        try:
            Path(path).parent.rmdir()  # gradio's per-file hash folder, when now empty
        except OSError:
            pass
    return removed


__all__ = ["current_event_id", "event_alive", "queue_figures", "session_jobs", "waiting_jobs", "admit_jobs",
           "is_app_file", "cache_files", "prune_cache"]
