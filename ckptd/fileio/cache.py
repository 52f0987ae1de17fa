"""Page-cache advice: the one place ckptd calls posix_fadvise, and a reader that drops what it
has read, so the daemon's reads do not push the training job's data out of the cache. Only
hints: nothing here decides whether data is durable (that is `fileio.durable`).
"""

from __future__ import annotations

import contextlib
import os

# Written data is pushed to disk and dropped from the page cache in steps of this size, so a
# compressed copy never sits in memory that the training job's data needs.
WRITEBACK_STEP = 32 << 20


def advise(fd: int, offset: int, length: int, name: str = "POSIX_FADV_DONTNEED") -> None:
    """posix_fadvise `name` on a range of `fd` (length 0: to the end). The one place ckptd
    gives the kernel page-cache advice: only a hint, so a platform without it or an error is
    ignored. DONTNEED drops clean pages and starts writeback of dirty ones without waiting."""
    advice = getattr(os, name, None)
    if advice is not None:
        with contextlib.suppress(OSError):
            os.posix_fadvise(fd, offset, length, advice)


def drop_cache(path: str | os.PathLike[str]) -> None:
    """Ask the kernel to forget the clean cached pages of `path` (after an mmap'd scan)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return
    try:
        advise(fd, 0, 0, "POSIX_FADV_DONTNEED")
    finally:
        os.close(fd)


class DropBehindReader:
    """An object read front to back through its fd, dropping what is behind the cursor from
    the page cache, so verifying or restoring a copy does not evict the training job's data."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.pos = self._dropped = 0

    def read(self, n: int) -> bytes:
        data = os.read(self.fd, n)
        self._advance(len(data))
        return data

    def readinto(self, buf: memoryview) -> int:
        n = os.readv(self.fd, [buf])
        self._advance(n)
        return n

    def _advance(self, n: int) -> None:
        self.pos += n
        if self.pos - self._dropped >= WRITEBACK_STEP:
            advise(self.fd, self._dropped, self.pos - self._dropped)
            self._dropped = self.pos
