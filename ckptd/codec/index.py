"""The block index of a stored object: which stored bytes hold which raw bytes, read from the
object's tail, and one block decoded on its own. Never trusts a number it has not checked
against the object's sizes; never fetches or holds more than the index and one block.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import overload

import numpy as np
import numpy.typing as npt

from ckptd.codec import decoder, frame, seektable, zstdframes
from ckptd.errors import BadValue, CorruptData

TAIL_PROBE = 64 << 10


@dataclass(frozen=True)
class Block:
    index: int
    raw_start: int
    raw_len: int
    stored_start: int  # the block's whole stored bytes: container header + payload, or a frame
    stored_len: int
    check: int | None = None  # zstd: the seek table's checksum of the frame's content


class Blocks(Sequence[Block]):
    """The blocks of an index, kept as arrays and made into `Block`s only when asked for, so an
    index of millions of entries costs 8 bytes per block (12 with checksums), not a Python
    object each. Every block but the last holds `step` raw bytes (the block size)."""

    def __init__(
        self,
        step: int,
        raw_size: int,
        stored_first: int,
        stored_lens: npt.NDArray[np.uint32],
        checks: npt.NDArray[np.uint32] | None = None,
    ) -> None:
        self.step, self.raw_size = step, raw_size
        starts = np.empty(len(stored_lens) + 1, dtype=np.int64)
        starts[0] = stored_first
        np.cumsum(stored_lens, dtype=np.int64, out=starts[1:])
        starts[1:] += stored_first
        self._starts = starts  # block i's stored bytes: [starts[i], starts[i + 1])
        self._checks = None if checks is None else checks.copy()  # not a view of the tail

    def __len__(self) -> int:
        return len(self._starts) - 1

    @overload
    def __getitem__(self, i: int) -> Block: ...

    @overload
    def __getitem__(self, i: slice) -> Sequence[Block]: ...

    def __getitem__(self, i: int | slice) -> Block | Sequence[Block]:
        count = len(self)
        if isinstance(i, slice):
            lo, hi, step = i.indices(count)
            if step == 1:
                return self.between(lo, hi)
            return [self[j] for j in range(lo, hi, step)]
        if not -count <= i < count:
            raise IndexError(f"block {i} of {count}")
        i %= count
        return self.between(i, i + 1)[0]

    def between(self, lo: int, hi: int) -> list[Block]:
        """Blocks lo..hi-1 (0 <= lo <= hi <= len), their numbers taken from the arrays at once."""
        starts = self._starts[lo : hi + 1].tolist()
        checks = [None] * (hi - lo) if self._checks is None else self._checks[lo:hi].tolist()
        step, last = self.step, len(self) - 1
        return [
            Block(i, i * step, step if i < last else self.raw_size - i * step, start,
                  starts[k + 1] - start, checks[k])
            for k, (i, start) in enumerate(zip(range(lo, hi), starts, strict=False))
        ]

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Blocks):
            return NotImplemented
        mine, theirs = self._checks, other._checks
        same_checks = (
            np.array_equal(mine, theirs)
            if mine is not None and theirs is not None
            else mine is theirs is None
        )
        return (
            (self.step, self.raw_size) == (other.step, other.raw_size)
            and np.array_equal(self._starts, other._starts)
            and same_checks
        )

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"Blocks({len(self)} of {self.step} raw bytes, {self.raw_size} in all)"


@dataclass(frozen=True)
class BlockIndex:
    codec: str
    raw_size: int
    stored_size: int
    blocks: Blocks
    version: int | None = None  # the container's version (what decode_block needs)

    def covering(self, start: int, end: int) -> list[Block]:
        """The blocks overlapping raw bytes [start, end), in order."""
        if not 0 <= start <= end <= self.raw_size:
            raise BadValue(f"range [{start}, {end}) outside 0..{self.raw_size}")
        if start == end:
            return []
        step, last = self.blocks.step, len(self.blocks) - 1
        return self.blocks.between(start // step, min((end - 1) // step, last) + 1)


Fetch = Callable[[int, int], bytes]


def read_index(
    codec: str, stored_size: int, raw_size: int, tail: bytes, fetch: Fetch
) -> BlockIndex | None:
    """The index at the end of a stored object, from its last bytes `tail` (TAIL_PROBE of them,
    or the whole object when smaller); `fetch(start, end)` returns stored bytes [start, end)
    when the index is longer than the tail. None when the object has no index (codec `none`,
    or written before indexes existed): read it sequentially. CorruptData names what broke."""
    if stored_size < 0 or raw_size < 0 or len(tail) > stored_size:
        raise BadValue(f"tail of {len(tail)} bytes for an object of {stored_size} bytes")
    if codec == "none":
        return None
    if codec == "zstd":
        return _zstd_index(_Tail(stored_size, tail, fetch), raw_size)
    if codec == "zstd-bytegroup":
        return _container_index(_Tail(stored_size, tail, fetch), raw_size)
    raise CorruptData(f"unknown codec {codec!r}: no block index")


class _Tail:
    """The object's last bytes, fetching more in one request when asked for more than held."""

    def __init__(self, stored_size: int, tail: bytes, fetch: Fetch) -> None:
        self.size, self.tail, self.fetch = stored_size, tail, fetch

    def last(self, count: int, what: str) -> bytes:
        if count > self.size:
            raise CorruptData(f"{what}: {count} bytes in an object of {self.size}")
        if count <= len(self.tail):
            return self.tail[len(self.tail) - count :]
        start, end = self.size - count, self.size - len(self.tail)
        more = self.fetch(start, end)
        if len(more) != end - start:
            raise CorruptData(f"{what}: fetched {len(more)} bytes of [{start}, {end})")
        self.tail = more + self.tail
        return self.tail

    def first(self, count: int, what: str) -> bytes:
        if count > self.size:
            raise CorruptData(f"{what}: {count} bytes in an object of {self.size}")
        if len(self.tail) == self.size:
            return self.tail[:count]
        head = self.fetch(0, count)
        if len(head) != count:
            raise CorruptData(f"{what}: fetched {len(head)} bytes of [0, {count})")
        return head


def _container_index(tail: _Tail, raw_size: int) -> BlockIndex | None:
    where = "zstd-bytegroup"
    if not frame.has_index(tail.last(min(frame.FOOTER_SIZE, tail.size), where)):
        _old_end_record(tail, raw_size)
        return None
    footer = tail.last(frame.FOOTER_SIZE, f"{where}: index footer")
    head = frame.parse_index_footer(footer)
    overhead = frame.FILE_HEADER_SIZE + frame.END_SIZE + head.index_len + frame.FOOTER_SIZE
    _check_block_count(head.blocks, head.block_size, raw_size, tail.size - overhead)
    data = tail.last(frame.END_SIZE + head.index_len + frame.FOOTER_SIZE, f"{where}: index")
    index = memoryview(data)[frame.END_SIZE : frame.END_SIZE + head.index_len]
    frame.check_index(index, footer)
    frame.parse_end(data[: frame.END_SIZE], head.blocks, raw_size)
    rows = frame.entries(index)
    _check_rows(rows[:, 0], rows[:, 1], head.block_size, raw_size, tail.size - overhead)
    blocks = Blocks(head.block_size, raw_size, frame.FILE_HEADER_SIZE, rows[:, 0])
    return BlockIndex("zstd-bytegroup", raw_size, tail.size, blocks, head.version)


def _check_block_count(blocks: int, block_size: int, raw_size: int, stored: int) -> None:
    """Before any entry is fetched or read: the encoder writes exactly one block per
    `block_size` raw bytes (the last one shorter), each of MIN_BLOCK_STORED to raw length plus
    MAX_BLOCK_HEADER stored bytes; `stored` is the bytes the blocks must fill."""
    where = "zstd-bytegroup"
    if blocks != -(-raw_size // block_size):
        raise CorruptData(
            f"{where}: index of {blocks} blocks of {block_size} bytes for {raw_size} raw bytes"
        )
    if not blocks * frame.MIN_BLOCK_STORED <= stored <= raw_size + blocks * frame.MAX_BLOCK_HEADER:
        raise CorruptData(f"{where}: index of {blocks} blocks in {stored} bytes of blocks")


def _old_end_record(tail: _Tail, raw_size: int) -> None:
    """An object without a footer must be one that versions 1 and 2 wrote: a valid end record
    at the end, and (one more fetch, for old objects only) their version in the file header."""
    end = tail.last(min(frame.END_SIZE, tail.size), "zstd-bytegroup")
    try:
        _, total = frame.read_end(end)
    except CorruptData as err:
        raise CorruptData("zstd-bytegroup: no index footer, nor an end record, at the end") from err
    if total != raw_size:
        raise CorruptData(f"zstd-bytegroup: end record says {total} bytes, expected {raw_size}")
    _, version = frame.parse_file_header(tail.first(frame.FILE_HEADER_SIZE, "zstd-bytegroup"))
    if version >= frame.INDEXED:
        raise CorruptData(f"zstd-bytegroup: version {version} object without its index (cut short)")


def _check_rows(
    stored_lens: npt.NDArray[np.uint32],
    raw_lens: npt.NDArray[np.uint32],
    block_size: int,
    raw_size: int,
    stored: int,
) -> None:
    """Every block but the last holds block_size raw bytes, the last the rest; every stored
    length is one the encoder can write for its raw length; the stored lengths fill `stored`."""
    last = raw_size - (len(raw_lens) - 1) * block_size  # 1..block_size: the count is checked
    _check_columns(
        stored_lens,
        raw_lens,
        (block_size, last),
        (frame.MIN_BLOCK_STORED, frame.MIN_BLOCK_STORED),
        (block_size + frame.MAX_BLOCK_HEADER, last + frame.MAX_BLOCK_HEADER),
        stored,
        "zstd-bytegroup: index",
    )


def _check_columns(
    stored_lens: npt.NDArray[np.uint32],
    raw_lens: npt.NDArray[np.uint32],
    raw: tuple[int, int],
    least: tuple[int, int],
    most: tuple[int, int],
    stored: int,
    what: str,
) -> None:
    """Entries but the last hold raw[0] raw bytes in least[0]..most[0] stored bytes, the last
    raw[1] in least[1]..most[1]; all stored lengths sum to `stored`. Checked on whole columns,
    one byte per entry of temporaries; the first entry that breaks a rule is named."""
    body_stored, body_raw = stored_lens[:-1], raw_lens[:-1]
    bad = body_raw != raw[0]
    bad |= body_stored < least[0]
    bad |= body_stored > most[0]
    if bad.any():
        i = int(np.argmax(bad))
    elif len(raw_lens) and not (
        raw_lens[-1] == raw[1] and least[1] <= stored_lens[-1] <= most[1]
    ):
        i = len(raw_lens) - 1
    else:
        if int(stored_lens.sum(dtype=np.uint64)) != stored:
            raise CorruptData(f"{what} sums disagree with the object's sizes")
        return
    raise CorruptData(f"{what} entry {i}: {int(stored_lens[i])} stored / {int(raw_lens[i])} raw")


def _zstd_index(tail: _Tail, raw_size: int) -> BlockIndex | None:
    if not seektable.has_table(tail.last(min(seektable.FOOTER_SIZE, tail.size), "zstd")):
        return None
    frames, checked = seektable.parse_footer(tail.last(seektable.FOOTER_SIZE, "zstd"))
    size = seektable.table_size(frames, checked)
    _check_frame_count(frames, raw_size, tail.size - size)
    table = seektable.parse(tail.last(size, "zstd: seek table")[-size:])
    # Every frame but the last holds the first's raw bytes, the last the rest, 1..first of
    # them; a frame stores MIN_FRAME to stored_bound(its raw length) bytes.
    first = int(table.raw_len[0])
    last = raw_size - (frames - 1) * first
    full = zstdframes.MIN_FULL_FRAME <= first <= zstdframes.MAX_FRAME_CONTENT and 0 < last <= first
    if frames > 1 and not full:
        raise CorruptData(f"zstd: seek table of {frames} frames of {first} bytes")
    _check_columns(
        table.stored_len,
        table.raw_len,
        (first, last),
        (seektable.MIN_FRAME, seektable.MIN_FRAME),
        (zstdframes.stored_bound(first), zstdframes.stored_bound(last)),
        tail.size - size,
        "zstd: seek table",
    )
    blocks = Blocks(first, raw_size, 0, table.stored_len, table.check)
    return BlockIndex("zstd", raw_size, tail.size, blocks)


def _check_frame_count(frames: int, raw_size: int, stored: int) -> None:
    """Before any entry is fetched or read: the encoder writes one frame per block of at least
    MIN_FULL_FRAME and at most MAX_FRAME_CONTENT raw bytes (one empty frame for an empty
    file), each of MIN_FRAME to stored_bound(its raw length) bytes; `stored` is what the
    frames must fill."""
    most = max(1, -(-raw_size // zstdframes.MIN_FULL_FRAME))
    least = max(1, -(-raw_size // zstdframes.MAX_FRAME_CONTENT))
    if not least <= frames <= most:
        raise CorruptData(f"zstd: seek table of {frames} frames for {raw_size} raw bytes")
    # stored_bound summed over the frames: sum(raw >> 8) <= raw_size >> 8; margins <= 64 each.
    bound = raw_size + (raw_size >> 8) + frames * zstdframes.stored_bound(0)
    if not frames * seektable.MIN_FRAME <= stored <= bound:
        raise CorruptData(f"zstd: seek table of {frames} frames in {stored} bytes of frames")


def decode_block(
    codec: str, block: Block, stored: memoryview, out: memoryview, version: int | None = None
) -> None:
    """Decode exactly `block.stored_len` stored bytes into the first `block.raw_len` bytes of
    `out` (caller memory, written in place), checking everything: the container's header,
    payload and raw checksums; a zstd frame's content size and checksum. CorruptData names
    the block and its raw offset. `version`: the container's (BlockIndex.version)."""
    stored = memoryview(stored).cast("B")
    target = memoryview(out).cast("B")
    if len(stored) != block.stored_len or len(target) < block.raw_len:
        raise BadValue(
            f"block {block.index}: {len(stored)} stored bytes for {block.stored_len}, "
            f"room for {len(target)} of {block.raw_len}"
        )
    if block.raw_len > frame.MAX_BLOCK:
        raise BadValue(f"block {block.index}: raw length {block.raw_len} over {frame.MAX_BLOCK}")
    target = target[: block.raw_len]
    if codec == "zstd-bytegroup":
        decoder.decode_container_block(
            stored, target, block.index, block.raw_start, version or frame.VERSION
        )
    elif codec == "zstd":
        where = f"zstd: frame {block.index} (raw offset {block.raw_start})"
        zstdframes.decode_frame(stored, target, where, block.check)
    else:
        raise CorruptData(f"codec {codec!r} has no blocks to decode")
