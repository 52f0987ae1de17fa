"""Scan roots into Snapshots and Candidates, and the fingerprint that says a checkpoint's files
changed.

Owns per-file change tracking, and the open-for-write marks and changed directories a watcher
(`ckptd.watch.watcher`) keeps for it; the walk (never following a symlink out of the root) is
`ckptd.watch.walk`, the checkpoint directories kept as judged `ckptd.watch.kept`. Must not
decide completeness (layouts do), watch for events, or touch the store.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import stat
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckptd import fileio, inputs, layouts
from ckptd.errors import BadInput, UnsafePath
from ckptd.formats import torchhead
from ckptd.model import Candidate, FileInfo, PlainValue, RootOptions, Snapshot
from ckptd.watch import kept
from ckptd.watch.walk import Listing, Walk, relative_dirs

# An "opened for writing" mark with no close event expires after this long without change:
# inotify may never report the close of a file written into a just-created directory.
OPEN_MARK_MIN_S = 30.0
# Every directory is listed again at least this often, whatever the watcher vouches for: an
# event inotify never raises (a write through a hard link elsewhere, through a shared mapping)
# costs at most this long. A directory listed the same keeps its records and its verdicts.
FULL_WALK_S = 60.0


@dataclass(eq=False)
class _DirRecord:
    """One directory's share of a scan: kept while its listing is kept and none is open."""

    listing: Listing
    seen: dict[str, _Seen]
    files: dict[str, FileInfo]
    open: bool  # a file in it is marked open: its mark may expire, so it is built each scan
    wants: list[str]  # its files some layout wants the bytes of
    fields: list[str]  # its files some layout wants the pickle's plain values of


@dataclass
class _Seen:
    size: int
    mtime_ns: int
    changed_at: float
    seen_at: float
    first_mtime_ns: int


class OpenFiles:
    """What the watcher tells one root's scanner: the files it saw opened/modified for writing
    and not yet closed, and the directories it saw change since the last walk. Only while it
    vouches for the root (every directory watched, no event lost since) does the walk reuse
    the listings of the directories it did not report."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: dict[str, float] = {}
        self._dirty: set[str] = set()
        self._vouched = False
        self._lost = True

    def any(self) -> bool:
        """Whether any file is marked at all (a scan asks each file only then)."""
        with self._lock:
            return bool(self._open)

    def opened(self, abspath: str, now: float) -> None:
        with self._lock:
            self._open[abspath] = now
            self._dirty.add(os.path.dirname(abspath))

    def closed(self, abspath: str) -> None:
        with self._lock:
            self._open.pop(abspath, None)
            self._dirty.add(os.path.dirname(abspath))

    def touched(self, abs_dir: str) -> None:
        """Something in this directory changed (an entry made, written, renamed or gone)."""
        with self._lock:
            self._dirty.add(abs_dir)

    def vouch(self, on: bool) -> None:
        """The watcher now watches every directory of the root (True), or cannot (False). A
        new vouch starts with one full walk: events before the watches existed were missed."""
        with self._lock:
            self._vouched = on
            self._lost = True

    def lost(self) -> None:
        """Events were lost (a queue overflow): the next walk lists every directory."""
        with self._lock:
            self._lost = True

    def take(self) -> tuple[frozenset[str], bool]:
        """The directories changed (or whose files' marks changed) since the last call, and
        whether the next walk must list every directory; resets both. Called by a scan before
        it walks: an event that lands during the walk is kept for the next one."""
        with self._lock:
            dirty, self._dirty = frozenset(self._dirty), set()
            full = self._lost or not self._vouched
            self._lost = False
            return dirty, full

    def is_open(self, abspath: str, changed_at: float, now: float, expiry: float) -> bool:
        with self._lock:
            mark = self._open.get(abspath)
            if mark is None:
                return False
            if now - max(mark, changed_at) > expiry:
                del self._open[abspath]
                return False
            return True


class RootScanner:
    """Walks one root and remembers, per file, when its size or mtime last changed."""

    def __init__(self, name: str, path: Path, layout: str, opts: RootOptions,
                 open_files: OpenFiles | None = None,
                 top: Callable[[str, bool], bool] | None = None) -> None:
        self.name = name
        self.path = path
        self.layout = layout
        self.opts = opts
        self.open_files = open_files or OpenFiles()
        self._seen: dict[str, _Seen] = {}
        # What the last scan built per file and per candidate, reused while nothing under it
        # changed: a root keeps its finished steps, and a scan that rebuilt each of their
        # files' records and re-hashed each of their members' stats would cost more with
        # every step the root holds.
        self._infos: dict[str, FileInfo] = {}
        self._prints: dict[tuple[str, int, str], tuple[tuple[str, ...], str]] = {}
        self._contents: dict[str, tuple[int, int, bool, bytes | str]] = {}
        self._fields: dict[str, tuple[int, int, dict[str, PlainValue] | None]] = {}
        # Per path, whether a layout wants its bytes and its pickle's plain values: a function
        # of the name alone, asked once while the path exists (a scan of 10,000 files would
        # otherwise ask every layout about every file each time).
        self._wants: dict[str, tuple[bool, bool]] = {}
        self._real_root = os.path.realpath(path)
        # The walk keeps each directory's listing, this scanner each directory's records.
        self.walk = Walk(path, self._real_root, top, stat_member)
        self._records: dict[str, _DirRecord] = {}
        self._full_at = 0.0  # when the walk last listed every directory
        self._units: dict[str, kept.Unit] = {}  # checkpoint directories judged, not changed
        self._registrations: dict[int, tuple[str, ...]] = {}
        self.kept = 0  # checkpoint directories the last scan kept as judged
        # Directories (root-relative; "" = the root) the last scan could not read.
        self.unreadable: set[str] = set()
        # Paths that look like checkpoints but carry a step no checkpoint can have.
        self.unrecognised: list[str] = []

    def scan(self, now: float, registrations: dict[int, tuple[str, ...]] | None = None
             ) -> tuple[Snapshot, list[tuple[Candidate, str]]]:
        """One scan: the snapshot and every candidate with its fingerprint. Directories the
        watcher vouches did not change keep the records the last scan built for them."""
        changed, full = self.open_files.take()
        dirty = relative_dirs(os.fspath(self.path), changed)
        if full or now - self._full_at >= FULL_WALK_S or now < self._full_at:
            full, self._full_at = True, now
        listings = self.walk.run(None if full else dirty)
        self.unreadable = self.walk.unreadable
        expiry = max(OPEN_MARK_MIN_S, 6 * self.opts.settle)
        changing: set[str] = set()  # changed since an earlier scan saw them: being written
        fresh: set[str] = set()  # new or changed since the last scan
        marked = self.open_files.any()
        files: dict[str, FileInfo] = {}
        seen: dict[str, _Seen] = {}
        dirs: set[str] = set()
        records: dict[str, _DirRecord] = {}
        for rel_dir, (listing, same) in listings.items():
            rec = self._records.get(rel_dir)
            if not (same and rec is not None and rec.listing is listing and not rec.open
                    and rel_dir not in dirty):
                rec = self._record(listing, now, marked, expiry, changing, fresh)
            records[rel_dir] = rec
            seen.update(rec.seen)
            files.update(rec.files)
            dirs.update(listing.subdirs)
        for rel_dir, old in self._records.items():  # gone since: whole directories, or files
            new = records.get(rel_dir)
            if new is not old:
                gone = [rel for rel in old.seen if new is None or rel not in new.seen]
                fresh.update(gone)
                for rel in gone:
                    self._wants.pop(rel, None)
        self._records, self._seen, self._infos = records, seen, files
        contents, refused = self._read_contents(seen, files, records)
        snap = Snapshot(files=files, dirs=frozenset(dirs), contents=contents,
                        registrations=dict(registrations or {}),
                        torch_fields=self._read_torch_fields(seen, files, changing, records),
                        bad_contents=refused)
        ranked, self.unrecognised = self._detect(snap, records, now)
        prints = self._prints
        self._prints = {}  # only this scan's candidates are kept
        return snap, [(c, self._fingerprint(c, seen, fresh, prints)) for _, c in ranked]

    def _detect(self, snap: Snapshot, records: dict[str, _DirRecord], now: float
                ) -> tuple[list[tuple[int, Candidate]], list[str]]:
        """The layouts' verdicts, over the files of the directories not kept as judged
        (`ckptd.watch.kept`), with the kept ones' candidates as the last scan found them."""
        units = [u for u in self._units.values() if kept.still(u, records)]
        if snap.registrations != self._registrations:
            units = []  # a registration may claim any file: judge every one again
        self._registrations = snap.registrations
        view = None
        if units:
            frozen = kept.frozen_dirs(units)
            files: dict[str, FileInfo] = {}
            for rel_dir, rec in records.items():
                if rel_dir not in frozen:
                    files.update(rec.files)
            view = dataclasses.replace(snap, files=files, dirs=snap.dirs - frozen)
        ranked, bad = layouts.detect_ranked(
            snap, self.opts, now, self.layout, view=view,
            kept=[rc for u in units for rc in u.ranked], kept_bad=[b for u in units for b in u.bad])
        self.kept = len(units)
        self._units = kept.choose(ranked, bad, records, {u.path: u for u in units})
        return ranked, bad

    def _record(self, listing: Listing, now: float, marked: bool, expiry: float,
                changing: set[str], fresh: set[str]) -> _DirRecord:
        """One directory's file records from its listing: a file whose size and mtime did not
        change and that is not open keeps the record the last scan built."""
        seen: dict[str, _Seen] = {}
        files: dict[str, FileInfo] = {}
        wants: list[str] = []
        fields: list[str] = []
        for rel, size, mtime_ns, link in listing.files:
            want = self._wants.get(rel)
            if want is None:
                want = self._wants[rel] = (layouts.wants_content(rel, self.layout),
                                           layouts.wants_torch_fields(rel, self.layout))
            if want[0]:
                wants.append(rel)
            if want[1]:
                fields.append(rel)
            prev = self._seen.get(rel)
            if prev and prev.size == size and prev.mtime_ns == mtime_ns:
                info = self._infos.get(rel)
                if (not marked and info is not None and not info.open_for_write
                        and info.symlink == link):
                    seen[rel], files[rel] = prev, info  # unchanged and not open: as it was
                    continue
                changed_at = prev.changed_at
            else:
                changed_at = now
                fresh.add(rel)
                if prev:
                    changing.add(rel)
            seen_at = prev.seen_at if prev else now
            first_mtime_ns = prev.first_mtime_ns if prev else mtime_ns
            seen[rel] = _Seen(size, mtime_ns, changed_at, seen_at, first_mtime_ns)
            abspath = os.path.join(self.path, rel)
            files[rel] = FileInfo(rel, size, mtime_ns / 1e9, changed_at,
                                  marked and self.open_files.is_open(abspath, changed_at, now,
                                                                     expiry),
                                  seen_at, link, first_mtime_ns / 1e9)
        return _DirRecord(listing, seen, files, any(i.open_for_write for i in files.values()),
                          wants, fields)

    def _fingerprint(self, cand: Candidate, seen: dict[str, _Seen], fresh: set[str],
                     last: dict[tuple[str, int, str], tuple[tuple[str, ...], str]]) -> str:
        """`fingerprint` of a candidate, computed again only when its member list or one of
        its members changed since the last scan (new, changed or gone: `fresh`)."""
        key = (cand.path, cand.step, cand.layout)
        hit = last.get(key)
        if hit is not None and (hit[0] is cand.files  # a kept candidate: nothing changed
                                or hit[0] == cand.files and fresh.isdisjoint(cand.files)):
            fp = hit[1]
        else:
            fp = fingerprint(cand, seen)
        self._prints[key] = (cand.files, fp)
        return fp

    def _read_contents(self, seen: dict[str, _Seen], files: Mapping[str, FileInfo],
                       records: Mapping[str, _DirRecord]
                       ) -> tuple[dict[str, bytes], dict[str, str]]:
        """The bytes of the small files layouts asked for, read through the bounded reader
        once per size, mtime and kind of entry (a link's stat is its target's); and the ones
        it refused (a link, over the cap of their kind), with why, so their checkpoint is
        judged bad instead of waiting for them."""
        out: dict[str, bytes] = {}
        refused: dict[str, str] = {}
        cache: dict[str, tuple[int, int, bool, bytes | str]] = {}
        for rel in (rel for rec in records.values() for rel in rec.wants):
            s = seen[rel]
            link = files[rel].symlink
            hit = self._contents.get(rel)
            data: bytes | str | None
            if hit and hit[:3] == (s.size, s.mtime_ns, link):
                data = hit[3]
            else:
                data = _read_small(self.path, rel, layouts.content_kind(rel))
            if data is None:
                continue
            cache[rel] = (s.size, s.mtime_ns, link, data)
            if isinstance(data, str):
                refused[rel] = data
            else:
                out[rel] = data
        self._contents = cache
        return out, refused


    def _read_torch_fields(self, seen: dict[str, _Seen], files: Mapping[str, FileInfo],
                           changing: set[str], records: Mapping[str, _DirRecord]
                           ) -> dict[str, dict[str, PlainValue]]:
        """The plain values of the pickles layouts asked for, from each file's first bytes:
        once per size and mtime, and not while the file changes from scan to scan (a large
        file being written would be read and parsed at every scan it wakes)."""
        out: dict[str, dict[str, PlainValue]] = {}
        cache: dict[str, tuple[int, int, dict[str, PlainValue] | None]] = {}
        for rel in (rel for rec in records.values() for rel in rec.fields):
            if rel in changing:
                continue
            s = seen[rel]
            hit = self._fields.get(rel)
            if hit and hit[0] == s.size and hit[1] == s.mtime_ns:
                fields = hit[2]
            else:  # never through a link below the root: a linked file is not its own step
                fields = _leading_fields(self.path, rel) if not files[rel].symlink else None
            cache[rel] = (s.size, s.mtime_ns, fields)
            if fields is not None:
                out[rel] = fields
        self._fields = cache
        return out


def stat_member(real_root: str, path: str) -> tuple[os.stat_result, bool]:
    """stat() a member and say whether it is a symlink leading out of the root (then the link
    itself is stat'ed, never its target). The scanner and the checks that a stage's files did
    not change (`member_stats`, `file_fingerprint`) use this one rule."""
    st = os.lstat(path)
    if not stat.S_ISLNK(st.st_mode):
        return st, False
    target = os.path.realpath(path)
    if target == real_root or target.startswith(real_root + os.sep):
        return os.stat(path), False
    return st, True


def _leading_fields(root: Path, rel: str) -> dict[str, PlainValue] | None:
    """A pickle's leading plain values, from at most `HEAD_BYTES` of the file opened beneath
    the root (`fileio.open_beneath`: no link followed anywhere along the way)."""
    try:
        fd = fileio.open_beneath(root, rel)
    except (OSError, UnsafePath):
        return None
    try:
        with os.fdopen(fd, "rb") as f:
            head = f.read(torchhead.HEAD_BYTES)
    except OSError:
        return None
    return torchhead.leading_fields(head, rel)


def _read_small(root: Path, rel: str, kind: inputs.Kind) -> bytes | str | None:
    """A metadata file's bytes (`ckptd.inputs`: a regular file, never through a link, at most
    its kind's cap); why it was refused (str); None when it could not be read now (gone,
    EACCES: the next scan tries again). The walk never descends a linked directory, so only
    the last component can be a link, and O_NOFOLLOW refuses it."""
    try:
        root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        return inputs.read_file(rel, kind, dir_fd=root_fd)  # messages name `rel`
    except BadInput as exc:
        return str(exc)
    except OSError:
        return None
    finally:
        os.close(root_fd)


def fingerprint(cand: Candidate, seen: dict[str, Any]) -> str:
    """Digest of the candidate's member paths, sizes and mtimes: changes when any file does."""
    h = hashlib.sha256()
    for rel in sorted(cand.files):
        s = seen.get(rel)
        h.update(rel.encode())
        h.update(b"\0%d\0%d\n" % ((s.size, s.mtime_ns) if s else (-1, -1)))
    return h.hexdigest()[:32]


def file_fingerprint(root: Path, files: tuple[str, ...]) -> str:
    """The same digest computed from the files on disk now (to detect change during a stage)."""
    return stats_fingerprint(files, member_stats(root, files))


def member_stats(root: Path, files: Iterable[str]) -> dict[str, os.stat_result]:
    """Each member's stat now, by the scanner's rule; members that are gone are left out."""
    out: dict[str, os.stat_result] = {}
    real_root = os.path.realpath(root)
    for rel in files:
        try:
            out[rel], _ = stat_member(real_root, os.path.join(root, rel))
        except OSError:
            continue
    return out


def stats_fingerprint(files: tuple[str, ...], stats: Mapping[str, os.stat_result]) -> str:
    """`fingerprint` of `files` from stats already taken (one stat pass for two uses)."""
    seen = {rel: _Seen(st.st_size, st.st_mtime_ns, 0.0, 0.0, st.st_mtime_ns)
            for rel, st in stats.items()}
    return fingerprint(Candidate("", 0, "", files, False), seen)
