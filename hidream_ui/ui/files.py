"""Files in and out of the app: which client paths it may open, which results it serves, and a
cache that does not grow without bound.

* `UploadGate`: the Edit, Batch and Compare events run with ``preprocess=False`` (so a damaged
  file gets our clear per-file message instead of gradio's), which means the handler receives
  whatever path a raw API client writes. The gate opens a path only when gradio stored it for
  this app (an upload through it, or its copy of an example) or when it lies in a folder the app
  trusts (the bundled examples). Anything else gets one generic message that says nothing about
  whether the file exists.
* `ServedResults`: the results folder is not served as a whole; each result PNG the app wrote is
  allowed individually (and dropped again once retention deleted it).
* `CacheJanitor`: keeps gradio's cache for this app to at most N files and M seconds of age
  while running (gradio's own `delete_cache` handles age and shutdown; the count is ours).
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

from hidream_ui.requests import RequestError

logger = logging.getLogger(__name__)

NOT_UPLOADED = "a file uploaded to this app (upload it again)"


class UploadGate:
    """Turns a client's file value into (path, display name), refusing paths the app did not get.

    `is_stored(path)` says whether gradio stored that exact path for this app; `roots` are
    folders whose files anyone may use (the bundled examples). Values that are not paths (PIL
    images, numpy arrays from Python callers) pass through untouched.
    """

    def __init__(self, is_stored: Callable[[str], bool], roots: Iterable[str | os.PathLike] = ()):
        self._is_stored = is_stored
        self._roots = [os.path.realpath(r) for r in roots]

    def allows(self, path: str | os.PathLike) -> bool:
        text = os.fspath(path)
        if self._is_stored(text):
            return True
        real = os.path.realpath(text)
        return any(real == root or real.startswith(root + os.sep) for root in self._roots)

    def path(self, value: Any, field: str = "image") -> tuple[Any, str | None]:
        """(something `open_image` / `open()` reads, the user's file name) for one file value.

        FileData dicts (what ``preprocess=False`` hands over) and FileData-like objects carry the
        user's name in `orig_name`; a refused path raises RequestError naming only the user's
        name, never the path (that would confirm the file exists).
        """
        if value is None:
            raise RequestError(field, None, "a file: upload one")
        if isinstance(value, Mapping):
            path, name = value.get("path"), value.get("orig_name")
            if not path:
                raise RequestError(field, value.get("orig_name") or "upload",
                                   "an uploaded file (the upload did not arrive)")
        elif isinstance(value, (str, os.PathLike)):
            path, name = value, None
        elif isinstance(getattr(value, "path", None), (str, os.PathLike)):
            path, name = value.path, getattr(value, "orig_name", None)
        else:
            return value, None  # PIL / numpy from Python callers: no file is opened
        if not isinstance(path, (str, os.PathLike)):
            raise RequestError(field, "upload", NOT_UPLOADED)
        if not self.allows(path):
            logger.warning("refused a %s path the app did not store", field)
            raise RequestError(field, name or "upload", NOT_UPLOADED)
        return path, name or Path(path).name


class ServedResults:
    """The result PNGs gradio may serve: exactly those the app wrote and retention kept.

    `allowed` is the very list given to `launch(allowed_paths=...)`; gradio reads it on every
    file request, so adding a path here makes that one file reachable.
    """

    def __init__(self, fixed: Iterable[str | os.PathLike] = ()):
        self._fixed = [str(p) for p in fixed]
        self._results: list[str] = []
        self._lock = threading.Lock()
        self.allowed: list[str] = list(self._fixed)

    def add(self, *paths: str | os.PathLike | None) -> None:
        with self._lock:
            self._results.extend(str(p) for p in paths if p)
            # Retention may have deleted older results: they are no longer served either.
            self._results = [p for p in dict.fromkeys(self._results) if os.path.isfile(p)]
            self.allowed[:] = self._fixed + self._results  # in place: gradio holds this list

    def __contains__(self, path: object) -> bool:
        return str(path) in self.allowed


class CacheJanitor:
    """Runs `prune()` every `interval` seconds on a daemon thread until `stop()`."""

    def __init__(self, prune: Callable[[], int], interval: float):
        self._prune = prune
        self._interval = interval
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.removed = 0

    def run_once(self) -> int:
        try:
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
            while not self._stop.wait(self._interval):
                self.run_once()

        self._thread = threading.Thread(target=loop, name="hidream-cache-janitor", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None


__all__ = ["UploadGate", "ServedResults", "CacheJanitor", "NOT_UPLOADED"]
