"""The links of ``response_format=url`` (server/openai_api.py): an unguessable, expiring address under
``/v1/images/results/`` for each result, served through the app's own file route as the caller who
made the edit (`loopback.Loopback.fetch`).

A link names no server path: its token is random (`secrets`), and the table here maps it to the
caller and the result's path. The table is bounded (`MAX_LINKS`, the oldest go first) and forgets
links `ttl` seconds after they were made (an hour, as OpenAI's own image links). A result the app's
cache let go of before then answers 404 like an unknown link.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

from hidream_ui.server.loopback import Caller

LINK_TTL = 3600.0  # seconds a result link answers
MAX_LINKS = 10_000  # links kept at once (a flood of edits pushes the oldest out)
TOKEN_BYTES = 24


@dataclass(frozen=True)
class Link:
    caller: Caller  # who made the edit: the file is read as this caller
    path: str  # the result's path in the app's cache (never shown to anyone)
    expires: float


def _now() -> float:
    return time.monotonic()


class ResultLinks:
    """token -> `Link`, bounded and expiring. `clock` (default: the monotonic clock) is read on every
    use, so a test can move it."""

    def __init__(self, ttl: float = LINK_TTL, max_links: int = MAX_LINKS, clock: Callable[[], float] | None = None):
        if ttl <= 0 or max_links < 1:
            raise ValueError(f"ttl must be > 0 and max_links >= 1 (got {ttl}, {max_links})")
        self.ttl = ttl
        self.max_links = max_links
        self._clock = clock
        self._links: OrderedDict[str, Link] = OrderedDict()
        self._lock = threading.Lock()

    def now(self) -> float:
        return (self._clock or _now)()

    def add(self, caller: Caller, path: str) -> str:
        """A new token for `path`, read as `caller`, answering for `ttl` seconds."""
        token = secrets.token_urlsafe(TOKEN_BYTES)
        with self._lock:
            self._forget_expired()
            self._links[token] = Link(caller=caller, path=path, expires=self.now() + self.ttl)
            while len(self._links) > self.max_links:
                self._links.popitem(last=False)
        return token

    def get(self, token: str) -> Link | None:
        """The link of `token` while it answers, else None."""
        with self._lock:
            self._forget_expired()
            return self._links.get(token)

    def __len__(self) -> int:
        return len(self._links)

    def _forget_expired(self) -> None:
        now = self.now()
        while self._links:
            token, link = next(iter(self._links.items()))
            if link.expires > now:
                break
            del self._links[token]


__all__ = ["LINK_TTL", "MAX_LINKS", "Link", "ResultLinks"]
