"""The limits one app applies to gradio's cache, and what the pruning sees of one cached file.

Plain values shared by the per-client accounting (`client_storage`), the pruning of the folder
(`gradio_cache.prune_cache`) and the app's flags (hidream_ui/config.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# Files nobody is charged for that changed this recently are never pruned: gradio may still be
# writing them (an upload being received, a result being copied in) or about to hand their path out.
ARRIVING_GRACE = 30.0
# A client's latest job (the files its newest call read, produced and previewed) stays in use this
# long after that call: long enough to look at the result and press "Edit the result", short enough
# that nobody pins the cache with it. One job per client: a client cannot pin more by opening sessions.
LATEST_HOLD = 300.0
MB = 1024 * 1024
# The pruning aims this fraction below each cap (`headroom`): a running job writes its previews and its
# result between two rounds, and those must land under the cap, not over it until the next round.
HEADROOM = 0.1


@dataclass(frozen=True)
class StorageLimits:
    """The limits one app applies to gradio's cache (flags in hidream_ui/config.py)."""

    client_bytes: int  # --client-quota-mb
    client_files: int  # --client-quota-files
    cache_bytes: int  # --cache-max-mb
    cache_files: int  # --cache-max-files
    max_age: float  # --cache-max-age
    grace: float = ARRIVING_GRACE
    hold: float = LATEST_HOLD

    @classmethod
    def for_config(cls, config: Any) -> "StorageLimits":
        return cls(
            client_bytes=config.client_quota_mb * MB,
            client_files=config.client_quota_files,
            cache_bytes=config.cache_max_mb * MB,
            cache_files=config.cache_max_files,
            max_age=float(config.cache_max_age),
        )

    @property
    def quota_bytes(self) -> int:
        """One client never holds more than the whole cache."""
        return min(self.client_bytes, self.cache_bytes)

    @property
    def quota_files(self) -> int:
        return min(self.client_files, self.cache_files)


def headroom(cap: int) -> int:
    """How far below `cap` (files or bytes) the pruning brings what it prunes (see HEADROOM)."""
    return int(cap * HEADROOM)


@dataclass(frozen=True)
class CacheEntry:
    """One file in gradio's cache as the janitor saw it."""

    path: str
    size: int
    changed: float  # st_ctime: written, renamed into place, or touched by gradio when handed out again
    modified: float  # st_mtime: still growing while an upload is received
    spool: bool = False  # a multipart spool file of an upload (top-level `tmp*`), not yet renamed into place


@dataclass(frozen=True)
class Refusal:
    # 413: this request alone is too big for a client; 429: its jobs in progress fill its quota; 503: cache full
    status: int
    message: str


__all__ = ["StorageLimits", "CacheEntry", "Refusal", "headroom", "ARRIVING_GRACE", "LATEST_HOLD", "HEADROOM", "MB"]
