"""The links of "Send to my phone" and the results on the booth's wall (``--wall``).

Both are `openai_links.ResultLinks` tokens: unguessable, expiring (an hour), bounded, naming no server
path, read back through the app's own file route as the visitor who made the edit
(server/share_routes.py). The wall is the last `WALL_SIZE` results whose visitors ticked "Show on
the wall", in memory only: a restart empties it, and an entry leaves it when its link expires.

One `ShareLinks` per app (`of(demo)`): the Edit tab's hook (ui/share_phone.py) adds to it while
the page is built, the routes read it.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

from hidream_ui.server.loopback import Caller
from hidream_ui.server.openai_links import LINK_TTL, Link, ResultLinks

WALL_SIZE = 30  # results the wall cycles (the oldest leave first)
PHONE_PATH = "/share"  # + "/<token>": a result's PNG, for a phone (no cookies needed)
WALL_PATH = "/wall"  # the wall's page; WALL_PATH + "/list.json": its links


@dataclass(frozen=True)
class PhoneLink:
    """What the Edit tab shows: the link and when it stops answering (seconds since the epoch)."""

    url: str
    expires_at: float


class ShareLinks:
    """Phone links and the wall of one app. `clock` (monotonic seconds) is for tests."""

    def __init__(self, ttl: float = LINK_TTL, wall_size: int = WALL_SIZE, clock: Callable[[], float] | None = None):
        if wall_size < 1:
            raise ValueError(f"wall_size must be >= 1 (got {wall_size})")
        self.links = ResultLinks(ttl=ttl, clock=clock)
        self.wall_size = wall_size
        self._wall: OrderedDict[str, str] = OrderedDict()  # result path -> its wall token
        self._lock = threading.Lock()

    def phone_link(self, caller: Caller, path: str, base_url: str) -> PhoneLink:
        """A new link to `path` under `base_url` (the address the visitor reached the app by)."""
        token = self.links.add(caller, path)
        link = self.links.get(token)
        remaining = (link.expires - self.links.now()) if link is not None else 0.0
        return PhoneLink(url=f"{base_url.rstrip('/')}{PHONE_PATH}/{token}", expires_at=time.time() + remaining)

    def get(self, token: str) -> Link | None:
        return self.links.get(token)

    def show_on_wall(self, caller: Caller, path: str, show: bool) -> None:
        """Puts the result at `path` on the wall (`show`) or takes it off. Only the Edit tab's own
        result reaches here: a visitor names no path (ui/share_phone.py)."""
        with self._lock:
            self._wall.pop(path, None)
            if show:
                self._wall[path] = self.links.add(caller, path)
                while len(self._wall) > self.wall_size:
                    self._wall.popitem(last=False)

    def wall_tokens(self) -> list[str]:
        """The wall's tokens still answering, newest first."""
        with self._lock:
            live = [(path, token) for path, token in self._wall.items() if self.links.get(token) is not None]
            self._wall = OrderedDict(live)
            return [token for _, token in reversed(live)]


_APPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_APPS_LOCK = threading.Lock()


def of(demo) -> ShareLinks:
    """The `ShareLinks` of the gradio app `demo` (made on first use)."""
    with _APPS_LOCK:
        table = _APPS.get(demo)
        if table is None:
            table = _APPS[demo] = ShareLinks()
        return table


__all__ = ["PHONE_PATH", "WALL_PATH", "WALL_SIZE", "PhoneLink", "ShareLinks", "of"]
