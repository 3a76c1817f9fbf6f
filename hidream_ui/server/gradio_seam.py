"""The seam between the app and Gradio's private internals: one registry of every override.

Gradio has no public way to ask which event runs in this thread, whether its client is still
connected, which files it stored for this app, or how many jobs one session holds; nor to admit
jobs per client, to make its sessions cheap, or to log a client in from outside its login page.
The app needs all of it to be safe in front of strangers, so it reads and patches Gradio's
private state in a few places (`gradio_queue`, `gradio_cache`, `gradio_sessions`, and the HTTP
guard and operator login for Gradio's routes). Each such place is an `Override` here, registered
with what it touches, why, and the Gradio version it was checked against (`checked_with`).

Every body marks itself with `@override(name)`, which refuses a name that is not registered here,
so an override cannot exist without its entry. tests/test_gradio_seam.py fails when the installed
Gradio differs from an entry's `checked_with` (listing which overrides to re-check) and when a
private attribute, a parameter, a route or a line of Gradio's source an override relies on is gone.
At run time a mismatch is logged once (`warn_if_unchecked`); the bodies themselves read Gradio
defensively, so a renamed attribute degrades to "unknown" (never to a crash, never to accepting a
file).

Stdlib only at import: gradio stays unimported until a check asks for it.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
import logging
from dataclasses import dataclass
from typing import Any, Callable, Mapping, TypeVar

logger = logging.getLogger(__name__)

# The Gradio release the overrides below were read against (requirements.txt pins it). A re-check
# of one override on a newer Gradio updates that entry's `checked_with` alone.
GRADIO_6_31 = "6.31.0"


@dataclass(frozen=True)
class Override:
    """One place where the app relies on Gradio's private internals.

    `touches`: dotted names that must exist on the installed Gradio: ``module.Class.attr`` (a class
    attribute, or one every instance gets: checked on a real instance), optionally with the
    parameters the app passes or reads, ``module.Class.method(a, b)``. `routes`: HTTP paths of
    Gradio's app the override stands in front of. `marks`: ``(module, text)`` pairs, text that must
    still appear in that module's source (a cookie name, an exception a parser catches): what no
    attribute check can see.
    """

    name: str
    target: str  # what it patches or reads, dotted
    checked_with: str  # the Gradio version it was checked against
    touches: tuple[str, ...] = ()
    routes: tuple[str, ...] = ()
    marks: tuple[tuple[str, str], ...] = ()
    why: str = ""

    def __post_init__(self) -> None:
        if not (self.why and self.checked_with and self.target):
            raise ValueError(f"Gradio override {self.name!r} must say what it touches, why, and the version checked")


def _on(owner: str, *names: str) -> tuple[str, ...]:
    """``owner.name`` for each name: the attributes of one Gradio class an override touches."""
    return tuple(f"{owner}.{name}" for name in names)


_QUEUE = "gradio.queueing"
_BLOCKS = "gradio.blocks"
_STATE = "gradio.state_holder"
_FN = "gradio.block_function.BlockFunction"
_BODY = "gradio.data_classes.PredictBodyInternal"

OVERRIDES: tuple[Override, ...] = (
    Override(
        "event_context",
        "gradio.context.LocalContext.event_id",
        GRADIO_6_31,
        touches=("gradio.context.LocalContext.event_id",),
        why="which event the handler in this thread runs for: its cancel token and its 'still connected' check",
    ),
    Override(
        "queue_state",
        f"{_QUEUE}.Queue (read)",
        GRADIO_6_31,
        touches=(
            f"{_BLOCKS}.Blocks._queue",
            *_on(f"{_QUEUE}.Queue", "active_jobs", "event_queue_per_concurrency_id"),
            *_on(f"{_QUEUE}.EventQueue", "queue", "current_concurrency"),
            *_on(f"{_QUEUE}.Event", "_id", "alive", "session_hash", "fn"),
            f"{_FN}.concurrency_id",
        ),
        why="waiting and running events per lane and per session: the status panel, queue position, "
        "'is this client still there', idle-session expiry",
    ),
    Override(
        "queue_admission",
        f"{_QUEUE}.Queue.push",
        GRADIO_6_31,
        touches=(
            f"{_QUEUE}.Queue.push(body, request, username)",
            f"{_BLOCKS}.Blocks.fns",
            *_on(_FN, "api_name", "inputs"),
            *_on(_BODY, "fn_index", "session_hash", "data"),
        ),
        marks=((_QUEUE, '"queue_full"'), (_QUEUE, '"validator_error"')),
        why="per-lane queue limit and per-session job limit where gradio admits events (browser, "
        "gradio_client and REST alike); pads the late inputs of older raw clients",
    ),
    Override(
        "login_cookies",
        "gradio.routes.App.tokens",
        GRADIO_6_31,
        touches=_on("gradio.routes.App", "tokens", "cookie_id"),
        marks=(("gradio.routes", 'f"access-token-{app.cookie_id}"'), ("gradio.routes", "access-token-unsecure-")),
        why="who a raw HTTP request is logged in as (guard), and the operator's sign-in without gradio's auth",
    ),
    Override(
        "cached_image_names",
        "gradio.processing_utils.hash_bytes",
        GRADIO_6_31,
        touches=("gradio.processing_utils.hash_bytes",),
        why="a live preview's 'before' image written once under the name gradio gives it, so gradio "
        "never rewrites a file a client is downloading",
    ),
    Override(
        "app_file_records",
        f"{_BLOCKS}.Blocks.upload_file_set",
        GRADIO_6_31,
        touches=(
            *_on(f"{_BLOCKS}.Blocks", "upload_file_set", "temp_file_sets", "blocks"),
            f"{_BLOCKS}.Block.keep_in_cache",
            *_on("gradio.routes.App", "uploaded_file_dir", "get_blocks"),
        ),
        why="which cached files are this app's uploads or examples (the upload gate), and taking pruned "
        "or refused files out of gradio's records",
    ),
    Override(
        "queued_files",
        f"{_QUEUE}.Event.data",
        GRADIO_6_31,
        touches=(f"{_QUEUE}.Event.data", f"{_BODY}.data"),
        why="files a waiting or running event names are in use: the pruning never removes them",
    ),
    Override(
        "call_watch",
        f"{_BLOCKS}.Blocks.process_api",
        GRADIO_6_31,
        touches=(f"{_BLOCKS}.Blocks.process_api(block_fn, inputs, request, session_hash, event_id)",),
        why="the files each call read and produced, charged to its client (per-client storage)",
    ),
    Override(
        "upload_abort",
        "gradio.route_utils.GradioMultiPartParser",
        GRADIO_6_31,
        touches=("gradio.route_utils.GradioMultiPartParser.parse",),
        # The parser deletes its spool files on this exception; the upload route answers it (413/400).
        marks=(
            ("gradio.route_utils", "except (MultiPartException, MultipartParseError)"),
            ("gradio.routes", "except MultiPartException as exc:"),
        ),
        why="the one exception that makes gradio's upload parser delete its spool files when the guard cuts a body",
    ),
    Override(
        "lean_sessions",
        f"{_STATE}.SessionState, {_STATE}.StateHolder (subclassed; the app's holder re-classed)",
        GRADIO_6_31,
        touches=(
            f"{_STATE}.SessionState.__init__(blocks)",
            f"{_STATE}.SessionState.__setitem__(key, value)",
            f"{_STATE}.SessionState._update_config(key)",
            f"{_STATE}.SessionState._update_value_in_config(key, value)",
            *_on(f"{_STATE}.SessionState", "components", "blocks_config", "config_values", "state_data"),
            *_on(f"{_STATE}.SessionState", "_state_ttl", "is_closed", "STATE_TTL_WHEN_CLOSED"),
            f"{_STATE}.StateHolder.__getitem__(session_id)",
            f"{_STATE}.StateHolder.update(session_id)",
            *_on(f"{_STATE}.StateHolder", "blocks", "capacity"),
            *_on(f"{_BLOCKS}.Blocks", "default_config", "state_holder"),
            *_on(f"{_BLOCKS}.BlocksConfig", "blocks", "renderables"),
            f"{_BLOCKS}.BlocksConfig.config_for_block(_id, rendered_ids, block)",
        ),
        why="a new session costs nothing until it changes something (gradio copies every block's config), "
        "and a full session table evicts the sessions of least worth first",
    ),
    Override(
        "session_table",
        f"{_STATE}.StateHolder.session_data",
        GRADIO_6_31,
        touches=(
            *_on(f"{_STATE}.StateHolder", "session_data", "time_last_used", "lock"),
            f"{_STATE}.StateHolder.delete_state(session_id)",
        ),
        why="dropping idle sessions, and knowing whether a request names a session gradio holds",
    ),
    Override(
        "http_routes",
        "gradio.routes.App (its HTTP routes)",
        GRADIO_6_31,
        routes=(
            "/gradio_api/upload",
            "/gradio_api/cancel",
            "/gradio_api/queue/join",
            "/gradio_api/run/{api_name}",
            "/gradio_api/call/{api_name}",
            "/login",
            "/logout",
        ),
        marks=(("gradio.data_classes", "gradio.FileData"),),
        why="the guard bounds, throttles and cancels on gradio's routes (upload, cancel, queue join, run, "
        "call, login) by their paths and bodies",
    ),
)

_BY_NAME = {entry.name: entry for entry in OVERRIDES}
if len(_BY_NAME) != len(OVERRIDES):  # pragma: no cover - a typo in the table above
    raise ValueError("two Gradio overrides share a name")

# name -> the bodies that registered under it (module.qualname), filled as the modules are imported.
BODIES: dict[str, list[str]] = {entry.name: [] for entry in OVERRIDES}

_T = TypeVar("_T")


def override(name: str) -> Callable[[_T], _T]:
    """Marks a function or class as (part of) the registered override `name`; refuses a name the
    registry does not hold, so that no private use of Gradio exists without its entry."""
    if name not in _BY_NAME:
        raise ValueError(f"{name!r} is not a registered Gradio override (gradio_seam.OVERRIDES: {sorted(_BY_NAME)})")

    def mark(body: _T) -> _T:
        body.__gradio_override__ = name  # type: ignore[attr-defined]
        BODIES[name].append(f"{body.__module__}.{body.__qualname__}")  # type: ignore[attr-defined]
        return body

    return mark


def installed_gradio() -> str | None:
    """The installed Gradio's version (None when gradio is not installed)."""
    try:
        return importlib.metadata.version("gradio")
    except importlib.metadata.PackageNotFoundError:
        return None


def unchecked(version: str | None = None) -> list[Override]:
    """The overrides not checked against `version` (default: the installed Gradio)."""
    version = installed_gradio() if version is None else version
    return [entry for entry in OVERRIDES if entry.checked_with != version]


def recheck_message(stale: list[Override], version: str | None) -> str:
    """What to re-check, one override a line: its name, what it touches, the version it was checked with."""
    lines = [f"gradio {version} is installed; re-check these overrides (hidream_ui/server/gradio_seam.py):"]
    lines += [f"  {entry.name}: {entry.target} (checked with {entry.checked_with})" for entry in stale]
    return "\n".join(lines)


_WARNED = False


def warn_if_unchecked() -> None:
    """Logs, once per process, the overrides the installed Gradio was not checked against."""
    global _WARNED
    if _WARNED:
        return
    _WARNED = True
    version = installed_gradio()
    stale = unchecked(version)
    if stale:
        logger.warning(recheck_message(stale, version))


# ---------------------------------------------------------------------------------------------
# Checks against the installed Gradio (tests/test_gradio_seam.py)
# ---------------------------------------------------------------------------------------------


def _resolve(dotted: str) -> tuple[Any, list[str]]:
    """(the deepest importable module of `dotted`, the attribute names after it)."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            return importlib.import_module(".".join(parts[:cut])), parts[cut:]
        except ImportError:
            continue
    raise ImportError(f"no module of {dotted!r} can be imported")


def missing_touches(entry: Override, samples: Mapping[type, Any]) -> list[str]:
    """What `entry` touches that the installed Gradio lacks, one line each. `samples`: a real
    instance per class, for attributes that only instances have (set in ``__init__``)."""
    problems = []
    for touched in entry.touches:
        dotted, _, params = touched.partition("(")
        wanted = [p.strip() for p in params.rstrip(")").split(",") if p.strip()]
        try:
            owner, names = _resolve(dotted)
        except ImportError as exc:
            problems.append(f"{entry.name}: {dotted}: {exc}")
            continue
        found = True
        for index, attr in enumerate(names):
            if hasattr(owner, attr):
                owner = getattr(owner, attr)
                continue
            last = index == len(names) - 1
            sample = samples.get(owner) if isinstance(owner, type) else None
            if last and sample is not None and hasattr(sample, attr):
                owner = getattr(sample, attr)
                continue
            where = "" if not isinstance(owner, type) or sample is not None else " (no sample instance to look on)"
            problems.append(f"{entry.name}: {dotted}: no attribute {attr!r}{where}")
            found = False
            break
        if found and wanted:
            try:
                have = set(inspect.signature(owner).parameters)
            except (TypeError, ValueError):
                have = set()
            lacking = [p for p in wanted if p not in have]
            if lacking:
                problems.append(f"{entry.name}: {dotted}: no parameter(s) {lacking}")
    for module, text in entry.marks:
        try:
            source = inspect.getsource(importlib.import_module(module))
        except (ImportError, OSError, TypeError) as exc:
            problems.append(f"{entry.name}: {module}: source unreadable ({exc})")
            continue
        if text not in source:
            problems.append(f"{entry.name}: {module}: no longer contains {text!r}")
    return problems


def missing_routes(entry: Override, paths: set[str]) -> list[str]:
    """The routes `entry` relies on that are not among `paths` (a Gradio app's route paths)."""
    return [f"{entry.name}: route {route} is gone" for route in entry.routes if route not in paths]


__all__ = [
    "GRADIO_6_31",
    "Override",
    "OVERRIDES",
    "BODIES",
    "override",
    "installed_gradio",
    "unchecked",
    "recheck_message",
    "warn_if_unchecked",
    "missing_touches",
    "missing_routes",
]
