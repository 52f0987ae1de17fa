"""The block index of stored objects: ranges decoded from only their blocks, old objects read
sequentially, and every corrupt or hostile index caught as CorruptData in bounded memory."""

from __future__ import annotations

import io
import json
import random
import shutil
import struct
import subprocess
import tracemalloc
from collections.abc import Callable
from itertools import pairwise
from pathlib import Path

import numpy as np
import pytest
import xxhash
import zstandard

from ckptd.codec import (
    TAIL_PROBE,
    BlockIndex,
    decode_block,
    decode_stream,
    frame,
    make_encoder,
    read_index,
    seektable,
)
from ckptd.errors import CorruptData

GOLDEN = Path(__file__).parent.parent / "golden" / "codec"
KIB = 1 << 10


def floats(size: int, seed: int = 0) -> bytes:
    """Weights-like fp32 bytes with some text mixed in: planes, plain zstd and raw blocks."""
    rng = np.random.default_rng(seed)
    weights = (rng.standard_normal(size // 4 + 1) * 0.02).astype(np.float32).tobytes()
    text = b"".join(b'{"step": %d, "loss": 0.%d}\n' % (i, i * 7919) for i in range(size // 20 + 1))
    noise = rng.integers(0, 256, size, dtype=np.uint8).tobytes()
    third = size // 3
    return (weights[:third] + text[:third] + noise)[:size]


def encode(data: bytes, codec: str, block_size: int) -> tuple[str, bytes]:
    out = io.BytesIO()
    enc = make_encoder(codec, out, block_size=block_size)
    enc.update(0, memoryview(data))
    enc.finish(len(data))
    return enc.codec, out.getvalue()


class Object:
    """A stored object behind a fetch function that checks every range asked for."""

    def __init__(self, stored: bytes) -> None:
        self.stored = stored
        self.fetches: list[tuple[int, int]] = []

    def fetch(self, start: int, end: int) -> bytes:
        assert 0 <= start < end <= len(self.stored), (start, end)
        self.fetches.append((start, end))
        return self.stored[start:end]

    def tail(self, probe: int = TAIL_PROBE) -> bytes:
        return self.stored[len(self.stored) - min(probe, len(self.stored)) :]

    def index(self, codec: str, raw_size: int, probe: int = TAIL_PROBE) -> BlockIndex | None:
        return read_index(codec, len(self.stored), raw_size, self.tail(probe), self.fetch)


def read_range(codec: str, obj: Object, index: BlockIndex, start: int, end: int) -> bytes:
    """Raw bytes [start, end) decoded from only the blocks that cover them."""
    blocks = index.covering(start, end)
    if not blocks:
        return b""
    first = blocks[0].raw_start
    out = bytearray(blocks[-1].raw_start + blocks[-1].raw_len - first)
    view = memoryview(out)
    for block in blocks:
        lo = block.stored_start
        stored = memoryview(obj.fetch(lo, lo + block.stored_len))
        decode_block(codec, block, stored, view[block.raw_start - first :], index.version)
    return bytes(out[start - first : end - first])


def read_all(codec: str, obj: Object, raw_size: int) -> bytes | None:
    index = obj.index(codec, raw_size)
    return None if index is None else read_range(codec, obj, index, 0, raw_size)


def stream(codec: str, stored: bytes) -> bytes:
    dst = io.BytesIO()
    decode_stream(codec, io.BytesIO(stored), dst)
    return dst.getvalue()


@pytest.mark.parametrize("codec", ["zstd", "zstd-bytegroup"])
@pytest.mark.parametrize("block_size", [KIB, 4 * KIB, 64 * KIB])
@pytest.mark.parametrize("blocks", [0, 1, 3, 3.5])
def test_random_ranges_round_trip(codec: str, block_size: int, blocks: float) -> None:
    data = floats(int(blocks * block_size) + (7 if blocks == 1 else 0))
    used, stored = encode(data, codec, block_size)
    assert used == codec
    obj = Object(stored)
    index = obj.index(codec, len(data))
    assert index is not None and (index.raw_size, index.stored_size) == (len(data), len(stored))
    assert index.version == (frame.VERSION if codec == "zstd-bytegroup" else None)
    assert sum(b.raw_len for b in index.blocks) == len(data)
    assert stream(codec, stored) == data
    rng = random.Random(block_size + len(data))
    for _ in range(40):
        start = rng.randrange(len(data) + 1)
        end = rng.randrange(start, len(data) + 1)
        assert read_range(codec, obj, index, start, end) == data[start:end]
    assert read_range(codec, obj, index, 0, len(data)) == data


@pytest.mark.parametrize("codec", ["zstd", "zstd-bytegroup"])
def test_an_index_longer_than_the_tail_is_fetched_once(codec: str) -> None:
    data = floats(300 * KIB)
    _, stored = encode(data, codec, KIB)
    obj = Object(stored)
    index = obj.index(codec, len(data), probe=64)
    assert index is not None and len(index.blocks) == 300
    assert len(obj.fetches) == 1 and obj.fetches[0][1] == len(stored) - 64
    assert index == Object(stored).index(codec, len(data))


def test_covering_finds_exactly_the_overlapping_blocks() -> None:
    data = floats(10 * KIB + 5)
    _, stored = encode(data, "zstd-bytegroup", KIB)
    index = Object(stored).index("zstd-bytegroup", len(data))
    assert index is not None
    assert [b.index for b in index.covering(0, 1)] == [0]
    assert [b.index for b in index.covering(KIB - 1, KIB + 1)] == [0, 1]
    assert [b.index for b in index.covering(KIB, 2 * KIB)] == [1]
    assert [b.index for b in index.covering(10 * KIB, 10 * KIB + 5)] == [10]
    assert index.covering(5, 5) == []
    for bad in ((-1, 3), (3, 2), (0, len(data) + 1)):
        with pytest.raises(ValueError):
            index.covering(*bad)


@pytest.mark.parametrize("codec", ["zstd", "zstd-bytegroup"])
def test_blocks_are_a_sequence_made_from_the_arrays(codec: str) -> None:
    data = floats(6 * KIB + 5)
    _, stored = encode(data, codec, KIB)
    index = Object(stored).index(codec, len(data))
    assert index is not None
    blocks = list(index.blocks)
    assert [b.index for b in blocks] == list(range(7)) and index.covering(0, len(data)) == blocks
    assert index.blocks[-1] == blocks[6] and index.blocks[1:3] == blocks[1:3]
    assert index.blocks[::3] == blocks[::3] and index.blocks[5:2] == []
    assert all(a.stored_start + a.stored_len == b.stored_start for a, b in pairwise(blocks))
    assert all(b.raw_start == b.index * KIB for b in blocks) and blocks[6].raw_len == 5
    assert (blocks[0].check is None) == (codec == "zstd-bytegroup")
    for bad in (7, -8):
        with pytest.raises(IndexError):
            index.blocks[bad]


def test_decode_block_writes_a_numpy_buffer_in_place() -> None:
    weights = (np.random.default_rng(1).standard_normal(5000) * 0.02).astype(np.float32)
    data = weights.tobytes()
    for codec in ("zstd", "zstd-bytegroup"):
        _, stored = encode(data, codec, 4 * KIB)
        index = Object(stored).index(codec, len(data))
        assert index is not None
        target = np.zeros(5000, dtype=np.float32)
        before = target.ctypes.data
        raw = target.view(np.uint8).data
        for block in index.blocks:
            piece = memoryview(stored)[block.stored_start : block.stored_start + block.stored_len]
            decode_block(codec, block, piece, raw[block.raw_start :], index.version)
        assert target.ctypes.data == before
        assert np.array_equal(target, weights)
        # A whole float buffer (format "f") is taken as its bytes.
        single = np.zeros(1024, dtype=np.float32)
        first = index.blocks[0]
        piece = memoryview(stored)[first.stored_start : first.stored_start + first.stored_len]
        decode_block(codec, first, piece, single.data, index.version)
        assert np.array_equal(single, weights[:1024])


def test_decode_block_refuses_wrong_sizes_and_foreign_blocks() -> None:
    data = floats(8 * KIB)
    _, stored = encode(data, "zstd-bytegroup", KIB)
    index = Object(stored).index("zstd-bytegroup", len(data))
    assert index is not None
    one, two = index.blocks[1], index.blocks[2]
    piece = memoryview(stored)[one.stored_start : one.stored_start + one.stored_len]
    with pytest.raises(ValueError):
        decode_block("zstd-bytegroup", one, piece[:-1], memoryview(bytearray(KIB)))
    with pytest.raises(ValueError):
        decode_block("zstd-bytegroup", one, piece, memoryview(bytearray(KIB - 1)))
    other = memoryview(stored)[two.stored_start : two.stored_start + two.stored_len]
    if len(other) == len(piece):
        with pytest.raises(CorruptData):
            decode_block("zstd-bytegroup", one, other, memoryview(bytearray(KIB)))
    with pytest.raises(CorruptData, match="no blocks"):
        decode_block("none", one, piece, memoryview(bytearray(KIB)))


OLD_GOLDEN = sorted(
    p.name
    for p in GOLDEN.iterdir()
    if p.suffix in (".zbg", ".zst") and not p.name.startswith("v3-")
)


@pytest.mark.parametrize("name", OLD_GOLDEN)
def test_objects_from_before_the_index_are_read_sequentially(name: str) -> None:
    stored = (GOLDEN / name).read_bytes()
    codec = "zstd" if name.endswith(".zst") else "zstd-bytegroup"
    data = stream(codec, stored)
    assert Object(stored).index(codec, len(data)) is None
    if codec == "zstd-bytegroup":  # its end record still vouches for the size
        with pytest.raises(CorruptData, match="end record says"):
            Object(stored).index(codec, len(data) + 1)


@pytest.mark.parametrize("name", ["v3-fp32.zbg", "v3-bf16-seekable.zst"])
def test_golden_objects_with_an_index_read_by_range(name: str) -> None:
    want = json.loads((GOLDEN / "golden.json").read_text())[name]
    codec, size = str(want["codec"]), int(want["size"])
    obj = Object((GOLDEN / name).read_bytes())
    index = obj.index(codec, size)
    assert index is not None and len(index.blocks) == -(-size // (16 * KIB))
    data = read_range(codec, obj, index, 0, size)
    assert xxhash.xxh3_128_hexdigest(data) == want["xxh3_128"]
    assert read_range(codec, obj, index, 20_000, 40_000) == data[20_000:40_000]


def as_version_2(stored: bytes) -> bytes:
    """A version 3 container rewritten as version 2 wrote it: no index, no footer."""
    footer = frame.parse_index_footer(stored[-frame.FOOTER_SIZE :])
    head = bytearray(stored[:12])
    head[4] = 2
    body = stored[frame.FILE_HEADER_SIZE : len(stored) - frame.FOOTER_SIZE - footer.index_len]
    return bytes(head) + struct.pack("<I", xxhash.xxh32_intdigest(bytes(head))) + body


def test_a_version_2_container_has_no_index_and_still_decodes() -> None:
    data = floats(5 * KIB + 3)
    _, stored = encode(data, "zstd-bytegroup", KIB)
    old = as_version_2(stored)
    assert old[4] == 2 and len(old) == len(stored) - 6 * frame.ENTRY_SIZE - frame.FOOTER_SIZE
    assert stream("zstd-bytegroup", old) == data
    assert Object(old).index("zstd-bytegroup", len(data)) is None
    with pytest.raises(CorruptData, match="trailing"):
        stream("zstd-bytegroup", old + stored[len(old) - len(stored) :])


def test_single_block_and_raw_objects_carry_no_index() -> None:
    text = floats(3 * KIB)[KIB : 2 * KIB]  # JSON-like text: auto stores it as one zstd frame
    noise = np.random.default_rng(2).integers(0, 256, KIB, dtype=np.uint8).tobytes()
    for data, codec in ((text, "zstd"), (b"", "none"), (noise, "none")):
        used, stored = encode(data, "auto", 4 * KIB)
        assert used == codec
        assert Object(stored).index(codec, len(data)) is None
        assert stream(codec, stored) == data


@pytest.mark.skipif(shutil.which("zstd") is None, reason="no zstd command line tool")
@pytest.mark.parametrize("size", [0, 3 * KIB + 1])
def test_stock_zstd_decodes_an_object_with_a_seek_table(size: int, tmp_path: Path) -> None:
    data = floats(size)
    _, stored = encode(data, "zstd", KIB)
    assert stored[-4:] == struct.pack("<I", seektable.SEEKABLE_MAGIC)
    path = tmp_path / "x.zst"
    path.write_bytes(stored)
    got = subprocess.run(["zstd", "-q", "-d", "-c", str(path)], capture_output=True, check=True)
    assert got.stdout == data


def test_stream_decode_skips_skippable_frames() -> None:
    data = floats(3 * KIB)
    _, stored = encode(data, "zstd", KIB)
    first = seektable.row(0, 0, 0)  # any 12 bytes
    skip = struct.pack("<II", seektable.SKIPPABLE_FIRST, len(first)) + first
    assert stream("zstd", skip + stored) == data
    frames = read_all("zstd", Object(stored), len(data))
    assert frames == data
    with pytest.raises(CorruptData, match="seek table sums"):
        read_all("zstd", Object(skip + stored), len(data))
    with pytest.raises(CorruptData, match="after the seek table"):
        stream("zstd", stored + skip)


def rewrite_container_index(stored: bytes, change: int) -> bytes:
    """The container with its first index entry's stored length changed and a valid checksum."""
    footer = frame.parse_index_footer(stored[-frame.FOOTER_SIZE :])
    at = len(stored) - frame.FOOTER_SIZE - footer.index_len
    rows = frame.entries(stored[at : at + footer.index_len]).tolist()
    rows[0] = [rows[0][0] + change, rows[0][1]]
    rows[1] = [rows[1][0] - change, rows[1][1]]
    index = b"".join(frame.pack_entry(*row) for row in rows)
    return stored[:at] + frame.pack_index(index, footer.block_size)


def rewrite_seek_table(stored: bytes, change: int) -> bytes:
    size = struct.unpack("<I", stored[-9:-5])[0] * 12 + 17
    table = seektable.parse(stored[-size:])
    assert table.check is not None
    columns = (table.stored_len.tolist(), table.raw_len.tolist(), table.check.tolist())
    rows = list(zip(*columns, strict=True))
    rows[0] = (rows[0][0] + change, *rows[0][1:])
    rows[1] = (rows[1][0] - change, *rows[1][1:])
    return stored[:-size] + seektable.pack_rows(b"".join(seektable.row(*r) for r in rows))


def test_an_index_that_disagrees_with_the_blocks_is_caught_both_ways() -> None:
    data = floats(4 * KIB)
    for codec, rewrite in (
        ("zstd-bytegroup", rewrite_container_index),
        ("zstd", rewrite_seek_table),
    ):
        _, stored = encode(data, codec, KIB)
        moved = rewrite(stored, 5)
        assert len(moved) == len(stored) and moved != stored
        with pytest.raises(CorruptData, match="index|seek table"):
            stream(codec, moved)
        with pytest.raises(CorruptData):
            read_all(codec, Object(moved), len(data))


@pytest.mark.parametrize("codec", ["zstd-bytegroup", "zstd"])
def test_every_flipped_byte_is_caught(codec: str) -> None:
    data = floats(5 * KIB + 100)
    _, stored = encode(data, codec, KIB)
    assert len(stored) < TAIL_PROBE  # the tail is the whole object: every byte is in it
    table = len(stored) - (seektable.table_size(6, True) if codec == "zstd" else 0)
    missed = 0
    for at in range(len(stored)):
        for mask in (0x01, 0x40, 0xFF):
            flipped = bytearray(stored)
            flipped[at] ^= mask
            obj = Object(bytes(flipped))
            try:
                got = read_all(codec, obj, len(data))
            except CorruptData:
                continue
            if codec == "zstd-bytegroup":
                # Only the file header is not read by a ranged reader; the stream reader is.
                assert at < frame.FILE_HEADER_SIZE and got == data
                with pytest.raises(CorruptData, match="zstd-bytegroup: .*(header|magic|version)"):
                    stream(codec, obj.stored)
            elif at >= table:
                # The seekable magic flipped: no table found, and the stream reader says so.
                assert got is None and at >= len(stored) - 4
                with pytest.raises(CorruptData, match="seek table"):
                    stream(codec, obj.stored)
            else:
                # zstd ignores some header bits; the manifest hash is the end-to-end check.
                assert got == data
                missed += 1
    assert missed < 0.05 * 3 * table


@pytest.mark.parametrize("codec", ["zstd-bytegroup", "zstd"])
def test_every_cut_of_the_tail_is_caught(codec: str) -> None:
    data = floats(3 * KIB + 1)
    _, stored = encode(data, codec, KIB)
    table = seektable.table_size(4, True)
    for cut in range(1, 120):
        short = stored[:-cut]
        if codec == "zstd" and cut == table:
            # Without its table the object is a complete zstd stream, as older ones were.
            assert Object(short).index(codec, len(data)) is None
            assert stream(codec, short) == data
            continue
        try:
            prefix = stream(codec, short)
        except CorruptData:
            pass
        else:  # whole frames left: a shorter zstd stream, which the manifest's size rejects
            assert codec == "zstd" and len(prefix) < len(data) and data.startswith(prefix)
        try:
            got = read_all(codec, Object(short), len(data))
        except CorruptData:
            continue
        # No seek table footer left: the reader falls back to the stream, which says why.
        assert got is None and codec == "zstd"


def hostile_container_footer(stored: bytes, blocks: int, block_size: int = KIB) -> bytes:
    body = struct.pack("<QIIBBH", blocks * frame.ENTRY_SIZE, blocks, block_size, 3, 0, 0)
    check = struct.pack("<I", xxhash.xxh32_intdigest(body))  # right only for an empty index
    return stored + body + check + frame.INDEX_MAGIC


@pytest.mark.parametrize("blocks", [1, 1000, 2**31, 2**32 - 1])
def test_a_hostile_tail_cannot_make_the_reader_allocate(blocks: int) -> None:
    _, stored = encode(floats(2 * KIB), "zstd-bytegroup", KIB)
    hostile = {
        "zstd-bytegroup": hostile_container_footer(stored, blocks),
        "zstd": stored + struct.pack("<IBI", blocks, 0x80, seektable.SEEKABLE_MAGIC),
    }
    tracemalloc.start()
    try:
        for codec, tail in hostile.items():
            obj = Object(tail)
            with pytest.raises(CorruptData):
                obj.index(codec, 2 * KIB)
            with pytest.raises(CorruptData):
                obj.index(codec, 2 * KIB, probe=16)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20


@pytest.mark.parametrize(
    ("stored_size", "raw_size"), [(0, 0), (5, 0), (40, 10), (1 << 40, 1 << 41)]
)
def test_tails_too_short_for_an_index_are_corrupt_or_none(stored_size: int, raw_size: int) -> None:
    tail = bytes(min(stored_size, 64))

    def fetch(start: int, end: int) -> bytes:
        raise AssertionError(f"fetched [{start}, {end}) for a tail without an index")

    for codec in ("zstd-bytegroup", "zstd"):
        try:
            found = read_index(codec, stored_size, raw_size, tail, fetch)
        except CorruptData:
            continue
        assert found is None and codec == "zstd"
    assert read_index("none", stored_size, raw_size, tail, fetch) is None


def forged_container(blocks: int, raw_claim: int | None = None) -> tuple[bytes, int]:
    """A container whose index lists `blocks` blocks of 1 KiB raw in the fewest stored bytes
    the format allows, end record and checksums right: (object, raw size the entries add up
    to). With `raw_claim`, the end record says that many raw bytes instead."""
    raw = blocks * KIB
    rows = np.empty((blocks, 2), dtype="<u4")
    rows[:, 0], rows[:, 1] = frame.MIN_BLOCK_STORED, KIB
    stored = (
        frame.pack_file_header(KIB)
        + bytes(blocks * frame.MIN_BLOCK_STORED)
        + frame.pack_end(blocks, raw if raw_claim is None else raw_claim)
        + frame.pack_index(rows.tobytes(), KIB)
    )
    return stored, raw


def forged_seek_table(frames: int) -> tuple[bytes, int]:
    """A zstd object whose seek table lists `frames` frames of 1 KiB raw in MIN_FRAME bytes."""
    rows = np.zeros((frames, 3), dtype="<u4")
    rows[:, 0], rows[:, 1] = seektable.MIN_FRAME, KIB
    stored = bytes(frames * seektable.MIN_FRAME) + seektable.pack_rows(rows.tobytes())
    return stored, frames * KIB


def traced_peak(run: Callable[[], object]) -> int:
    tracemalloc.start()
    try:
        run()
    except CorruptData:
        pass
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    return peak


@pytest.mark.parametrize("codec", ["zstd-bytegroup", "zstd"])
def test_a_count_the_raw_size_denies_is_refused_before_any_entry_is_read(codec: str) -> None:
    # 2 MiB objects whose index lists ~50 000 (container) or ~100 000 (zstd) entries, each
    # well formed, for a file of 1 MiB: the encoder writes 1 024 blocks at most for it.
    count = 50_000 if codec == "zstd-bytegroup" else 100_000
    if codec == "zstd-bytegroup":
        stored, _ = forged_container(count, raw_claim=1 << 20)
    else:
        stored, _ = forged_seek_table(count)
    obj = Object(stored)
    peak = traced_peak(lambda: obj.index(codec, 1 << 20, probe=64))
    with pytest.raises(CorruptData, match=f"{count} (blocks|frames)"):
        Object(stored).index(codec, 1 << 20, probe=64)
    assert obj.fetches == []  # refused from the footer alone: no entry fetched, none parsed
    assert peak < 64 * KIB


@pytest.mark.parametrize("codec", ["zstd-bytegroup", "zstd"])
def test_a_large_index_costs_arrays_not_an_object_per_entry(codec: str) -> None:
    # As many entries as 2 MiB of bytes allow, all consistent (a manifest forged to match):
    # the index is read, and costs a few bytes per entry, not a Python object each.
    count = 50_000 if codec == "zstd-bytegroup" else 100_000
    stored, raw = forged_container(count) if codec == "zstd-bytegroup" else forged_seek_table(count)
    entry = frame.ENTRY_SIZE if codec == "zstd-bytegroup" else 12
    found: list[BlockIndex | None] = []
    peak = traced_peak(lambda: found.append(Object(stored).index(codec, raw, probe=64)))
    (index,) = found
    assert index is not None and len(index.blocks) == count
    assert peak < 3 * count * entry + (256 << 10)
    last = index.blocks[-1]
    assert (last.index, last.raw_start, last.raw_len) == (count - 1, raw - KIB, KIB)
    assert last.stored_start + last.stored_len == len(stored) - (
        frame.END_SIZE + count * entry + frame.FOOTER_SIZE
        if codec == "zstd-bytegroup"
        else seektable.table_size(count, True)
    )
    assert [b.index for b in index.covering(raw - KIB - 1, raw - KIB + 1)] == [count - 2, count - 1]


def rewrite_rows(codec: str, stored: bytes, edit: Callable[[list[list[int]]], None]) -> bytes:
    """The object with its index entries edited and the index sealed again (checksum); the
    entries are read here with struct, not by the parsers under test."""
    if codec == "zstd-bytegroup":
        footer = frame.parse_index_footer(stored[-frame.FOOTER_SIZE :])
        at = len(stored) - frame.FOOTER_SIZE - footer.index_len
        rows = [list(r) for r in struct.iter_unpack("<II", stored[at : at + footer.index_len])]
        edit(rows)
        index = b"".join(frame.pack_entry(*row) for row in rows)
        return stored[:at] + frame.pack_index(index, footer.block_size)
    size = struct.unpack("<I", stored[-9:-5])[0] * 12 + 17
    rows = [list(r) for r in struct.iter_unpack("<III", stored[-size + 8 : -9])]
    edit(rows)
    return stored[:-size] + seektable.pack_rows(b"".join(seektable.row(*r) for r in rows))


def test_a_block_stored_longer_than_the_encoder_can_write_is_refused() -> None:
    # Block 1 claims 100 bytes more than a header and its raw bytes; block 0 gives them up so
    # the sums still agree. The container never stores a payload longer than its raw bytes.
    data = np.random.default_rng(3).integers(0, 256, 3 * KIB, dtype=np.uint8).tobytes()
    _, stored = encode(data, "zstd-bytegroup", KIB)

    def move(rows: list[list[int]]) -> None:
        assert rows[0][0] > 150 and rows[1][0] == KIB + frame.BLOCK_FIXED_SIZE + 9
        rows[0][0] -= 100
        rows[1][0] += 100

    with pytest.raises(CorruptData, match=f"index entry 1: {KIB + 133} stored / {KIB} raw"):
        Object(rewrite_rows("zstd-bytegroup", stored, move)).index("zstd-bytegroup", len(data))


def test_frames_smaller_than_any_block_size_are_refused() -> None:
    # Ten frames of 1000 raw bytes: consistent sums, but the encoder's block size is >= 1 KiB.
    data = floats(10_000)
    coder = zstandard.ZstdCompressor(write_checksum=True)
    frames = [coder.compress(data[i : i + 1000]) for i in range(0, 10_000, 1000)]
    rows = b"".join(seektable.row(len(f), 1000, int.from_bytes(f[-4:], "little")) for f in frames)
    stored = b"".join(frames) + seektable.pack_rows(rows)
    with pytest.raises(CorruptData, match="10 frames of 1000 bytes"):
        Object(stored).index("zstd", len(data))
    with pytest.raises(CorruptData, match=r"frame 1 \(raw offset 1000\): .* after the last frame"):
        stream("zstd", stored)


@pytest.mark.parametrize("codec", ["zstd-bytegroup", "zstd"])
def test_a_refused_entry_is_named(codec: str) -> None:
    data = floats(5 * KIB)
    _, stored = encode(data, codec, KIB)

    def shrink(rows: list[list[int]]) -> None:
        rows[4][0] += rows[3][0] - 5  # block 3 shorter than any block, the sums kept
        rows[3][0] = 5

    with pytest.raises(CorruptData, match="entry 3: 5 stored / 1024 raw"):
        Object(rewrite_rows(codec, stored, shrink)).index(codec, len(data))


class Counted(io.BytesIO):
    """A source that counts the bytes read from it."""

    taken = 0

    def read(self, size: int | None = -1) -> bytes:
        data = super().read(size)
        self.taken += len(data)
        return data


@pytest.mark.parametrize("kind", ["empty frames", "skippable frames", "1000-byte frames"])
def test_a_stream_of_frames_the_encoder_never_writes_stops_at_the_second(kind: str) -> None:
    # 4 MiB of frames that each cost a call and yield nothing (or too little), then a frame
    # of data: refused at the second frame, within the first chunk read, not decoded through
    # (7.7 s of CPU for the empty frames before, and 8.2 s for the skippable ones).
    data = floats(10 * KIB)
    coder = zstandard.ZstdCompressor(write_checksum=True)
    unit = {
        "empty frames": coder.compress(b""),
        "skippable frames": struct.pack("<II", seektable.SKIPPABLE_FIRST, 0),
        "1000-byte frames": coder.compress(bytes(1000)),
    }[kind]
    src = Counted(unit * ((4 << 20) // len(unit)) + coder.compress(data))
    what = "skippable frame 2 after 0 frames" if kind == "skippable frames" else "frame 1 "
    with pytest.raises(CorruptData, match=what):
        decode_stream("zstd", src, io.BytesIO())
    assert src.taken <= 1 << 20



def test_a_container_of_blocks_shorter_than_its_block_size_stops_at_the_second() -> None:
    # 4 MiB of one-byte blocks, each well formed, with a right end record and index: the
    # encoder cuts every block but the last at block_size, so the second is refused before it
    # is read (decoded through before: 1.1 s of CPU for 100,000 bytes out).
    one = b"\x07"
    check = xxhash.xxh3_64_intdigest(one)
    head = frame.BlockHeader(1, 1, 0, 0, check, check, (frame.PlaneEntry(frame.METHOD_RAW, 1),))
    block = frame.pack_block_header(head) + one
    count = (4 << 20) // (len(block) + frame.ENTRY_SIZE)
    src = Counted(
        frame.pack_file_header(KIB)
        + block * count
        + frame.pack_end(count, count)
        + frame.pack_index(frame.pack_entry(len(block), 1) * count, KIB)
    )
    with pytest.raises(CorruptData, match=r"block 1 \(raw offset 1\): a block after a short"):
        decode_stream("zstd-bytegroup", src, io.BytesIO())
    assert src.taken < 2 * len(block) + frame.FILE_HEADER_SIZE + 4
