"""Reading a file once: the bounded read pass feeding every sink (the content hash among them),
exact positional reads, and the open-file limit a step's members need. Never writes a file;
a root's member is read through the descriptor `open_beneath` gave, never opened by name here.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence
from typing import Protocol

import xxhash

from ckptd.errors import ValidationFailed
from ckptd.fileio.cache import advise
from ckptd.model import Reason

CHUNK_SIZE = 8 << 20
HASH_ALG = "xxh3-128"
# Drop cached pages in steps of this many bytes rather than after every chunk: one syscall per
# step keeps the pass cheap while the cache footprint stays a few chunks.
_DROP_STEP = 64 << 20
_MIN_BUFFER = 64 << 10  # the smallest read_pass buffer


class Sink(Protocol):
    """Consumer of one read pass. `view` is only valid during the call (the buffer is reused)."""

    def update(self, offset: int, view: memoryview) -> None: ...

    def finish(self, total: int) -> None: ...


class HashSink:
    """The content hash of a file (xxh3-128, hex), named in manifests as `HASH_ALG`."""

    alg = HASH_ALG

    def __init__(self) -> None:
        self._h = xxhash.xxh3_128()
        self.digest = ""
        self.size = 0

    def update(self, offset: int, view: memoryview) -> None:
        self._h.update(view)

    def finish(self, total: int) -> None:
        self.size = total
        self.digest = self._h.hexdigest()


def read_pass(
    path: str | os.PathLike[str],
    sinks: Sequence[Sink],
    chunk_size: int = CHUNK_SIZE,
    drop_cache: bool = True,
    fd: int | None = None,
) -> int:
    """Read `path` once, front to back, handing each chunk to every sink; return bytes read.

    With `fd`, reads that open descriptor (from its start) instead of opening `path`, which
    then only names the file in messages. Memory is one reused buffer of `chunk_size`. With
    `drop_cache`, pages behind the cursor are dropped from the page cache as the pass goes, so
    validating a checkpoint does not evict the training job's data. Raises
    ValidationFailed(reason "changed") when the file's size changes during the pass; OSError
    as is; whatever a sink raises stops the pass.
    """
    if chunk_size <= 0:
        raise ValueError("chunk_size must be positive")
    own = fd is None
    if fd is None:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    else:
        os.lseek(fd, 0, os.SEEK_SET)  # the caller's descriptor (`open_beneath`), from the top
    try:
        size_at_open = os.fstat(fd).st_size
        advise(fd, 0, 0, "POSIX_FADV_SEQUENTIAL")
        # A buffer no bigger than the file (+1 so one read finds its end): a fresh 8 MiB
        # buffer per 60 KiB file was 0.6 ms of zeroing each, most of a small file's read.
        buf_size = min(chunk_size, max(size_at_open + 1, _MIN_BUFFER))
        total = _stream(fd, sinks, buf_size, drop_cache)
        if total != size_at_open or os.fstat(fd).st_size != total:
            raise ValidationFailed(
                Reason.CHANGED, f"{path} changed size while being read", str(path)
            )
    finally:
        if own:
            os.close(fd)
    for sink in sinks:
        sink.finish(total)
    return total


def _stream(fd: int, sinks: Sequence[Sink], chunk_size: int, drop_cache: bool) -> int:
    buf = memoryview(bytearray(chunk_size))
    offset = dropped = 0
    try:
        while n := os.readv(fd, [buf]):
            with buf[:n] as view:
                for sink in sinks:
                    sink.update(offset, view)
            offset += n
            if drop_cache and offset - dropped >= _DROP_STEP:
                advise(fd, dropped, offset - dropped, "POSIX_FADV_DONTNEED")
                dropped = offset
    finally:
        if drop_cache and offset > dropped:
            advise(fd, dropped, offset - dropped, "POSIX_FADV_DONTNEED")
    return offset


def pread_exact(fd: int, offset: int, n: int) -> bytes:
    """Up to `n` bytes at `offset` (fewer only at end of file)."""
    parts: list[bytes] = []
    got = 0
    while got < n:
        part = os.pread(fd, n - got, offset + got)
        if not part:
            break
        parts.append(part)
        got += len(part)
    return b"".join(parts)


def raise_open_file_limit() -> int:
    """Raise this process's soft limit on open files to its hard limit; return the limit in
    force. Validation holds every file of a step open at once (a file swapped after it was
    opened is never what gets read), so a 10,000-file DCP step needs more than the 1,024 a
    login shell or a Slurm step often starts with; the hard limit is the administrator's."""
    try:
        import resource
    except ImportError:  # not on this platform: nothing to raise
        return 1 << 20
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else 1 << 20
    if soft == resource.RLIM_INFINITY or soft >= want:
        return want if soft == resource.RLIM_INFINITY else soft
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        return want
    return soft


def open_file_limit() -> int:
    """The soft limit on open files in force now (1 << 20 where there is none)."""
    try:
        import resource
    except ImportError:
        return 1 << 20
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return 1 << 20 if soft == resource.RLIM_INFINITY else soft
