"""Durable writes: ckptd's temp names, atomic replacement of a file, fsync of files and
directories, and the writer of a large new file that keeps the page cache small. Never removes
anything but its own temp file, and never opens a path a client named (that is `fileio.paths`).
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import json
import os
import secrets
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from ckptd.errors import BadValue, CkptdError, DiskFull
from ckptd.fileio.cache import WRITEBACK_STEP, advise

# Every temp file ckptd creates starts with this, so startup recovery deletes its own leftovers
# and never anything a training job wrote.
TEMP_PREFIX = ".ckptd-tmp-"


def temp_name(final: Path) -> Path:
    """A fresh temp path beside `final` that startup recovery recognizes as ckptd's own."""
    return final.with_name(f"{TEMP_PREFIX}{final.name}.{os.getpid()}-{secrets.token_hex(4)}")


def atomic_write_bytes(
    path: str | os.PathLike[str], data: bytes, *, dir_fd: int | None = None
) -> None:
    """Replace `path` with `data` so a crash leaves either the old or the new file, never half:
    a temp name beside it (`temp_name`), write, fsync, rename, fsync the directory.

    With `dir_fd`, `path` is a plain name in that directory (a writer beneath a root's fd); the
    temp file is created there with O_NOFOLLOW|O_EXCL, so no link is ever written through.
    """
    final = Path(path)
    if dir_fd is not None and final.name != os.fspath(path):
        raise BadValue(f"with dir_fd, {os.fspath(path)!r} must be a plain name")
    tmp = temp_name(final)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(tmp, flags, 0o644, dir_fd=dir_fd)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, final, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp, dir_fd=dir_fd)
        raise
    if dir_fd is None:
        fsync_dir(final.parent)
    else:
        os.fsync(dir_fd)


def atomic_write_json(
    path: str | os.PathLike[str], obj: Any, *, dir_fd: int | None = None
) -> None:
    """`atomic_write_bytes` of `obj` as indented JSON with sorted keys and a trailing newline.
    NaN is written as Python's json writes it: callers whose documents must be strict check
    their input at the door (the save door's request head is)."""
    data = (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode()
    atomic_write_bytes(path, data, dir_fd=dir_fd)


def fsync_file(path: str | os.PathLike[str], drop: bool = False) -> None:
    """Flush a file's data and metadata to disk (it may have been written by another process).
    With `drop`, then forget its cached pages: the ones the writer's own writes brought in were
    dirty during the read pass (which drops only clean pages) and are clean only now."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
        if drop:
            advise(fd, 0, 0, "POSIX_FADV_DONTNEED")
    finally:
        os.close(fd)


# fsyncs in flight at once by `fsync_many`: concurrent fsyncs share the filesystem's journal
# commits (ext4, XFS), so a step of 10,000 small files does not pay 10,000 commits in a row.
FSYNC_THREADS = 8


def fsync_many(files: Sequence[int | str | os.PathLike[str]], drop: bool = False) -> None:
    """`fsync_file` (an open descriptor as is, a path opened for it) for every item, several at
    once; every item is attempted, and the first OSError is raised after all have been. The
    durability of each file is what one fsync of it gives; only the waiting is shared."""
    def one(item: int | str | os.PathLike[str]) -> None:
        if not isinstance(item, int):
            fsync_file(item, drop=drop)
            return
        os.fsync(item)
        if drop:
            advise(item, 0, 0, "POSIX_FADV_DONTNEED")

    if len(files) <= 1:
        for item in files:
            one(item)
        return
    # Each thread takes the next item itself: one hand-off per thread, not one future (a
    # lock, a condition, a queue put and a wake-up) per file of a 10,000-file step.
    failed: dict[int, BaseException] = {}
    order = itertools.count()  # next() of a count is atomic under the interpreter lock

    def drain() -> None:
        while (i := next(order)) < len(files):
            try:
                one(files[i])
            except BaseException as exc:  # broad: raised below, once every item is tried
                failed[i] = exc

    threads = min(FSYNC_THREADS, len(files))
    with ThreadPoolExecutor(threads, "ckptd-fsync") as pool:
        for fut in [pool.submit(drain) for _ in range(threads)]:
            fut.result()
    if failed:
        first = [failed[i] for i in sorted(failed)]
        raise next((e for e in first if not isinstance(e, OSError)), first[0])


def fsync_dir(path: str | os.PathLike[str], *, quiet: bool = False) -> None:
    """Make the names in a directory durable (after a create, rename or delete). With `quiet`,
    an OSError is swallowed: for a delete, whose durability is best effort (the name is gone
    either way)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        if not quiet:
            raise


def write_error(exc: OSError, what: str) -> CkptdError:
    """An OSError met while writing a copy, as ckptd's error. Never an OSError: validation
    would take that for a fault of the checkpoint being read."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return DiskFull(f"no space left on device while writing {what}; the original files are "
                        "untouched (free space and retry)")
    return CkptdError(f"cannot write {what}: {exc.strerror or exc}")


class DurableWriter:
    """A new file written through a raw fd: written pages are pushed out and dropped from the
    page cache as it grows; `close_durably` fsyncs. Write errors become `write_error`s."""

    def __init__(self, path: Path, what: str) -> None:
        self.path, self.what = path, what
        self.size = 0
        self._cleaned = self._pushed = 0
        try:
            self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise write_error(exc, what) from exc
        self._open = True

    def write(self, data: bytes | memoryview) -> int:
        view = memoryview(data).cast("B")
        n = len(view)
        try:
            while view:
                view = view[os.write(self._fd, view) :]
        except OSError as exc:
            raise write_error(exc, self.what) from exc
        self.size += n
        if self.size - self._pushed >= WRITEBACK_STEP:
            # DONTNEED starts writeback of the new dirty pages and drops the earlier ones,
            # which are clean by now: the cache holds about two steps, without a blocking sync.
            advise(self._fd, self._cleaned, self.size - self._cleaned)
            self._cleaned, self._pushed = self._pushed, self.size
        return n

    def close_durably(self) -> None:
        try:
            os.fsync(self._fd)
        except OSError as exc:
            raise write_error(exc, self.what) from exc
        finally:
            advise(self._fd, 0, 0)
            self.close()

    def close_written(self) -> None:
        """Close with writeback started but not waited for: the caller makes the file durable
        later (`fsync_many` over many files at once), before anything names it as done."""
        advise(self._fd, self._cleaned, 0)
        self.close()

    def close(self) -> None:
        if self._open:
            self._open = False
            os.close(self._fd)
