"""Behaviour that wraps any backend: retries with backoff, a bandwidth cap, a concurrency cap.

Each wrapper is itself a `Backend`; none knows which implementation it wraps.
"""

from __future__ import annotations

import io
import random
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, BinaryIO, TypeVar, cast

from ckptd.backends.base import SMALL_OBJECT_MAX, Backend, ObjectMeta, Source, os_error
from ckptd.errors import BadInput, ObjectExists, TransientError
from ckptd.log import get_logger

T = TypeVar("T")

# A create-only put whose earlier attempt may have landed is confirmed by comparing content;
# only worth it (and only cheap) for small objects such as manifests.
_CONFIRM_LIMIT = 16 * 1024 * 1024


class _Delegating:
    """Forwards the contract's attributes to the wrapped backend."""

    def __init__(self, inner: Backend) -> None:
        self.inner = inner

    @property
    def url(self) -> str:
        return self.inner.url

    @property
    def part_size(self) -> int:
        return self.inner.part_size

    @property
    def md5_etags(self) -> bool:
        return self.inner.md5_etags

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.inner!r})"


# -- retries ------------------------------------------------------------------------------


class RetryingBackend(_Delegating):
    """Retries TransientError with exponential backoff and full jitter; PermanentError at once.

    Attempt k (1-based) that fails transiently is followed by a sleep of
    `rng() * min(max_delay, base_delay * 2**(k-1))`, up to `attempts` attempts in all. Each
    retry logs `storage_retry` (op, key, attempt, error, delay_s); exhausting the attempts
    logs `storage_gave_up`. A retried put rewinds a seekable source to where the first attempt
    started; a non-seekable source is not retried. A retried get rewinds and truncates a
    seekable destination; a non-seekable one is retried only if nothing was written yet. A
    `get_range` holds nothing between attempts: it is simply asked again.
    PreconditionFailed is not retried: a conditional put whose lost answer hid its success
    meets it on the retry, and the caller's re-read then finds its own write.
    """

    def __init__(
        self,
        inner: Backend,
        attempts: int = 5,
        base_delay: float = 0.5,
        max_delay: float = 30.0,
        sleep: Callable[[float], None] = time.sleep,
        rng: Callable[[], float] = random.random,
    ) -> None:
        super().__init__(inner)
        self.attempts = max(1, attempts)
        self.base_delay = base_delay
        self.max_delay = max_delay
        self._sleep = sleep
        self._rng = rng

    def put(
        self,
        key: str,
        src: Source,
        size: int | None = None,
        *,
        create_only: bool = False,
        if_match: str | None = None,
    ) -> ObjectMeta:
        rewind = _rewinder(src)
        failed_before = False

        def attempt(n: int) -> ObjectMeta:
            nonlocal failed_before
            if n > 1:
                failed_before = True
                assert rewind is not None
                rewind()
            return self.inner.put(key, src, size, create_only=create_only, if_match=if_match)

        try:
            return self._run("put", key, attempt, can_retry=rewind is not None)
        except ObjectExists:
            # An earlier attempt may have landed with only its answer lost; then the object
            # there is ours and the create succeeded.
            if create_only and failed_before and rewind and self._is_ours(key, src, rewind):
                get_logger().info("storage_create_confirmed", key=key)
                return self.inner.stat(key)
            raise

    def get(self, key: str, dst: BinaryIO, etag: str | None = None) -> int:
        guard = _DestinationGuard(dst)

        def attempt(n: int) -> int:
            if n > 1:
                guard.reset()
            return self.inner.get(key, guard.writer, etag=etag)

        return self._run("get", key, attempt, can_retry=True, retry_ok=guard.can_reset)

    def get_bytes(self, key: str, limit: int = SMALL_OBJECT_MAX) -> bytes:
        return self._run("get", key, lambda _n: self.inner.get_bytes(key, limit))

    def get_versioned(self, key: str, limit: int = SMALL_OBJECT_MAX) -> tuple[bytes, str]:
        return self._run("get", key, lambda _n: self.inner.get_versioned(key, limit))

    def get_range(
        self, key: str, start: int, end: int, etag: str | None = None
    ) -> bytes | memoryview:
        return self._run("get", key, lambda _n: self.inner.get_range(key, start, end, etag))

    def stat(self, key: str) -> ObjectMeta:
        return self._run("stat", key, lambda _n: self.inner.stat(key))

    def list(self, prefix: str = "") -> Iterator[ObjectMeta]:
        # Collected per attempt so a listing cut off halfway is redone, never yielded twice.
        yield from self._run("list", prefix, lambda _n: list(self.inner.list(prefix)))

    def delete(self, key: str) -> None:
        self._run("delete", key, lambda _n: self.inner.delete(key))

    def delay(self, attempt: int) -> float:
        """Sleep after failed attempt `attempt` (1-based): full jitter over a capped exponential."""
        ceiling = min(self.max_delay, self.base_delay * (2 ** (attempt - 1)))
        return float(ceiling * self._rng())

    def _run(
        self,
        op: str,
        key: str,
        fn: Callable[[int], T],
        can_retry: bool = True,
        retry_ok: Callable[[], bool] = lambda: True,
    ) -> T:
        for n in range(1, self.attempts + 1):
            try:
                return fn(n)
            except TransientError as exc:
                if n == self.attempts or not can_retry or not retry_ok():
                    if n > 1:
                        get_logger().warning(
                            "storage_gave_up", op=op, key=key, attempts=n, error=str(exc)
                        )
                    raise
                wait = self.delay(n)
                get_logger().warning(
                    "storage_retry", op=op, key=key, attempt=n, error=str(exc), delay_s=wait
                )
                self._sleep(wait)
        raise AssertionError("unreachable: the last attempt returns or raises")

    def _is_ours(self, key: str, src: Source, rewind: Callable[[], None]) -> bool:
        if isinstance(src, bytes | bytearray | memoryview):
            mine = bytes(src)
        else:
            rewind()
            try:
                mine = src.read(_CONFIRM_LIMIT + 1)
            except OSError:
                return False
        if len(mine) > _CONFIRM_LIMIT:
            return False
        try:
            return self.inner.get_bytes(key, _CONFIRM_LIMIT) == mine
        except (TransientError, BadInput):
            return False  # cannot tell: report the conflict rather than guess


def _rewinder(src: Source) -> Callable[[], None] | None:
    """A callable putting `src` back where it is now, or None if that is impossible."""
    if isinstance(src, bytes | bytearray | memoryview):
        return lambda: None
    try:
        if not src.seekable():
            return None
        start = src.tell()
    except (OSError, ValueError, AttributeError):
        return None
    return lambda: _seek(src, start)


def _seek(f: BinaryIO, pos: int) -> None:
    try:
        f.seek(pos)
    except OSError as exc:
        raise os_error(exc, "rewinding the source for a retry") from None


class _DestinationGuard:
    """Lets a retried get start over: rewind+truncate, or 'nothing written yet'."""

    def __init__(self, dst: BinaryIO) -> None:
        self.dst = dst
        self.writer = cast(BinaryIO, _CountingWriter(dst))
        self._start: int | None = None
        try:
            if dst.seekable():
                self._start = dst.tell()
        except (OSError, ValueError, AttributeError):
            self._start = None

    def can_reset(self) -> bool:
        return self._start is not None or cast(_CountingWriter, self.writer).count == 0

    def reset(self) -> None:
        if self._start is not None:
            self.dst.seek(self._start)
            self.dst.truncate()


class _CountingWriter(io.RawIOBase):
    def __init__(self, dst: BinaryIO) -> None:
        self.dst = dst
        self.count = 0

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        written = self.dst.write(data)
        self.count += len(data)
        return written if written is not None else len(data)


# -- bandwidth ----------------------------------------------------------------------------


class TokenBucket:
    """A rate limit in bytes/s shared by every transfer that draws from it (thread-safe).

    `take(n)` reserves n bytes and sleeps until the bucket has paid for them: reservations queue
    up as debt, so concurrent transfers share the rate instead of each getting it. At most
    `burst_s` seconds' worth of unused allowance is saved up.
    """

    def __init__(
        self,
        rate: float,
        burst_s: float = 0.25,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if rate <= 0:
            raise ValueError(f"bandwidth cap must be positive, got {rate}")
        self.rate = float(rate)
        self.capacity = self.rate * burst_s
        self._tokens = self.capacity
        self._clock = clock
        self._sleep = sleep
        self._last = clock()
        self._lock = threading.Lock()

    def take(self, n: int) -> None:
        with self._lock:
            now = self._clock()
            self._tokens = min(self.capacity, self._tokens + (now - self._last) * self.rate)
            self._last = now
            self._tokens -= n
            wait = -self._tokens / self.rate if self._tokens < 0 else 0.0
        if wait > 0:
            self._sleep(wait)


class ThrottledBackend(_Delegating):
    """Caps the bytes/s streamed by put and the gets across all transfers through this instance.

    The cap applies where bytes enter (a put's source reads) or leave (a get's destination
    writes) the backend; a store that buffers a part before sending it bursts within a part
    but keeps the average.
    """

    def __init__(self, inner: Backend, max_bytes_per_s: float, burst_s: float = 0.25) -> None:
        super().__init__(inner)
        self.bucket = TokenBucket(max_bytes_per_s, burst_s)

    def put(
        self,
        key: str,
        src: Source,
        size: int | None = None,
        *,
        create_only: bool = False,
        if_match: str | None = None,
    ) -> ObjectMeta:
        if isinstance(src, bytes | bytearray | memoryview):
            src = cast(BinaryIO, io.BytesIO(src))
        reader = cast(BinaryIO, _ThrottledReader(src, self.bucket))
        return self.inner.put(key, reader, size, create_only=create_only, if_match=if_match)

    def get(self, key: str, dst: BinaryIO, etag: str | None = None) -> int:
        return self.inner.get(key, cast(BinaryIO, _ThrottledWriter(dst, self.bucket)),
                              etag=etag)

    def get_bytes(self, key: str, limit: int = SMALL_OBJECT_MAX) -> bytes:
        data = self.inner.get_bytes(key, limit)
        self.bucket.take(len(data))
        return data

    def get_versioned(self, key: str, limit: int = SMALL_OBJECT_MAX) -> tuple[bytes, str]:
        data, version = self.inner.get_versioned(key, limit)
        self.bucket.take(len(data))
        return data, version

    def get_range(
        self, key: str, start: int, end: int, etag: str | None = None
    ) -> bytes | memoryview:
        data = self.inner.get_range(key, start, end, etag)
        self.bucket.take(len(data))
        return data

    def stat(self, key: str) -> ObjectMeta:
        return self.inner.stat(key)

    def list(self, prefix: str = "") -> Iterator[ObjectMeta]:
        return self.inner.list(prefix)

    def delete(self, key: str) -> None:
        self.inner.delete(key)


class _ThrottledReader(io.RawIOBase):
    def __init__(self, src: BinaryIO, bucket: TokenBucket) -> None:
        self.src = src
        self.bucket = bucket

    def readable(self) -> bool:
        return True

    def read(self, n: int | None = -1) -> bytes:
        data = self.src.read(-1 if n is None else n)
        self.bucket.take(len(data))
        return data

    def seekable(self) -> bool:
        return self.src.seekable()

    def seek(self, pos: int, whence: int = 0) -> int:
        return self.src.seek(pos, whence)

    def tell(self) -> int:
        return self.src.tell()


class _ThrottledWriter(io.RawIOBase):
    def __init__(self, dst: BinaryIO, bucket: TokenBucket) -> None:
        self.dst = dst
        self.bucket = bucket

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        self.bucket.take(len(data))
        written = self.dst.write(data)
        return written if written is not None else len(data)


# -- concurrency --------------------------------------------------------------------------


class LimitedBackend(_Delegating):
    """At most `concurrency` transfers (put, get, get_bytes, get_range) at once through this
    instance."""

    def __init__(self, inner: Backend, concurrency: int) -> None:
        super().__init__(inner)
        self.concurrency = max(1, concurrency)
        self._slots = threading.BoundedSemaphore(self.concurrency)

    def put(
        self,
        key: str,
        src: Source,
        size: int | None = None,
        *,
        create_only: bool = False,
        if_match: str | None = None,
    ) -> ObjectMeta:
        with self._slots:
            return self.inner.put(key, src, size, create_only=create_only, if_match=if_match)

    def get(self, key: str, dst: BinaryIO, etag: str | None = None) -> int:
        with self._slots:
            return self.inner.get(key, dst, etag=etag)

    def get_bytes(self, key: str, limit: int = SMALL_OBJECT_MAX) -> bytes:
        with self._slots:
            return self.inner.get_bytes(key, limit)

    def get_versioned(self, key: str, limit: int = SMALL_OBJECT_MAX) -> tuple[bytes, str]:
        with self._slots:
            return self.inner.get_versioned(key, limit)

    def get_range(
        self, key: str, start: int, end: int, etag: str | None = None
    ) -> bytes | memoryview:
        with self._slots:
            return self.inner.get_range(key, start, end, etag)

    def stat(self, key: str) -> ObjectMeta:
        return self.inner.stat(key)

    def list(self, prefix: str = "") -> Iterator[ObjectMeta]:
        return self.inner.list(prefix)

    def delete(self, key: str) -> None:
        self.inner.delete(key)
