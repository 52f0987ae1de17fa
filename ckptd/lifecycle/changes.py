"""A generation counter with a condition variable: the daemon's "something changed" signal.

Long-polls (`wait` endpoint) block here until any state transition; owns nothing else.
"""

from __future__ import annotations

import threading


class Changes:
    """A generation counter with a condition: long-polls wait here for any state change."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self.generation = 0

    def notify(self) -> None:
        with self._cond:
            self.generation += 1
            self._cond.notify_all()

    def wait(self, generation: int, timeout: float) -> int:
        with self._cond:
            self._cond.wait_for(lambda: self.generation != generation, timeout)
            return self.generation
