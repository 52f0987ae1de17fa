"""An object file as a put's source: read with fadvise, counted for progress, its S3 etag
computed on the fly (and the S3 etag of a local file, to compare with a stored object's).

Reads object files and writes nothing; knows nothing of manifests' meaning or the store.
"""

from __future__ import annotations

import hashlib
import io
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ckptd import fileio
from ckptd.backends.base import ObjectMeta, bare, os_error
from ckptd.errors import CkptdError, PermanentError

_READ_LIMIT = 8 << 20  # largest single read from an object file
_DROP_STEP = 64 << 20  # drop cached pages behind the cursor in steps this big

Progress = Callable[[int], None]


class Meter:
    """Bytes sent (re-sends included) and step progress (high-water marks only)."""

    def __init__(self, progress: Progress | None) -> None:
        self._progress = progress
        self._lock = threading.Lock()
        self.sent_bytes = 0

    def sent(self, n: int) -> None:
        with self._lock:
            self.sent_bytes += n

    def advance(self, n: int) -> None:
        if self._progress is not None and n > 0:
            with self._lock:
                self._progress(n)


class S3Etag:
    """A read-pass sink computing S3's etag of the bytes: the MD5 for a single-part object,
    else the MD5 of the parts' MD5s and "-<parts>" (parts of `part_size`, as the backend puts)."""

    def __init__(self, size: int, part_size: int) -> None:
        self.part_size = part_size if size > part_size else 0
        self._part = hashlib.md5(usedforsecurity=False)
        self._in_part = 0
        self._digests: list[bytes] = []

    def update(self, offset: int, view: memoryview) -> None:
        while len(view):
            take = len(view) if not self.part_size else min(
                len(view), self.part_size - self._in_part)
            self._part.update(view[:take])
            self._in_part += take
            view = view[take:]
            if self.part_size and self._in_part == self.part_size:
                self._close_part()

    def finish(self, total: int) -> None:
        pass

    def etag(self) -> str:
        if not self.part_size:
            return self._part.hexdigest()
        if self._in_part:
            self._close_part()
        whole = hashlib.md5(b"".join(self._digests), usedforsecurity=False).hexdigest()
        return f"{whole}-{len(self._digests)}"

    def _close_part(self) -> None:
        self._digests.append(self._part.digest())
        self._part = hashlib.md5(usedforsecurity=False)
        self._in_part = 0


def etag_matches_file(meta: ObjectMeta, path: Path, size: int, part_size: int) -> bool:
    """Does the store's etag equal the S3 etag of the local file? One read of the file."""
    if not meta.etag:
        return False
    etag = bare(meta.etag)
    parts = -(-size // part_size) if size > part_size else 0
    if etag.count("-") != (1 if parts else 0) or (parts and not etag.endswith(f"-{parts}")):
        return False  # not the shape our own put would produce: cannot be compared
    sink = S3Etag(size, part_size)
    try:
        fileio.read_pass(path, [sink])
    except (OSError, CkptdError):
        return False
    return sink.etag() == etag


def fingerprint(path: Path) -> list[int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return [st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev]


class ObjectReader(io.RawIOBase):
    """An object file as a put's source: sequential reads with fadvise (pages behind the cursor
    are dropped: the disk belongs to the training job), seekable for retries, counting bytes
    for progress and `sent_bytes`, and computing the S3 etag of what was read."""

    def __init__(self, path: Path, meter: Meter, part_size: int, md5: bool) -> None:
        super().__init__()
        self.path = path
        self._fd = -1  # so close() after a failed open has nothing to do
        try:
            self._fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            raise PermanentError(f"{path}: stored object missing on local disk") from None
        except OSError as exc:
            raise os_error(exc, f"open {path}") from None
        st = os.fstat(self._fd)
        self.size = st.st_size
        self.fingerprint = [st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev]
        self._meter = meter
        self._pos = self._high = self._dropped = 0
        self._hold = False
        self._hasher: S3Etag | None = S3Etag(self.size, part_size) if md5 else None
        self._md5 = md5
        self._part_size = part_size
        fileio.advise(self._fd, 0, 0, "POSIX_FADV_SEQUENTIAL")

    def readable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self._fd

    def hold_cache(self) -> None:
        """Stop dropping the pages behind the cursor: a backend sending this file's pages from
        a mapping drops them itself once they are sent (until close, which drops them all)."""
        self._hold = True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._pos, 2: self.size}[whence]
        self._pos = max(0, base + pos)
        # A retry starts over: hash afresh from 0; from anywhere else the hash is lost.
        fresh = self._md5 and self._pos == 0
        self._hasher = S3Etag(self.size, self._part_size) if fresh else None
        return self._pos

    def read(self, n: int | None = -1) -> bytes:
        want = self.size - self._pos if n is None or n < 0 else n
        data = os.pread(self._fd, min(want, _READ_LIMIT), self._pos) if want > 0 else b""
        self._account(memoryview(data))
        return data

    def readinto(self, buf: Any) -> int:
        """Like read, into `buf` (a reused buffer: no allocation per read)."""
        view = memoryview(buf).cast("B")
        want = min(len(view), self.size - self._pos, _READ_LIMIT)
        got = os.preadv(self._fd, [view[:want]], self._pos) if want > 0 else 0
        self._account(view[:got])
        return got

    def _account(self, data: memoryview) -> None:
        """Hash, count and advance over `data`, just read at the cursor."""
        if self._hasher is not None:
            self._hasher.update(self._pos, data)
        self._pos += len(data)
        self._meter.sent(len(data))
        if self._pos > self._high:
            self._meter.advance(self._pos - self._high)
            self._high = self._pos
        if not self._hold and self._high - self._dropped >= _DROP_STEP:
            fileio.advise(self._fd, self._dropped, self._high - self._dropped)
            self._dropped = self._high

    def etag(self) -> str | None:
        """The S3 etag of the bytes read, if they were read once through from the start."""
        if self._hasher is None or self._pos != self.size:
            return None
        return self._hasher.etag()

    def close(self) -> None:
        if not self.closed and self._fd >= 0:
            fileio.advise(self._fd, 0, 0)
            os.close(self._fd)
        super().close()

    def __enter__(self) -> ObjectReader:
        return self
