"""The daemon's clock as one small protocol: wall time and monotonic time. The daemon hands
`SYSTEM` to every service that judges time (lease, scan settle, discovery, the stage workers,
retention, persist, the effects hook, start-up recovery, the supervisor's restarts and call
board, the metrics, the API's holds and registrations); tests hand them a clock they move by
hand. Imports nothing else of ckptd;
never sleeps: a service's waits are on its own events, in real time."""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    def time(self) -> float:
        """Seconds since the epoch: what is recorded and shown."""
        ...

    def monotonic(self) -> float:
        """Seconds on a clock that never goes back: what intervals are measured on."""
        ...


class SystemClock:
    """The real clock."""

    def time(self) -> float:
        return time.time()

    def monotonic(self) -> float:
        return time.monotonic()


SYSTEM: Clock = SystemClock()
