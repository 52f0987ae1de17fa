"""Reading a stored object back, a local copy's or a remote one's: the codec's stream decoded
and checked against its manifest entry (size and content hash), the original bytes handed to a
writer if given. Never more bytes than the manifest says, so a corrupt object cannot fill a disk.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, cast

from ckptd import fileio
from ckptd.codec import decode_stream, read_threads
from ckptd.errors import CorruptData
from ckptd.fileio import HASH_ALG, DropBehindReader, DurableWriter, HashSink
from ckptd.remote.manifest import StoredFile

Progress = Callable[[int], None]


@dataclass(frozen=True)
class Decoding:
    """How one object's blocks are decoded: on `threads` threads of `pool` (a pool shared by
    the objects decoded at once), or on the caller's thread alone."""

    threads: int = 1
    pool: ThreadPoolExecutor | None = None


ONE_THREAD = Decoding()


@contextmanager
def every_core() -> Iterator[Decoding]:
    """A decode pool of the cores this process may use, for readers the user waits for
    (`ckptd restore`): each object decodes on all of them, at most threads + 1 blocks held
    per object; the daemon's own decodes stay on one thread (`ONE_THREAD`)."""
    threads = read_threads()
    if threads == 1:
        yield ONE_THREAD
        return
    with ThreadPoolExecutor(threads, "ckptd-decode") as pool:
        yield Decoding(threads, pool)


class _Checker:
    """The decoder's output: hashes and counts the original bytes, refuses more than expected
    (a corrupt object must not fill a disk), and forwards them to `out` if given."""

    def __init__(self, f: StoredFile, out: DurableWriter | None, progress: Progress | None):
        self.f, self.out, self.progress = f, out, progress
        self.hash = HashSink()
        self.size = 0

    def write(self, data: bytes | memoryview) -> int:
        n = len(data)
        if self.size + n > self.f.size:
            raise CorruptData(f"{self.f.path}: decodes to more than its {self.f.size} bytes")
        self.hash.update(self.size, memoryview(data))
        self.size += n
        if self.out is not None:
            self.out.write(data)
        if self.progress is not None:
            self.progress(n)
        return n

    def check(self) -> None:
        self.hash.finish(self.size)
        f = self.f
        if self.size != f.size:
            raise CorruptData(f"{f.path}: decodes to {self.size} bytes, the manifest says {f.size}")
        if self.hash.digest != f.hash:
            raise CorruptData(f"{f.path}: content hash mismatch (decoded {self.hash.digest}, "
                              f"manifest {f.hash}): the stored object {f.key} is corrupt")


def decode_object(
    src: Path, f: StoredFile, out: DurableWriter | None = None, progress: Progress | None = None,
    decoding: Decoding = ONE_THREAD,
) -> None:
    """Decode the stored object at `src` (streaming), checking size and hash against `f`;
    the original bytes go to `out` when given. Raises CorruptData naming the file."""
    if f.hash_alg != HASH_ALG:
        raise CorruptData(f"{f.path}: hash algorithm {f.hash_alg!r} is not {HASH_ALG!r}")
    fd = os.open(src, os.O_RDONLY | os.O_CLOEXEC)
    try:
        stored = os.fstat(fd).st_size
        if stored != f.stored_size:
            raise CorruptData(f"{f.path}: stored object {f.key} has {stored} bytes, the "
                              f"manifest says {f.stored_size}")
        decode_checked(cast(BinaryIO, DropBehindReader(fd)), f, out, progress, decoding)
    finally:
        fileio.advise(fd, 0, 0)
        os.close(fd)


def decode_checked(src: BinaryIO, f: StoredFile, out: DurableWriter | None = None,
                   progress: Progress | None = None, decoding: Decoding = ONE_THREAD) -> None:
    """Decode the stored object read from `src` (streaming), checking size and hash against
    `f`; the original bytes go to `out` when given. Raises CorruptData naming the file.
    `decoding` says on how many threads (and which pool) one object's blocks decode."""
    if f.hash_alg != HASH_ALG:
        raise CorruptData(f"{f.path}: hash algorithm {f.hash_alg!r} is not {HASH_ALG!r}")
    checker = _Checker(f, out, progress)
    try:
        decode_stream(f.codec, src, cast(BinaryIO, checker), threads=decoding.threads,
                      pool=decoding.pool)
    except CorruptData as exc:
        if str(exc).startswith(f"{f.path}: "):
            raise
        raise CorruptData(f"{f.path}: stored object {f.key} is corrupt: {exc}") from exc
    checker.check()
