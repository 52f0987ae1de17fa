"""The file watcher wakes the scanner for what changes a root, and the kernel does not queue
it an event for each read: validation opens every file of a step about three times, and a
10,000-file step's reads were tens of thousands of events the watcher's threads handled only
to drop them, on the CPU the validating thread needed."""

from __future__ import annotations

import threading
from pathlib import Path

from support.wait import wait_until

from ckptd.watch import EventWatcher, OpenFiles


def test_reads_queue_no_events_and_writes_wake_the_scanner(tmp_path: Path) -> None:
    wakes = threading.Semaphore(0)
    watcher = EventWatcher(wakes.release, polling=False, poll_interval=1.0)
    (tmp_path / "sub").mkdir()
    watcher.watch(tmp_path, OpenFiles())
    watcher.start()
    try:
        from watchdog.observers.inotify_c import InotifyConstants

        unwanted = InotifyConstants.IN_OPEN | InotifyConstants.IN_CLOSE_NOWRITE
        masks = [e.get_event_mask_from_filter() for e in watcher._observer.emitters]
        assert masks and all(not m & unwanted for m in masks)  # not even queued by the kernel
        (tmp_path / "sub" / "new.pt").write_bytes(b"y")
        wait_until(lambda: wakes.acquire(blocking=False), 5.0, "a write waking the scanner")
    finally:
        watcher.stop()
