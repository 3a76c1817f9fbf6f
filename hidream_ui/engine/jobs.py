"""Jobs and their cancel tokens: one cancellation mechanism for edit, batch and compare.

A job is created when a handler starts work for a client (a browser session or an API client;
both are identified by their session hash). Its `CancelToken` travels with the work down to the
pipeline, which checks it after every denoising step. Everything that wants the work to stop sets
that one token:

* the Stop buttons (the handler knows the caller's session),
* a client's `Job.cancel()` and the browser's `cancels=` (the app's ASGI guard sees gradio's
  ``/cancel`` request and names the session and the event),
* the public ``/cancel`` API (the caller's own session only),
* a client that went away (the token asks the handler's `alive` probe at every step).

Standard library only: the engine, the UI and the tests share it without importing gradio.
"""

from __future__ import annotations

import itertools
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

__all__ = ["CancelToken", "Job", "JobProgress", "JobRegistry", "Preview", "PreviewFn", "StepInfo", "StepFn"]


@dataclass(frozen=True)
class StepInfo:
    step: int  # 1-based, steps finished
    total: int
    stage: str  # "edit" | "refine"
    elapsed: float
    eta: float | None


StepFn = Callable[[StepInfo], None]


@dataclass(frozen=True)
class Preview:
    """A live preview of an edit after `step` of `total` steps: a small RGB picture (a PIL image at the
    latent's resolution, pipeline/previews.py) of what the step predicts. Shown, never saved."""

    step: int
    total: int
    image: Any  # PIL.Image.Image (typed loosely: this module imports only the standard library)


PreviewFn = Callable[[Preview], None]


@dataclass(frozen=True)
class JobProgress:
    """A job's progress as its bar shows it: the fraction done (0..1, steps within the current item
    included) and the bar's text; `step` / `total`: the denoising steps of the current edit."""

    fraction: float
    text: str
    step: int | None = None
    total: int | None = None


MAX_EARLY_CANCELS = 256  # cancels remembered for events that had not started yet


class CancelToken:
    """Set once, read at every step. Remembers why and at which step it was set, so a test (or
    a log line) can tell how far the work ran after the request to stop.

    `alive` is an optional probe (for example "is the client still connected?"); a probe that
    answers False counts as a cancellation with the reason "the client went away".
    """

    def __init__(self, alive: Callable[[], bool] | None = None):
        self._event = threading.Event()
        self._alive = alive
        self.reason: str | None = None
        self.step = 0  # steps finished by the work holding the token (the engine updates it)
        self.cancelled_at_step: int | None = None
        self.cancelled_at: float | None = None

    def cancel(self, reason: str = "cancelled") -> None:
        if self._event.is_set():
            return
        self.reason = reason
        self.cancelled_at_step = self.step
        self.cancelled_at = time.monotonic()
        self._event.set()

    @property
    def cancelled(self) -> bool:
        if self._event.is_set():
            return True
        if self._alive is not None:
            try:
                alive = self._alive()
            except Exception:  # noqa: BLE001 - a broken probe must never stop good work
                alive = True
            if not alive:
                self.cancel("the client went away")
                return True
        return False

    def wait(self, timeout: float | None = None) -> bool:
        return self._event.wait(timeout)


@dataclass
class Job:
    """One piece of work for one client."""

    id: int
    kind: str  # "edit" | "batch" | "compare"
    session: str | None
    event_id: str | None
    token: CancelToken
    started: float = field(default_factory=time.monotonic)
    # What the job's progress bar shows now: set by the handler that moves the bar, read by the
    # system panel, so the two never disagree (one source).
    progress: "JobProgress | None" = None


class JobRegistry:
    """The running jobs of one app, by session and by gradio event id.

    A cancel names a session (Stop buttons, ``/cancel``) or a session and an event (a client's
    `Job.cancel()`); only the jobs of that session are ever touched, so one visitor cannot stop
    another visitor's work. A cancel that arrives before the job exists (Stop pressed while the
    job still waited for the model) is remembered for that event and applied when it starts.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._jobs: dict[int, Job] = {}
        self._ids = itertools.count(1)
        self._early: dict[tuple[str | None, str], float] = {}  # (session, event) -> when cancelled
        self.history: list[Job] = []  # the last finished jobs (tests and the soak benchmark read it)

    @contextmanager
    def start(
        self, kind: str, session: str | None, event_id: str | None = None, alive: Callable[[], bool] | None = None
    ) -> Iterator[Job]:
        token = CancelToken(alive)
        with self._lock:
            job = Job(id=next(self._ids), kind=kind, session=session, event_id=event_id, token=token)
            self._jobs[job.id] = job
            early = self._early.pop((session, event_id), None) if event_id else None
        if early is not None:
            token.cancel("cancelled before it started")
        try:
            yield job
        finally:
            with self._lock:
                self._jobs.pop(job.id, None)
                self.history.append(job)
                del self.history[:-32]

    def running(self, session: str | None = None) -> list[Job]:
        with self._lock:
            return [job for job in self._jobs.values() if session is None or job.session == session]

    def cancel(
        self, session: str | None, event_id: str | None = None, reason: str = "cancelled", kind: str | None = None
    ) -> int:
        """Cancels the session's jobs (only the one of `event_id`, or of `kind`, when given);
        returns how many.

        A session of None matches nothing: an anonymous caller can cancel no one's work.
        """
        if session is None:
            return 0
        with self._lock:
            jobs = [
                job
                for job in self._jobs.values()
                if job.session == session
                and (event_id is None or job.event_id == event_id)
                and (kind is None or job.kind == kind)
            ]
            if not jobs and event_id is not None:
                now = time.monotonic()
                # Forget early cancels nobody claimed (the event never started) after a minute, and
                # keep the table small whatever a client sends (the oldest go first).
                self._early = {key: t for key, t in self._early.items() if now - t < 60}
                while len(self._early) >= MAX_EARLY_CANCELS:
                    self._early.pop(next(iter(self._early)))
                self._early[(session, event_id)] = now
        for job in jobs:
            job.token.cancel(reason)
        return len(jobs)
