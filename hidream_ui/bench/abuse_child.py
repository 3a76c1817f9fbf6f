"""`python -m hidream_ui.bench.abuse_child [app flags]`: `python -m hidream_ui app` for `bench abuse`,
with Gradio's session table capped at $BENCH_ABUSE_SESSION_CAPACITY sessions.

Gradio keeps the state of at most 10,000 sessions (`Blocks.state_session_capacity`, a `launch()`
argument the app has no flag for); a probe cannot open that many in bounded time on a small machine,
so the `session-flood` probe launches the app through this module, which sets the cap on Gradio's
own state holder right after the app has made its sessions lean (`gradio_internals.lean_sessions`).
Nothing else changes: which session goes when the table is full is the app's own choice. Every
0.2 s the table's size is appended to $BENCH_ABUSE_SESSION_LOG as a JSON line
`{"t", "sessions", "worked", "capacity"}` (`worked`: sessions that ran a job), for the probe's figures.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time

from hidream_ui.bench.abuse_app import SESSION_CAPACITY_ENV, SESSION_LOG_ENV

LOG_EVERY = 0.2


def _log_sessions(holder, capacity: int, path: str) -> None:
    with open(path, "a", encoding="utf-8") as out:
        while True:
            sessions = getattr(holder, "session_data", None) or {}
            try:
                worked = sum(1 for state in list(sessions.values()) if getattr(state, "worked", False))
            except RuntimeError:  # the table changed while it was read: the next round counts
                worked = None
            out.write(
                json.dumps(
                    {
                        "t": time.time(),
                        "sessions": len(sessions),
                        "worked": worked,
                        "capacity": getattr(holder, "capacity", capacity),
                    }
                )
                + "\n"
            )
            out.flush()
            time.sleep(LOG_EVERY)


def install(capacity: int, log_path: str | None) -> None:
    """Wraps `gradio_internals.lean_sessions` (the app calls it once its gradio app exists, before
    any request): the app's own step first, then the cap on the same state holder."""
    from hidream_ui.server import gradio_internals  # stdlib only at import: gradio stays unimported here

    original = gradio_internals.lean_sessions

    def lean_sessions(demo):
        made_lean = original(demo)
        holder = getattr(demo, "state_holder", None)
        if holder is not None:
            holder.capacity = capacity
            print(
                f"bench abuse: gradio's session table capped at {capacity} sessions "
                f"({type(holder).__name__}, lean: {made_lean})",
                flush=True,
            )
            if log_path:
                threading.Thread(
                    target=_log_sessions, args=(holder, capacity, log_path), daemon=True, name="bench-sessions"
                ).start()
        return made_lean

    gradio_internals.lean_sessions = lean_sessions


def main(argv: list[str] | None = None) -> int:
    capacity = os.environ.get(SESSION_CAPACITY_ENV)
    if capacity:
        install(int(capacity), os.environ.get(SESSION_LOG_ENV))
    from hidream_ui.cli.app import main as app_main  # the app itself, as `python -m hidream_ui app` runs it
    from hidream_ui.cli.commands import run_main

    with contextlib.suppress(KeyboardInterrupt):
        return run_main(app_main, sys.argv[1:] if argv is None else argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
