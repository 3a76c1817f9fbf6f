"""The one job runner (engine/runner.py): typed events, the work's thread ends with the job."""

from __future__ import annotations

import ast
import threading
import time
from pathlib import Path

import pytest

import hidream_ui
from hidream_ui.engine.jobs import CancelToken
from hidream_ui.engine.runner import ABANDONED, JobEvent, run_job, stream_job


def test_run_job_reports_every_event_in_order_then_done():
    seen: list[JobEvent] = []

    def work(emit):
        emit("step", 1)
        emit("item", "a")
        return "result"

    assert run_job(work, seen.append) == "result"
    assert seen == [JobEvent("step", 1), JobEvent("item", "a"), JobEvent("done", "result")]


def test_an_unknown_event_kind_is_refused_by_name():
    with pytest.raises(ValueError, match="'stepp'"):
        run_job(lambda emit: emit("stepp", 1), lambda event: None)


def test_stream_job_yields_as_it_happens_and_reraises_failures():
    token = CancelToken()

    def work(emit):
        emit("step", 1)
        raise RuntimeError("boom in the second step")

    events = stream_job(work, token, name="t-fail")
    assert next(events) == JobEvent("step", 1)
    with pytest.raises(RuntimeError, match="second step"):
        next(events)
    assert not token.cancelled


def test_an_abandoned_stream_cancels_its_job_and_the_thread_ends_after_its_step():
    token = CancelToken()
    steps = []

    def work(emit):
        for step in range(1000):
            if token.cancelled:
                return "stopped"
            time.sleep(0.01)
            steps.append(step)
            emit("step", step)
        return "ran to the end"

    events = stream_job(work, token, name="t-abandoned")
    assert next(events).kind == "step"
    events.close()  # what gradio does when the browser goes away
    assert token.cancelled and token.reason == ABANDONED
    deadline = time.monotonic() + 5
    while any(t.name == "t-abandoned" for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not any(t.name == "t-abandoned" for t in threading.enumerate())
    assert len(steps) < 1000


def test_the_ui_starts_no_threads_of_its_own():
    """Edit, Batch and Compare run their jobs through engine/runner.py; no tab keeps a thread."""
    ui = Path(hidream_ui.__file__).parent / "ui"
    offenders = []
    for path in sorted(ui.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Attribute) and node.attr == "Thread":
                offenders.append(f"{path.name}:{node.lineno}")
    assert offenders == []
    streaming = {path.name for path in ui.glob("*.py") if "stream_job(" in path.read_text(encoding="utf-8")}
    # The Edit tab streams too (its live previews; issue 21), from its handlers' module.
    assert {"batch_tab.py", "compare_tab.py", "edit_handlers.py"} <= streaming


def test_the_command_line_jobs_run_through_run_job():
    """`edit` and `batch --manifest` (locally and on Ray) run as `run_job` jobs (issue 53: one runner)."""
    cli = Path(hidream_ui.__file__).parent / "cli"
    for name in ("edit.py", "batch.py"):
        calls = [
            node
            for node in ast.walk(ast.parse((cli / name).read_text(encoding="utf-8")))
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "run_job"
        ]
        assert calls, f"cli/{name} runs no job through engine/runner.run_job"
