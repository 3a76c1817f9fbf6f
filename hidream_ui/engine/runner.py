"""The one job runner: edit, batch and compare run through it the same way.

A job is `work(emit)`: it takes the engine call that does the work, the job's cancel token (Stop,
`/cancel`, a client's `Job.cancel()` or its disconnect set it) and reports what happens as one
typed event stream, `JobEvent(kind, payload)`:

    step     StepInfo           a denoising step finished (edit, batch, compare)
    preview  Preview            a live preview every K steps of an edit (--preview-every; never saved)
    rewrite  (done, count)      instructions rewritten so far (batch with rewriting)
    item     BatchItem          a batch item finished, failed or was refused (`batch --manifest`:
                                its ItemOutput, unsaved; the command saves it)
    cell     (CompareCell, EditResult)   a comparison cell finished
    done     the work's return value: the last event

Two ways to run one:
* `run_job`: in the calling thread, events to a callback (the `edit` command's steps to its bar;
  `batch --manifest`, whose items are saved and recorded as their events arrive).
* `stream_job`: in one thread of its own, events yielded as they happen (the Edit tab streams its
  live previews, the Batch and Compare tabs their partial results). A sync generator is advanced
  by whichever gradio worker thread is free, so the computing thread must be one of its own: on an
  NPU the device is bound to the thread that computes. When the consumer stops early (the browser
  went away), the job's token is cancelled and the thread ends after its current step; the engine
  lock keeps the next job from overlapping it. Nothing is left running past the job's next step.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterator, TypeVar

from hidream_ui.engine.jobs import CancelToken

T = TypeVar("T")

EVENT_KINDS = ("step", "preview", "rewrite", "item", "cell", "done")
ABANDONED = "the client went away"


@dataclass(frozen=True)
class JobEvent:
    kind: str  # one of EVENT_KINDS
    payload: Any


Emit = Callable[[str, Any], None]


def _checked(kind: str) -> str:
    if kind not in EVENT_KINDS:
        raise ValueError(f"job event kind {kind!r}: expected one of {', '.join(EVENT_KINDS)}")
    return kind


def run_job(work: Callable[[Emit], T], on_event: Callable[[JobEvent], None]) -> T:
    """Runs `work(emit)` in the calling thread; each `emit(kind, payload)` reaches `on_event` at once,
    then `done` with the return value. Exceptions propagate (EditCancelled for a stopped job)."""
    result = work(lambda kind, payload: on_event(JobEvent(_checked(kind), payload)))
    on_event(JobEvent("done", result))
    return result


def stream_job(work: Callable[[Emit], Any], token: CancelToken, *, name: str) -> Iterator[JobEvent]:
    """Runs `work(emit)` in a thread named `name` and yields its events as they happen, `done` last
    (with the return value), or re-raises what `work` raised. A consumer that stops early cancels
    `token`; the thread then stops after its current step, and nobody waits for it on gradio's
    event loop (that would stall every client)."""
    events: "queue.Queue[tuple[str, Any]]" = queue.Queue()

    def target() -> None:
        try:
            events.put(("done", work(lambda kind, payload: events.put((_checked(kind), payload)))))
        except BaseException as exc:  # noqa: BLE001 - re-raised in the consumer's thread below
            events.put(("failed", exc))

    thread = threading.Thread(target=target, name=name, daemon=True)
    thread.start()
    finished = False
    try:
        while True:
            kind, payload = events.get()
            if kind == "failed":
                finished = True
                raise payload
            if kind == "done":
                finished = True
                yield JobEvent(kind, payload)
                return
            yield JobEvent(kind, payload)
    finally:
        if finished:
            thread.join()
        else:
            token.cancel(ABANDONED)


__all__ = ["ABANDONED", "EVENT_KINDS", "Emit", "JobEvent", "run_job", "stream_job"]
