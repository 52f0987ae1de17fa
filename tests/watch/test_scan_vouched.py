"""A rescan under a watcher that vouches for the root lists only the directories it saw change
and passes to the layouts only the files of checkpoints not judged before: a root's finished,
unchanged steps cost it nothing per file. What it reports is what a fresh scan reports, and a
rewrite in place, a delete, an mtime set back, an open mark in a finished step are still seen;
where the watcher cannot vouch (start, an overflow, no watcher, the periodic full walk) every
directory is listed again."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support.wait import wait_until

from ckptd import layouts
from ckptd.clock import SYSTEM
from ckptd.model import RootOptions
from ckptd.watch import scanner as scanner_mod
from ckptd.watch.inotify import Inotify
from ckptd.watch.scanner import FULL_WALK_S, OpenFiles, RootScanner

FILES = 20  # data files per step


def write_step(root: Path, step: int) -> Path:
    d = root / f"step-{step}"
    d.mkdir()
    for i in range(FILES):
        (d / f"__0_{i}.distcp").write_bytes(b"y" * (10 + i))
    (d / ".metadata").write_bytes(b"x")
    return d


class Counts:
    """The scanner's own stat calls and the files the layouts were given, counted."""

    def __init__(self) -> None:
        self.stats: list[str] = []
        self.judged: list[str] = []


@pytest.fixture
def counts(monkeypatch: pytest.MonkeyPatch) -> Counts:
    c = Counts()
    real_stat, real_detect = scanner_mod.stat_member, layouts.detect_ranked

    def stat_spy(real_root: str, path: str) -> Any:
        c.stats.append(path)
        return real_stat(real_root, path)

    def detect_spy(snap: Any, *args: Any, **kw: Any) -> Any:
        c.judged.extend((kw.get("view") or snap).files)
        return real_detect(snap, *args, **kw)

    monkeypatch.setattr(scanner_mod, "stat_member", stat_spy)
    monkeypatch.setattr(layouts, "detect_ranked", detect_spy)
    return c


class Sync:
    """Waits until a watcher has read every event raised before: inotify queues events in
    order, and a file made in this directory of its own raises the last one."""

    def __init__(self, watcher: Inotify, d: Path) -> None:
        d.mkdir(exist_ok=True)
        self.d, self.marks, self.n = d, OpenFiles(), 0
        assert watcher.watch(str(d), self.marks)

    def __call__(self) -> None:
        self.marks.take()

        def poke() -> bool:
            self.n += 1
            (self.d / f"s{self.n}").touch()
            return bool(self.marks.take()[0])

        wait_until(poke, 5.0, "the watcher reading its queue")


@pytest.fixture
def kernel() -> Iterator[Inotify]:
    w = Inotify(lambda: None, SYSTEM)
    w.start()
    yield w
    w.stop()


class Root:
    """A scanner over `path` with a real inotify watcher feeding it, as the scan service has."""

    def __init__(self, path: Path, kernel: Inotify, counts: Counts) -> None:
        self.path, self.counts = path, counts
        self.sync = Sync(kernel, path.parent / (path.name + "-sync"))
        self.sc = RootScanner("r", path, "dcp", RootOptions(settle=0.0))
        self.twin = RootScanner("r", path, "dcp", RootOptions(settle=0.0))  # no watcher
        assert kernel.watch(str(path), self.sc.open_files)
        self.now = time.time()

    def scan(self) -> list[tuple[Any, str]]:
        """One scan; what it reports is what the same scan by a full walk reports."""
        self.sync()  # the watcher's thread has read the events of what the test just did
        self.now += 1
        _, full = self.twin.scan(self.now)
        self.counts.stats.clear()
        self.counts.judged.clear()
        found = self.sc.scan(self.now)[1]
        assert report(found) == report(full)
        return found

    def settled(self) -> list[tuple[Any, str]]:
        """Scans until a scan lists nothing: a directory is trusted once listed the same twice."""
        for _ in range(4):
            found = self.scan()
            if self.sc.walk.listed == 0:
                return found
        raise AssertionError("the walk never settled")


def fresh(path: Path) -> list[tuple[str, tuple[str, ...], bool, str]]:
    _, found = RootScanner("r", path, "dcp", RootOptions(settle=0.0)).scan(time.time())
    return [(c.path, c.files, c.complete, fp) for c, fp in found]


def report(found: list[tuple[Any, str]]) -> list[tuple[str, tuple[str, ...], bool, str]]:
    return [(c.path, c.files, c.complete, fp) for c, fp in found]


def test_kept_steps_are_neither_listed_nor_judged_again(
        tmp_path: Path, kernel: Inotify, counts: Counts) -> None:
    for step in (100, 200, 300):
        write_step(tmp_path, step)
    root = Root(tmp_path, kernel, counts)
    before = root.settled()
    assert root.sc.kept == 3 and counts.stats == [] and counts.judged == []

    write_step(tmp_path, 400)  # a new step beside three finished ones
    found = root.scan()
    new = {str(tmp_path / "step-400"), *(str(tmp_path / "step-400" / f) for f in os.listdir(
        tmp_path / "step-400"))}
    assert set(counts.stats) <= new | {str(tmp_path / f"step-{s}") for s in (100, 200, 300)}
    assert all(rel.startswith("step-400/") for rel in counts.judged)
    assert report(found) == fresh(tmp_path)
    assert [fp for c, fp in found if c.path != "step-400"] == [fp for _, fp in before]


@pytest.mark.parametrize("change", ["rewrite", "delete", "mtime"])
def test_a_change_in_a_kept_step_is_still_seen(
        tmp_path: Path, kernel: Inotify, counts: Counts, change: str) -> None:
    for step in (100, 200):
        write_step(tmp_path, step)
    root = Root(tmp_path, kernel, counts)
    before = dict((c.path, fp) for c, fp in root.settled())
    member = tmp_path / "step-100" / "__0_3.distcp"
    if change == "rewrite":
        member.write_bytes(b"z" * 13)  # the same size, in place: no directory's mtime moves
    elif change == "delete":
        member.unlink()
    else:
        st = member.stat()
        os.utime(member, ns=(st.st_atime_ns, st.st_mtime_ns - 10**9))  # no write at all
    found = root.scan()
    after = dict((c.path, fp) for c, fp in found)
    assert after["step-100"] != before["step-100"]
    assert after["step-200"] == before["step-200"]
    assert not any(rel.startswith("step-200/") for rel in counts.judged)


def test_an_open_mark_in_a_kept_step_is_reported_and_cleared(
        tmp_path: Path, kernel: Inotify, counts: Counts) -> None:
    write_step(tmp_path, 100)
    root = Root(tmp_path, kernel, counts)
    root.settled()
    rel = "step-100/__0_1.distcp"
    root.sc.open_files.opened(str(tmp_path / rel), root.now)
    snap, found = root.sc.scan(root.now + 1)
    assert snap.files[rel].open_for_write and not found[0][0].complete
    root.sc.open_files.closed(str(tmp_path / rel))
    snap, found = root.sc.scan(root.now + 2)
    assert not snap.files[rel].open_for_write and found[0][0].complete


def test_a_marker_beside_a_kept_step_makes_it_judged_again(
        tmp_path: Path, kernel: Inotify, counts: Counts) -> None:
    write_step(tmp_path, 100)
    root = Root(tmp_path, kernel, counts)
    assert root.settled()[0][0].complete
    (tmp_path / "step-100-unfinished").mkdir()  # NeMo's marker, as a directory beside it
    found = root.scan()
    assert not found[0][0].complete and "unfinished" in found[0][0].waiting_for


def test_a_directory_with_a_link_is_listed_at_every_scan(
        tmp_path: Path, kernel: Inotify, counts: Counts) -> None:
    write_step(tmp_path, 100)
    (tmp_path / "step-100" / "extra.distcp").symlink_to(tmp_path / "step-100" / "__0_1.distcp")
    root = Root(tmp_path, kernel, counts)
    for _ in range(3):
        root.scan()
    assert root.sc.walk.listed == 1  # its target's changes raise no event in its directory


def test_after_an_overflow_every_directory_is_listed(
        tmp_path: Path, counts: Counts) -> None:
    """A real overflow (the reader starts after more events than the kernel queues): the next
    scan lists every directory again."""
    queued = int(Path("/proc/sys/fs/inotify/max_queued_events").read_text())
    if queued > 1 << 17:
        pytest.skip(f"max_queued_events is {queued}: too many files to overflow it here")
    write_step(tmp_path, 100)
    write_step(tmp_path, 200)
    (tmp_path / "noise").mkdir()
    idle = Inotify(lambda: None, SYSTEM)  # a reader never started
    root = Root(tmp_path, idle, counts)
    idle.stop()
    w = Inotify(lambda: None, SYSTEM)  # the one that reads, from after the overflow
    try:
        assert w.watch(str(tmp_path), root.sc.open_files)
        for i in range(3):  # no event yet: the walk settles without waiting on the watcher
            root.sc.scan(root.now + i)
        assert root.sc.walk.listed == 0
        root.now += 3
        for i in range(queued // 2 + 100):
            (tmp_path / "noise" / f"f{i}").touch()
        w.start()
        root.sync = Sync(w, tmp_path.parent / (tmp_path.name + "-sync2"))
        root.scan()  # after the overflow was read: the sync's event came after it
        assert root.sc.walk.reused == 0 and root.sc.walk.listed == 4
    finally:
        w.stop()


def test_without_a_watcher_every_directory_is_listed_and_verdicts_kept(
        tmp_path: Path, counts: Counts) -> None:
    for step in (100, 200):
        write_step(tmp_path, step)
    sc = RootScanner("r", tmp_path, "dcp", RootOptions(settle=0.0))
    now = time.time()
    for i in range(3):
        sc.scan(now + i)
    counts.judged.clear()
    sc.scan(now + 3)
    assert sc.walk.listed == 3 and sc.walk.reused == 0
    assert sc.kept == 2 and counts.judged == []  # listed the same: judged as before


def test_the_periodic_full_walk_lists_every_directory(
        tmp_path: Path, kernel: Inotify, counts: Counts) -> None:
    for step in (100, 200):
        write_step(tmp_path, step)
    root = Root(tmp_path, kernel, counts)
    root.settled()
    root.now += FULL_WALK_S
    root.scan()
    assert root.sc.walk.listed == 3
    assert root.scan() == root.scan() and root.sc.walk.listed == 0
