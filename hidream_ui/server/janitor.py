"""`CacheJanitor`: runs the pruning of gradio's cache every few seconds while the app runs, and at
once when a charge takes a client or the cache past a cap (gradio's own `delete_cache` handles age
and shutdown; bytes, counts and per-client quotas are ours: `client_storage.ClientStorage`).
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from hidream_ui.server.client_storage import ClientStorage

logger = logging.getLogger(__name__)


class CacheJanitor:
    """Runs `prune()` every `interval` seconds on a daemon thread until `stop()`; `storage` is the
    `ClientStorage` the pruning consults (None: count and age only, as before per-client accounting)."""

    def __init__(self, prune: Callable[[], int], interval: float, storage: "ClientStorage | None" = None):
        self._prune = prune
        self._interval = interval
        self.storage = storage
        self._run_lock = threading.Lock()  # the timer thread and an upload's "prune, then look again"
        self._stop = threading.Event()
        self._wake = threading.Event()  # `wake()`: a round now, not at the next tick
        self._thread: threading.Thread | None = None
        self.removed = 0
        if storage is not None and storage.wake is None:
            storage.wake = self.wake

    def run_once(self) -> int:
        try:
            with self._run_lock:
                removed = self._prune()
        except Exception:  # noqa: BLE001 - housekeeping must never take the app down
            logger.exception("pruning gradio's cache failed")
            return 0
        self.removed += removed
        return removed

    def start(self) -> None:
        if self._thread is not None:
            return

        def loop() -> None:
            while not self._stop.is_set():
                self._wake.wait(self._interval)
                self._wake.clear()
                if not self._stop.is_set():
                    self.run_once()

        self._thread = threading.Thread(target=loop, name="hidream-cache-janitor", daemon=True)
        self._thread.start()

    def wake(self) -> None:
        """A round as soon as the janitor's thread can run it (cheap: called from the event loop)."""
        self._wake.set()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None


__all__ = ["CacheJanitor"]
