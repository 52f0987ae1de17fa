"""The bytes of one put: counted and size-checked; a local object file sent from its pages
(a read-only mapping handed to the store client in views, its resident pages trimmed as they
go) instead of copies in memory, any other source read in bounded pieces.

Owns the mapping, its trimming and the page-cache drops behind it; the source still does every
read (hashing, counting, size checks), so what was checked is what the mapping holds.
"""

from __future__ import annotations

import mmap
import os
import threading
from collections.abc import Callable, Iterator
from typing import Protocol, TypeVar, runtime_checkable

from ckptd import fileio
from ckptd.backends.base import COPY_CHUNK, Source, os_error
from ckptd.errors import PermanentError

_T = TypeVar("_T")
Payload = bytes | memoryview | Iterator[bytes] | Iterator[memoryview]

MAP_AT_LEAST = 1 << 20  # smaller objects are cheaper as one bytes object
_TRIM_EVERY_S = 0.02
_VIEW = 8 << 20  # one view handed to the client (the client splits them into parts)
_READ = 1 << 20  # the source reads into one reused buffer of this size


@runtime_checkable
class MappableSource(Protocol):
    """A put source backed by a regular file whose bytes the backend may map and send directly.

    `hold_cache()` tells it to stop dropping pages behind its read cursor: the pages it read
    are sent from the mapping later, and the backend drops them once they are sent. A source
    with a true `grows` attribute is a file still being written whose reads return only final
    bytes: the mapping is then extended as the reads pass its end."""

    def fileno(self) -> int: ...

    def tell(self) -> int: ...

    def readinto(self, buf: bytearray, /) -> int: ...

    def hold_cache(self) -> None: ...


class MappedBody:
    """One put's bytes as views of a read-only shared mapping of the source's file.

    Every view covers exactly bytes the source has just read (and so hashed and counted), from
    its current position on. At most `depth` bytes behind the last view handed out can still be
    in flight (the client's parts); everything before that is dropped from the page cache. The
    pages the client touches while sending are unmapped from this process every 50 ms by the
    trimmer (they stay valid: a file mapping re-reads them on the next touch), so sending costs
    no resident memory beyond them, whatever the part size and concurrency. For a growing
    source a longer mapping replaces the last one when a read passes its end; the earlier ones
    are unmapped as soon as the client has let go of their views.
    """

    def __init__(self, src: MappableSource, depth: int, where: str) -> None:
        self.src = src
        self.where = where
        self.depth = depth
        self._fd = src.fileno()
        self.start = src.tell()
        self.length = os.fstat(self._fd).st_size
        self._map = mmap.mmap(self._fd, self.length, mmap.MAP_SHARED, mmap.PROT_READ)
        self._grows = bool(getattr(src, "grows", False))
        self._old: list[mmap.mmap] = []  # replaced mappings some view may still hold
        self._lock = threading.Lock()
        self.handed = self.start  # end of the last view handed out
        self._trimmed = self.start  # pages before this are out of the mapping and the cache
        self._dropped = 0
        src.hold_cache()

    def remaining(self) -> int:
        return self.length - self.start

    def read_all(self) -> int:
        """Have the source read (hash, count) the rest of the file; how many bytes it gave."""
        buf = bytearray(_READ)
        total = 0
        while got := self.src.readinto(buf):
            total += got
        return total

    def chunks(self) -> Iterator[memoryview]:
        """Views over the source's successive reads, each yielded just after it is read."""
        buf = bytearray(_READ)
        pos = self.start
        while True:
            got = 0
            while got < _VIEW and (n := self.src.readinto(buf)):
                got += n
            if not got:
                return
            yield self.view(pos, got)
            pos += got

    def view(self, pos: int, n: int) -> memoryview:
        """Bytes [pos, pos + n) of the file, which the source has just read."""
        if pos + n > self.length:
            if not self._grows:
                raise PermanentError(f"put {self.where}: the source grew while being sent")
            self._extend(pos + n)
        with self._lock:
            self.handed = pos + n
        return memoryview(self._map)[pos : pos + n]

    def _extend(self, need: int) -> None:
        """Map the growing file to its current end (at least `need` bytes, which the source
        has read and so are final)."""
        length = os.fstat(self._fd).st_size
        if length < need:
            raise PermanentError(f"put {self.where}: the source read past the file's end")
        new = mmap.mmap(self._fd, length, mmap.MAP_SHARED, mmap.PROT_READ)
        with self._lock:
            old, self._map, self.length = self._map, new, length
            old.madvise(mmap.MADV_DONTNEED)  # views of it stay valid: re-read on touch
            self._old.append(old)
            self._release_old()

    def _release_old(self) -> None:
        keep = []
        for old in self._old:
            try:
                old.close()
            except BufferError:
                keep.append(old)  # a view still in flight: tried again at the next trim
        self._old = keep

    def trim(self) -> None:
        """Unmap the pages sent so far (and drop from the cache those surely done with)."""
        with self._lock:
            if self._map.closed:
                return
            if self._old:
                self._release_old()
            lo = _page_floor(max(self.start, self.handed - self.depth - _VIEW))
            if self.handed > lo:
                self._map.madvise(mmap.MADV_DONTNEED, lo, self.handed - lo)
            for old in self._old:  # a growing source's replaced mappings: views still sent
                end = min(len(old), self.handed)
                if end > lo:
                    old.madvise(mmap.MADV_DONTNEED, lo, end - lo)
            done = self.handed - self.depth
            if done > self._dropped:
                fileio.advise(self._fd, self._dropped, done - self._dropped)
                self._dropped = done

    def close(self) -> None:
        """Unmap everything and drop the file's pages; the mapping itself goes when the client
        has let go of its last view (now, after a finished put)."""
        with self._lock:
            if self._map.closed:
                return
            self._map.madvise(mmap.MADV_DONTNEED, 0, self.length)
            self._old.append(self._map)
            self._release_old()  # a view still held somewhere: unmapped when it is released
            self._old.clear()
        fileio.advise(self._fd, 0, 0)


def _page_floor(n: int) -> int:
    return n - n % mmap.PAGESIZE


class _Trimmer:
    """One thread trimming every open MappedBody every 50 ms; it sleeps while there is none."""

    def __init__(self) -> None:
        self._bodies: set[MappedBody] = set()
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None

    def add(self, body: MappedBody) -> None:
        with self._cond:
            self._bodies.add(body)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="ckptd-trim",
                                                daemon=True)
                self._thread.start()
            self._cond.notify()

    def remove(self, body: MappedBody) -> None:
        with self._cond:
            self._bodies.discard(body)

    def _loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: bool(self._bodies))
                bodies = list(self._bodies)
            for body in bodies:
                body.trim()
            with self._cond:
                self._cond.wait(_TRIM_EVERY_S)


TRIMMER = _Trimmer()


def open_body(src: object, size: int | None, depth: int, where: str) -> MappedBody | None:
    """A MappedBody for `src` when it can be mapped (a mappable regular file of at least
    MAP_AT_LEAST bytes), else None: the caller reads it into memory as before."""
    if not isinstance(src, MappableSource) or (size is not None and size < MAP_AT_LEAST):
        return None
    try:
        body = MappedBody(src, depth, where)
    except (OSError, ValueError):
        return None  # not mappable (a pipe, an empty or special file): read it instead
    TRIMMER.add(body)
    return body


def close_body(body: MappedBody) -> None:
    TRIMMER.remove(body)
    body.close()


class PutBody:
    """The bytes of one put: counted, size-checked, read from a file in bounded pieces."""

    def __init__(self, src: Source, size: int | None, where: str,
                 mapped: MappedBody | None = None) -> None:
        self.src = src
        self.size = size
        self.where = where
        self.mapped = mapped
        self.count = 0

    def payload(self, part_size: int, whole: bool) -> Payload:
        """Bytes for a single-request put, or an iterator of chunks for a multipart one."""
        if isinstance(self.src, bytes | bytearray | memoryview):
            self.count = len(self.src)
            self.finish()
            return bytes(self.src)
        if self.mapped is not None:
            return self._mapped(self.mapped, part_size, whole)
        first = self._read_upto(None if whole else part_size + 1)
        if whole or len(first) <= part_size:
            self.finish()
            return first
        return self._chunks(first)

    def finish(self) -> None:
        """Refuse to store an object whose source gave other than the announced size."""
        if self.size is not None and self.count != self.size:
            raise PermanentError(
                f"put {self.where}: source gave {self.count} bytes, expected {self.size}"
            )

    def _mapped(self, m: MappedBody, part_size: int, whole: bool) -> Payload:
        """The source is read through all the same (hashed, counted); what is sent are views
        of the mapping over exactly the bytes read."""
        if whole or m.remaining() <= part_size:
            self.count = self._os(m.read_all)
            self.finish()
            return m.view(m.start, self.count)
        return self._mapped_chunks(m)

    def _mapped_chunks(self, m: MappedBody) -> Iterator[memoryview]:
        chunks = m.chunks()
        while (view := self._os(lambda: next(chunks, None))) is not None:
            self.count += len(view)
            yield view
        self.finish()  # raising before the iterator ends makes obstore abort the upload

    def _os(self, fn: Callable[[], _T]) -> _T:
        try:
            return fn()
        except OSError as exc:
            raise os_error(exc, f"put {self.where}: reading the source") from None

    def _chunks(self, first: bytes) -> Iterator[bytes]:
        yield first
        while chunk := self._read(COPY_CHUNK):
            yield chunk
        # Raising here, before the iterator ends, makes obstore abort the multipart upload.
        self.finish()

    def _read_upto(self, limit: int | None) -> bytes:
        parts: list[bytes] = []
        got = 0
        while limit is None or got < limit:
            want = COPY_CHUNK if limit is None else min(COPY_CHUNK, limit - got)
            chunk = self._read(want)
            if not chunk:
                break
            parts.append(chunk)
            got += len(chunk)
        return b"".join(parts)

    def _read(self, n: int) -> bytes:
        assert not isinstance(self.src, bytes | bytearray | memoryview)
        try:
            chunk = self.src.read(n)
        except OSError as exc:
            raise os_error(exc, f"put {self.where}: reading the source") from None
        self.count += len(chunk)
        return chunk
