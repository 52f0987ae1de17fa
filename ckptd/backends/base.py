"""The storage contract every backend implements, its metadata type and shared helpers.

Owns the rules (docstring of `Backend`), key checks and OS-error classification; does no I/O.
"""

from __future__ import annotations

import errno
from collections.abc import Iterator
from dataclasses import dataclass
from typing import BinaryIO, Protocol, runtime_checkable

from ckptd.errors import BadInput, CorruptData, PermanentError, StorageError, TransientError

MiB = 1024 * 1024
DEFAULT_PART_SIZE = 64 * MiB
# The most bytes `get_bytes`/`get_versioned` return when the caller names no smaller limit.
SMALL_OBJECT_MAX = 64 * MiB
# Largest read or write handed to or taken from a caller's file object in one call.
COPY_CHUNK = 1 * MiB
MAX_KEY_BYTES = 1024  # S3's limit; applied everywhere so a key valid on one backend is on all
# The most bytes one `get_range` returns: one request's answer, held in memory whole.
MAX_RANGE = 256 * MiB

Source = BinaryIO | bytes


@dataclass(frozen=True)
class ObjectMeta:
    """What a backend knows about one stored object.

    `key` is relative to the backend's base prefix. `etag` is the store's entity tag when it gives
    one (S3: MD5 of the content for single-part puts, `<md5-of-md5s>-<parts>` for multipart ones;
    the local backend gives None). `mtime` is seconds since the epoch (for `put`'s result: the
    local clock when the put returned). `version` is the tag a read is pinned to
    (`get_range(etag=)`, `get(etag=)`): the same tag `get_versioned` gives for that version
    (S3, Azure: the ETag; GCS: `<generation>#<etag>`; file://: device, inode, mtime (ns) and
    size). Every backend's `stat` and `list` give it; None only where a store gives no ETag.
    """

    key: str
    size: int
    mtime: float
    etag: str | None = None
    version: str | None = None


@runtime_checkable
class Backend(Protocol):
    """A place to keep objects under '/'-separated relative keys: the whole storage contract.

    Rules every implementation keeps (the conformance suite in tests/backends/test_backends.py
    checks them):

    - Keys are relative, '/'-separated, without empty, "." or ".." segments, at most 1024 bytes
      (`check_key`). They live under the backend's base prefix (a directory or bucket/prefix) and
      nothing is ever read or written outside it. A key is never also the directory of other
      keys ("a" beside "a/b"): object stores allow it, a directory cannot hold it.
    - `put` is atomic: a reader sees the whole new object or the old state, never a part. It is
      idempotent for the same content. It streams a file object in bounded reads (`src` is read
      from its current position to EOF; `size`, when given, must match what is read, else
      PermanentError and nothing is stored). Objects above the backend's part size go up as
      multipart uploads. `create_only=True` raises `ObjectExists` if the key is present and leaves
      the stored object unchanged: the manifest commit relies on this. A create-only object is
      sent in one request, so keep such objects small.
    - Compare-and-swap for small pointers (LATEST): `get_versioned` returns an object's bytes
      with an opaque version tag (S3: its ETag; file://: inode, mtime and size), and
      `put(..., if_match=tag)` stores only if the object is still that version, atomically
      with respect to other conditional puts, else raises `PreconditionFailed` (also when the
      object is gone) and changes nothing. Sent in one request; not combined with
      `create_only` (which is the way to create such an object).
    - `get` streams the object into `dst` (bounded memory) and returns the byte count. It reads
      one version: an object replaced or rewritten while it is read is `PreconditionFailed`
      (never bytes of two versions), and with `etag` (a version tag) it reads only that
      version, another one being `PreconditionFailed` too. `get_bytes` and `get_versioned`
      are for small objects only and take a `limit`: an object over it is refused with
      `BadInput` naming the key, found from the size the store reports (fstat, the GET's
      metadata) before the body is read, and no more than `limit` + 1 bytes are ever read,
      whatever the object claims or grows to.
    - Reading never blocks on what is not an object: file:// opens non-blocking and never
      through a link, so a FIFO, device, directory or symlink under a key is refused at once
      (`ObjectNotFound`, as `stat` and `list` do not show it either).
    - `get_range(key, start, end, etag)` returns exactly the bytes [start, end) in one request
      (0 <= start < end, end - start <= MAX_RANGE, else ValueError). With `etag` (the version
      tag `get_versioned` and `stat` give: S3's ETag, file://'s device/inode/mtime/size tag)
      it reads only that version: another one is `PreconditionFailed`. A range reaching past
      the object's end is `CorruptData` naming the key and range (the caller's map of the
      object is wrong); an answer shorter than asked is `TransientError`. file:// reads with
      pread from a descriptor opened as `get` opens it (no link followed, regular files only).
    - `stat` gives size, etag (where the store has one), mtime and the version tag reads are
      pinned with (`ObjectMeta.version`), on every backend.
    - `list(prefix)` yields every object under the directory-like `prefix` ("" = everything;
      "a/b" matches "a/b/c", not "a/bc"), recursively. Order is not part of the contract.
    - `delete` is idempotent: deleting a missing key is not an error.
    - Every error is `TransientError` (retrying later may help) or `PermanentError` (it will
      not); a missing object is `ObjectNotFound` (a PermanentError); a failed `if_match` is
      `PreconditionFailed` (neither: re-read, then decide). No store library's own
      exception types escape a backend.
    - Backends never retry on their own beyond a few immediate per-request retries documented
      by the implementation; backoff, bandwidth caps and concurrency limits are wrappers
      (`ckptd.backends.wrappers`) that work on any backend.
    - Instances are safe to share between threads.
    """

    @property
    def url(self) -> str:
        """Where the objects live, for messages and logs (never holds credentials)."""
        ...

    @property
    def part_size(self) -> int:
        """Objects larger than this go up as multipart uploads of parts this big."""
        ...

    @property
    def md5_etags(self) -> bool:
        """True when the etag a put gives is S3's: the MD5 of a single-part object's bytes, the
        MD5 of its parts' MD5s and `-<parts>` for a multipart one (S3 and compatibles,
        unencrypted or SSE-S3). The upload checks sent bytes against it; GCS and Azure etags
        are opaque and file:// has none: False."""
        ...

    def put(
        self,
        key: str,
        src: Source,
        size: int | None = None,
        *,
        create_only: bool = False,
        if_match: str | None = None,
    ) -> ObjectMeta:
        """Store `src` (bytes, or a binary file object read to EOF) under `key`, atomically."""
        ...

    def get_versioned(self, key: str, limit: int = SMALL_OBJECT_MAX) -> tuple[bytes, str]:
        """A small object's bytes (at most `limit`, else BadInput) and the version tag
        `put(if_match=...)` compares."""
        ...

    def get(self, key: str, dst: BinaryIO, etag: str | None = None) -> int:
        """Write the object's bytes (of version `etag` when given) to `dst`; return how many
        were written."""
        ...

    def get_bytes(self, key: str, limit: int = SMALL_OBJECT_MAX) -> bytes:
        """The whole object in memory: for small objects (manifests, pointers). An object
        over `limit` bytes is BadInput naming the key, refused before its body is read."""
        ...

    def get_range(
        self, key: str, start: int, end: int, etag: str | None = None
    ) -> bytes | memoryview:
        """Exactly the object's bytes [start, end), of version `etag` when given. A read-only
        buffer safe to keep after the call: the object store answers a view of the client's
        own buffer instead of copying it (see `ObstoreBackend.get_range`)."""
        ...

    def stat(self, key: str) -> ObjectMeta:
        """Metadata of one object; `ObjectNotFound` if absent."""
        ...

    def list(self, prefix: str = "") -> Iterator[ObjectMeta]:
        """Every object under `prefix` (directory-like), recursively."""
        ...

    def delete(self, key: str) -> None:
        """Remove the object; a missing key is fine."""
        ...


def check_key(key: str) -> str:
    """Return `key` if it is a valid relative key, else raise PermanentError naming it."""
    if not isinstance(key, str) or not key:
        raise PermanentError(f"invalid storage key {key!r}: empty")
    if len(key.encode("utf-8", "surrogatepass")) > MAX_KEY_BYTES:
        raise PermanentError(f"invalid storage key {key[:60]!r}...: longer than 1024 bytes")
    if "\x00" in key or "\\" in key:
        raise PermanentError(f"invalid storage key {key!r}: contains NUL or backslash")
    for part in key.split("/"):
        if part in ("", ".", ".."):
            raise PermanentError(
                f"invalid storage key {key!r}: use relative '/'-separated names without "
                "empty, '.' or '..' parts"
            )
    return key


def check_prefix(prefix: str) -> str:
    """A list prefix: "" (everything) or a key, with trailing slashes dropped."""
    stripped = prefix.rstrip("/")
    return check_key(stripped) if stripped else ""


def bare(etag: str) -> str:
    """An etag without its quotes and case: stores quote it, some in upper case."""
    return etag.strip().strip('"').lower()


def same_object(a: ObjectMeta, b: ObjectMeta) -> bool:
    """Are `a` and `b` the same stored object (same size, and same etag, else same mtime)?"""
    # A listing's mtime is finer than a HEAD's on S3: compare mtimes only where there is no etag.
    if a.size != b.size:
        return False
    if a.etag and b.etag:
        return bare(a.etag) == bare(b.etag)
    return a.etag is None and b.etag is None and a.mtime == b.mtime


def check_put_mode(create_only: bool, if_match: str | None) -> None:
    """Refuse a put that is both create-only and conditional on a version."""
    if create_only and if_match is not None:
        raise PermanentError("a put is create-only or conditional on a version, not both")


def check_range(key: str, start: int, end: int) -> None:
    """Refuse a `get_range` span that is empty, negative or over MAX_RANGE (ValueError)."""
    if not (isinstance(start, int) and isinstance(end, int)):
        raise ValueError(f"get_range {key!r}: start and end must be integers")
    if not 0 <= start < end or end - start > MAX_RANGE:
        raise ValueError(
            f"get_range {key!r}: [{start}, {end}) is not a range of 1 to {MAX_RANGE} bytes "
            "starting at 0 or later"
        )


def past_end(where: str, start: int, end: int, size: int) -> CorruptData:
    """The error of a range that reaches past the object's end."""
    return CorruptData(
        f"get_range {where}: bytes [{start}, {end}) reach past the object's end ({size} bytes)"
    )


def too_large(where: str, size: int | str, limit: int) -> BadInput:
    """The error of a small-object read over its limit."""
    return BadInput(f"{where}: {size} bytes, over the limit of {limit} for this read")


def join_url(url: str, key: str) -> str:
    """`url` and `key` joined for messages."""
    return f"{url.rstrip('/')}/{key}" if key else url


# errnos where trying again cannot help; everything else (EIO, ENOSPC, ESTALE, ETIMEDOUT, ...)
# may clear up, for instance when an NFS server comes back or a prune frees space.
_PERMANENT_ERRNOS = frozenset(
    {
        errno.EACCES,
        errno.EPERM,
        errno.EROFS,
        errno.ENOTDIR,
        errno.EISDIR,
        errno.ENAMETOOLONG,
        errno.EINVAL,
        errno.ELOOP,
        errno.EXDEV,
        errno.EBADF,
        errno.EFBIG,
        errno.EOPNOTSUPP,
        errno.ENOTSUP,
    }
)


def os_error(exc: OSError, what: str) -> StorageError:
    """Translate an OSError met while doing `what` into a transient or permanent StorageError."""
    detail = exc.strerror or str(exc)
    message = f"{what}: {detail}"
    if exc.errno in _PERMANENT_ERRNOS:
        return PermanentError(message)
    return TransientError(message)
