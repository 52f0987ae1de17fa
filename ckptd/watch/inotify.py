"""The roots' inotify watches, read straight from the kernel: one descriptor and one thread for
every root, a watch on each directory of a root except ckptd's own (`.ckptd/`, `.ckptd-*`).

Why not a general watcher library: ckptd writes a compressed copy of every step under
`<root>/.ckptd/`, and a watch that covers the whole tree reports each of those writes (a
10,000-file step: tens of thousands of events, and a walk of the staged copy when it is renamed)
to threads that hold the interpreter lock, beside the validating thread that needs it. Leaving
those directories unwatched means the kernel never queues their events (measured in
docs/PERFORMANCE.md, "Time to safe").

What an event does: a write marks the file open (`OpenFiles.opened`), a close after writing or
a rename away marks it closed, every event names its directory as changed (`OpenFiles.touched`)
and wakes the scanner, which lists again only the directories named since its last walk while
this watcher vouches for the root (`OpenFiles.vouch`: every directory watched). A queue overflow
says events were lost (`OpenFiles.lost`: the next walk lists every directory) and re-adds every
root's watches; a watch that cannot be added ends the vouching for its root. New directories
get their watches when they appear (created or moved in), and a root that goes away is
forgotten, so the scan loop's next `watch` adds it again when it is back. Must not scan or
decide anything.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import select
import struct
import threading
from collections.abc import Callable
from typing import Protocol

from ckptd.clock import Clock
from ckptd.log import get_logger
from ckptd.model import is_own

IN_ACCESS = 0x00000001
IN_MODIFY = 0x00000002
IN_ATTRIB = 0x00000004
IN_CLOSE_WRITE = 0x00000008
IN_CLOSE_NOWRITE = 0x00000010
IN_OPEN = 0x00000020
IN_MOVED_FROM = 0x00000040
IN_MOVED_TO = 0x00000080
IN_CREATE = 0x00000100
IN_DELETE = 0x00000200
IN_DELETE_SELF = 0x00000400
IN_MOVE_SELF = 0x00000800
IN_Q_OVERFLOW = 0x00004000
IN_IGNORED = 0x00008000
IN_ONLYDIR = 0x01000000
IN_DONT_FOLLOW = 0x02000000
IN_EXCL_UNLINK = 0x04000000
IN_ISDIR = 0x40000000
# What a read raises, and a watch must not ask for: reads (validation's own) change nothing.
IN_OPEN_ALL = IN_ACCESS | IN_OPEN | IN_CLOSE_NOWRITE
# IN_ATTRIB: a file's mtime set back (`touch -d`, `cp -p`) changes its fingerprint and is
# written to no directory; the scan reuses what a directory held unless an event names it.
MASK = (IN_MODIFY | IN_ATTRIB | IN_CLOSE_WRITE | IN_MOVED_FROM | IN_MOVED_TO | IN_CREATE | IN_DELETE
        | IN_DELETE_SELF | IN_MOVE_SELF | IN_ONLYDIR | IN_DONT_FOLLOW | IN_EXCL_UNLINK)
_HEAD = struct.Struct("iIII")  # struct inotify_event: wd, mask, cookie, len; then the name
_READ = 1 << 16  # bytes per read: whole events only, each at most 16 + NAME_MAX + 1


class Marks(Protocol):
    """Where a root's open-for-writing marks and changed directories go
    (`ckptd.watch.scanner.OpenFiles`), and whether the watches vouch for the whole root."""

    def opened(self, abspath: str, now: float) -> None: ...

    def closed(self, abspath: str) -> None: ...

    def touched(self, abs_dir: str) -> None: ...

    def vouch(self, on: bool) -> None: ...

    def lost(self) -> None: ...


class _Libc:
    def __init__(self) -> None:
        lib = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        self.init1 = lib.inotify_init1
        self.init1.argtypes, self.init1.restype = [ctypes.c_int], ctypes.c_int
        self.add = lib.inotify_add_watch
        self.add.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]
        self.add.restype = ctypes.c_int
        self.rm = lib.inotify_rm_watch
        self.rm.argtypes, self.rm.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int


_LIBC: _Libc | None = None


def _libc() -> _Libc:
    global _LIBC  # noqa: PLW0603 - loaded once, on first use
    if _LIBC is None:
        _LIBC = _Libc()
    return _LIBC


class Inotify:
    """Recursive watches of several roots on one inotify descriptor, read by one thread
    (`ckptd.watch.watcher.Watcher`)."""

    def __init__(self, wake: Callable[[], None], clock: Clock) -> None:
        self._wake = wake
        self._clock = clock
        self._libc = _libc()
        fd = self._libc.init1(os.O_NONBLOCK | os.O_CLOEXEC)
        if fd < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"inotify_init1: {os.strerror(err)}")
        self._fd = fd
        self._stop_r, self._stop_w = os.pipe2(os.O_CLOEXEC)
        self._lock = threading.Lock()
        self._dirs: dict[int, tuple[str, str]] = {}  # wd -> (root, directory)
        self._wds: dict[str, int] = {}  # directory -> wd
        self._roots: dict[str, Marks] = {}
        self._short: set[str] = set()  # roots told about a watch that could not be added
        self._thread = threading.Thread(target=self._run, daemon=True, name="ckptd-inotify")
        self._closed = False

    # -- the watcher's interface -------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def alive(self) -> bool:
        return self._thread.is_alive()

    def started(self) -> bool:
        return self._thread.ident is not None

    def stop(self) -> None:
        if self._closed:
            return
        self._closed = True
        with self._lock:
            for marks in self._roots.values():
                marks.vouch(False)  # no event is read from now on
        os.write(self._stop_w, b"x")
        if self._thread.ident is not None:
            self._thread.join(timeout=5)
        if not self._thread.is_alive():
            for fd in (self._fd, self._stop_r, self._stop_w):
                os.close(fd)

    def watch(self, path: str | os.PathLike[str], marks: Marks) -> bool:
        """Watch `path` and every directory below it (idempotent). False when it is no
        directory, or its own watch cannot be added."""
        root = os.fspath(path)
        with self._lock:
            if root in self._roots:
                return True
            if not os.path.isdir(root):
                return False
            if self._add(root, root) is None:
                return False
            self._roots[root] = marks
            self._add_below(root, root)
            # Vouched only when every directory got its watch; from a full walk on.
            marks.vouch(root not in self._short)
            return True

    def unwatch(self, path: str | os.PathLike[str]) -> None:
        root = os.fspath(path)
        with self._lock:
            marks = self._roots.pop(root, None)
            if marks is not None:
                marks.vouch(False)
            self._short.discard(root)
            for wd in [wd for wd, (r, _) in self._dirs.items() if r == root]:
                self._forget(wd, remove=True)

    def watched(self, root: str) -> list[str]:
        """The directories watched for `root`."""
        with self._lock:
            return sorted(d for r, d in self._dirs.values() if r == root)

    # -- watches -----------------------------------------------------------------------------

    def _add(self, root: str, directory: str) -> int | None:
        # The root itself may be a link to its directory (as the scanner's walk allows); no
        # link below it is ever followed.
        mask = MASK & ~IN_DONT_FOLLOW if directory == root else MASK
        wd = int(self._libc.add(self._fd, os.fsencode(directory), mask))
        if wd < 0:
            err = ctypes.get_errno()
            if err in (errno.ENOENT, errno.ENOTDIR):
                return None  # gone meanwhile: its parent's event says so
            marks = self._roots.get(root)
            if marks is not None:
                marks.vouch(False)  # a directory no event covers: every scan walks it all
            if err in (errno.ENOSPC, errno.ENOMEM) and root not in self._short:
                get_logger().warning("watch_incomplete", root=root, directory=directory,
                                     error=os.strerror(err))
            self._short.add(root)  # once per root: the scans still find everything
            return None
        old = self._dirs.get(wd)
        if old is not None:
            self._wds.pop(old[1], None)
        self._dirs[wd] = (root, directory)
        self._wds[directory] = wd
        return wd

    def _add_below(self, root: str, top: str) -> None:
        """Watches on every directory under `top`, never through a link, never ckptd's own."""
        stack = [top]
        while stack:
            directory = stack.pop()
            try:
                with os.scandir(directory) as entries:
                    subdirs = [e.path for e in entries
                               if not is_own(e.name) and e.is_dir(follow_symlinks=False)]
            except OSError:
                continue  # gone or unreadable: the scan reports it
            for sub in subdirs:
                if self._add(root, sub) is not None:
                    stack.append(sub)

    def _forget(self, wd: int, remove: bool = False) -> None:
        entry = self._dirs.pop(wd, None)
        if entry is not None and self._wds.get(entry[1]) == wd:
            del self._wds[entry[1]]
        if remove:
            self._libc.rm(self._fd, wd)  # a watch already gone is fine

    def _under(self, directory: str) -> list[int]:
        prefix = directory + os.sep
        return [wd for path, wd in self._wds.items() if path == directory
                or path.startswith(prefix)]

    def _moved(self, old: str, new: str) -> None:
        """A watched directory renamed within a root: its watches stay, their paths change."""
        for wd in self._under(old):
            root, path = self._dirs[wd]
            moved = new + path[len(old):]
            del self._wds[path]
            self._dirs[wd] = (root, moved)
            self._wds[moved] = wd

    # -- events ------------------------------------------------------------------------------

    def _run(self) -> None:
        poll = select.poll()
        poll.register(self._fd, select.POLLIN)
        poll.register(self._stop_r, select.POLLIN)
        while True:
            ready = [fd for fd, _ in poll.poll()]
            if self._stop_r in ready:
                return
            try:
                data = os.read(self._fd, _READ)
            except BlockingIOError:
                continue
            self._handle(data)

    def _handle(self, data: bytes) -> None:
        now = self._clock.time()
        woke = overflow = False
        moved_from: dict[int, str] = {}  # cookie -> directory renamed away, not yet seen again
        with self._lock:
            pos = 0
            while pos + _HEAD.size <= len(data):
                wd, mask, cookie, length = _HEAD.unpack_from(data, pos)
                name = os.fsdecode(data[pos + _HEAD.size:pos + _HEAD.size + length]
                                   .split(b"\0", 1)[0])
                pos += _HEAD.size + length
                if mask & IN_Q_OVERFLOW:
                    overflow = True
                    continue
                entry = self._dirs.get(wd)
                if entry is None:
                    continue
                root, directory = entry
                marks = self._roots.get(root)
                if marks is not None:
                    marks.touched(directory)
                if mask & IN_IGNORED:  # the directory is gone (or its watch was removed)
                    self._forget(wd)
                    if directory == root:
                        self._roots.pop(root, None)  # watched again once it is back
                    woke = True
                    continue
                if not name:  # about the watched directory itself
                    if mask & IN_MOVE_SELF and directory == root:  # renamed away: forget it,
                        self._roots.pop(root, None)  # so a new one there is watched anew
                        for stale in [w for w, (r, _) in self._dirs.items() if r == root]:
                            self._forget(stale, remove=True)
                    woke = True
                    continue
                if is_own(name):  # its own paths: never watched, never a wake
                    continue
                path = os.path.join(directory, name)
                if mask & IN_ISDIR:
                    if marks is not None:
                        marks.touched(path)
                    if mask & IN_MOVED_FROM:
                        moved_from[cookie] = path
                    elif mask & IN_MOVED_TO and cookie in moved_from:
                        self._moved(moved_from.pop(cookie), path)
                    elif mask & (IN_CREATE | IN_MOVED_TO) and self._add(root, path) is not None:
                        self._add_below(root, path)
                else:
                    if marks is not None and mask & IN_MODIFY:
                        marks.opened(path, now)
                    elif marks is not None and mask & (IN_CLOSE_WRITE | IN_MOVED_FROM):
                        marks.closed(path)
                woke = True
            for gone in moved_from.values():  # renamed out of the tree, or paired in a later
                for wd in self._under(gone):  # read: a later IN_MOVED_TO watches it anew
                    self._forget(wd, remove=True)
            if overflow:
                get_logger().info("watch_overflow", roots=len(self._roots))
                for root, marks in list(self._roots.items()):
                    marks.lost()  # the next scan lists every directory again
                    self._add_below(root, root)
                woke = True
        if woke:
            self._wake()
