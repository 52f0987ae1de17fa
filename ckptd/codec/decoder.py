"""Streaming decoders: one stored object in, the original bytes out, one block at a time; and
one container block on its own, through the same checks (framing, lengths, checksums, the
index, truncation), raising CorruptData that names the block; never more than one block held.
"""

from __future__ import annotations

import os
import threading
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import contextmanager
from typing import BinaryIO

import numpy as np
import xxhash
import zstandard

from ckptd.codec import buffers, frame, nibbles, planes
from ckptd.codec.frame import BlockHeader
from ckptd.codec.nibbles import NibblePlane
from ckptd.codec.zstdframes import COPY_CHUNK, FrameStream
from ckptd.errors import CorruptData

KEEP_CODERS = 4  # idle block decoders kept for decode_block (each holds one block's arrays)
MAX_READ_THREADS = 8


def read_threads() -> int:
    """How many threads a reader the user waits for decodes on: the cores this process may
    run on (its affinity, which a cpuset or `taskset` narrows), at most MAX_READ_THREADS."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # no affinity call on this platform
        cores = os.cpu_count() or 1
    return max(1, min(MAX_READ_THREADS, cores))

ChunkCallback = Callable[[int], None] | None


def decode_stream(
    codec: str, src: BinaryIO, dst: BinaryIO, chunk_cb: ChunkCallback = None, threads: int = 1,
    pool: ThreadPoolExecutor | None = None,
) -> int:
    """Undo `codec` from `src` into `dst`; returns the bytes written; calls `chunk_cb(n)` per
    piece written. Raises CorruptData on corruption, truncation or an unknown codec.

    With `threads > 1`, the blocks of a `zstd-bytegroup` object are decoded on that many
    threads (read and written in order on the caller's), at most `threads + 1` blocks held;
    on `pool` when given (shared by the objects a caller decodes at once, so their blocks
    together never need more threads than the pool has), else on a pool of this call's."""
    if codec == "zstd-bytegroup":
        return _container(src, dst, chunk_cb or _ignore, threads, pool)
    decoders = {"none": _copy, "zstd": _zstd_frames}
    if codec not in decoders:
        raise CorruptData(f"unknown codec {codec!r}: cannot decode")
    return decoders[codec](src, dst, chunk_cb or _ignore)


def _ignore(_: int) -> None:
    pass


def _read_exact(src: BinaryIO, size: int, what: str) -> bytes:
    data = src.read(size)
    if len(data) == size:
        return data
    parts = [data]
    got = len(data)
    while got < size:
        more = src.read(size - got)
        if not more:
            raise CorruptData(f"{what}: truncated ({got} of {size} bytes)")
        parts.append(more)
        got += len(more)
    return b"".join(parts)


def _put(dst: BinaryIO, data: bytes | memoryview, cb: Callable[[int], None]) -> int:
    dst.write(data)
    cb(len(data))
    return len(data)


def _copy(src: BinaryIO, dst: BinaryIO, cb: Callable[[int], None]) -> int:
    total = 0
    while chunk := src.read(COPY_CHUNK):
        total += _put(dst, chunk, cb)
    return total


def _zstd_frames(src: BinaryIO, dst: BinaryIO, cb: Callable[[int], None]) -> int:
    """Concatenated zstd frames, each checked for a declared, bounded content size."""
    return FrameStream(src, dst, cb).run()


class _BlockCoder:
    """Decodes one container block's payload into caller memory, checking everything; the
    stream decoder and `decode_block` both go through `decode_into`."""

    def __init__(self, version: int, ws: planes.Workspace) -> None:
        self.version = version
        self.dctx = zstandard.ZstdDecompressor()
        self.ws = ws

    def decode_into(
        self, head: BlockHeader, payload: memoryview, out: memoryview, where: str
    ) -> None:
        """Decode `payload` (exactly head.stored_len bytes) into `out` (head.raw_len bytes)."""
        if xxhash.xxh3_64_intdigest(payload) != head.stored_checksum:
            raise CorruptData(f"{where}: stored bytes corrupted (payload checksum mismatch)")
        start, end = head.phase, head.phase + head.plane_len * head.width
        out[:start] = payload[:start]
        parts: list[planes.Plane | NibblePlane] = []
        pos = start
        for i, entry in enumerate(head.planes):
            stored = payload[pos : pos + entry.stored_len]
            pos += entry.stored_len
            parts.append(self._plane(entry.method, stored, head.plane_len, f"{where} plane {i}", i))
        rotate = head.transform == frame.TRANSFORM_SIGN_ROTATE
        try:
            nibbles.merge(parts, head.width, rotate, out[start:end], self.ws)
        except ValueError as err:  # the kernels' own length checks: planes that do not fit
            raise CorruptData(f"{where}: {err}") from err
        top = parts[-1]
        if isinstance(top, NibblePlane) and top.marks != len(top.escapes):
            raise CorruptData(f"{where}: {top.marks} escape marks for {len(top.escapes)} escapes")
        out[end:] = payload[pos:]
        if xxhash.xxh3_64_intdigest(out) != head.checksum:
            raise CorruptData(f"{where}: decoded bytes do not match the block checksum")

    def _plane(
        self, method: int, stored: memoryview, size: int, where: str, i: int
    ) -> planes.Plane | NibblePlane:
        if method == frame.METHOD_RAW:
            return np.frombuffer(stored, dtype=np.uint8)
        if method == frame.METHOD_NIBBLES:
            return self._nibbles(stored, size, where)
        return self._zstd(stored, size, where)

    def _zstd(self, stored: memoryview, size: int, where: str) -> planes.Plane:
        """One zstd frame that must declare and hold exactly `size` bytes.

        One-shot `decompress` into a fresh buffer: 0.65 ms per 1 MiB of nibble pairs against
        0.70-0.76 ms for `stream_reader().readinto` into a reused one, 0.74-0.83 ms for
        `decompressobj` (bench/decode_merge_bench.py). Decompressing a block's planes in
        lockstep instead, cache-sized chunks at a time by `readinto` into reused buffers, each
        chunk merged at once, measured 0.75-0.95x of this whole decode per CPU second (16-256
        Ki-element chunks): zstd then streams through its own window buffer and each chunk
        costs calls, while a 4 MiB block's planes already sit in L2/L3 for the merge
        (bench/decode_fused_bench.py; docs/PERFORMANCE.md, "Fused decode")."""
        try:
            if zstandard.frame_content_size(stored) != size:
                raise CorruptData(f"{where}: zstd frame does not declare {size} bytes")
            data = self.dctx.decompress(stored, max_output_size=size)
        except zstandard.ZstdError as err:
            raise CorruptData(f"{where}: {err}") from err
        if len(data) != size:
            raise CorruptData(f"{where}: decoded {len(data)} bytes, expected {size}")
        return np.frombuffer(data, dtype=np.uint8)

    def _nibbles(self, stored: memoryview, size: int, where: str) -> NibblePlane:
        head = frame.parse_nibbles_head(stored, size, where)
        at = frame.NIBBLES_HEAD_SIZE
        pairs = self._zstd(stored[at : head.escapes_at], (size + 1) // 2, where)
        escapes: planes.Plane = np.frombuffer(stored[head.escapes_at :], dtype=np.uint8)
        if head.escape_method == frame.ESCAPES_ZSTD:
            escapes = self._zstd(stored[head.escapes_at :], head.escapes, where)
        return NibblePlane(pairs, head.base, size, escapes)


class _BlockReader(_BlockCoder):
    """Reads container blocks from a stream into buffers reused from block to block."""

    def __init__(self, block_size: int, version: int) -> None:
        self.slot = buffers.take(block_size)
        super().__init__(version, self.slot.ws)
        self.payload = self.slot.buf
        self.out: planes.Plane = self.ws.get("out", np.uint8, block_size)

    def decode(self, src: BinaryIO, head: BlockHeader, index: int, offset: int) -> memoryview:
        self.read(src, head, index, offset)
        return self.decode_read(head, index, offset)

    def read(self, src: BinaryIO, head: BlockHeader, index: int, offset: int) -> None:
        where = f"zstd-bytegroup: block {index} (raw offset {offset})"
        _read_into(src, memoryview(self.payload)[: head.stored_len], f"{where} payload")

    def decode_read(self, head: BlockHeader, index: int, offset: int) -> memoryview:
        """Decode the payload `read` left in this reader's buffer."""
        where = f"zstd-bytegroup: block {index} (raw offset {offset})"
        out = self.out[: head.raw_len].data
        self.decode_into(head, memoryview(self.payload)[: head.stored_len], out, where)
        return out


_idle: list[_BlockCoder] = []
_idle_lock = threading.Lock()


@contextmanager
def _coder(version: int) -> Iterator[_BlockCoder]:
    """A block decoder for one call, reused across calls (and threads, one at a time)."""
    with _idle_lock:
        coder = _idle.pop() if _idle else None
    coder = coder or _BlockCoder(version, planes.Workspace())
    coder.version = version
    try:
        yield coder
    finally:
        with _idle_lock:
            if len(_idle) < KEEP_CODERS:
                _idle.append(coder)


def release_idle() -> None:
    """Drop the idle block decoders (each holds one block's arrays): for a caller that is done
    decoding for a while and wants the memory back, as a training process after a load."""
    with _idle_lock:
        _idle.clear()


def decode_container_block(
    stored: memoryview, out: memoryview, index: int, offset: int, version: int
) -> None:
    """One whole stored block (header and payload, nothing else) into all of `out`."""
    where = f"zstd-bytegroup: block {index} (raw offset {offset})"
    fixed = bytes(stored[: frame.BLOCK_FIXED_SIZE])
    if len(fixed) < frame.BLOCK_FIXED_SIZE or frame.is_end(fixed[:4]):
        raise CorruptData(f"{where}: not a block header")
    size = frame.BLOCK_FIXED_SIZE + frame.table_size(fixed)
    if size > len(stored):
        raise CorruptData(f"{where}: header longer than the block's {len(stored)} bytes")
    head = frame.parse_block_header(
        fixed, bytes(stored[frame.BLOCK_FIXED_SIZE : size]), index, len(out), version
    )
    if head.raw_len != len(out) or size + head.stored_len != len(stored):
        raise CorruptData(
            f"{where}: header says {head.raw_len} raw / {size + head.stored_len} stored bytes, "
            f"the index {len(out)} / {len(stored)}"
        )
    with _coder(version) as coder:
        coder.decode_into(head, stored[size:], out, where)


def _fill(readinto: Callable[[memoryview], int | None], buf: memoryview) -> int:
    """Fill `buf` from `readinto` until full or end of input; returns bytes filled."""
    got = 0
    while got < len(buf):
        n = readinto(buf[got:])
        if not n:
            break
        got += n
    return got


def _read_into(src: BinaryIO, buf: memoryview, what: str) -> None:
    got = _fill(_readinto(src), buf)
    if got != len(buf):
        raise CorruptData(f"{what}: truncated ({got} of {len(buf)} bytes)")


def _readinto(src: BinaryIO) -> Callable[[memoryview], int | None]:
    """`src.readinto`, or an equivalent for streams that only have `read`."""
    method: Callable[[memoryview], int | None] | None = getattr(src, "readinto", None)
    if method is not None:
        return method

    def fallback(buf: memoryview) -> int:
        data = src.read(len(buf))
        buf[: len(data)] = data
        return len(data)

    return fallback


def _container(src: BinaryIO, dst: BinaryIO, cb: Callable[[int], None], threads: int,
               shared: ThreadPoolExecutor | None) -> int:
    block_size, version = frame.parse_file_header(
        _read_exact(src, frame.FILE_HEADER_SIZE, "zstd-bytegroup: file header")
    )
    if threads <= 1:
        readers = [_BlockReader(block_size, version)]
    else:
        readers = [_BlockReader(block_size, version) for _ in range(threads + 1)]
    rows = bytearray()  # the index record this object must end with (version 3)
    try:
        heads = _heads(src, block_size, version, rows)
        if threads <= 1:
            total = sum(_put(dst, readers[0].decode(src, *h), cb) for h in heads)
        elif shared is not None:
            total = _in_parallel(src, dst, cb, heads, readers, shared)
        else:
            with ThreadPoolExecutor(threads, "ckptd-decode") as pool:
                total = _in_parallel(src, dst, cb, heads, readers, pool)
    finally:
        buffers.give([r.slot for r in readers])
    if version >= frame.INDEXED:
        _check_index(src, bytes(rows), block_size, version)
    if src.read(1):
        raise CorruptData("zstd-bytegroup: trailing bytes after the end of the object")
    return total


Head = tuple[BlockHeader, int, int]  # header, block index, raw offset


def _heads(src: BinaryIO, block_size: int, version: int, rows: bytearray) -> Iterator[Head]:
    """Each block's checked header, in order; the caller reads the payload before the next.
    Ends after the end record; appends each block's index entry to `rows`."""
    total = index = 0
    short = False  # a block of less than block_size raw bytes was read: the encoder's last
    while True:
        where = f"zstd-bytegroup: block {index}"
        marker = _read_exact(src, 4, f"{where} header")
        if frame.is_end(marker):
            rest = _read_exact(src, frame.END_SIZE - 4, "zstd-bytegroup: end record")
            frame.parse_end(marker + rest, index, total)
            return
        if short:  # so every block holds a block's worth of output, however small the blocks
            raise CorruptData(f"{where} (raw offset {total}): a block after a short, last one")
        fixed = marker + _read_exact(src, frame.BLOCK_FIXED_SIZE - 4, f"{where} header")
        rest = _read_exact(src, frame.table_size(fixed), f"{where} header")
        head = frame.parse_block_header(fixed, rest, index, block_size, version)
        short = head.raw_len < block_size
        rows += frame.pack_entry(len(fixed) + len(rest) + head.stored_len, head.raw_len)
        yield head, index, total
        total += head.raw_len
        index += 1


def _in_parallel(
    src: BinaryIO,
    dst: BinaryIO,
    cb: Callable[[int], None],
    heads: Iterator[Head],
    readers: list[_BlockReader],
    pool: ThreadPoolExecutor,
) -> int:
    """Read blocks in order on this thread, decode them on `pool`, write them in order; a
    reader per block in flight. On any error the blocks before it are still written and the
    first error in stream order is the one raised, as a decode on one thread would."""
    free = list(readers)
    flight: deque[tuple[_BlockReader, Future[memoryview]]] = deque()
    total = 0

    def retire() -> None:
        nonlocal total
        reader, done = flight.popleft()
        try:
            total += _put(dst, done.result(), cb)
        finally:
            free.append(reader)

    try:
        while True:
            if not free:
                retire()  # an error here leaves only later blocks in flight: not written
            try:
                head = next(heads, None)
                if head is not None:
                    free[-1].read(src, *head)
            except BaseException:
                while flight:
                    retire()  # the blocks before are written; an error of theirs comes first
                raise
            if head is None:
                break
            reader = free.pop()
            flight.append((reader, pool.submit(reader.decode_read, *head)))
        while flight:
            retire()
    finally:
        for _, done in flight:
            done.cancel()
        # A block still decoding writes into its reader's buffers, which the caller gives
        # back when this returns: wait for it (a pool of this call's would wait at its exit;
        # a shared one does not).
        wait([done for _, done in flight])
    return total


def _check_index(src: BinaryIO, rows: bytes, block_size: int, version: int) -> None:
    """The index record and footer after the end record must describe the blocks decoded."""
    index = _read_exact(src, len(rows), "zstd-bytegroup: index record")
    footer = _read_exact(src, frame.FOOTER_SIZE, "zstd-bytegroup: index footer")
    head = frame.parse_index_footer(footer)
    frame.check_index(index, footer)
    if (index, head.index_len, head.block_size, head.version) != (
        rows,
        len(rows),
        block_size,
        version,
    ):
        raise CorruptData("zstd-bytegroup: index does not match the blocks decoded")
