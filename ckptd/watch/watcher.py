"""What the scan service asks of a file watcher, and which watcher it gets: inotify read from
the kernel (`ckptd.watch.inotify`), or polling (`ckptd.watch.polling`) when asked for (NFS,
CIFS) or where inotify cannot be had. A watcher's events only wake the scanner early and mark
files open or closed; it never scans or decides anything.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from ckptd.clock import SYSTEM, Clock
from ckptd.log import get_logger
from ckptd.watch.inotify import Inotify
from ckptd.watch.polling import PollingWatcher
from ckptd.watch.scanner import OpenFiles


class Watcher(Protocol):
    """Watches over the roots; each relevant event marks open/closed files and wakes the scan."""

    def start(self) -> None: ...

    def alive(self) -> bool: ...

    def started(self) -> bool: ...

    def stop(self) -> None: ...

    def watch(self, root: Path, open_files: OpenFiles, /) -> bool:
        """Start watching `root` (idempotent). False when it does not exist yet."""
        ...

    def unwatch(self, root: Path, /) -> None: ...


def open_watcher(wake: Callable[[], None], polling: bool, poll_interval: float,
                 clock: Clock = SYSTEM) -> Watcher:
    """The inotify watcher unless `polling` is asked for or inotify cannot be had here."""
    if not polling:
        try:
            return Inotify(wake, clock)
        except OSError as exc:  # no inotify here, or the instance limit is reached
            get_logger().warning("watch_polling", error=str(exc))
    return PollingWatcher(wake, poll_interval, clock)
