"""Bounded property tests of the block index parsers (the container's index record and footer,
the zstd seek table): objects written by ckptd's own encoder, mutated where the index lives
(bits flipped, cut short, the count set to anything up to 2**32 - 1, entries swapped or set to
any value, the index sealed again so its checksum does not hide the change), read by range and
as a stream. Every outcome is the original bytes or CorruptData, never another exception, and
no input costs more than a bounded amount of CPU. A few hundred cases a run."""

from __future__ import annotations

import io
import json
import struct
import time
from pathlib import Path

import numpy as np
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptd.codec import TAIL_PROBE, decode_block, decode_stream, frame, make_encoder, read_index
from ckptd.codec import seektable as table
from ckptd.errors import CorruptData

GOLDEN = Path(__file__).parent.parent / "golden" / "codec"
KIB = 1 << 10
CPU_PER_INPUT = 2.0  # seconds: generous for a 2-core machine shared by many; a read takes ms


def _weights(size: int) -> bytes:
    values = (np.random.default_rng(size).standard_normal(size // 4 + 1) * 0.02).astype(np.float32)
    text = b"".join(b'{"step": %d}\n' % i for i in range(size // 10))
    return (values.tobytes()[: size // 2] + text)[:size]


def _encode(data: bytes, codec: str, block_size: int) -> bytes:
    out = io.BytesIO()
    enc = make_encoder(codec, out, block_size=block_size)
    enc.update(0, memoryview(data))
    enc.finish(len(data))
    assert enc.codec == codec
    return out.getvalue()


def _objects() -> list[tuple[str, bytes, bytes]]:
    """(codec, stored, raw) written by the encoder: several shapes, and the golden objects."""
    found = []
    for codec in ("zstd-bytegroup", "zstd"):
        for size, block in ((5 * KIB + 100, KIB), (4 * KIB, KIB), (3 * KIB, 2 * KIB), (0, KIB)):
            data = _weights(size)
            found.append((codec, _encode(data, codec, block), data))
    want = json.loads((GOLDEN / "golden.json").read_text())
    for name in ("v3-fp32.zbg", "v3-bf16-seekable.zst"):
        codec = str(want[name]["codec"])
        stored = (GOLDEN / name).read_bytes()
        dst = io.BytesIO()
        decode_stream(codec, io.BytesIO(stored), dst)
        found.append((codec, stored, dst.getvalue()))
    return found


OBJECTS = _objects()


def _index_at(codec: str, stored: bytes) -> tuple[int, int, int]:
    """(where the entries start, entry size, count) of an unmutated object."""
    if codec == "zstd-bytegroup":
        head = frame.parse_index_footer(stored[-frame.FOOTER_SIZE :])
        return len(stored) - frame.FOOTER_SIZE - head.index_len, frame.ENTRY_SIZE, head.blocks
    (count,) = struct.unpack_from("<I", stored, len(stored) - table.FOOTER_SIZE)
    return len(stored) - table.table_size(count, True) + table.SKIP_HEADER_SIZE, 12, count


def _reseal(codec: str, stored: bytearray) -> None:
    """Make the container footer's checksum right again for whatever its fields now claim,
    when the bytes it claims are in the object (the seek table carries no checksum)."""
    if codec != "zstd-bytegroup" or len(stored) < frame.FOOTER_SIZE:
        return
    foot = len(stored) - frame.FOOTER_SIZE
    (index_len,) = struct.unpack_from("<Q", stored, foot)
    if index_len > foot:
        return
    check = xxhash.xxh32(bytes(stored[foot - index_len : foot]))
    check.update(bytes(stored[foot : foot + 20]))
    struct.pack_into("<I", stored, foot + 20, check.intdigest())


def _set_count(codec: str, stored: bytearray, count: int) -> None:
    if codec == "zstd-bytegroup":
        foot = len(stored) - frame.FOOTER_SIZE
        struct.pack_into("<QI", stored, foot, count * frame.ENTRY_SIZE, count)
    else:
        struct.pack_into("<I", stored, len(stored) - table.FOOTER_SIZE, count)


def mutate(codec: str, stored: bytes, how: str, a: int, b: int, reseal: bool) -> bytes:
    out = bytearray(stored)
    start, entry, count = _index_at(codec, stored)
    if how == "flip":  # a bit in the last 400 bytes (index, footer, end record, last blocks)
        at = len(out) - 1 - a % min(len(out), 400)
        out[at] ^= 1 << (b % 8)
    elif how == "cut":
        del out[len(out) - 1 - a % len(out) :]
    elif how == "count":
        # the count the bytes allow at most, just off the true one, or anything up to 2**32 - 1
        most = len(out) // (frame.MIN_BLOCK_STORED if codec == "zstd-bytegroup" else 9)
        choices = (0, 1, count - 1, count + 1, most, most + 1, 2**31, 2**32 - 1, a)
        _set_count(codec, out, choices[b % len(choices)] % 2**32)
    elif how == "swap" and count:
        i, j = a % count, b % count
        x, y = start + i * entry, start + j * entry
        out[x : x + entry], out[y : y + entry] = out[y : y + entry], out[x : x + entry]
    elif how == "set" and count:
        fields = entry // 4
        at = start + (a % (count * fields)) * 4
        struct.pack_into("<I", out, at, b % 2**32)
    if reseal:
        _reseal(codec, out)
    return bytes(out)


def read_by_range(codec: str, stored: bytes, raw_size: int) -> bytes | None:
    """All raw bytes through the index and decode_block, as the remote reader does."""
    fetched = [0]

    def fetch(start: int, end: int) -> bytes:
        assert 0 <= start < end <= len(stored), (start, end)
        fetched[0] += 1
        return stored[start:end]

    tail = stored[len(stored) - min(TAIL_PROBE // 64, len(stored)) :]  # small: fetches happen
    index = read_index(codec, len(stored), raw_size, tail, fetch)
    assert fetched[0] <= 1  # the index is fetched in one request, or not at all
    if index is None:
        return None
    out = bytearray(raw_size)
    view = memoryview(out)
    for block in index.covering(0, raw_size):
        piece = memoryview(stored)[block.stored_start : block.stored_start + block.stored_len]
        decode_block(codec, block, piece, view[block.raw_start :], index.version)
    return bytes(out)


def read_stream(codec: str, stored: bytes) -> bytes:
    dst = io.BytesIO()
    decode_stream(codec, io.BytesIO(stored), dst)
    return dst.getvalue()


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.integers(0, len(OBJECTS) - 1),
    st.sampled_from(["flip", "cut", "count", "swap", "set"]),
    st.integers(0, 2**32 - 1),
    st.integers(0, 2**32 - 1),
    st.booleans(),
    st.sampled_from(["same", "same", "same", "more", "less", "zero", "huge"]),
)
def test_a_mutated_index_reads_right_or_is_corrupt_data(
    which: int, how: str, a: int, b: int, reseal: bool, claim: str
) -> None:
    codec, stored, data = OBJECTS[which]
    mutated = mutate(codec, stored, how, a, b, reseal)
    # The raw size is the manifest's, a number from the bucket too.
    sizes = {"more": len(data) + 1, "less": max(len(data) - 1, 0), "zero": 0, "huge": 1 << 40}
    raw_size = sizes.get(claim, len(data))
    cpu = time.process_time()
    try:
        got = read_by_range(codec, mutated, raw_size)
    except CorruptData:
        pass
    else:
        # Read without an error: the bytes are the original's (a file of the size asked for),
        # or the object has no index and is read as a stream (checked below).
        assert got is None or (raw_size == len(data) and got == data)
    try:
        streamed = read_stream(codec, mutated)
    except CorruptData:
        pass
    else:
        # zstd objects cut at the table, or before whole frames, are a shorter zstd stream:
        # the manifest's size and hash reject those.
        assert streamed == data or (codec == "zstd" and data.startswith(streamed))
    assert time.process_time() - cpu < CPU_PER_INPUT


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=300), st.sampled_from(["zstd-bytegroup", "zstd"]), st.integers(0, 2**40))
def test_any_tail_is_an_index_none_or_corrupt_data(tail: bytes, codec: str, raw_size: int) -> None:
    # Any bytes, and the same with the footer's magic appended so the parsers run on them.
    magic = {"zstd-bytegroup": frame.INDEX_MAGIC, "zstd": struct.pack("<I", table.SEEKABLE_MAGIC)}
    for stored in (tail, tail + magic[codec]):
        try:
            read_by_range(codec, stored, raw_size)
        except CorruptData:
            pass
