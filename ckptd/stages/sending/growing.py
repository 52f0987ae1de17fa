"""An object file still being written, as a put's source: the writer reports how many bytes are
final (`Growth`), and `GrowingReader` reads only those, waiting for more until the writer says
the object is finished (docs/UPLOAD.md, "Sending early").

The compressed object is written append-only through a raw descriptor (no bytes are patched
later: the container's index and the zstd seek table are appended at the end), so every byte
the writer has reported written is final. A read past them waits (in short waits, so that a
cancel is seen promptly, and at most `STALL_S` without progress); it fails, which makes the
store client abort the multipart upload, when the writer fails, the send is cancelled or the
finished object is not what was read. Never writes, never holds more than one read in memory,
never reads the store.
"""

from __future__ import annotations

import errno
import io
import os
import threading
import time
from pathlib import Path
from typing import Any

from ckptd import fileio
from ckptd.backends.base import os_error
from ckptd.stages.sending.reader import S3Etag

# How long a read waits without the writer reporting progress before it gives up (the send is
# then aborted and the finished object left to the upload stage).
STALL_S = 600.0
_POLL_S = 0.05  # a waiting read looks at its cancel this often
_READ_LIMIT = 8 << 20  # largest single read
_DROP_STEP = 64 << 20  # drop cached pages behind the cursor in steps this big


class Growth:
    """What the writer of one object tells its sender: bytes final so far (`advance`), then
    exactly one of `done` (finished: its key and size) or `fail`. Thread-safe."""

    def __init__(self, key: str) -> None:
        self.key = key
        self._cond = threading.Condition()
        self.written = 0
        self.final: int | None = None  # the finished object's size
        self.failed: str | None = None

    def advance(self, written: int) -> None:
        with self._cond:
            if written > self.written and self.final is None:
                self.written = written
                self._cond.notify_all()

    def done(self, key: str, size: int) -> None:
        """Finished as `key`, `size` bytes; a key other than the one announced fails it."""
        with self._cond:
            if self.failed is not None or self.final is not None:
                return
            if key != self.key or size < self.written:
                self.failed = f"finished as {key!r} ({size} bytes), not as streamed"
            else:
                self.written = self.final = size
            self._cond.notify_all()

    def fail(self, why: str) -> None:
        with self._cond:
            if self.final is None and self.failed is None:
                self.failed = why
                self._cond.notify_all()

    def streamed(self) -> bool:
        """Finished as announced: the sender delivers it (no separate offer needed)."""
        with self._cond:
            return self.final is not None

    def wait_past(self, pos: int, cancel: threading.Event, stall_s: float) -> int:
        """Block until bytes past `pos` are final or the object is finished; the end of the
        final bytes. OSError when the writer failed, `cancel` is set, or no progress came
        within `stall_s`."""
        deadline = time.monotonic() + stall_s
        with self._cond:
            while True:
                if cancel.is_set():
                    raise OSError(errno.ECANCELED, "early send cancelled")
                if self.failed is not None:
                    raise OSError(errno.EIO, f"the object's writer stopped: {self.failed}")
                if self.written > pos or self.final is not None:
                    return self.written
                left = deadline - time.monotonic()
                if left <= 0:
                    raise OSError(errno.ETIMEDOUT, f"no new bytes for {stall_s:.0f} s")
                self._cond.wait(min(_POLL_S, left))


class GrowingReader(io.RawIOBase):
    """The file at `path`, written as `growth` says, read sequentially from its start: each
    read returns only final bytes, waiting for them; EOF only once the object is finished and
    read to its end. Computes the S3 etag of the parts (`part_size`) as read; `fingerprint`
    is the finished file's. Not seekable; `grows` tells a backend that maps the file to
    extend its mapping as the reads pass its end (`backends.mapped`)."""

    grows = True

    def __init__(self, path: Path, growth: Growth, part_size: int, md5: bool,
                 cancel: threading.Event, stall_s: float = STALL_S) -> None:
        super().__init__()
        self.path, self.growth = path, growth
        self._fd = -1
        try:
            self._fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            raise os_error(exc, f"open {path}") from None
        self._cancel, self._stall_s = cancel, stall_s
        # Only objects past one part are streamed: their etag is always the multipart form.
        self._hasher = S3Etag(part_size + 1, part_size) if md5 else None
        self._pos = self._dropped = 0
        self._hold = False
        self.size: int | None = None  # known at EOF
        self.fingerprint: list[int] | None = None
        fileio.advise(self._fd, 0, 0, "POSIX_FADV_SEQUENTIAL")

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False

    def tell(self) -> int:
        return self._pos

    def fileno(self) -> int:
        return self._fd

    def hold_cache(self) -> None:
        """Stop dropping the pages behind the cursor: the backend sends them from a mapping
        and drops them itself."""
        self._hold = True

    def read(self, n: int | None = -1) -> bytes:
        want = self._final(_READ_LIMIT if n is None or n < 0 else n)
        if not want:
            return b""
        data = os.pread(self._fd, want, self._pos)
        self._account(memoryview(data), want)
        return data

    def readinto(self, buf: Any) -> int:
        view = memoryview(buf).cast("B")
        want = self._final(min(len(view), _READ_LIMIT))
        if not want:
            return 0
        got = os.preadv(self._fd, [view[:want]], self._pos)
        self._account(view[:got], want)
        return got

    def _final(self, n: int) -> int:
        """How many bytes (at most `n`) may be read at the cursor, waiting for them; 0 at the
        finished object's end."""
        end = self.growth.wait_past(self._pos, self._cancel, self._stall_s)
        want = min(end - self._pos, n)
        if want <= 0:
            self._end()
            return 0
        return want

    def _account(self, data: memoryview, want: int) -> None:
        if len(data) != want:
            raise OSError(errno.EIO, f"{self.path}: {len(data)} of {want} final bytes read")
        if self._hasher is not None:
            self._hasher.update(self._pos, data)
        self._pos += len(data)
        if not self._hold and self._pos - self._dropped >= _DROP_STEP:
            fileio.advise(self._fd, self._dropped, self._pos - self._dropped)
            self._dropped = self._pos

    def _end(self) -> None:
        """At EOF: the finished file must be exactly what was read."""
        st = os.fstat(self._fd)
        if self.growth.final != self._pos or st.st_size != self._pos:
            raise OSError(errno.EIO, f"{self.path}: finished at {st.st_size} bytes, "
                                     f"{self._pos} read")
        self.size = self._pos
        self.fingerprint = [st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev]

    def etag(self) -> str | None:
        """The S3 etag of the bytes read, once read to the finished object's end."""
        if self._hasher is None or self.size is None:
            return None
        return self._hasher.etag()

    def close(self) -> None:
        if not self.closed and self._fd >= 0:
            fileio.advise(self._fd, 0, 0)
            os.close(self._fd)
        super().close()
