"""The polling watcher: watchdog's polling observer over the roots, for file systems whose
changes inotify does not see (NFS, CIFS) and where inotify cannot be had. Each relevant event
marks a file open or closed and wakes the scanner.

Must not scan or decide anything: the scanner alone decides what changed.
"""

from __future__ import annotations

import os
import threading
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ckptd.clock import Clock
from ckptd.model import is_own
from ckptd.watch.scanner import OpenFiles


class PollingWatcher:
    """Watches over the roots by polling (`ckptd.watch.watcher.Watcher`)."""

    def __init__(self, wake: Callable[[], None], poll_interval: float, clock: Clock) -> None:
        from watchdog.observers.polling import PollingObserver

        # watchdog warns, with its whole watch table, each time a directory moved within a
        # watched tree gets its watch again (ckptd's trash and copy renames do this); the new
        # watch replaces the old one, which is what is wanted.
        warnings.filterwarnings("ignore", message="Callback with id", category=RuntimeWarning,
                                module="watchdog")
        self._wake = wake
        self._clock = clock
        self._observer: Any = PollingObserver(timeout=poll_interval)
        self._watches: dict[str, Any] = {}
        self._lock = threading.Lock()

    def start(self) -> None:
        self._observer.start()

    def alive(self) -> bool:
        return bool(self._observer.is_alive())

    def started(self) -> bool:
        return self._observer.ident is not None

    def stop(self) -> None:
        if not self._observer.is_alive():
            return
        self._observer.stop()
        self._observer.join(timeout=5)

    def watch(self, path: Path, open_files: OpenFiles) -> bool:
        """Start watching `path` (idempotent). False when it does not exist yet."""
        key = str(path)
        with self._lock:
            if key in self._watches:
                return True
            if not path.is_dir():
                return False
            handler = _Handler(key, open_files, self._wake, self._clock)
            try:
                self._watches[key] = self._observer.schedule(
                    handler, key, recursive=True, event_filter=_events_wanted())
            except OSError:
                return False
            return True

    def unwatch(self, path: Path) -> None:
        with self._lock:
            w = self._watches.pop(str(path), None)
            if w is not None:
                try:
                    self._observer.unschedule(w)
                except (KeyError, ValueError):
                    pass


def _events_wanted() -> list[Any]:
    """Every event the handler acts on, and not "opened" or "closed without a write" (every
    read of a watched file would be one; `ckptd.watch.inotify.MASK` leaves them out the same
    way)."""
    from watchdog.events import (
        DirCreatedEvent,
        DirDeletedEvent,
        DirModifiedEvent,
        DirMovedEvent,
        FileClosedEvent,
        FileCreatedEvent,
        FileDeletedEvent,
        FileModifiedEvent,
        FileMovedEvent,
    )

    return [FileCreatedEvent, DirCreatedEvent, FileModifiedEvent, DirModifiedEvent,
            FileMovedEvent, DirMovedEvent, FileDeletedEvent, DirDeletedEvent, FileClosedEvent]


class _Handler:
    """A watchdog event handler: duck-typed `dispatch` keeps watchdog types out of the API."""

    def __init__(self, root: str, open_files: OpenFiles, wake: Callable[[], None],
                 clock: Clock) -> None:
        self._root = root
        self._open = open_files
        self._wake = wake
        self._clock = clock

    def dispatch(self, event: Any) -> None:
        # ckptd's own paths are left out as the kernel watches leave them out; a move out of
        # one (a restore's staging directory renamed into place) is the new path's event.
        paths = [event.src_path, getattr(event, "dest_path", "") or event.src_path]
        if all(is_own(os.path.relpath(p, self._root)) for p in paths):
            return
        kind = event.event_type
        if not event.is_directory:
            # Only a write marks a file open: watchdog synthesizes "created" events for files found
            # in a directory made before its watch existed, and those never get a "closed".
            if kind == "modified":
                self._open.opened(event.src_path, self._clock.time())
            elif kind == "closed":
                self._open.closed(event.src_path)
            elif kind == "moved":
                self._open.closed(event.src_path)
        if kind != "opened" and kind != "closed_no_write":
            self._wake()
