"""`PeakRSS`: this process's peak resident set size, sampled on a thread (for the benchmarks' child processes,
where the whole process is the thing measured)."""

from __future__ import annotations

import threading
import time


class PeakRSS:
    """Starts sampling at construction: `baseline` is the RSS then, `peak` the highest seen so far."""

    def __init__(self, interval: float = 0.005):
        import psutil

        self._process = psutil.Process()
        self.baseline = self.now()
        self._peak = self.baseline
        self._stop = threading.Event()
        self._interval = interval
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def now(self) -> int:
        return int(self._process.memory_info().rss)

    def _sample(self) -> None:
        while not self._stop.is_set():
            self._peak = max(self._peak, self.now())
            time.sleep(self._interval)

    @property
    def peak(self) -> int:
        return max(self._peak, self.now())

    def stop(self) -> int:
        """Stops sampling; returns the peak."""
        self._stop.set()
        self._thread.join()
        return self.peak
