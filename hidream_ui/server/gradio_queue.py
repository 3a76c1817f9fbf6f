"""Gradio's queue, read and limited: the running event, waiting and running events per lane and
per session, and the app's admission policy where gradio admits events.

Overrides registered in `gradio_seam` (`event_context`, `queue_state`, `queue_admission`). Read
defensively: a queue that does not look as expected answers "unknown" (alive, no figures, nothing
admitted differently), never a crash.
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable, Iterator

from hidream_ui.server.gradio_seam import override


@override("event_context")
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


@override("queue_state")
def gradio_queue(demo: Any) -> Any:
    """Gradio's queue of `demo` (None when it has none, or it moved)."""
    return getattr(demo, "_queue", None)


@override("queue_state")
def queued_events(demo: Any) -> Iterator[Any]:
    """Every event gradio knows of for `demo`: running ones, then waiting ones."""
    queue = gradio_queue(demo)
    for job in list(getattr(queue, "active_jobs", None) or []):
        yield from list(job or [])
    for group in list((getattr(queue, "event_queue_per_concurrency_id", None) or {}).values()):
        yield from list(getattr(group, "queue", None) or [])


@override("queue_state")
def event_alive(demo: Any, event_id: str | None) -> bool:
    """False once gradio has given up on the event (its client disconnected, or it was cancelled).

    Gradio marks the events of a session `alive = False` when that session's event stream
    closes. Unknown events count as alive: only a positive "gone" stops work.
    """
    if not event_id:
        return True
    for event in queued_events(demo):
        if getattr(event, "_id", None) == event_id:
            return bool(getattr(event, "alive", True))
    return True


@override("queue_state")
def queue_figures(demo: Any, concurrency_id: str) -> dict[str, int] | None:
    """Waiting / running events of one concurrency group (None when gradio's queue is unreadable)."""
    per_group = getattr(gradio_queue(demo), "event_queue_per_concurrency_id", None)
    if not isinstance(per_group, dict):
        return None
    group = per_group.get(concurrency_id)
    if group is None:
        return {"waiting": 0, "running": 0}
    return {"waiting": len(group.queue), "running": int(group.current_concurrency)}


@override("queue_state")
def queue_position(demo: Any, session_hash: str | None, concurrency_id: str) -> int | None:
    """1-based place of `session_hash`'s first waiting event in the `concurrency_id` group's queue
    (None: nothing of that session waits there, or the queue is unreadable)."""
    if not session_hash:
        return None
    group = (getattr(gradio_queue(demo), "event_queue_per_concurrency_id", None) or {}).get(concurrency_id)
    for place, event in enumerate(list(getattr(group, "queue", None) or []), start=1):
        if getattr(event, "session_hash", None) == session_hash and getattr(event, "alive", True):
            return place
    return None


@override("queue_state")
def session_jobs(demo: Any, session_hash: str, concurrency_id: str) -> int:
    """Events of `session_hash` in the `concurrency_id` group, waiting or running."""
    count = 0
    for event in queued_events(demo):
        fn = getattr(event, "fn", None)
        if (
            getattr(event, "session_hash", None) == session_hash
            and getattr(event, "alive", True)
            and getattr(fn, "concurrency_id", None) == concurrency_id
        ):
            count += 1
    return count


@override("queue_state")
def waiting_jobs(demo: Any, concurrency_id: str) -> int:
    """Events waiting (not yet running) in the `concurrency_id` group."""
    figures = queue_figures(demo, concurrency_id)
    return figures["waiting"] if figures else 0


@override("queue_admission")
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
    queue = gradio_queue(demo)
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


__all__ = [
    "current_event_id",
    "gradio_queue",
    "queued_events",
    "event_alive",
    "queue_figures",
    "queue_position",
    "session_jobs",
    "waiting_jobs",
    "admit_jobs",
]
