"""The block index of a stored object: which stored bytes hold which raw bytes, read from the
object's tail, and one block decoded on its own. Never trusts a number it has not checked
against the object's sizes; never fetches or holds more than the index and one block.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass

from ckptd.codec import decoder, frame, seektable, zstdframes
from ckptd.errors import CorruptData

TAIL_PROBE = 64 << 10


@dataclass(frozen=True)
class Block:
    index: int
    raw_start: int
    raw_len: int
    stored_start: int  # the block's whole stored bytes: container header + payload, or a frame
    stored_len: int
    check: int | None = None  # zstd: the seek table's checksum of the frame's content


@dataclass(frozen=True)
class BlockIndex:
    codec: str
    raw_size: int
    stored_size: int
    blocks: tuple[Block, ...]
    version: int | None = None  # the container's version (what decode_block needs)

    def covering(self, start: int, end: int) -> list[Block]:
        """The blocks overlapping raw bytes [start, end), in order."""
        if not 0 <= start <= end <= self.raw_size:
            raise ValueError(f"range [{start}, {end}) outside 0..{self.raw_size}")
        if start == end:
            return []
        first = bisect.bisect_right(self.blocks, start, key=lambda b: b.raw_start) - 1
        found = []
        for block in self.blocks[max(first, 0) :]:
            if block.raw_start >= end:
                break
            if block.raw_len:
                found.append(block)
        return found


Fetch = Callable[[int, int], bytes]


def read_index(
    codec: str, stored_size: int, raw_size: int, tail: bytes, fetch: Fetch
) -> BlockIndex | None:
    """The index at the end of a stored object, from its last bytes `tail` (TAIL_PROBE of them,
    or the whole object when smaller); `fetch(start, end)` returns stored bytes [start, end)
    when the index is longer than the tail. None when the object has no index (codec `none`,
    or written before indexes existed): read it sequentially. CorruptData names what broke."""
    if stored_size < 0 or raw_size < 0 or len(tail) > stored_size:
        raise ValueError(f"tail of {len(tail)} bytes for an object of {stored_size} bytes")
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
    if overhead + head.blocks * frame.MIN_BLOCK_STORED > tail.size:
        raise CorruptData(f"{where}: index of {head.blocks} blocks in {tail.size} bytes")
    data = tail.last(frame.END_SIZE + head.index_len + frame.FOOTER_SIZE, f"{where}: index")
    index = memoryview(data)[frame.END_SIZE : frame.END_SIZE + head.index_len]
    frame.check_index(index, footer)
    frame.parse_end(data[: frame.END_SIZE], head.blocks, raw_size)
    rows = frame.entries(index)
    _check_rows(rows, head.block_size, raw_size, tail.size - overhead, where)
    return BlockIndex(
        "zstd-bytegroup",
        raw_size,
        tail.size,
        _blocks(rows, frame.FILE_HEADER_SIZE),
        head.version,
    )


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
    rows: list[tuple[int, int]], block_size: int, raw_size: int, stored: int, where: str
) -> None:
    """Every block but the last holds block_size raw bytes; the sums match the object."""
    for i, (stored_len, raw_len) in enumerate(rows):
        last = i == len(rows) - 1
        if raw_len != block_size and not (last and 0 < raw_len < block_size):
            raise CorruptData(f"{where}: index entry {i}: raw length {raw_len}")
        if stored_len < frame.MIN_BLOCK_STORED:
            raise CorruptData(f"{where}: index entry {i}: stored length {stored_len}")
    if sum(r for _, r in rows) != raw_size or sum(s for s, _ in rows) != stored:
        raise CorruptData(f"{where}: index sums disagree with the object's sizes")


def _zstd_index(tail: _Tail, raw_size: int) -> BlockIndex | None:
    if not seektable.has_table(tail.last(min(seektable.FOOTER_SIZE, tail.size), "zstd")):
        return None
    frames, checked = seektable.parse_footer(tail.last(seektable.FOOTER_SIZE, "zstd"))
    size = seektable.table_size(frames, checked)
    if size + frames * seektable.MIN_FRAME > tail.size:
        raise CorruptData(f"zstd: seek table of {frames} frames in {tail.size} bytes")
    entries = seektable.parse(tail.last(size, "zstd: seek table")[-size:])
    rows = [(e.stored_len, e.raw_len) for e in entries]
    first = rows[0][1] if rows else 0
    for i, (stored_len, raw_len) in enumerate(rows):
        fits = raw_len == first or (i == len(rows) - 1 and raw_len < first)
        if stored_len < seektable.MIN_FRAME or not fits or (raw_len == 0 and len(rows) > 1):
            raise CorruptData(f"zstd: seek table entry {i}: {stored_len} stored / {raw_len} raw")
    if first > zstdframes.MAX_FRAME_CONTENT or not rows:
        raise CorruptData(f"zstd: seek table of {len(rows)} frames of {first} bytes")
    if sum(r for _, r in rows) != raw_size or sum(s for s, _ in rows) != tail.size - size:
        raise CorruptData("zstd: seek table sums disagree with the object's sizes")
    blocks = _blocks(rows, 0)
    if checked:
        blocks = tuple(
            Block(b.index, b.raw_start, b.raw_len, b.stored_start, b.stored_len, e.check)
            for b, e in zip(blocks, entries, strict=True)
        )
    return BlockIndex("zstd", raw_size, tail.size, blocks)


def _blocks(rows: list[tuple[int, int]], stored_start: int) -> tuple[Block, ...]:
    found = []
    raw = 0
    for i, (stored_len, raw_len) in enumerate(rows):
        found.append(Block(i, raw, raw_len, stored_start, stored_len))
        raw += raw_len
        stored_start += stored_len
    return tuple(found)


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
        raise ValueError(
            f"block {block.index}: {len(stored)} stored bytes for {block.stored_len}, "
            f"room for {len(target)} of {block.raw_len}"
        )
    if block.raw_len > frame.MAX_BLOCK:
        raise ValueError(f"block {block.index}: raw length {block.raw_len} over {frame.MAX_BLOCK}")
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
