"""The samplers of `bench abuse`: /status latency (and what it says), the server's peak RSS, and
the app's cache against its caps; each samples on a thread of its own until `stop()`."""

from __future__ import annotations

import contextlib
import threading
import time

from hidream_ui.bench.abuse_app import _MB, AbuseApp
from hidream_ui.bench.abuse_client import new_session

STATUS_EVERY = 0.2
STATUS_TIMEOUT = 10.0
CACHE_EVERY = 0.1


class StatusSampler:
    """Asks `/status` every STATUS_EVERY s on its own connection; keeps (time, seconds, status)."""

    def __init__(self, app: AbuseApp, every: float = STATUS_EVERY):
        self.app = app
        self.every = every
        self.samples: list[tuple[float, float, dict | None]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="abuse-status")
        self._thread.start()

    def _loop(self) -> None:
        import httpx

        session = new_session("status")
        with contextlib.suppress(httpx.HTTPError, RuntimeError), self.app.http(timeout=STATUS_TIMEOUT) as http:
            while not self._stop.is_set():
                started = time.monotonic()
                status = None
                try:
                    answer = http.post("/gradio_api/run/status", json={"data": [], "session_hash": session})
                    data = answer.json().get("data") if answer.status_code == 200 else None
                    status = data[0] if data else None
                except (httpx.HTTPError, ValueError):
                    pass
                self.samples.append((started, time.monotonic() - started, status))
                self._stop.wait(self.every)

    def max_seconds(self, since: float) -> float | None:
        times = [seconds for at, seconds, _ in self.samples if at >= since]
        return round(max(times), 3) if times else None

    def wait_for_sample(self, since: float) -> None:
        """Waits (at most one request's timeout and one interval) until a request started at or after
        `since` has been answered: a probe shorter than one /status round trip on a busy machine
        would otherwise have no figure at all."""
        deadline = time.monotonic() + STATUS_TIMEOUT + self.every + 1.0
        while time.monotonic() < deadline and not self._stop.is_set():
            if any(at >= since for at, _, _ in list(self.samples)):
                return
            time.sleep(0.02)

    def statuses(self, since: float = 0.0) -> list[dict]:
        return [status for at, _, status in self.samples if at >= since and status]

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=STATUS_TIMEOUT + 2)


class RssSampler:
    """The server's peak RSS since `reset()`, sampled every 0.1 s on a thread."""

    def __init__(self, app: AbuseApp):
        self.app = app
        self.baseline = self.peak = app.rss_mb()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="abuse-rss")
        self._thread.start()

    def reset(self) -> None:
        self.baseline = self.peak = self.app.rss_mb()

    def _loop(self) -> None:
        import psutil

        while not self._stop.is_set():
            with contextlib.suppress(psutil.Error):
                self.peak = max(self.peak, self.app.rss_mb())
            self._stop.wait(0.1)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


class CacheSampler:
    """The app's cache (`AbuseApp.cache_counts`: files and bytes that count against its limits),
    sampled every CACHE_EVERY s on a thread: the peaks, and how often and how long it was over
    `max_files` / `max_bytes`. Use as a context manager or call `stop()`."""

    def __init__(self, app: AbuseApp, max_files: int, max_bytes: int, every: float = CACHE_EVERY):
        self.app = app
        self.max_files = max_files
        self.max_bytes = max_bytes
        self.every = every
        self.samples: list[tuple[float, int, int]] = []  # (monotonic time, files, bytes)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="abuse-cache")
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            files, size = self.app.cache_counts()
            self.samples.append((time.monotonic(), files, size))
            self._stop.wait(self.every)

    def stop(self) -> None:
        if not self._stop.is_set():
            self._stop.set()
            self._thread.join(timeout=10)
            files, size = self.app.cache_counts()
            self.samples.append((time.monotonic(), files, size))

    def __enter__(self) -> "CacheSampler":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def figures(self) -> dict:
        return cache_figures(self.samples, self.max_files, self.max_bytes)


def cache_figures(samples: list[tuple[float, int, int]], max_files: int, max_bytes: int) -> dict:
    """What a run of cache samples says: first, peak and last file counts and MB, the caps, how many
    samples were over either cap, for how many seconds in all and at most in one stretch (a sample
    over a cap counts until the next sample)."""
    if not samples:
        return {
            "cache_samples": 0,
            "cache_files_first": None,
            "cache_files_max": None,
            "cache_files_end": None,
            "cache_mb_max": None,
            "cache_mb_end": None,
            "cache_max_files": max_files,
            "cache_max_mb": round(max_bytes / _MB, 1),
            "cache_samples_over_cap": None,
            "cache_seconds_over_cap": None,
            "cache_longest_over_cap_s": None,
        }
    over, seconds, longest, run_start = 0, 0.0, 0.0, None
    for index, (at, files, size) in enumerate(samples):
        ends = samples[index + 1][0] if index + 1 < len(samples) else at
        if files > max_files or size > max_bytes:
            over += 1
            seconds += ends - at
            run_start = at if run_start is None else run_start
            longest = max(longest, ends - run_start)
        else:
            run_start = None
    return {
        "cache_samples": len(samples),
        "cache_files_first": samples[0][1],
        "cache_files_max": max(s[1] for s in samples),
        "cache_files_end": samples[-1][1],
        "cache_mb_max": round(max(s[2] for s in samples) / _MB, 2),
        "cache_mb_end": round(samples[-1][2] / _MB, 2),
        "cache_max_files": max_files,
        "cache_max_mb": round(max_bytes / _MB, 1),
        "cache_samples_over_cap": over,
        "cache_seconds_over_cap": round(seconds, 2),
        "cache_longest_over_cap_s": round(longest, 2),
    }
