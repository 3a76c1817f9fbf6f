"""`ServedResults`: the results folder is not served as a whole; each result PNG the app wrote is
allowed individually (and dropped again once retention deleted it), and a History entry names its
result by an opaque id signed for one browser, never by its path.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import threading
from typing import Any, Iterable


class ServedResults:
    """The result PNGs gradio may serve: exactly those the app wrote and retention kept.

    `allowed` is the very list given to `launch(allowed_paths=...)`; gradio reads it on every
    file request, so adding a path here makes that one file reachable.
    """

    # A History entry names its result by an opaque id (`result_id`), never by its path, signed for
    # one browser (`ticket`). What a browser sends back is bounded before it is hashed or looked up.
    ID_CHARS = 22  # secrets.token_urlsafe(16)
    MAX_BROWSER_CHARS = 128  # the browser's secret (history_entries.new_browser_secret: 43 characters)

    def __init__(self, fixed: Iterable[str | os.PathLike] = ()):
        self._fixed = [str(p) for p in fixed]
        self._results: list[str] = []
        self._lock = threading.Lock()
        self.allowed: list[str] = list(self._fixed)
        # path -> id and back, only for results still served (add() drops the others), so the map is
        # bounded like the result list. Random, not derived from the path: an id says nothing.
        self._ids: dict[str, str] = {}
        self._paths: dict[str, str] = {}
        # This process's key: a History entry (in the browser's own storage, which the browser can
        # rewrite) opens a result only with a ticket made here, so a restart ends every ticket.
        self._key = secrets.token_bytes(32)

    def result_id(self, path: str | os.PathLike | None) -> str | None:
        """The opaque id a browser keeps for the served result `path` (made on first ask; None when
        `path` is not a result this server serves)."""
        if not path:
            return None
        path = os.fspath(path)
        with self._lock:
            if path not in self._results:
                return None
            if path not in self._ids:
                made = secrets.token_urlsafe(16)
                self._ids[path], self._paths[made] = made, path
            return self._ids[path]

    def ticket(self, result_id: str, browser: str) -> str:
        """The signature of a History entry: this process's key over the result's id and the
        browser's secret (history_entries says what it binds and what it does not)."""
        message = f"hidream-ui history\0{result_id}\0{browser}".encode("utf-8", "surrogatepass")
        return hmac.new(self._key, message, hashlib.sha256).hexdigest()

    def stored(self, result_id: Any, ticket: Any, browser: Any) -> str | None:
        """The path of the result `result_id` names when this server signed `ticket` for it and for
        this `browser` (its secret), still serves it and the file is there; else None. A path a
        browser sends back is never looked at: an entry names only an id."""
        if not (isinstance(result_id, str) and isinstance(ticket, str) and isinstance(browser, str)):
            return None
        if len(result_id) != self.ID_CHARS or len(ticket) != 64 or not 0 < len(browser) <= self.MAX_BROWSER_CHARS:
            return None
        # As bytes: compare_digest refuses str with non-ASCII characters (a browser can send any).
        if not hmac.compare_digest(self.ticket(result_id, browser).encode(), ticket.encode("utf-8", "surrogatepass")):
            return None
        with self._lock:
            path = self._paths.get(result_id)
        return path if path is not None and os.path.isfile(path) else None

    def add(self, *paths: str | os.PathLike | None) -> None:
        with self._lock:
            self._results.extend(str(p) for p in paths if p)
            # Retention may have deleted older results: they are no longer served either.
            self._results = [p for p in dict.fromkeys(self._results) if os.path.isfile(p)]
            self.allowed[:] = self._fixed + self._results  # in place: gradio holds this list
            served = set(self._results)
            self._ids = {path: made for path, made in self._ids.items() if path in served}
            self._paths = {made: path for path, made in self._ids.items()}

    def __contains__(self, path: object) -> bool:
        return str(path) in self.allowed

    def result_of(self, path: str, cache_folder: str | os.PathLike | None) -> str | None:
        """The served result whose copy `path` is: a file inside gradio's cache folder with a served
        result's name and the same bytes (gradio's copy of an output it sent to a browser). None
        otherwise. Reads `path` only inside `cache_folder`, and only to compare it with the result."""
        if cache_folder is None:
            return None
        real, folder = os.path.realpath(path), os.path.realpath(cache_folder)
        if not real.startswith(folder + os.sep) or not os.path.isfile(real):
            return None
        with self._lock:
            named = [p for p in self._results if os.path.basename(p) == os.path.basename(real)]
        for result in named:
            try:
                if os.path.getsize(result) == os.path.getsize(real) and _same_bytes(result, real):
                    return result
            except OSError:
                continue
        return None


def _same_bytes(a: str, b: str) -> bool:
    with open(a, "rb") as first, open(b, "rb") as second:
        while True:
            x, y = first.read(1 << 20), second.read(1 << 20)
            if x != y:
                return False
            if not x:
                return True


__all__ = ["ServedResults"]
