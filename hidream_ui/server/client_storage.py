"""`ClientStorage`: who holds what in gradio's cache, and the pruning policy built on it.

Every file a client causes (uploads, result copies, live previews, masks) is charged to it; a
client at its quota loses its own least recently used files, a full cache takes from the heaviest
client first, and nobody is refused for what it or others keep (only what jobs in progress use is
never pruned). The folder itself is walked and pruned by `gradio_cache.prune_cache`, on the
janitor's thread (`janitor.CacheJanitor`).
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from hidream_ui.server.storage_limits import MB, CacheEntry, Refusal, StorageLimits, headroom

# Clients remembered for "latest job" (a flood of addresses must not grow the table without bound:
# the least recently seen are forgotten first; a forgotten client's files simply are not pinned).
MAX_CLIENTS = 10_000
# Paths remembered as "aged out" (bounded the same way): a picture a page still shows after its file
# went is answered "this picture has expired, upload it again", not "not an upload of this app".
MAX_EXPIRED = 10_000
FORCED_PRUNE_INTERVAL = 0.25  # seconds: an upload about to be refused prunes first, unless a pruning ran this recently


@dataclass
class _Upload:
    """An upload being received."""

    key: str
    base: int  # bytes its client's running and latest jobs held when it began (what cannot make room)
    declared: int = 0  # its Content-Length (0: chunked), reserved in the cache until it ends
    received: int = 0


@dataclass(frozen=True)
class _Latest:
    """A client's latest job: the files its newest call (all yields of one event) named."""

    event_id: str | None
    seen: float
    paths: frozenset


class ClientStorage:
    """Per-client accounting of gradio's cache, and the pruning policy built on it: files age out per
    client, least recently used first; nobody is refused because of what they, or others, keep.

    **Who is a client.** The upload route carries no session (the browser uploads before any event
    exists), so an upload is charged to what the request does carry: the logged-in user and the
    connection's address (`client_key`). Every call's output copies (results, live previews, the
    download) are charged to the caller's key too. Sessions are free to make, addresses are not:
    everything is per key, never per session.

    **In use** (never pruned): every cache path named in the data of a queued or running event (read
    from gradio's queue by the caller of `plan`; bounded by the queue's limits) and the examples'
    copies (gradio keeps them). **Held** for `hold` seconds: the files of each client's latest job,
    one job per client, so that the result on its screen survives its own newer uploads; under cache
    pressure the heaviest client's held files go too. **Arriving** (never pruned): files nobody is
    charged for yet that changed within `grace` seconds, and upload spool files while an upload is
    being received.

    **Pruning** (`plan`): anything not in use older than `max_age` since it was last written or used;
    then a client over its quota gives up its own least recently used files (a file another client
    holds too is only taken off its account); then, while the cache is over its caps, files charged
    to nobody go, then the heaviest client's least recently used files, one at a time. A file a page
    still shows may go: the upload gate then says "expired, upload it again" (`expired`).

    **Refusals** are left only where no pruning can make room: a request bigger than a client's quota
    by itself (413), a client whose queued and running jobs fill its quota (429), a cache filled by
    jobs in progress and uploads in flight (503).
    """

    def __init__(
        self,
        limits: StorageLimits,
        clock: Callable[[], float] = time.time,
        prune_now: Callable[[], int] | None = None,
        wake: Callable[[], None] | None = None,
    ):
        self.limits = limits
        self._clock = clock
        self._lock = threading.Lock()
        self._owners: dict[str, set[str]] = {}  # path -> keys charged for it
        self._charged: dict[str, float] = {}  # path -> time.monotonic() of its latest charge
        self._held: dict[str, dict[str, int]] = {}  # key -> {path: bytes}
        self._used: dict[str, float] = {}  # path -> last time a call named it
        self._receiving: dict[int, _Upload] = {}  # upload id -> the upload being received
        self._next_upload = 0
        self._latest: dict[str, _Latest] = {}  # key -> its latest job (dict order: least recently seen first)
        self._referenced: frozenset = frozenset()  # paths queued or running events named at the last `plan`
        self._expired: dict[str, None] = {}  # paths pruned while charged, oldest first (bounded)
        self._total = (0, 0)  # (files, bytes) of the cache no pruning frees, at the last scan, plus uploads since
        self.prune_now = prune_now  # the janitor's round, run when an upload finds the cache full
        self.wake = wake  # asks the janitor for a round soon (non-blocking): a client or the cache went past a cap
        self._scanned = 0.0  # time.monotonic() of the last `plan`

    # ------------------------------------------------------------------ who
    @staticmethod
    def client_key(address: str | None, user: str | None = None) -> str:
        # A login and its address together: one shared login (a booth's `--auth booth:pw`) must not
        # share one quota among all its visitors, so that one of them cannot fill it for everyone.
        return f"user:{user}@{address or '?'}" if user else f"address:{address or '?'}"

    def usage(self, key: str) -> tuple[int, int]:
        """(files, bytes) charged to `key`."""
        with self._lock:
            held = self._held.get(key) or {}
            return len(held), sum(held.values())

    def owners(self, path: str) -> set[str]:
        with self._lock:
            return set(self._owners.get(str(path), ()))

    def expired(self, path: str) -> bool:
        """True when `path` was a client's file that the pruning removed (it aged out)."""
        with self._lock:
            return str(path) in self._expired

    # ------------------------------------------------------------------ uploads
    def refusal(self, key: str, declared: int | None = None) -> Refusal | None:
        """Why an upload from `key` is refused before its body is read (None: admitted). `declared`:
        the request's Content-Length, if it has one (it must fit in the cache's room as a whole)."""
        limits = self.limits
        if declared is not None and declared > limits.quota_bytes:
            return Refusal(
                413,
                f"This upload ({declared / MB:.1f} MB) is larger than one client may keep on this "
                f"server (at most {limits.quota_bytes / MB:.0f} MB per client): upload less.",
            )
        files, size = self._binding_usage(key)
        with self._lock:
            size += sum(u.received for u in self._receiving.values() if u.key == key)
            total_files, total_bytes = self._total
            total_bytes += self._in_flight()
        if files >= limits.quota_files or size >= limits.quota_bytes:
            return Refusal(
                429,
                f"Your queued and running jobs use {files} file(s), {size / MB:.1f} MB, on this "
                f"server (at most {limits.quota_files} files and {limits.quota_bytes / MB:.0f} MB per "
                "client): wait for one to finish, or stop it.",
            )
        if (
            total_files >= limits.cache_files
            or total_bytes >= limits.cache_bytes
            or total_bytes + (declared or 0) > limits.cache_bytes
        ):
            return Refusal(
                503,
                f"The server's upload space is taken by jobs in progress (at most {limits.cache_files} "
                f"files, {limits.cache_bytes / MB:.0f} MB): try again in a minute.",
            )
        return None

    def _binding_usage(self, key: str) -> tuple[int, int]:
        """(files, bytes) of `key` that an upload must fit beside: the files its queued and running
        jobs name (everything else of it ages out to make room, its latest job's files included)."""
        with self._lock:
            held = self._held.get(key) or {}
            binding = [n for p, n in held.items() if p in self._referenced]
            return len(binding), sum(binding)

    def prune_before_refusing(self) -> bool:
        """Runs the pruning now (unless one ran a moment ago) so that a refusal is not based on files
        the janitor would remove at its next round; False when it did not run."""
        prune = self.prune_now
        with self._lock:
            # A flood of refused uploads costs at most a few folder walks a second.
            if prune is None or time.monotonic() - self._scanned < FORCED_PRUNE_INTERVAL:
                return False
            self._scanned = time.monotonic()
        prune()
        return True

    def begin_upload(self, key: str, declared: int | None = None) -> int:
        """Starts counting an upload's bytes; `declared` (its Content-Length) is reserved in the cache
        from the start, so that uploads admitted together cannot overfill it between them."""
        _, base = self._binding_usage(key)
        with self._lock:
            self._next_upload += 1
            self._receiving[self._next_upload] = _Upload(key, base, max(0, declared or 0))
            return self._next_upload

    def receive(self, upload: int, size: int) -> Refusal | None:
        """Counts `size` more bytes of an upload; a refusal once the client's quota (beside what its
        jobs in progress use), or the cache's room with every upload in flight counted, would overflow."""
        limits = self.limits
        with self._lock:
            current = self._receiving[upload]
            current.received += size
            others = sum(u.received for n, u in self._receiving.items() if u.key == current.key and n != upload)
            cache = self._total[1] + self._in_flight()
        if current.base + others + current.received > limits.quota_bytes:
            return Refusal(
                413,
                f"This upload is larger than one client may keep on this server (at most "
                f"{limits.quota_bytes / MB:.0f} MB per client, {current.base / MB:.1f} MB of it used "
                "by your jobs in progress): upload less.",
            )
        if cache > limits.cache_bytes:
            return Refusal(
                503,
                f"The server's upload space is full (at most {limits.cache_bytes / MB:.0f} MB, "
                "uploads in progress included): try again in a minute.",
            )
        return None

    def _in_flight(self) -> int:
        """Bytes of the uploads being received (all clients), a declared length counted in full;
        the caller holds the lock. Until an upload completes, `_total` does not hold its files."""
        return sum(max(u.received, u.declared) for u in self._receiving.values())

    @property
    def receiving_bytes(self) -> int:
        """Bytes received so far by the uploads in flight (all clients)."""
        with self._lock:
            return sum(u.received for u in self._receiving.values())

    def end_upload(self, upload: int) -> None:
        with self._lock:
            self._receiving.pop(upload, None)

    @property
    def receiving(self) -> bool:
        """True while any upload is being received (its spool file is still growing)."""
        with self._lock:
            return bool(self._receiving)

    def record_upload(self, key: str, paths: Iterable[str]) -> tuple[list[str], bool]:
        """Charges the stored `paths` to `key`: (the paths new to `key`, whether this one request is
        more than a client may keep beside its jobs in progress; the caller then refuses it and
        `uncharge`s them). A client that is merely at its quota is not refused: its least recently
        used files age out (the janitor is woken for that)."""
        new: list[str] = []
        with self._lock:
            held = self._held.get(key) or {}
            for path in dict.fromkeys(map(str, paths)):
                if path not in held:
                    self._charge(key, path)
                    new.append(path)
            held = self._held.get(key) or {}
            files, size = self._total
            self._total = (files + len(new), size + sum(held.get(p, 0) for p in new))
        jobs, _ = self._binding_usage(key)
        refused = jobs + len(new) > self.limits.quota_files
        if not refused:  # a refused request is undone at once: no round for it (it would count its files)
            self._wake_if_over(key)
        return new, refused

    def uncharge(self, key: str, paths: Iterable[str]) -> list[str]:
        """Takes `paths` off `key`; returns those nobody else holds (safe to delete)."""
        alone = []
        with self._lock:
            files, size = self._total
            for path in map(str, paths):
                owners = self._owners.get(path, set())
                owners.discard(key)
                held = (self._held.get(key) or {}).pop(path, 0)
                if key in self._held and not self._held[key]:
                    del self._held[key]  # a refused client's empty account must not outlive it
                if not owners:
                    self._owners.pop(path, None)
                    self._charged.pop(path, None)
                    alone.append(path)
                    files, size = files - 1, size - held
            self._total = (max(0, files), max(0, size))
            # A round that ran while these files were there counted them: the next upload that would be
            # refused on that count looks again (`prune_before_refusing`) instead of trusting it.
            self._scanned = 0.0
        return alone

    # ------------------------------------------------------------------ calls
    def record_call(
        self,
        session: str | None,
        key: str,
        fn: Any,
        event_id: str | None,
        inputs: Iterable[str],
        outputs: Iterable[str],
    ) -> None:
        """A call of event `fn` by `key` (from `session`) named `inputs` and produced `outputs` (cache
        paths): outputs are charged to `key`; both become `key`'s latest job (a generator's yields,
        one event id, add up: its live previews and its result)."""
        now = self._clock()
        inputs, outputs = {str(p) for p in inputs}, {str(p) for p in outputs}
        with self._lock:
            for path in outputs:
                self._charge(key, path)
            for path in inputs | outputs:
                self._used[path] = now
            touched = [path for path in inputs if path in self._owners]
        for path in touched:
            # Gradio's own age clean-up (`delete_cache`) reads ctime: a file a call just used is new again.
            try:
                os.utime(path)
            except OSError:
                pass
        if not (inputs or outputs):
            return  # a call without files (/status, a History refresh) changes nobody's latest job
        with self._lock:
            previous = self._latest.pop(key, None)
            named = inputs | outputs
            if previous is not None and event_id is not None and previous.event_id == event_id:
                named |= previous.paths
            self._latest[key] = _Latest(event_id, now, frozenset(named))  # re-inserted: dict order is use order
            while len(self._latest) > MAX_CLIENTS:
                self._latest.pop(next(iter(self._latest)))
        if outputs:
            self._wake_if_over(key)

    def in_use(self, now: float | None = None) -> set[str]:
        """The files of every client's latest job seen within `hold` (older ones are dropped)."""
        now = self._clock() if now is None else now
        paths: set[str] = set()
        with self._lock:
            for key, latest in list(self._latest.items()):
                if now - latest.seen > self.limits.hold:
                    del self._latest[key]
                    continue
                paths |= latest.paths
        return paths

    def _wake_if_over(self, key: str) -> None:
        """Asks the janitor for a round now when `key` went past its quota or the cache past its file
        cap, so that both stay within their caps between its timed rounds."""
        limits = self.limits
        with self._lock:
            held = self._held.get(key) or {}
            over = (
                len(held) > limits.quota_files - headroom(limits.quota_files)
                or sum(held.values()) > limits.quota_bytes - headroom(limits.quota_bytes)
                or len(self._owners) > limits.cache_files - headroom(limits.cache_files)
            )
        if over and self.wake is not None:
            self.wake()

    # ------------------------------------------------------------------ pruning
    def plan(
        self,
        entries: list[CacheEntry],
        *,
        referenced: Iterable[str] = (),
        now: float | None = None,
        max_files: int | None = None,
        max_age: float | None = None,
        max_bytes: int | None = None,
        walked_from: float | None = None,
    ) -> list[str]:
        """The paths to delete from `entries` (the cache's files, examples excluded), oldest first.
        `referenced`: paths queued or running events name. The caps default to the limits.
        `walked_from`: time.monotonic() when the walk that listed `entries` began (None: before every charge).
        Files a client gives up that another client still holds stay, taken off the first one's account."""
        limits = self.limits
        now = self._clock() if now is None else now
        max_files = limits.cache_files if max_files is None else max_files
        max_bytes = limits.cache_bytes if max_bytes is None else max_bytes
        max_age = limits.max_age if max_age is None else max_age
        referenced = frozenset(map(str, referenced))
        held_now = self.in_use(now)
        receiving = self.receiving
        present = {e.path for e in entries}
        with self._lock:
            self._referenced = referenced
            # Gone by other hands (gradio's own age clean-up). A file charged after the walk began is not
            # in it, yet there: forgetting it would let a client uploading during the janitor's round drop
            # out of its own count and pass its quota.
            for path in [
                p
                for p in self._owners
                if p not in present and (walked_from is None or self._charged.get(p, 0.0) < walked_from)
            ]:
                self._forget(path)
            for path in [p for p in self._used if p not in present]:
                del self._used[path]  # named by a call but not (or no longer) in the cache
            owners = {p: set(k) for p, k in self._owners.items()}
            used = dict(self._used)

        def last(entry: CacheEntry) -> float:
            return max(entry.changed, used.get(entry.path, 0.0))

        def removable(entry: CacheEntry, pressed: bool = False) -> bool:
            # A charged file is complete (the upload route or the call that made it has returned);
            # one nobody is charged for may still be being written. A latest job's files yield only
            # to a full cache (`pressed`), never to age or to their own client's quota.
            arriving = (entry.path not in owners and now - entry.modified < limits.grace) or (entry.spool and receiving)
            return entry.path not in referenced and (pressed or entry.path not in held_now) and not arriving

        ordered = sorted(entries, key=last)  # least recently used first
        victims: dict[str, CacheEntry] = {}
        released: list[tuple[str, str]] = []  # (key, path): charges given up; the file stays for its other holders

        def give_up(key: str, entry: CacheEntry) -> bool:
            """`key` gives `entry` up: deleted when nobody else holds it (True), else only uncharged."""
            holders = owners.get(entry.path, set())
            holders.discard(key)
            if holders:
                released.append((key, entry.path))
                return False
            victims[entry.path] = entry
            return True

        # Too old; or a spool file left by an upload that ended without renaming it (nothing arrives).
        for entry in ordered:
            if removable(entry) and (now - last(entry) > max_age or entry.spool):
                victims[entry.path] = entry
        by_key: dict[str, list[CacheEntry]] = {}  # key -> its files left, least recently used first
        for entry in ordered:
            if entry.path not in victims:
                for key in owners.get(entry.path, ()):
                    by_key.setdefault(key, []).append(entry)
        # A client over its quota gives up its own least recently used files (uploads, results,
        # previews alike): it ages out instead of being refused.
        # Down to the headroom below the quota, so that what its running job writes before the next
        # round keeps it within its quota.
        quota_files = limits.quota_files - headroom(limits.quota_files)
        quota_bytes = limits.quota_bytes - headroom(limits.quota_bytes)
        for key, held in by_key.items():
            count, size = len(held), sum(e.size for e in held)
            for entry in list(held):
                if count <= quota_files and size <= quota_bytes:
                    break
                # A file another client holds too is only taken off this one's account (it stays,
                # in use or not); one of its own goes when nothing needs it.
                if len(owners.get(entry.path, ())) < 2 and not removable(entry):
                    continue
                give_up(key, entry)
                held.remove(entry)
                count, size = count - 1, size - entry.size
        # The whole cache over its caps: files charged to nobody make room first, then the heaviest
        # client (by the cap that is exceeded) gives up its least recently used file, one at a time.
        left = [e for e in ordered if e.path not in victims]
        # Files still arriving (nobody charged yet: an upload being received or stored, a result being
        # copied in) are counted against the cache where they come in (the upload route's checks) and here
        # from the round after they are charged: counted now, they would make a client pay for a stranger's
        # upload that is about to be refused.
        counted = [e for e in left if owners.get(e.path) or removable(e)]
        count, size = len(counted), sum(e.size for e in counted)
        # Room is made down to the headroom below the caps, so that what a running job writes before
        # the next round lands under them.
        max_files, max_bytes = max_files - headroom(max_files), max_bytes - headroom(max_bytes)
        for entry in left:
            if count <= max_files and size <= max_bytes:
                break
            if not owners.get(entry.path) and removable(entry):
                victims[entry.path] = entry
                count, size = count - 1, size - entry.size
        candidates = {
            key: [e for e in held if e.path not in victims and removable(e, pressed=True)]
            for key, held in by_key.items()
        }
        weight = {key: [len(held), sum(e.size for e in held)] for key, held in by_key.items()}
        while count > max_files or size > max_bytes:
            heavy = [key for key, files in candidates.items() if files]
            if not heavy:
                break  # what is left is in use or arriving: uploads are refused (503) until it goes
            by = 0 if count > max_files else 1
            key = max(heavy, key=lambda k: weight[k][by])
            entry = candidates[key].pop(0)
            if entry.path in victims or key not in owners.get(entry.path, ()):
                continue
            weight[key][0] -= 1
            weight[key][1] -= entry.size
            if give_up(key, entry):
                count, size = count - 1, size - entry.size
        with self._lock:
            for key, path in released:
                self._release(key, path)
            # What an upload must fit beside: the files no pruning would give up for it (in use by jobs
            # in progress, or arriving). Spool files are left out: they are uploads in flight, counted as such.
            binding = [e for e in left if e.path not in victims and not e.spool and not removable(e, pressed=True)]
            self._total = (len(binding), sum(e.size for e in binding))
            self._scanned = time.monotonic()
        return list(victims)

    def forget(self, paths: Iterable[str]) -> None:
        """Deleted files leave the accounts; those a client was charged for are remembered as expired."""
        with self._lock:
            for path in map(str, paths):
                if path in self._owners:
                    self._expired.pop(path, None)
                    self._expired[path] = None
                self._forget(path)
            while len(self._expired) > MAX_EXPIRED:
                self._expired.pop(next(iter(self._expired)))

    def _forget(self, path: str) -> None:
        self._charged.pop(path, None)
        for key in self._owners.pop(path, ()):
            held = self._held.get(key)
            if held is not None:
                held.pop(path, None)
                if not held:
                    del self._held[key]
        self._used.pop(path, None)

    def _release(self, key: str, path: str) -> None:
        """`key` no longer holds `path` (others still do); the caller holds the lock."""
        owners = self._owners.get(path)
        if owners is not None:
            owners.discard(key)
            if not owners:
                self._owners.pop(path, None)
                self._charged.pop(path, None)
        held = self._held.get(key)
        if held is not None:
            held.pop(path, None)
            if not held:
                del self._held[key]

    def _charge(self, key: str, path: str) -> None:
        try:
            size = os.path.getsize(path)
        except OSError:
            size = 0
        self._owners.setdefault(path, set()).add(key)
        self._held.setdefault(key, {})[path] = size
        self._charged[path] = time.monotonic()


__all__ = ["ClientStorage", "MAX_CLIENTS", "MAX_EXPIRED", "FORCED_PRUNE_INTERVAL"]
