"""The object-store backend on obstore: s3:// (any S3-compatible endpoint), gs://, az://, abfs://.

Owns the contract's calls (put, get, ranges, stat, list, delete), each through
`objstore_errors.guard`: no obstore type or exception leaves the backend. The client is built
by `objstore_client`; retries with backoff live in `wrappers`, not here.
"""

from __future__ import annotations

import re
import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, BinaryIO
from urllib.parse import urlsplit

import obstore
from obstore import exceptions as obx

from ckptd.backends.base import (
    COPY_CHUNK,
    DEFAULT_PART_SIZE,
    SMALL_OBJECT_MAX,
    ObjectMeta,
    Source,
    check_key,
    check_prefix,
    check_put_mode,
    check_range,
    join_url,
    os_error,
    past_end,
    too_large,
)
from ckptd.backends.credentials import Creds
from ckptd.backends.mapped import PutBody, close_body, open_body
from ckptd.backends.objstore_client import S3_SCHEMES, open_client
from ckptd.backends.objstore_errors import guard, translate
from ckptd.errors import (
    CorruptData,
    ObjectNotFound,
    PermanentError,
    PreconditionFailed,
    StorageError,
    TransientError,
)

if TYPE_CHECKING:
    from obstore import GetOptions, PutMode

# A get of a larger object fetches ranges this big, `concurrency` of them at once.
_GET_RANGE = 8 << 20

# A ranged GET starting at or past the object's end: HTTP 416 (S3's code InvalidRange), or
# obstore's own check when the store answers a range starting exactly at the end (Azurite).
_UNSATISFIABLE = re.compile(
    r"status(?: code)?: 416\b|<Code>InvalidRange</Code>"
    r"|Wanted range starting at \d+, but object was only \d+ bytes long"
)


class ObstoreBackend:
    """Objects in a bucket under the URL's path prefix; see `Backend` for the rules.

    Timeouts: `connect_timeout_s` for a TCP/TLS connect; `read_timeout_s` for a stalled
    download, stat, list or delete (no byte received for that long); `request_timeout_s` for
    one whole request (one part of an upload, one 8 MiB range of a download), which is
    also what bounds a stalled upload.
    `request_retries` is obstore's own immediate retry of a single failed request (5xx,
    connection errors): it keeps one bad part from restarting a multi-gigabyte upload. Backoff
    across whole operations is `RetryingBackend`'s job; pass 0 to leave every decision to it.
    """

    def __init__(
        self,
        url: str,
        *,
        endpoint: str = "",
        region: str = "",
        access_key_id: str = "",
        secret_access_key: str = "",
        part_size: int = DEFAULT_PART_SIZE,
        concurrency: int = 4,
        connect_timeout_s: float = 10.0,
        read_timeout_s: float = 60.0,
        request_timeout_s: float = 600.0,
        request_retries: int = 2,
    ) -> None:
        if part_size < 5 * 1024 * 1024 and urlsplit(url).scheme in S3_SCHEMES:
            # S3 rejects multipart parts under 5 MiB (except the last): fail here, not mid-upload.
            raise PermanentError(f"part_size {part_size} is below S3's minimum of 5 MiB")
        self.url = url.rstrip("/")
        self._gcs = urlsplit(url).scheme == "gs"  # version tags carry the generation
        self.md5_etags = urlsplit(url).scheme in S3_SCHEMES
        self.part_size = part_size
        self.concurrency = max(1, concurrency)
        creds = Creds(access_key_id, secret_access_key)

        def open_store(read_timeout: float | None) -> Any:
            return open_client(
                self.url, endpoint=endpoint, region=region, creds=creds,
                connect_timeout_s=connect_timeout_s, read_timeout_s=read_timeout,
                request_timeout_s=request_timeout_s, request_retries=request_retries,
            )

        self._range_slots = threading.Semaphore(2 * self.concurrency)
        self._store = guard("open", self.url, lambda: open_store(read_timeout_s))
        # Uploads get their own client without a read timeout: while a part is being sent
        # nothing comes back, so a slow link would look stalled. request_timeout_s bounds them.
        self._put_store = guard("open", self.url, lambda: open_store(None))

    def __repr__(self) -> str:
        return f"ObstoreBackend({self.url!r})"

    # -- the contract ----------------------------------------------------------------------

    def put(
        self,
        key: str,
        src: Source,
        size: int | None = None,
        *,
        create_only: bool = False,
        if_match: str | None = None,
    ) -> ObjectMeta:
        check_key(key)
        where = join_url(self.url, key)
        # A file's pages are sent from a mapping of it, not copies: see mapped.MappedBody.
        mode = _put_mode(create_only, if_match, self._gcs, where)
        whole = mode != "overwrite"  # create-only and If-Match go in one request
        depth = (self.concurrency + 1) * self.part_size
        mapped = None if whole else open_body(src, size, depth, where)
        body = PutBody(src, size, where, mapped)
        try:
            payload = body.payload(self.part_size, whole=whole)
            result = guard(
                "put",
                where,
                lambda: obstore.put(
                    self._put_store,
                    key,
                    payload,
                    mode=mode,
                    chunk_size=self.part_size,
                    max_concurrency=self.concurrency,
                ),
            )
        finally:
            payload = b""
            if body.mapped is not None:
                close_body(body.mapped)
        body.finish()
        return ObjectMeta(key=key, size=body.count, mtime=time.time(), etag=result["e_tag"],
                          version=_version_tag(result, self._gcs))

    def get(self, key: str, dst: BinaryIO, etag: str | None = None) -> int:
        meta = self.stat(key)
        where = join_url(self.url, key)
        # if_match pins every range to `etag`, else to the version stat saw: a concurrent
        # overwrite fails the read (PreconditionFailed) instead of splicing two versions.
        pin = _split_tag(etag)[1] if etag is not None else meta.etag
        ranges = _ranges(meta.size, _GET_RANGE)
        try:
            if len(ranges) == 1:
                written = self._get_into(key, where, _options(pin, None), dst)
            else:
                written = self._get_ranges(key, where, pin, ranges, dst)
        except PreconditionFailed:
            self._raise_if_missing(key)  # Azure answers If-Match on no object with 412
            raise
        if written != meta.size:
            raise TransientError(f"get {where}: got {written} bytes of {meta.size}")
        return written

    def get_bytes(self, key: str, limit: int = SMALL_OBJECT_MAX) -> bytes:
        return self._get_small(key, limit)[0]

    def get_versioned(self, key: str, limit: int = SMALL_OBJECT_MAX) -> tuple[bytes, str]:
        data, etag = self._get_small(key, limit)
        if not etag:
            where = join_url(self.url, key)
            raise PermanentError(f"get {where}: the store gave no ETag, so no conditional put")
        return data, etag

    def get_range(
        self, key: str, start: int, end: int, etag: str | None = None
    ) -> bytes | memoryview:
        """One GET of bytes [start, end) on the read-timeout client, If-Match `etag` when given.

        Answers a read-only memoryview of obstore's `Bytes`: the body as the client received
        it, not copied again (measured on 8 MiB ranges from a local SeaweedFS: `bytes()` took
        a median 5.5 ms, a third of the 16 ms GET; the view a few microseconds). The view
        keeps that immutable buffer alive, so it is safe to hold after the call."""
        check_key(key)
        check_range(key, start, end)
        where = join_url(self.url, key)
        options: GetOptions = {"range": (start, end)}
        if etag is not None:
            options["if_match"] = _split_tag(etag)[1]
        result = self._get_span(key, where, start, end, options)
        size = int(result.meta["size"])
        if end > size:  # the store answered what there is; the body is dropped unread
            raise past_end(where, start, end, size)
        data = memoryview(guard("get", where, result.bytes))
        if len(data) != end - start:
            raise TransientError(
                f"get_range {where}: got {len(data)} bytes of [{start}, {end})"
            )
        return data

    def stat(self, key: str) -> ObjectMeta:
        check_key(key)
        where = join_url(self.url, key)
        return _meta(guard("stat", where, lambda: obstore.head(self._store, key)), self._gcs)

    def list(self, prefix: str = "") -> Iterator[ObjectMeta]:
        start = check_prefix(prefix)
        where = join_url(self.url, start)
        stream = guard("list", where, lambda: obstore.list(self._store, start or None))
        while (batch := guard("list", where, lambda: next(stream, None))) is not None:
            for item in batch:
                yield _meta(item, self._gcs)

    def delete(self, key: str) -> None:
        check_key(key)
        where = join_url(self.url, key)
        try:
            guard("delete", where, lambda: obstore.delete(self._store, key))
        except ObjectNotFound:
            return  # idempotent; a missing *bucket* is a plain PermanentError and still raised

    # -- helpers ---------------------------------------------------------------------------

    def _get_ranges(self, key: str, where: str, pin: str | None,
                    ranges: Sequence[tuple[int, int] | None], dst: BinaryIO) -> int:
        """Fetch `ranges` with up to `concurrency` requests in flight and write them to `dst`
        in order. Fetched ranges wait in memory until written: all gets of this backend
        together hold at most 2 x `concurrency` of them (of _GET_RANGE bytes)."""

        def fetch(rng: tuple[int, int] | None) -> Any:
            result = guard("get", where, lambda: obstore.get(
                self._store, key, options=_options(pin, rng)))
            return guard("get", where, result.bytes)

        written = following = 0
        pending: deque[Future[Any]] = deque()  # each holds one of self._range_slots
        try:
            with ThreadPoolExecutor(self.concurrency, "ckptd-get") as pool:
                try:
                    while True:
                        # Top up, blocking for a slot only when nothing is pending (progress).
                        while (len(pending) < self.concurrency and following < len(ranges)
                               and self._range_slots.acquire(blocking=not pending)):
                            pending.append(pool.submit(fetch, ranges[following]))
                            following += 1
                        if not pending:
                            return written
                        fut = pending.popleft()
                        try:
                            written += _write(dst, memoryview(fut.result()), where)
                        finally:
                            self._range_slots.release()
                finally:
                    for fut in pending:
                        fut.cancel()
        finally:
            for _ in pending:  # cancelled or finished by now: the pool has shut down
                self._range_slots.release()

    def _get_span(
        self, key: str, where: str, start: int, end: int, options: GetOptions
    ) -> Any:
        """The ranged GET's answer (headers read, body not yet): a failed If-Match is
        PreconditionFailed and an unsatisfiable range CorruptData, unlike `guard`'s reading."""
        try:
            return obstore.get(self._store, key, options=options)
        except (obx.BaseError, OSError, ValueError) as exc:
            if isinstance(exc, obx.PreconditionError):
                self._raise_if_missing(key)  # Azure answers If-Match on no object with 412
                raise PreconditionFailed(
                    f"get_range {where}: not version {options.get('if_match')}"
                ) from None
            if _UNSATISFIABLE.search(str(exc)):
                raise CorruptData(
                    f"get_range {where}: bytes [{start}, {end}) start at or past the "
                    "object's end"
                ) from None
            raise translate(exc, "get", where) from None

    def _raise_if_missing(self, key: str) -> None:
        """ObjectNotFound when `key` is gone; any other answer (or error) leaves it to the
        caller's own error."""
        try:
            self.stat(key)
        except ObjectNotFound:
            raise
        except StorageError:
            return

    def _get_small(self, key: str, limit: int) -> tuple[bytes, str | None]:
        """A small object's bytes and ETag. Its size comes with the GET's answer, before the
        body: one over `limit` is refused unread; a body longer than announced is cut off
        after `limit` + 1 bytes."""
        check_key(key)
        where = join_url(self.url, key)
        result = guard("get", where, lambda: obstore.get(self._store, key))
        size = int(result.meta["size"])
        if size > limit:
            raise too_large(where, size, limit)  # the body is never read: dropped unread
        stream = result.stream(min_chunk_size=min(COPY_CHUNK, limit + 1))
        chunks: list[bytes] = []
        got = 0
        while (chunk := guard("get", where, lambda: next(stream, None))) is not None:
            got += len(chunk)
            if got > limit:
                raise too_large(where, f"more than {limit}", limit)
            chunks.append(bytes(chunk))
        if got != size:
            raise TransientError(f"get {where}: got {got} bytes of {size}")
        return b"".join(chunks), _version_tag(result.meta, self._gcs)

    def _get_into(self, key: str, where: str, options: GetOptions, dst: BinaryIO) -> int:
        result = guard("get", where, lambda: obstore.get(self._store, key, options=options))
        stream = result.stream(min_chunk_size=COPY_CHUNK)
        written = 0
        while (chunk := guard("get", where, lambda: next(stream, None))) is not None:
            written += _write(dst, chunk, where)
        return written


def _write(dst: BinaryIO, data: Any, where: str) -> int:
    try:
        dst.write(data)
    except OSError as exc:
        raise os_error(exc, f"get {where}: writing the destination") from None
    return len(data)


def _put_mode(create_only: bool, if_match: str | None, gcs: bool, where: str) -> PutMode:
    """obstore's mode: If-None-Match: * (create), If-Match: <etag> (update), or plain; GCS
    swaps on the generation (x-goog-if-generation-match) that its version tags carry."""
    check_put_mode(create_only, if_match)
    if if_match is not None:
        generation, etag = _split_tag(if_match)
        if gcs and generation is None:
            raise PermanentError(
                f"put {where}: a gs:// swap needs the version tag get_versioned gives, "
                f"not {if_match!r}"
            )
        return {"e_tag": etag, "version": generation} if generation else {"e_tag": etag}
    return "create" if create_only else "overwrite"


# GCS compares a swap with the object's generation, not its ETag: its version tags read
# "<generation>#<etag>", the ETag kept for pinned reads (If-Match). '#' is in no ETag.
_TAG_SEP = "#"


def _version_tag(meta: Any, gcs: bool) -> str | None:
    etag: str | None = meta.get("e_tag")
    generation = meta.get("version") if gcs else None  # S3's and Azure's are version ids
    return f"{generation}{_TAG_SEP}{etag}" if etag and generation else etag


def _split_tag(tag: str) -> tuple[str | None, str]:
    """(generation, etag) of a version tag; no generation outside GCS."""
    generation, sep, etag = tag.partition(_TAG_SEP)
    return (generation, etag) if sep else (None, tag)


def _ranges(size: int, part: int) -> list[tuple[int, int] | None]:
    """None (one plain GET) for small objects, else `part`-sized (start, end) ranges."""
    if size <= part:
        return [None]
    return [(start, min(start + part, size)) for start in range(0, size, part)]


def _options(pin: str | None, rng: tuple[int, int] | None) -> GetOptions:
    options: GetOptions = {"if_match": pin} if pin else {}
    if rng:
        options["range"] = rng
    return options


def _meta(item: Any, gcs: bool) -> ObjectMeta:
    return ObjectMeta(
        key=item["path"],
        size=int(item["size"]),
        mtime=item["last_modified"].timestamp(),
        etag=item.get("e_tag"),
        version=_version_tag(item, gcs),
    )
