"""`AppServices`: what every tab's handlers share besides the engine.

One instance per demo: the job registry (cancel tokens), the upload gate, the result files gradio
may serve, the rewriter, and the clean-ups to run at shutdown.
Built by `layout.build_demo` (or by the launcher, which hands it over); tests build one with
`trusted_roots` to hand files to handlers in-process (the gate then accepts files under those
folders, as it accepts the bundled examples).
"""

from __future__ import annotations

import logging
import re
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from hidream_ui.config import AppConfig
from hidream_ui.engine.errors import EngineError
from hidream_ui.engine.jobs import Job, JobRegistry
from hidream_ui.engine.protocol import Capabilities
from hidream_ui.rewrite.service import RewriteService
from hidream_ui.server import gradio_internals
from hidream_ui.server.files import ServedResults, UploadGate
from hidream_ui.ui.world_examples import examples_folder

logger = logging.getLogger(__name__)


def is_public(config: AppConfig) -> bool:
    """No login (`--auth`, `--auth-file`): anyone who reaches the port is a stranger."""
    return config.auth is None and config.auth_file is None


# Why a tab's Stop button cancelled a job (the default of `AppServices.cancel`): a stop the user
# asked for in the browser ends neutrally ("Stopped after k of N steps"), not as an error.
STOPPED_BY_USER = "stopped by its user"

ASSETS_DIR = Path(__file__).resolve().parents[2] / "assets"

# Absolute paths inside messages (POSIX or Windows): shown as their last component to visitors.
_ABSOLUTE_PATH = re.compile(r"(?:[A-Za-z]:)?[\\/](?:[^\s'\"\\/:]+[\\/])+([^\s'\"\\/:]*)")


def redact_paths(text: str) -> str:
    """`text` with every absolute path replaced by its last component ("/srv/models/HiDream-E1-1"
    -> "HiDream-E1-1"): what a visitor of an app without login may see of the server's disk."""
    return _ABSOLUTE_PATH.sub(lambda m: m.group(1) or "/", text)


@dataclass
class AppServices:
    """Built complete, once (`for_config`): nothing is assigned to it afterwards."""

    config: AppConfig
    jobs: JobRegistry
    gate: UploadGate
    results: ServedResults
    demo: Any = None  # the gr.Blocks the UI is built into (None: handlers used without a UI, in tests)
    janitor: Any = None  # the CacheJanitor of a launched app (cli/app.py); its lifespan starts it
    cache_folder: Path | None = None  # gradio's cache folder of this process (the launcher's)
    rewriter: Any = None  # the RewriteService (None: rewriting off)
    cleanups: list[Callable[[], None]] = field(default_factory=list)

    @classmethod
    def for_config(
        cls,
        config: AppConfig,
        *,
        engine: Any = None,
        demo: Any = None,
        cache_folder: Path | None = None,
        trusted_roots: Iterable[str | Path] = (),
        janitor: Any = None,
    ) -> "AppServices":
        """The services of one UI. `engine` (when given) makes the rewriter `config` asks for; `demo`
        is the (still empty) gr.Blocks the UI will be built into: the upload gate and the liveness
        probe read it."""

        def is_stored(path: str) -> bool:
            return demo is not None and gradio_internals.is_app_file(demo, path)

        rewriter = RewriteService.for_config(config, engine) if engine is not None else None
        if rewriter is not None and rewriter.uses_device and not engine.capabilities.local_rewriter:
            # The executor cannot run the local rewriter beside its work: no rewriter, and the System
            # panel says why (the Edit tab hides "Rewrite instruction" without one).
            logger.info("no local rewriter: %s", engine.capabilities.missing.get("local_rewriter"))
            rewriter = None
        # The app's own example folders: the bundled photos, and the world scenes of the trained offline model.
        examples = [ASSETS_DIR, *([examples_folder()] if config.uses_trained_tiny_model else [])]
        results = ServedResults(fixed=[str(root) for root in examples])
        # A result sent to the browser comes back as gradio's cached copy ("Edit the result", "Edit again").
        storage = getattr(janitor, "storage", None)
        gate = UploadGate(
            is_stored,
            roots=[*examples, *trusted_roots],
            result_of=lambda path: results.result_of(path, cache_folder),
            expired=storage.expired if storage is not None else None,
        )
        return cls(
            config=config,
            jobs=JobRegistry(),
            gate=gate,
            results=results,
            demo=demo,
            cache_folder=cache_folder,
            rewriter=rewriter,
            janitor=janitor,
        )

    @property
    def public(self) -> bool:
        """No login: anyone who reaches the port is a stranger."""
        return is_public(self.config)

    @contextmanager
    def job(self, kind: str, request: Any) -> Iterator[Job]:
        """Registers the caller's job for the duration of the block. Its token is set by Stop,
        `/cancel`, a client's `Job.cancel()`, or the client going away (gradio's event dies)."""
        session = getattr(request, "session_hash", None)
        event_id = gradio_internals.current_event_id()
        demo = self.demo
        alive = (lambda: gradio_internals.event_alive(demo, event_id)) if demo is not None and event_id else None
        with self.jobs.start(kind, session, event_id, alive) as job:
            yield job

    def cancel(self, request: Any, reason: str = STOPPED_BY_USER, kind: str | None = None) -> int:
        """Cancels the caller's own jobs (never anyone else's; only those of `kind` when given, so a
        tab's Stop stops that tab's work); returns how many."""
        return self.jobs.cancel(getattr(request, "session_hash", None), reason=reason, kind=kind)

    def close(self) -> None:
        for cleanup in reversed(self.cleanups):
            try:
                cleanup()
            except Exception:  # noqa: BLE001 - every clean-up gets its turn
                logger.exception("clean-up %r failed", cleanup)
        self.cleanups.clear()


def require_capability(engine: Any, name: str) -> None:
    """Raises EngineError with the executor's own reason when it lacks capability `name`: the API
    names of a hidden control (`/set_attention`, `/set_speed`) stay and answer with it."""
    capabilities: Capabilities = engine.capabilities
    if not capabilities.has(name):
        raise EngineError(capabilities.missing[name])


class TabHandlers:
    """What a tab's handlers hold: the engine (the executor) and the services shared with the other
    tabs (jobs and their cancel tokens, so one user's Stop only ever stops that user's work). Each
    tab and the system panel subclass it with their own handlers."""

    def __init__(self, engine: Any, services: AppServices | None = None):
        self.engine = engine
        self.services = services or AppServices.for_config(getattr(engine, "config", None) or AppConfig())

    def load_with_progress(self, progress: Callable | None) -> float:
        """Loads the model if needed (the first edit, a local rewrite, "Load model"), moving
        `progress` (a gr.Progress) with the load's messages; returns the seconds this call waited."""
        if self.engine.loaded:
            return 0.0
        started = time.perf_counter()

        def on_progress(fraction: float, message: str) -> None:
            if progress is not None:
                # Load messages name model files; strangers (no --auth) see folder names, as in /status.
                shown = redact_paths(message) if self.services.public else message
                progress(fraction, desc=f"Loading model: {shown}")

        self.engine.load(on_progress=on_progress)
        return time.perf_counter() - started


__all__ = [
    "AppServices",
    "ASSETS_DIR",
    "STOPPED_BY_USER",
    "TabHandlers",
    "require_capability",
    "is_public",
    "redact_paths",
]
