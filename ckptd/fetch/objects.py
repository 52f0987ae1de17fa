"""Reading one remote file by ranges: only the blocks a raw range needs are fetched (the codec's
block index), each checked as it is decoded and handed to a sink in raw order; a file read
whole is also checked against its manifest hash. Holds a bounded window of blocks; writes
nothing, and decides nothing about which files or ranges are wanted (the loaders do).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, BinaryIO, cast

import numpy as np

from ckptd.backends import Backend
from ckptd.codec.index import TAIL_PROBE, Block, BlockIndex, decode_block, read_index
from ckptd.copies.decode import decode_checked
from ckptd.errors import (
    CorruptData,
    NotFound,
    ObjectNotFound,
    ObjectReplaced,
    PermanentError,
    PreconditionFailed,
)
from ckptd.fetch.pipe import Pipe
from ckptd.fetch.spans import Spans, when_done
from ckptd.fileio import HASH_ALG, HashSink
from ckptd.remote.manifest import StoredFile

# (raw offset, bytes) in ascending raw order; the view is only valid during the call.
Sink = Callable[[int, memoryview], None]
# (raw offset, length) -> memory those bytes go to, or None: see ObjectReader.read.
Place = Callable[[int, int], memoryview | None]
Ranges = list[tuple[int, int]]

# An object this small is fetched with one GET and decoded as a stream: a ranged read would
# cost a request for its index and gain nothing.
WHOLE_BELOW = 4 << 20
# No stored byte of a codec ckptd writes decodes to more bytes than this: zstd's own limit (a
# 4-byte RLE block holds at most 128 KiB), which the container's zstd-coded blocks inherit.
MAX_EXPANSION = 1 << 15

# What a read says of the object it reads (after the object's URL), the same on every path.
MISSING = "the object the manifest names is missing"
REPLACED = ("the object was replaced while it was read (the version the read started on is "
            "gone; nothing of the new one was used)")


@dataclass
class ReadStats:
    """What the reads of one loader cost: stored bytes fetched, requests made, blocks decoded."""

    stored_bytes: int = 0
    requests: int = 0
    blocks: int = 0
    placed: int = 0  # blocks decoded straight into their destination
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def count(self, stored: int, requests: int = 1, blocks: int = 0, placed: int = 0) -> None:
        with self._lock:
            self.stored_bytes += stored
            self.requests += requests
            self.blocks += blocks
            self.placed += placed


def merge(ranges: Iterable[tuple[int, int]]) -> Ranges:
    """Sorted ranges with overlapping or touching ones joined; empty ones dropped."""
    out: Ranges = []
    for start, end in sorted(r for r in ranges if r[1] > r[0]):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


class ObjectReader:
    """One stored file of a remote step. `read(ranges, sink)` gives the sink the original
    bytes of `ranges` (all of the file when None) in raw order, each block checked; a read of
    the whole file is checked against the manifest's size and hash too.

    The first look at the object (`check`: one HEAD, before anything is read or allocated)
    compares it with the manifest and takes its version; every read after it, ranged or
    streamed, is pinned to that version. Errors name the object's URL: NotFound when it is
    gone, ObjectReplaced (a NotFound) when it was replaced after the first look, CorruptData
    when its bytes or sizes are not what the manifest says."""

    def __init__(self, backend: Backend, key: str, f: StoredFile, pool: ThreadPoolExecutor,
                 stats: ReadStats, window: int, slots: threading.Semaphore | None = None,
                 fetcher: ThreadPoolExecutor | None = None) -> None:
        self.backend, self.key, self.f = backend, key, f
        self.pool, self.stats, self.window = pool, stats, max(1, window)
        # Span fetches run apart from decoding: a decoding thread waits on its spans, so the
        # two must not share one pool (all its threads could be waiting).
        self.fetcher = fetcher or pool
        self.slots = slots or threading.Semaphore(self.window)
        self.where = f"{backend.url.rstrip('/')}/{key}"
        self._index: BlockIndex | None = None
        self._index_read = False
        self._pin: str | None = None
        self._looked = False
        self._lock = threading.Lock()

    # -- the first look ----------------------------------------------------------------------

    def check(self) -> int:
        """The first look at the object, taken once: the file's raw size, safe to allocate.

        One HEAD: NotFound when the object is gone; CorruptData when it does not hold the
        manifest's `stored_size` bytes (bytes appended after a valid object would otherwise go
        unseen by ranged reads) or when the manifest's `size` could not come out of them
        (codec `none`: the same size; any other: at most MAX_EXPANSION times it; an indexed
        object's index then ties it exactly). Its version is kept: every later read is pinned
        to it, so an object replaced mid-read fails instead of mixing two."""
        with self._lock:
            self._look()
        return self.f.size

    def _look(self) -> None:
        """`check`'s work; the caller holds `_lock`."""
        if self._looked:
            return
        f = self.f
        try:
            meta = self.backend.stat(self.key)
        except ObjectNotFound:
            raise NotFound(f"{self.where}: {MISSING}") from None
        if meta.size != f.stored_size:
            raise CorruptData(f"{self.where}: the object has {meta.size} bytes, the manifest "
                              f"says {f.stored_size}")
        if f.codec == "none" and f.size != f.stored_size:
            raise CorruptData(f"{self.where}: the manifest says the file has {f.size} bytes, "
                              f"but its {f.stored_size} stored bytes (codec 'none') are it")
        if f.size > f.stored_size * MAX_EXPANSION:
            raise CorruptData(f"{self.where}: the manifest says the file has {f.size} bytes, "
                              f"more than {f.stored_size} stored bytes of codec {f.codec!r} "
                              "can hold")
        if meta.version is None:
            raise PermanentError(f"{self.where}: the store gives no version tag (ETag) for the"
                                 " object, so its reads cannot be pinned to one version")
        self._pin = meta.version
        self._looked = True

    # -- the block index ---------------------------------------------------------------------

    def index(self) -> BlockIndex | None:
        """The object's block index (fetched once, after `check`); None when it has none
        (codec `none`, or written before objects carried one): such an object is read as one
        stream."""
        with self._lock:
            if not self._index_read:
                self._look()
                self._index = self._fetch_index()
                self._index_read = True
            return self._index

    def _fetch_index(self) -> BlockIndex | None:
        f = self.f
        if f.codec == "none" or f.stored_size == 0:
            return None
        tail = self._get(max(0, f.stored_size - TAIL_PROBE), f.stored_size)
        try:
            found = read_index(f.codec, f.stored_size, f.size, tail, self._get)
        except CorruptData as exc:
            raise CorruptData(f"{self.where}: block index: {exc}") from None
        return found

    def _get(self, start: int, end: int) -> bytes:
        return bytes(self._get_view(start, end))

    def _get_view(self, start: int, end: int) -> bytes | memoryview:
        try:
            data = self.backend.get_range(self.key, start, end, self._pin)
        except ObjectNotFound:
            raise NotFound(f"{self.where}: {MISSING}") from None
        except PreconditionFailed:
            raise ObjectReplaced(f"{self.where}: {REPLACED}") from None
        except CorruptData as exc:
            raise CorruptData(f"{self.where}: {exc}") from None
        self.stats.count(end - start)
        return data

    # -- reading -----------------------------------------------------------------------------

    def read(self, ranges: Ranges | None, sink: Sink, place: Place | None = None) -> None:
        """`place(raw_start, raw_len)`, when given, may return the memory a block's bytes
        are to end up in (called on a decoding thread): the block is decoded straight into
        it, and the sink then gets that same memory."""
        f = self.f
        wanted = merge(ranges) if ranges is not None else [(0, f.size)]
        outside = [(s, e) for s, e in wanted if s < 0 or e > f.size]
        if outside:  # the caller's ranges come from a file of the step (DCP's .metadata)
            raise CorruptData(f"{self.where}: bytes [{outside[0][0]}, {outside[0][1]}) are "
                              f"asked for, outside the file's {f.size} bytes")
        self.check()
        if f.size == 0 or not wanted:
            if ranges is None or f.size == 0:
                self._stream(wanted, sink)
            return
        index = self.index() if f.stored_size > WHOLE_BELOW else None
        if index is None:
            self._stream(wanted, sink)
        else:
            self._blocks(index, wanted, sink, place)

    def _blocks(self, index: BlockIndex, wanted: Ranges, sink: Sink, place: Place | None
                ) -> None:
        needed: dict[int, Block] = {}
        for start, end in wanted:
            for b in index.covering(start, end):
                needed[b.index] = b
        blocks = [needed[i] for i in sorted(needed)]
        whole = len(blocks) == len(index.blocks)
        hasher = HashSink() if whole else None
        spans = Spans(blocks, self._get_view, self.fetcher)
        pending: deque[Future[tuple[Block, Any]]] = deque()  # each holds one of `slots`
        at = done = 0

        def deliver() -> int:
            nonlocal done
            try:
                return self._deliver(pending.popleft(), wanted, at, sink, hasher)
            finally:
                self.slots.release()
                spans.forget(done)
                done += 1

        try:
            for i, block in enumerate(blocks):
                # A slot for every block in flight, shared by the files read at once; wait for
                # one only when nothing of this file is pending (else deliver first).
                while len(pending) >= self.window or not self.slots.acquire(
                        blocking=not pending):
                    at = deliver()
                pending.append(when_done(spans.fetch(i), self.pool, self._decode,
                                          block, index, place))
            while pending:
                at = deliver()
        except BaseException:
            for fut in pending:
                fut.cancel()
                self.slots.release()
            spans.cancel()
            raise
        if hasher is not None:
            self._check_whole(hasher, index.raw_size)

    def _decode(self, parts: list[tuple[int, Any]], block: Block, index: BlockIndex,
                place: Place | None) -> tuple[Block, Any]:
        """Decode one block from the fetched pieces that hold it, into the place its bytes go
        to when the sink has one ready (a destination tensor), else a buffer of its own."""
        pieces = [(at, memoryview(data)) for at, data in parts]
        stored: bytes | memoryview
        lo, hi = block.stored_start, block.stored_start + block.stored_len
        if len(pieces) == 1:
            at, view = pieces[0]
            stored = view[lo - at : hi - at]
        else:  # across a piece boundary: joined (one copy of one block's stored bytes)
            stored = b"".join(v[max(lo - at, 0) : hi - at] for at, v in pieces)
        found = place(block.raw_start, block.raw_len) if place is not None else None
        out = found if found is not None else np.empty(block.raw_len, dtype=np.uint8).data
        try:
            decode_block(index.codec, block, memoryview(stored), out, index.version)
        except CorruptData as exc:
            raise CorruptData(f"{self.where}: {exc}") from None
        self.stats.count(0, requests=0, blocks=1, placed=int(found is not None))
        return block, out

    def _fetch_block(self, block: Block, index: BlockIndex) -> tuple[Block, Any]:
        """One block fetched by its own range and decoded (random access: `ckptd.open`)."""
        stored = self._get_view(block.stored_start, block.stored_start + block.stored_len)
        out = np.empty(block.raw_len, dtype=np.uint8)
        try:
            decode_block(index.codec, block, memoryview(stored), out.data, index.version)
        except CorruptData as exc:
            raise CorruptData(f"{self.where}: {exc}") from None
        self.stats.count(0, requests=0, blocks=1)
        return block, out.data

    def _deliver(self, fut: Future[tuple[Block, Any]], wanted: Ranges, at: int, sink: Sink,
                 hasher: HashSink | None) -> int:
        """Hand one decoded block's wanted pieces to the sink; `at` is the first range that
        may still overlap (ranges and blocks both ascend)."""
        block, out = fut.result()
        view = memoryview(out).cast("B")
        if hasher is not None:
            hasher.update(block.raw_start, view)
        lo, hi = block.raw_start, block.raw_start + block.raw_len
        while at < len(wanted) and wanted[at][1] <= lo:
            at += 1
        i = at
        while i < len(wanted) and wanted[i][0] < hi:
            start, end = max(wanted[i][0], lo), min(wanted[i][1], hi)
            sink(start, view[start - lo : end - lo])
            i += 1
        return at

    def _check_whole(self, hasher: HashSink, size: int) -> None:
        f = self.f
        hasher.finish(size)
        if f.hash_alg != HASH_ALG:
            raise CorruptData(f"{self.where}: hash algorithm {f.hash_alg!r} is not {HASH_ALG!r}")
        if size != f.size or hasher.digest != f.hash:
            raise CorruptData(f"{self.where}: content hash mismatch (decoded {hasher.digest}, "
                              f"the manifest says {f.hash}): the stored object is corrupt")

    def _stream(self, wanted: Ranges, sink: Sink) -> None:
        """The whole object as one download, decoded as it arrives and checked against the
        manifest; the wanted pieces go to the sink."""
        self.check()
        pipe = Pipe(self.f, self.key)
        out = _RangeWriter(wanted, sink)
        fetcher = threading.Thread(target=self._download, args=(pipe,), daemon=True,
                                   name="ckptd-read-fetch")
        fetcher.start()
        try:
            decode_checked(cast(BinaryIO, pipe), self.f, cast(Any, out))
            pipe.finish()
        except ObjectReplaced:
            raise ObjectReplaced(f"{self.where}: {REPLACED}") from None
        except NotFound:
            raise NotFound(f"{self.where}: {MISSING}") from None
        except CorruptData as exc:
            raise CorruptData(f"{self.where}: {exc}") from None
        except BaseException:
            pipe.cancel()
            raise
        finally:
            pipe.cancel()
            fetcher.join()
        self.stats.count(self.f.stored_size)

    def _download(self, pipe: Pipe) -> None:
        try:
            self.backend.get(self.key, cast(BinaryIO, pipe), etag=self._pin)
        except BaseException as exc:  # handed to the decoding side, which raises it
            pipe.end(exc)
        else:
            pipe.end(None)


class _RangeWriter:
    """A decoder's output, cut to the wanted ranges and handed to a sink."""

    def __init__(self, wanted: Ranges, sink: Sink) -> None:
        self.wanted, self.sink, self.pos, self.at = wanted, sink, 0, 0

    def write(self, data: bytes | memoryview) -> int:
        view = memoryview(data).cast("B")
        lo, hi = self.pos, self.pos + len(view)
        wanted = self.wanted
        while self.at < len(wanted) and wanted[self.at][1] <= lo:
            self.at += 1
        i = self.at
        while i < len(wanted) and wanted[i][0] < hi:
            start, end = max(wanted[i][0], lo), min(wanted[i][1], hi)
            self.sink(start, view[start - lo : end - lo])
            i += 1
        self.pos = hi
        return len(view)
