"""The file watcher wakes the scanner for what changes a root, and the kernel queues it nothing
for reads or for ckptd's own writes: validation opens every file of a step about three times,
and the compressed copy of a 10,000-file step is 10,000 files written under `<root>/.ckptd/`;
before, both were tens of thousands of events that threads holding the interpreter lock
handled only to drop them, on the CPU the validating thread needed."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
from support.wait import wait_until

from ckptd.clock import SYSTEM
from ckptd.watch import inotify
from ckptd.watch.inotify import Inotify
from ckptd.watch.polling import PollingWatcher
from ckptd.watch.scanner import OpenFiles
from ckptd.watch.watcher import open_watcher


class _Wakes:
    def __init__(self) -> None:
        self.sem = threading.Semaphore(0)

    def __call__(self) -> None:
        self.sem.release()

    def drain(self) -> int:
        n = 0
        while self.sem.acquire(blocking=False):
            n += 1
        return n

    def wait(self, what: str) -> None:
        wait_until(lambda: self.sem.acquire(blocking=False), 5.0, what)


def test_reads_queue_no_events_and_writes_wake_the_scanner(tmp_path: Path) -> None:
    unwanted = inotify.IN_OPEN_ALL
    assert not inotify.MASK & unwanted  # not even queued by the kernel
    wakes = _Wakes()
    watcher = open_watcher(wakes, polling=False, poll_interval=1.0)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "old.pt").write_bytes(b"x")
    watcher.watch(tmp_path, OpenFiles())
    watcher.start()
    try:
        for _ in range(50):
            (tmp_path / "sub" / "old.pt").read_bytes()
        (tmp_path / "sub" / "new.pt").write_bytes(b"y")  # after the reads: its wake is the last
        wakes.wait("a write waking the scanner")
        assert wakes.drain() <= 3  # the write's own few events, none for the 50 reads
    finally:
        watcher.stop()


def test_the_polling_watcher_marks_writes_and_wakes_the_scanner(tmp_path: Path) -> None:
    wakes = _Wakes()
    watcher = open_watcher(wakes, polling=True, poll_interval=0.1)
    assert isinstance(watcher, PollingWatcher)  # asked for: never the kernel's
    marks = OpenFiles()
    assert not watcher.watch(tmp_path / "not-yet", marks)
    assert watcher.watch(tmp_path, marks) and watcher.watch(tmp_path, marks)  # idempotent
    assert not watcher.started()
    watcher.start()
    try:
        assert watcher.started() and watcher.alive()
        (tmp_path / "model.pt").write_bytes(b"y")
        wakes.wait("a write waking the scanner")
        watcher.unwatch(tmp_path)
    finally:
        watcher.stop()
    assert not watcher.alive()
    watcher.stop()  # a second stop (a replaced watcher's) is harmless


def test_ckptd_s_own_directories_are_not_watched(tmp_path: Path) -> None:
    wakes = _Wakes()
    kernel = Inotify(wakes, SYSTEM)
    (tmp_path / ".ckptd" / "objects").mkdir(parents=True)
    (tmp_path / ".ckptd-restore-1").mkdir()
    (tmp_path / "step-1" / "rank0").mkdir(parents=True)
    kernel.watch(str(tmp_path), OpenFiles())
    kernel.start()
    try:
        assert kernel.watched(str(tmp_path)) == [str(tmp_path), str(tmp_path / "step-1"),
                                                 str(tmp_path / "step-1" / "rank0")]
        staged = tmp_path / ".ckptd" / "objects" / "5.tmp"
        staged.mkdir()
        for i in range(200):  # a staged copy: written, then renamed into place
            (staged / f"{i}.zst").write_bytes(b"z" * 100)
        staged.rename(tmp_path / ".ckptd" / "objects" / "5")
        (tmp_path / "step-1" / "rank0" / "x.distcp").write_bytes(b"d")
        wakes.wait("the trainer's write waking the scanner")
        assert wakes.drain() <= 3  # nothing for the 200 staged files
    finally:
        kernel.stop()


def test_new_and_moved_directories_are_watched_and_marks_follow_writes(tmp_path: Path) -> None:
    wakes = _Wakes()
    marks = OpenFiles()
    kernel = Inotify(wakes, SYSTEM)
    kernel.watch(str(tmp_path), marks)
    kernel.start()
    try:
        staged = tmp_path / ".incoming" / "a" / "b"
        staged.mkdir(parents=True)  # created after the watch: watched as it appears
        wait_until(lambda: str(staged) in kernel.watched(str(tmp_path)), 5.0, "a new dir")
        staged.parent.parent.rename(tmp_path / "step-7")  # a trainer's commit by rename
        moved = tmp_path / "step-7" / "a" / "b"
        wait_until(lambda: str(moved) in kernel.watched(str(tmp_path)), 5.0, "a moved dir")
        assert str(staged) not in kernel.watched(str(tmp_path))
        f = moved / "shard.pt"
        with open(f, "wb") as out:  # written and still open: marked open
            out.write(b"w")
            out.flush()
            wait_until(lambda: marks.is_open(str(f), 0.0, 0.0, 1e9), 5.0, "an open mark")
        wait_until(lambda: not marks.is_open(str(f), 0.0, 0.0, 1e9), 5.0, "the close")
        (tmp_path / "step-7").rename(tmp_path.parent / f"{tmp_path.name}-out")  # leaves the root
        wait_until(lambda: kernel.watched(str(tmp_path)) == [str(tmp_path)], 5.0,
                   "the watches of a tree moved out dropped")
    finally:
        kernel.stop()


def test_a_root_that_goes_away_is_watched_again_when_it_is_back(tmp_path: Path) -> None:
    wakes = _Wakes()
    kernel = Inotify(wakes, SYSTEM)
    root = tmp_path / "root"
    root.mkdir()
    assert kernel.watch(str(root), OpenFiles())
    kernel.start()
    try:
        root.rename(tmp_path / "away")
        wait_until(lambda: kernel.watched(str(root)) == [], 5.0, "the moved root forgotten")
        root.mkdir()
        assert kernel.watch(str(root), OpenFiles())  # as the scan loop does each scan
        wakes.drain()
        (root / "model_step_1.pt").write_bytes(b"m")
        wakes.wait("a write in the new root")
        os.rmdir(tmp_path / "away")
        os.remove(root / "model_step_1.pt")
        os.rmdir(root)
        wait_until(lambda: kernel.watched(str(root)) == [], 5.0, "the deleted root forgotten")
        assert not kernel.watch(str(root), OpenFiles())  # not there: not watched
    finally:
        kernel.stop()


def test_a_root_given_as_a_link_is_watched_and_links_below_it_are_not(tmp_path: Path) -> None:
    real, outside = tmp_path / "real", tmp_path / "outside"
    (real / "step-1").mkdir(parents=True)
    outside.mkdir()
    (real / "escape").symlink_to(outside)  # a link out of the root: never watched
    link = tmp_path / "root-link"
    link.symlink_to(real)
    wakes = _Wakes()
    kernel = Inotify(wakes, SYSTEM)
    assert kernel.watch(str(link), OpenFiles())
    kernel.start()
    try:
        assert kernel.watched(str(link)) == [str(link), str(link / "step-1")]
        (outside / "x.pt").write_bytes(b"x")  # outside: no event
        (real / "step-1" / "y.pt").write_bytes(b"y")
        wakes.wait("a write through the root's link")
    finally:
        kernel.stop()


def test_an_overflowed_queue_wakes_the_scanner_and_watches_what_it_missed(
        tmp_path: Path) -> None:
    """More events than the kernel queues (its limit, `max_queued_events`) before the reader
    runs: the overflow wakes the scanner and every root's watches are added again, so a
    directory made while events were lost is watched all the same."""
    (tmp_path / "a").mkdir()
    wakes = _Wakes()
    kernel = Inotify(wakes, SYSTEM)
    assert kernel.watch(str(tmp_path), OpenFiles())
    queued = int(Path("/proc/sys/fs/inotify/max_queued_events").read_text())
    if queued > 1 << 17:
        pytest.skip(f"max_queued_events is {queued}: too many files to overflow it here")
    for i in range(queued // 2 + 100):  # a create and a close each
        (tmp_path / "a" / f"f{i}").touch()
    (tmp_path / "a" / "new" / "deeper").mkdir(parents=True)
    kernel.start()  # the reader starts only now: the queue has overflowed
    try:
        wakes.wait("the overflow waking the scanner")
        deeper = str(tmp_path / "a" / "new" / "deeper")
        wait_until(lambda: deeper in kernel.watched(str(tmp_path)), 5.0, "the lost dir watched")
        assert kernel.alive()
    finally:
        kernel.stop()


def test_polling_leaves_out_ckptd_s_own_paths_as_inotify_does(tmp_path: Path) -> None:
    """NFS roots are polled: a restore's staging directory (`.ckptd-*`) and the copy store
    (`.ckptd/`) wake the scanner no more than under inotify; the staging directory renamed
    into place is the new step's event."""
    wakes = _Wakes()
    watcher = open_watcher(wakes, polling=True, poll_interval=0.1)
    staging = tmp_path / ".ckptd-restore-1"
    for own in (staging, tmp_path / ".ckptd" / "objects"):
        own.mkdir(parents=True)
    watcher.watch(tmp_path, OpenFiles())
    watcher.start()
    try:
        for i in range(50):
            (staging / f"{i}.distcp").write_bytes(b"r")
            (tmp_path / ".ckptd" / "objects" / f"{i}.zst").write_bytes(b"z")
        (tmp_path / "step-1.pt").write_bytes(b"d")
        wakes.wait("the trainer's write waking the scanner")
        threading.Event().wait(0.3)  # polls after it: nothing more is pending
        assert wakes.drain() <= 3  # nothing for the 100 files of ckptd's own
        staging.rename(tmp_path / "step-2")
        wakes.wait("the staging directory renamed into place waking the scanner")
    finally:
        watcher.stop()
