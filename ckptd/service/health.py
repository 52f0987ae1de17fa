"""The daemon's health as the watchdog vouches for it: whether the whole can make progress
(every service up, the scan loop turning, a stage worker free of a stuck call), the state
database lost under it, and the scan loop's beat on the call board. Restarts nothing and feeds
no watchdog itself: the daemon's main thread asks, and beats.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from ckptd.log import get_logger

if TYPE_CHECKING:
    from ckptd.api.documents import ApiContext
    from ckptd.service.scan import Scanner
    from ckptd.service.supervisor import Supervisor
    from ckptd.service.workers import Workers
    from ckptd.store import Store


class Health:
    """One daemon's health, over the services it built. `scan_interval` is read at each call
    (a reload changes it); `stop_grace_s` bounds the stop of the services when the state
    database is lost."""

    def __init__(self, supervisor: Supervisor, workers: Workers, scanner: Scanner, store: Store,
                 ctx: ApiContext, scan_interval: Callable[[], float], stop_grace_s: float
                 ) -> None:
        self.supervisor, self.workers, self.scanner = supervisor, workers, scanner
        self.store, self.ctx = store, ctx
        self.scan_interval, self.stop_grace_s = scan_interval, stop_grace_s
        self.log = get_logger()

    def healthy(self) -> bool:
        """The daemon as a whole can make progress: every service is up, the scan loop turns
        and at least one stage worker is free of a stuck call. What the watchdog vouches for:
        one stuck item is degraded health (`ctx.state`), set aside, never a restart."""
        stuck = self.workers.stuck()
        all_stuck = bool(stuck) and len(stuck) >= len(self.workers.names)
        if all_stuck:
            self.log.error("all_workers_stuck", workers=stuck)
        return (self.supervisor.running() and not all_stuck
                and self.scanner.healthy(self.scan_interval()))

    def check_state(self) -> None:
        """A state database deleted or replaced under us: stop acting on the roots at once."""
        if self.ctx.problem is not None:
            return
        why = self.store.lost()
        if why is None:
            return
        self.ctx.problem = f"{why}; ckptd stopped acting on its roots until restarted"
        self.log.error("state_db_lost", error=why)
        self.supervisor.stop("lease", "scan", "watch", "discovery", "retention",
                             *self.workers.names, timeout=self.stop_grace_s)

    def watch_scan(self) -> None:
        """The scan loop as one long call on the board: each turn is a beat; quiet for as long
        as the watchdog allows (`scanner.healthy`) it is stuck, and health says so. Again at
        each reload: the bound follows `scan_interval`."""
        self.supervisor.calls.begin("scan", "scan", "", None, 2 * self.scan_interval() + 60,
                                    progress=lambda: self.scanner.beat)
