"""A clock a test moves by hand (`ckptd.clock.Clock`): handed to a service in the test process
(lease, scan, discovery, workers, retention, the effects, the supervisor), it makes "once the
lease is stale", "once the save has settled" or "once the hold expired" a call to `advance`,
not a wait. Never sleeps."""

from __future__ import annotations

import threading
import time


class FakeClock:
    """Wall and monotonic time that start at the real ones and move only when advanced; with
    `running=True` they also follow the real clock, advanced by the offset given."""

    def __init__(self, running: bool = False) -> None:
        self._lock = threading.Lock()
        # Whole seconds: a boundary a test advances to exactly ("quiet for exactly its bound")
        # stays exact, where a fractional start would round `start + 900 - start` past 900.
        self._wall0, self._mono0 = float(int(time.time())), float(int(time.monotonic()))
        self._running = running
        self._real0 = time.monotonic()
        self._offset = 0.0

    def advance(self, seconds: float) -> None:
        assert seconds >= 0, "a monotonic clock never goes back"
        with self._lock:
            self._offset += seconds

    def _elapsed(self) -> float:
        with self._lock:
            real = time.monotonic() - self._real0 if self._running else 0.0
            return real + self._offset

    def time(self) -> float:
        return self._wall0 + self._elapsed()

    def monotonic(self) -> float:
        return self._mono0 + self._elapsed()
