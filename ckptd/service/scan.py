"""The scan service: walks each root into candidates and has the store reconcile them; the
watcher's events only wake it early. Also keeps the watcher alive.

Owns the roots' scanners, the inotify/polling watcher, the scan loop's pacing and its count
(`scans`, in status). Decides nothing about checkpoints: it gathers each pending save's
stall (how long unchanged, truncated or not) and asks the lifecycle table whether it gave up
(`lifecycle.table.gives_up`, applied by `_give_up_stale`); layouts find, the table decides, the
store records. Reads time only from the clock it is given.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from ckptd.clock import SYSTEM, Clock
from ckptd.config import RootConfig
from ckptd.errors import InternalError
from ckptd.lifecycle.table import Stall, gives_up
from ckptd.log import get_logger
from ckptd.model import Candidate, RootError, Snapshot
from ckptd.service.metrics import Metrics
from ckptd.store import Found, Store
from ckptd.units import format_duration
from ckptd.watch.scanner import OpenFiles, RootScanner
from ckptd.watch.watcher import Watcher, open_watcher

DEBOUNCE_S = 0.1
WATCH_CHECK_S = 1.0


class Scanner:
    """Scans every root on a timer and when woken; one thread (the `scan` service)."""

    def __init__(self, store: Store, roots: Callable[[], Mapping[str, RootConfig]],
                 scan_interval: Callable[[], float], polling: bool, metrics: Metrics,
                 exclusive: Any = None,
                 may_adopt: Callable[[str], bool] = lambda root: True,
                 clock: Clock = SYSTEM) -> None:
        self.store = store
        self.clock = clock
        # False for a root another ckptd held before: its checkpoints were not the user's
        # own before ckptd came, whatever this daemon's store has seen.
        self.may_adopt = may_adopt
        self.roots = roots
        self.scan_interval = scan_interval
        self.metrics = metrics
        # Held while a root is walked and reconciled: retention takes it for local deletes,
        # so a scan never sees a checkpoint half moved into the trash.
        self.exclusive = exclusive if exclusive is not None else contextlib.nullcontext()
        self._polling = polling
        self._wake = threading.Event()
        self._count_lock = threading.Lock()
        self._scanners: dict[str, RootScanner] = {}
        self._pending: set[str] = set()
        self._conflicts: set[tuple[str, int]] = set()
        self._bad_logged: dict[str, set[str]] = {}  # per root: refused metadata already logged
        # Per root: each candidate's newest member mtime by (path, fingerprint), as the last
        # scan found it: a kept step's is not recomputed over its files at every scan.
        self._newest: dict[str, dict[tuple[str, str], float]] = {}
        self.beat = clock.monotonic()
        # Full scans finished since start: a test waits on it ("not after two more scans").
        self.scans = 0
        self.watcher = self._new_watcher()
        self.log = get_logger()

    def _new_watcher(self) -> Watcher:
        poll = max(1.0, min(self.scan_interval(), 5.0))
        return open_watcher(self.wake, self._polling, poll_interval=poll, clock=self.clock)

    def wake(self) -> None:
        self._wake.set()

    # -- roots -------------------------------------------------------------------------------

    def set_roots(self, roots: Mapping[str, RootConfig]) -> None:
        """Start watching new or changed roots, stop watching removed ones (start, reload)."""
        for name, scanner in list(self._scanners.items()):
            new = roots.get(name)
            if new is None or new.path != scanner.path:
                self.watcher.unwatch(scanner.path)
                del self._scanners[name]
        for root in roots.values():
            old = self._scanners.get(root.name)
            # The watcher keeps feeding the OpenFiles it was given for a path: reuse it.
            open_files = old.open_files if old is not None else OpenFiles()
            self._scanners[root.name] = RootScanner(root.name, root.path, root.layout,
                                                    root.options, open_files)
            if not self.watcher.watch(root.path, open_files):
                self.log.warning("root_missing", root=root.name, path=str(root.path))

    # -- services ----------------------------------------------------------------------------

    def run(self, stop: threading.Event) -> None:
        """The scan loop: a full rescan every scan_interval, sooner when woken or settling."""
        while not stop.is_set():
            self.beat = self.clock.monotonic()
            wait = self.scan_interval()
            if self._pending:
                # Something is settling: look again soon instead of a full interval later.
                settle = min((r.settle for r in self.roots().values()), default=wait)
                wait = min(wait, max(0.25, settle / 2))
            self._wake.wait(wait)
            if stop.is_set():
                return
            time.sleep(DEBOUNCE_S)  # let a burst of events land before walking the tree
            self._wake.clear()
            self.scan_all()

    def watch(self, stop: threading.Event) -> None:
        """Keep the watcher's observer alive: a dead one is replaced, its roots watched again."""
        if self.watcher.started():  # a restart: the old observer died (or was stopped)
            old = self.watcher
            self.watcher = self._new_watcher()
            old.stop()
            for scanner in self._scanners.values():
                self.watcher.watch(scanner.path, scanner.open_files)
        self.watcher.start()
        self.wake()  # events may have been missed while it was down
        while not stop.wait(WATCH_CHECK_S):
            if not self.watcher.alive():
                raise InternalError("the file watcher's observer thread died")
        self.watcher.stop()

    # -- one scan ----------------------------------------------------------------------------

    def scan_all(self) -> None:
        for root in list(self.roots().values()):
            try:
                self.scan_root(root)
            except Exception as exc:  # broad: one root's bad state must not stop the others' scans
                self.metrics.error("scan")
                self.store.set_root_error(root.name, RootError.SCAN, f"scan: {exc}",
                                          self.clock.time())
                self.log.error("scan_failed", root=root.name, error=str(exc), exc_info=True)
        with self._count_lock:
            self.scans += 1

    def scan_root(self, root: RootConfig) -> None:
        scanner = self._scanners.get(root.name)
        if scanner is None:
            return  # removed by a reload meanwhile
        if not root.path.is_dir():
            self.store.set_root_error(root.name, RootError.ROOT_MISSING,
                                      f"root path {root.path} does not exist", self.clock.time())
            return
        self.watcher.watch(root.path, scanner.open_files)
        with self.exclusive:
            now = self.clock.time()
            snap, found = scanner.scan(now, self._registrations(root.name))
            changes = self.store.sync_root(
                root.name, self._found(root.name, snap, found), now,
                unreadable=frozenset(scanner.unreadable), adopt=self.may_adopt(root.name))
        self._give_up_stale(root, snap, [c for c, _ in found if not c.complete], now)
        self._report_bad(root.name, snap.bad_contents)
        if scanner.unreadable:
            self.store.set_root_error(root.name, RootError.UNREADABLE,
                                      f"could not read {sorted(scanner.unreadable)}"
                                      " (checkpoints there are not marked gone)", now)
        else:
            self.store.clear_root_error(root.name, RootError.SCAN, RootError.UNREADABLE,
                                        RootError.ROOT_MISSING)
        if any(not c.complete for c, _ in found):
            self._pending.add(root.name)
        else:
            self._pending.discard(root.name)
        for ch in changes:
            self.log.info(ch.event, root=root.name, step=ch.step, layout=ch.layout, path=ch.path,
                          detail=ch.detail or None)

    def _found(self, root: str, snap: Snapshot, found: list[tuple[Candidate, str]]
               ) -> list[Found]:
        """The scan's candidates as the store takes them, with their newest member mtimes:
        the fingerprint digests every member's mtime, so an unchanged one keeps its value."""
        last = self._newest.get(root, {})
        now: dict[tuple[str, str], float] = {}
        out = []
        for c, fp in found:
            newest = last.get((c.path, fp))
            if newest is None:
                newest = _newest(snap, c)
            now[(c.path, fp)] = newest
            out.append(Found(c, fp, newest))
        self._newest[root] = now
        return out

    def _report_bad(self, root: str, bad: Mapping[str, str]) -> None:
        """Metadata the bounded reader refused (a link, a FIFO, over its cap): counted in the
        `ckptd_bad_inputs` metric (kind `metadata`) at every scan, logged once each."""
        self.metrics.bad_inputs(root, "metadata", len(bad))
        seen = self._bad_logged.setdefault(root, set())
        for rel in sorted(set(bad) - seen):
            self.log.warning("bad_metadata_item", root=root, path=rel, error=bad[rel])
        seen.intersection_update(bad)
        seen.update(bad)

    def _give_up_stale(self, root: RootConfig, snap: Snapshot, pending: list[Candidate],
                       now: float) -> None:
        """A save still incomplete `pending_timeout` after its files last changed (a registered
        file never written, a shard short of its bytes) is given up: the lifecycle decides
        (`gives_up`) from its status, how long it stalled and its candidate's typed cause."""
        for c in pending:
            rec = self.store.checkpoint(root.name, c.step)
            if rec is None:
                continue
            changed = [snap.files[f].changed_at for f in c.files if f in snap.files]
            stall = Stall(now - max(changed, default=rec.created), c.truncated)
            reason = gives_up(self.store.status(root.name, c.step), stall, root.pending_timeout)
            if reason is None:
                continue
            message = (f"still incomplete {format_duration(root.pending_timeout)} after its"
                       f" last change: waiting for {c.waiting_for}")
            if self.store.give_up(root.name, c.step, reason.value, message, now):
                self.log.warning("checkpoint_invalid", root=root.name, step=c.step,
                                 reason=reason.value, message=message)

    def _registrations(self, root: str) -> dict[int, tuple[str, ...]]:
        """The root's registrations, less those naming a file another checkpoint on disk
        holds: a file belongs to one checkpoint, and a registration never takes it away."""
        owners = self.store.owners(root)
        kept = {}
        for step, paths in self.store.registrations(root).items():
            taken = sorted(p for p in paths if owners.get(p, step) != step)
            if taken:
                self._warn_once(root, step, taken)
            else:
                kept[step] = paths
        return kept

    def _warn_once(self, root: str, step: int, taken: list[str]) -> None:
        if (root, step) not in self._conflicts:
            self._conflicts.add((root, step))
            self.log.warning("registration_conflict", root=root, step=step, paths=taken[:5],
                             message="its files belong to another checkpoint; ignored")

    def unrecognised(self, root: str) -> list[str]:
        scanner = self._scanners.get(root)
        return list(scanner.unrecognised) if scanner is not None else []

    def healthy(self, scan_interval: float) -> bool:
        return self.clock.monotonic() - self.beat < 2 * scan_interval + 60


def _newest(snap: Snapshot, c: Candidate) -> float:
    return max((snap.files[f].mtime for f in c.files if f in snap.files), default=0.0)
