"""Every use of Gradio's private internals, behind one seam: this module is what the rest of the
app imports (`gradio_internals.<name>`), and each name is a registered override.

The registry, with what each override touches, why, and the Gradio version it was checked
against, is `gradio_seam.OVERRIDES`; tests/test_gradio_seam.py fails when the installed Gradio
differs from an override's `checked_with` (naming the overrides to re-check) or lacks something
an override touches. The bodies, one job per module:

* `gradio_queue`: the running event, waiting and running events per lane and per session, and the
  app's admission policy where gradio admits events (`admit_jobs`);
* `gradio_sessions`: lean sessions, idle-session expiry, the session table, login cookies;
* `gradio_cache`: the private cache folder, which cached files are this app's, their pruning,
  uploads refused after the fact, the files each call read and wrote.

Read defensively: a mismatch (a Gradio upgrade renamed something) degrades to "unknown" (never to
a crash and never to accepting a file). Pinned by tests/test_hardening*.py and tests/test_safety.py
too. Stdlib only at import: gradio is imported where a body needs it.
"""

from __future__ import annotations

from hidream_ui.server.gradio_cache import (
    app_cache_files,
    cache_files,
    cache_once,
    discard_uploads,
    is_app_file,
    kept_files,
    private_cache_folder,
    prune_cache,
    referenced_paths,
    register_demo,
    stored_uploads,
    upload_abort,
    watch_calls,
)
from hidream_ui.server.gradio_queue import (
    admit_jobs,
    current_event_id,
    event_alive,
    queue_figures,
    queue_position,
    session_jobs,
    waiting_jobs,
)
from hidream_ui.server.gradio_seam import OVERRIDES, Override, unchecked
from hidream_ui.server.gradio_sessions import (
    expire_sessions,
    lean_sessions,
    logged_in_user,
    mark_worked,
    session_count,
    session_known,
    sign_in,
)

__all__ = [
    "OVERRIDES",
    "Override",
    "unchecked",
    "current_event_id",
    "event_alive",
    "logged_in_user",
    "sign_in",
    "queue_figures",
    "queue_position",
    "session_jobs",
    "waiting_jobs",
    "admit_jobs",
    "is_app_file",
    "kept_files",
    "cache_files",
    "cache_once",
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
