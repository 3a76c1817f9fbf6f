"""Gradio's per-session state and logins: lean sessions, idle-session expiry, the session table, and
who a raw HTTP request is logged in as (or signing one in as gradio's own login does).

Gradio builds a `SessionState` the first time a request names a new `session_hash` (any event,
`/status` included) and keeps it until 10,000 newer ones push it out. Its constructor renders the
config of every block of the app (about 240 KB and tens of milliseconds here), a snapshot kept
only for gradio's "deep link" feature, which this app does not offer. The lean state below copies
nothing until the session changes something: the app's blocks are shared until an event updates
one for that session, and the deep-link snapshot is rendered when asked for (from the session's
blocks, without the last values). Sessions idle for long enough are dropped (`expire_sessions`).

Overrides registered in `gradio_seam` (`lean_sessions`, `session_table`, `login_cookies`).
"""

from __future__ import annotations

import logging
import os
from typing import Any

from hidream_ui.server.gradio_queue import queued_events
from hidream_ui.server.gradio_seam import override

logger = logging.getLogger(__name__)


@override("app_file_records")  # App.get_blocks
def scope_demo(scope: dict) -> Any:
    """The gradio Blocks behind an HTTP request (ASGI `scope`), None when there is none."""
    get_blocks = getattr(scope.get("app"), "get_blocks", None)
    try:
        return get_blocks() if callable(get_blocks) else None
    except Exception:  # noqa: BLE001 - no Blocks (yet): nothing recorded to consult
        return None


@override("login_cookies")
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


@override("login_cookies")
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


@override("lean_sessions")
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


@override("lean_sessions")
def mark_worked(demo: Any, session_hash: str | None) -> None:
    """Marks `session_hash` as one that ran a job: evicted last (LeanSessionState.worth)."""
    state = (getattr(getattr(demo, "state_holder", None), "session_data", None) or {}).get(session_hash)
    if state is not None:
        state.worked = True


@override("session_table")
def session_known(scope: dict, session_hash: Any) -> bool:
    """True when the gradio app behind an HTTP request (ASGI `scope`) holds state for `session_hash`."""
    sessions = getattr(getattr(scope_demo(scope), "state_holder", None), "session_data", None)
    return isinstance(session_hash, str) and isinstance(sessions, dict) and session_hash in sessions


@override("session_table")
def session_count(demo: Any) -> int:
    """Sessions gradio holds state for."""
    return len(getattr(getattr(demo, "state_holder", None), "session_data", None) or {})


@override("session_table")
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
    busy = {getattr(event, "session_hash", None) for event in queued_events(demo)}
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
    "scope_demo",
    "logged_in_user",
    "sign_in",
    "lean_sessions",
    "mark_worked",
    "session_known",
    "session_count",
    "expire_sessions",
]
