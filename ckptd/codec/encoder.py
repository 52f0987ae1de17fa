"""Streaming encoders: sequential chunks in, one stored object out, bounded blocks in flight.

Owns block accumulation, the optional thread pool and the output framing per codec. Never
reads files, never holds more than `max_buffered_bytes` of input, never closes `out`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import BinaryIO, Generic, TypeVar

from ckptd.codec import blocks, buffers, frame, seektable
from ckptd.codec.blocks import BlockPolicy, Coders, Encoded
from ckptd.codec.buffers import Slot
from ckptd.codec.planes import Workspace
from ckptd.errors import BadValue, CorruptData

BLOCK_SIZE = 4 << 20
SUFFIXES = {"none": "", "zstd": ".zst", "zstd-bytegroup": ".zbg"}

R = TypeVar("R")


class Encoder:
    """Feed `update(offset, chunk)` with sequential chunks, then call `finish(total)` once.

    After `finish`, `codec` and `suffix` name what was written (for `auto`, the codec it
    resolved to), `raw_size` the input bytes and `stored_size` the bytes written to `out`.
    `buffered_bytes` / `peak_buffered_bytes` count input bytes held in memory (partial block
    plus blocks in flight); they never exceed `max_buffered_bytes`.
    """

    def __init__(self, codec: str, out: BinaryIO) -> None:
        self.codec = codec
        self.suffix = SUFFIXES[codec]
        self.raw_size = 0
        self.stored_size = 0
        self.buffered_bytes = 0
        self.peak_buffered_bytes = 0
        self.max_buffered_bytes = 0
        self._out = out
        self._finished = False

    def update(self, offset: int, chunk: memoryview) -> None:
        if self._finished:
            raise BadValue("encoder already finished")
        if offset != self.raw_size:
            raise BadValue(f"chunk at offset {offset}, expected {self.raw_size}")
        view = memoryview(chunk).cast("B")
        self.raw_size += len(view)
        self._consume(view)

    def finish(self, total: int) -> None:
        if self._finished:
            raise BadValue("encoder already finished")
        if total != self.raw_size:
            self.close()
            raise CorruptData(
                f"input changed while encoding: {self.raw_size} bytes read, {total} expected"
            )
        try:
            self._flush()
        finally:
            self.close()

    def close(self) -> None:
        """Stop without writing more (idempotent); `finish` calls it."""
        self._finished = True

    def __enter__(self) -> Encoder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _consume(self, view: memoryview) -> None:
        self._write(view)

    def _flush(self) -> None:
        pass

    def _write(self, piece: bytes | memoryview) -> None:
        self._out.write(piece)
        self.stored_size += len(piece)


Job = Callable[[memoryview, Workspace], R]


class BlockEncoder(Encoder, Generic[R]):
    """Cuts the input into `block_size` blocks and emits each coded block in input order.

    With `threads > 1`, blocks are coded on a pool; a fixed set of slots (threads + 2) bounds
    the blocks held at once, and buffers are reused rather than reallocated per block.
    """

    def __init__(
        self, codec: str, out: BinaryIO, job: Job[R], threads: int, block_size: int
    ) -> None:
        super().__init__(codec, out)
        self.block_size = block_size
        self._job = job
        self._pool = ThreadPoolExecutor(threads, "ckptd-codec") if threads > 1 else None
        nslots = threads + 2 if self._pool is not None else 1
        self._free = [buffers.take(block_size) for _ in range(nslots)]
        self._all = list(self._free)
        self._inline_ws = self._free[0].ws
        self._slot: Slot | None = None
        self._fill = 0
        self._inflight: deque[tuple[Slot, int, Future[R]]] = deque()
        self.max_buffered_bytes = block_size * (nslots + 1)

    def _consume(self, view: memoryview) -> None:
        size = self.block_size
        while view:
            if self._pool is None and self._fill == 0 and len(view) >= size:
                # Whole blocks straight from the caller's chunk: no copy on the common path.
                self._emit(self._job(view[:size], self._inline_ws))
                view = view[size:]
                continue
            slot = self._filling()
            take = min(size - self._fill, len(view))
            slot.buf[self._fill : self._fill + take] = view[:take]
            self._fill += take
            view = view[take:]
            self._account()
            if self._fill == size:
                self._submit()

    def _filling(self) -> Slot:
        if self._slot is None:
            if not self._free:
                self._retire_oldest()
            self._slot = self._free.pop()
        return self._slot

    def _submit(self) -> None:
        slot, fill = self._filling(), self._fill
        self._slot, self._fill = None, 0
        data = memoryview(slot.buf)[:fill]
        if self._pool is None:
            self._emit(self._job(data, slot.ws))
            self._free.append(slot)
        else:
            self._inflight.append((slot, fill, self._pool.submit(self._job, data, slot.ws)))
        self._account()

    def _retire_oldest(self) -> None:
        slot, _, future = self._inflight.popleft()
        self._emit(future.result())
        self._free.append(slot)
        self._account()

    def _flush(self) -> None:
        if self._fill:
            self._submit()
        while self._inflight:
            self._retire_oldest()
        self._end()

    def close(self) -> None:
        super().close()
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
        self._inflight.clear()
        self._slot, self._fill = None, 0
        buffers.give(self._all)  # no job runs any more: every slot is idle
        self._all, self._free = [], []
        self._account()

    def _account(self) -> None:
        inflight = sum(size for _, size, _ in self._inflight)
        self.buffered_bytes = self._fill + inflight + self._held_bytes()
        self.peak_buffered_bytes = max(self.peak_buffered_bytes, self.buffered_bytes)

    def _held_bytes(self) -> int:
        return 0

    def _emit(self, result: R) -> None:
        raise NotImplementedError

    def _end(self) -> None:
        pass


class ZstdEncoder(BlockEncoder[tuple[bytes, int]]):
    """`zstd`: one stock frame per block; concatenated frames are a valid zstd stream. A seek
    table in zstd's seekable format (a skippable frame, which zstd -d skips) ends the object."""

    def __init__(self, out: BinaryIO, coders: Coders, threads: int, block_size: int) -> None:
        super().__init__(
            "zstd",
            out,
            lambda d, _: (blocks.encode_frame(d, coders), len(d)),
            threads,
            block_size,
        )
        self._coders = coders
        self._rows = bytearray()

    def _emit(self, result: tuple[bytes, int]) -> None:
        coded, raw_len = result
        self._write(coded)
        self._rows += seektable.row(len(coded), raw_len, int.from_bytes(coded[-4:], "little"))

    def _end(self) -> None:
        if not self._rows:
            # An empty input still gets one (empty) frame: stock `zstd -d` rejects 0 bytes.
            self._emit((blocks.encode_frame(memoryview(b""), self._coders), 0))
        self._write(seektable.pack_rows(self._rows))


class ContainerEncoder(BlockEncoder[Encoded]):
    """`zstd-bytegroup`: the framed container of docs/FORMAT.md."""

    def __init__(
        self, out: BinaryIO, policy: BlockPolicy, coders: Coders, threads: int, block_size: int
    ) -> None:
        super().__init__(
            "zstd-bytegroup",
            out,
            lambda d, ws: blocks.encode_block(d, policy, coders, ws),
            threads,
            block_size,
        )
        self.blocks = 0
        self.kinds: dict[str, int] = {}
        self._started = False
        self._index = bytearray()  # the index record: one entry per block written

    def _emit(self, result: Encoded) -> None:
        if not self._started:
            self._write(frame.pack_file_header(self.block_size))
            self._started = True
        before = self.stored_size
        for piece in result.pieces():
            self._write(piece)
        self._index += frame.pack_entry(self.stored_size - before, result.raw_len)
        self.blocks += 1
        self.kinds[result.kind] = self.kinds.get(result.kind, 0) + 1

    def _end(self) -> None:
        if not self._started:
            self._write(frame.pack_file_header(self.block_size))
        self._write(frame.pack_end(self.blocks, self.raw_size))
        self._write(frame.pack_index(self._index, self.block_size))


class AutoEncoder(ContainerEncoder):
    """`auto`: the container, except that a file of at most one block is stored as what that
    block chose: raw bytes (codec `none`), one plain zstd frame (`zstd`) or the container."""

    def __init__(
        self, out: BinaryIO, policy: BlockPolicy, coders: Coders, threads: int, block_size: int
    ) -> None:
        super().__init__(out, policy, coders, threads, block_size)
        self._held: Encoded | None = None
        self._first = True

    def _held_bytes(self) -> int:
        return self._held.raw_len if self._held is not None else 0

    def _emit(self, result: Encoded) -> None:
        if self._first:
            self._first = False
            self._held = result.owned()
            return
        if self._held is not None:
            held, self._held = self._held, None
            super()._emit(held)
        super()._emit(result)

    def _end(self) -> None:
        held, self._held = self._held, None
        if held is None and self.blocks == 0:
            self._resolve("none")
        elif held is not None and held.kind in ("raw", "zstd"):
            self._resolve("none" if held.kind == "raw" else "zstd")
            self._write(held.payload[0])
        else:
            if held is not None:
                super()._emit(held)
            super()._end()

    def _resolve(self, codec: str) -> None:
        self.codec = codec
        self.suffix = SUFFIXES[codec]
