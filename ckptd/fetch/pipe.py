"""Restoring one remote object as a pipeline: the download (ranges in parallel, in the backend)
on one thread, decoding, hashing and writing on the caller's, overlapped through a bounded
hand-off; the output written like a local restore (temp name, fsync, pages dropped, rename).

Owns that hand-off and the retry of a whole object; decides nothing about which objects to
restore or where (`ckptd.restore.files` does), and never holds more than a bounded part of an
object.
"""

from __future__ import annotations

import os
import threading
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO, cast

from ckptd import fileio
from ckptd.backends import Backend
from ckptd.copies.decode import ONE_THREAD, Decoding, decode_checked
from ckptd.errors import (
    CorruptData,
    NotFound,
    ObjectNotFound,
    ObjectReplaced,
    PreconditionFailed,
    Signal,
    TransientError,
)
from ckptd.fileio import DurableWriter, write_error
from ckptd.log import get_logger
from ckptd.remote.manifest import StoredFile

Progress = Callable[[int], None]

ATTEMPTS = 3  # whole-object attempts when a download fails after bytes were decoded
BUFFERED = 8 << 20  # bytes downloaded but not yet decoded, per object


class _Cancelled(Signal):
    """The decoding side gave up: the download stops at its next write. An exception, not a
    return value: it is raised inside the backend's `get`, which writes into the pipe and
    only an exception unwinds; the pipe's own caller catches it."""


class Pipe:
    """Bytes from a download (the backend's `get` writes them) to a decoder (which reads
    them), at most `limit` bytes queued between the two. Counts what passes against the
    object's stored size: more is refused as it arrives, less is found at the end."""

    def __init__(self, f: StoredFile, key: str, limit: int = BUFFERED) -> None:
        self.f, self.key, self.limit = f, key, limit
        self._chunks: deque[memoryview] = deque()
        self._queued = 0
        self._cond = threading.Condition()
        self._ended = False
        self._error: BaseException | None = None
        self._cancelled = False
        self.received = 0

    # -- the download's side ---------------------------------------------------------------

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        n = len(view)
        if not view.readonly:  # the writer may reuse its buffer once this returns
            view = memoryview(bytes(view))
        with self._cond:
            if self.received + n > self.f.stored_size:
                raise CorruptData(f"{self.f.path}: object {self.key} holds more than the "
                                  f"{self.f.stored_size} bytes the manifest says")
            self._cond.wait_for(lambda: self._queued < self.limit or self._cancelled)
            if self._cancelled:
                raise _Cancelled()
            self._chunks.append(view)
            self._queued += n
            self.received += n
            self._cond.notify_all()
        return n

    def end(self, error: BaseException | None) -> None:
        with self._cond:
            self._ended, self._error = True, error
            self._cond.notify_all()

    # -- the decoder's side ----------------------------------------------------------------

    def readinto(self, buf: memoryview) -> int:
        out = memoryview(buf).cast("B")
        with self._cond:
            self._cond.wait_for(lambda: bool(self._chunks) or self._ended)
            if not self._chunks:
                self._raise_error()
                return 0
            head = self._chunks[0]
            n = min(len(head), len(out))
            out[:n] = head[:n]
            if n == len(head):
                self._chunks.popleft()
            else:
                self._chunks[0] = head[n:]
            self._queued -= n
            self._cond.notify_all()
        return n

    def read(self, n: int = -1) -> bytes:
        if n < 0:  # everything to the end
            parts = []
            while part := self.read(1 << 20):
                parts.append(part)
            return b"".join(parts)
        buf = bytearray(n)
        got = self.readinto(memoryview(buf))
        return bytes(buf[:got])

    def finish(self) -> None:
        """After the decoder is done: the download ended well and delivered exactly the
        stored size (bytes left over mean the object is longer than the manifest says)."""
        with self._cond:
            self._cond.wait_for(lambda: self._ended)
            self._raise_error()
            if self._chunks or self.received != self.f.stored_size:
                raise CorruptData(f"{self.f.path}: object {self.key} has {self.received} bytes,"
                                  f" the manifest says {self.f.stored_size}")

    def cancel(self) -> None:
        with self._cond:
            self._cancelled = True
            self._cond.notify_all()

    def _raise_error(self) -> None:
        if self._error is None:
            return
        if isinstance(self._error, ObjectNotFound):
            # A FIFO, device or link under the key (file://) is no object either: refused at
            # once, never waited on.
            raise missing(self.f, self.key, self._error) from None
        if isinstance(self._error, PreconditionFailed):
            raise ObjectReplaced(f"{self.f.path}: object {self.key} was replaced while it was "
                                 f"read ({self._error})") from None
        raise self._error


def missing(f: StoredFile, key: str, why: BaseException) -> NotFound:
    """The error of an object the manifest names that is not there (or is no object)."""
    return NotFound(f"{f.path}: object {key} named by the manifest is missing or not a "
                    f"regular file ({why})")


def first_look(backend: Backend, key: str, f: StoredFile) -> str | None:
    """One HEAD before anything is read: NotFound when the object is gone, CorruptData when
    it is not the manifest's stored size; the version every attempt then reads (None where
    the store gives no tag: each download is still of one version)."""
    try:
        meta = backend.stat(key)
    except ObjectNotFound as exc:
        raise missing(f, key, exc) from None
    if meta.size != f.stored_size:
        raise CorruptData(f"{f.path}: object {key} has {meta.size} bytes, the manifest says "
                          f"{f.stored_size}")
    return meta.version


def _download(backend: Backend, key: str, pipe: Pipe, pin: str | None) -> None:
    try:
        backend.get(key, cast(BinaryIO, pipe), etag=pin)
    except BaseException as exc:  # broad: handed to the decoding thread, which raises it
        pipe.end(exc)
    else:
        pipe.end(None)


class _HighWater:
    """Progress that counts each byte once across attempts of the same object."""

    def __init__(self, progress: Progress | None) -> None:
        self.progress, self.high, self.done = progress, 0, 0

    def start(self) -> None:
        self.done = 0

    def __call__(self, n: int) -> None:
        self.done += n
        if self.progress is not None and self.done > self.high:
            self.progress(self.done - self.high)
            self.high = self.done


def fetch_and_restore(backend: Backend, key: str, f: StoredFile, to: Path,
                      progress: Progress | None = None, decoding: Decoding = ONE_THREAD
                      ) -> Path:
    """Download the object at `key` and rebuild `f` under `to` from it as it arrives: checked
    against the manifest's size and hash, fsynced, its pages dropped, then renamed into place.
    A download failing transiently after bytes were decoded starts the object over (up to
    ATTEMPTS in all), every attempt of the version the first look saw: an object replaced
    meanwhile is ObjectReplaced, one gone NotFound. On any failure nothing is left at the
    final name."""
    dest = fileio.safe_join(to, f.path)
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise write_error(exc, f"the directory of {dest}") from exc
    pin = first_look(backend, key, f)
    counted = _HighWater(progress)
    for attempt in range(1, ATTEMPTS + 1):
        counted.start()
        try:
            return _attempt(backend, key, f, dest, counted, pin, decoding)
        except TransientError as exc:
            if attempt == ATTEMPTS:
                raise
            get_logger().warning("restore_object_retry", key=key, attempt=attempt,
                                 error=str(exc))
    raise AssertionError("unreachable: the last attempt returns or raises")


def _attempt(backend: Backend, key: str, f: StoredFile, dest: Path, progress: Progress,
             pin: str | None, decoding: Decoding) -> Path:
    tmp = fileio.temp_name(dest)
    out = DurableWriter(tmp, str(dest))
    pipe = Pipe(f, key)
    fetcher = threading.Thread(target=_download, args=(backend, key, pipe, pin), daemon=True,
                               name="ckptd-restore-fetch")
    fetcher.start()
    try:
        decode_checked(cast(BinaryIO, pipe), f, out, progress, decoding)
        pipe.finish()
        out.close_durably()
        os.replace(tmp, dest)
        fileio.fsync_dir(dest.parent)
        return dest
    except BaseException:
        pipe.cancel()
        out.close()
        tmp.unlink(missing_ok=True)
        raise
    finally:
        fetcher.join()
