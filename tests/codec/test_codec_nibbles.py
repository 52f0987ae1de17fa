"""Exponent-nibble planes (container version 2): round trips, the choice, and corrupt input."""

from __future__ import annotations

import io
import struct
from collections.abc import Callable

import numpy as np
import pytest
import torch
import xxhash
import zstandard
from support.codec_data import BLOCK, decode, encode, trained_weights

from ckptd.codec import frame, nibbles, planes
from ckptd.errors import CorruptData


def _blocks(stored: bytes) -> list[tuple[int, frame.BlockHeader]]:
    """(header start, header) of each block of a container."""
    pos, found = frame.FILE_HEADER_SIZE, []
    while not frame.is_end(stored[pos : pos + 4]):
        fixed = stored[pos : pos + frame.BLOCK_FIXED_SIZE]
        rest = stored[pos + len(fixed) : pos + len(fixed) + frame.table_size(fixed)]
        head = frame.parse_block_header(fixed, rest, len(found), frame.MAX_BLOCK)
        found.append((pos, head))
        pos += len(fixed) + len(rest) + head.stored_len
    return found


def _methods(stored: bytes) -> list[int]:
    return [p.method for _, head in _blocks(stored) for p in head.planes]


def _layers(dtype: torch.dtype) -> bytes:
    """The weights of two initialised linear layers (no optimizer state)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 192), torch.nn.Linear(192, 128))
    flat = torch.cat([p.detach().flatten() for p in model.parameters()]).to(dtype)
    return flat.view(torch.uint8).numpy().tobytes()


def _weights(dtype: torch.dtype, zeros: float = 0.0, layers: bool = False) -> bytes:
    """Weights with a share of exact zeros (exponent 0: outside any nibble window)."""
    raw = _layers(dtype) if layers else trained_weights(dtype, steps=5)
    data = np.frombuffer(raw, dtype=np.uint8).copy()
    width = torch.finfo(dtype).bits // 8
    elems = data.view({2: np.uint16, 4: np.uint32}[width])
    rng = np.random.default_rng(3)
    elems[rng.random(len(elems)) < zeros] = 0
    return data.tobytes()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("zeros", [0.0, 0.01, 0.3])
def test_float_weights_round_trip(dtype: torch.dtype, zeros: float) -> None:
    data = _weights(dtype, zeros)
    for codec in ("auto", "zstd-bytegroup"):
        enc, stored = encode(data, codec)
        assert decode(enc.codec, stored) == data


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_exponents_are_coded_as_nibbles(dtype: torch.dtype) -> None:
    data = _weights(dtype, zeros=0.01, layers=True)  # escapes, enough to be zstd-coded
    enc, stored = encode(data, "zstd-bytegroup")
    assert _methods(stored).count(frame.METHOD_NIBBLES) >= len(data) // BLOCK - 1
    assert decode(enc.codec, stored) == data
    _, plain = encode(data, "zstd")
    assert len(stored) < 0.9 * len(plain)


@pytest.mark.parametrize("shift", [1, 3])
@pytest.mark.parametrize("cut", [0, 1, 7])
def test_unaligned_and_odd_lengths(shift: int, cut: int) -> None:
    data = b"\x01" * shift + _weights(torch.bfloat16, 0.01)
    data = data[: len(data) - cut]
    enc, stored = encode(data, "zstd-bytegroup", chunk=9_999)
    assert frame.METHOD_NIBBLES in _methods(stored)
    assert decode(enc.codec, stored) == data


@pytest.mark.parametrize("count", [0, 1, 2, 3, 4, 5, 999, 4096])
def test_pack_unpack_nibbles(count: int) -> None:
    rng = np.random.default_rng(count)
    for base in (0, 17, nibbles.MAX_NIBBLE_BASE):
        top = (base + rng.integers(0, 16, count)).astype(np.uint8)
        top[rng.random(count) < 0.05] = rng.integers(0, 256)  # escapes, some inside the window
        pairs, escapes = nibbles.pack_nibbles(top, base, planes.Workspace())
        assert len(pairs) == (count + 1) // 2
        got, marks = nibbles.unpack_nibbles(
            pairs.copy(), base, count, escapes.copy(), planes.Workspace()
        )
        assert (got == top).all()
        assert marks == len(escapes)


def _rewrite(stored: bytes, edit: int, change: object, version: int | None = None) -> bytes:
    """`stored` with block `edit`'s payload changed by `change(payload, head)` and every check
    recomputed, so only the decoder's own validation can object."""
    out = bytearray(stored)
    if version is not None:
        out[4] = version
        out[12:16] = struct.pack("<I", xxhash.xxh32_intdigest(bytes(out[:12])))
    pos, head = _blocks(stored)[edit]
    table = 5 * head.width
    start = pos + frame.BLOCK_FIXED_SIZE + table + 4
    payload = bytearray(out[start : start + head.stored_len])
    change(payload, head)  # type: ignore[operator]
    out[start : start + head.stored_len] = payload
    out[pos + 16 : pos + 24] = struct.pack("<Q", xxhash.xxh3_64_intdigest(bytes(payload)))
    fixed_and_table = bytes(out[pos : pos + frame.BLOCK_FIXED_SIZE + table])
    out[start - 4 : start] = struct.pack("<I", xxhash.xxh32_intdigest(fixed_and_table))
    return bytes(out)


def _nibble_block(stored: bytes) -> tuple[int, int]:
    """(block index, offset of its nibble plane in the payload)."""
    for index, (_, head) in enumerate(_blocks(stored)):
        if head.planes[-1].method == frame.METHOD_NIBBLES:
            return index, head.phase + sum(p.stored_len for p in head.planes[:-1])
    raise AssertionError("no nibble plane")


@pytest.fixture(scope="module")
def coded() -> tuple[bytes, int, int]:
    _, stored = encode(_weights(torch.bfloat16, 0.001), "zstd-bytegroup")
    return (stored, *_nibble_block(stored))


def test_version_1_containers_cannot_hold_nibbles(coded: tuple[bytes, int, int]) -> None:
    stored, index, _ = coded
    bad = _rewrite(stored, index, lambda p, h: None, version=1)
    with pytest.raises(CorruptData, match="nibble method on plane 1 \\(version 1\\)"):
        decode("zstd-bytegroup", bad)


@pytest.mark.parametrize(
    ("field", "value", "error"),
    [
        (0, 250, "bad nibble plane head"),  # base beyond 240
        (1, 7, "unknown escape method"),
        (2, 1 << 30, "bad nibble plane head"),  # more escapes than elements
        (6, 1 << 30, "bad nibble plane head"),  # pairs frame longer than the plane
        (6, 3, "zstd"),  # pairs frame cut short
    ],
)
def test_corrupt_nibble_heads_are_named(
    coded: tuple[bytes, int, int], field: int, value: int, error: str
) -> None:
    stored, index, at = coded

    def change(payload: bytearray, head: frame.BlockHeader) -> None:
        fmt = "<B" if field < 2 else "<I"
        struct.pack_into(fmt, payload, at + field, value)

    with pytest.raises(CorruptData, match=error):
        decode("zstd-bytegroup", _rewrite(stored, index, change))


def test_escape_count_mismatch_is_detected(coded: tuple[bytes, int, int]) -> None:
    stored, index, at = coded

    def change(payload: bytearray, head: frame.BlockHeader) -> None:
        method, escapes = struct.unpack_from("<BI", payload, at + 1)
        assert method == frame.ESCAPES_RAW and escapes > 0
        struct.pack_into("<I", payload, at + 2, escapes - 1)

    with pytest.raises(CorruptData, match="escape"):
        decode("zstd-bytegroup", _rewrite(stored, index, change))


def test_decoder_reads_a_stream_in_small_pieces(coded: tuple[bytes, int, int]) -> None:
    stored = coded[0]

    class Trickle(io.RawIOBase):
        def __init__(self) -> None:
            self.pos = 0

        def readinto(self, buf: memoryview) -> int:  # type: ignore[override]
            n = min(len(buf), 777, len(stored) - self.pos)
            buf[:n] = stored[self.pos : self.pos + n]
            self.pos += n
            return n

        def readable(self) -> bool:
            return True

    from ckptd.codec import decode_stream

    out = io.BytesIO()
    decode_stream("zstd-bytegroup", Trickle(), out)  # type: ignore[arg-type]
    assert out.getvalue() == decode("zstd-bytegroup", stored)


@pytest.mark.parametrize("width", [2, 4, 8])
@pytest.mark.parametrize("count", [1, 2, 7, planes.MERGE_CHUNK + 3, 2 * planes.MERGE_CHUNK])
def test_split_packed_matches_split_then_pack(width: int, count: int) -> None:
    rng = np.random.default_rng(width * count)
    data = rng.integers(0, 256, count * width, dtype=np.uint8)
    data[width - 1 :: width] = 0x3C + rng.integers(0, 3, count)  # exponents near 2^-7
    view = memoryview(data.tobytes())
    want = [p.copy() for p in planes.split(view, width, True, planes.Workspace())]
    base = nibbles.nibble_base(want[-1])[0]
    lower, pairs, escapes = nibbles.split_packed(view, width, base, planes.Workspace())
    want_pairs, want_escapes = nibbles.pack_nibbles(want[-1], base, planes.Workspace())
    assert [p.tobytes() for p in lower] == [p.tobytes() for p in want[:-1]]
    assert pairs.tobytes() == want_pairs.tobytes()
    assert escapes.tobytes() == want_escapes.tobytes()


def test_nibbles_that_do_not_pay_store_the_plane_raw() -> None:
    from ckptd.codec import blocks, buffers

    top = np.random.default_rng(5).integers(0, 256, 5000, dtype=np.uint8)  # mostly escapes
    ws = planes.Workspace()
    pairs, escapes = nibbles.pack_nibbles(top, 0, ws)
    method, pieces = blocks._nibbles(pairs, escapes, 0, len(top), buffers.coders(3), ws)
    assert method == frame.METHOD_RAW
    assert b"".join(bytes(p) for p in pieces) == top.tobytes()


def _set_content_size(zframe: bytes, size: int) -> bytes:
    """`zframe` with its Frame_Content_Size field rewritten to `size` (same field width)."""
    fhd = zframe[4]
    single, did, fcs = (fhd >> 5) & 1, fhd & 3, fhd >> 6
    at = 5 + (0 if single else 1) + (0, 1, 2, 4)[did]
    width = (1 if single else 0, 2, 4, 8)[fcs]
    value = size - 256 if width == 2 else size
    assert width and 0 <= value < 1 << (8 * width)
    return zframe[:at] + value.to_bytes(width, "little") + zframe[at + width :]


Swap = Callable[[bytes, bytes], bytes]  # (a zstd frame, its content) -> the frame to store


def _plane_frame_swapped(data: bytes, method: int, swap: Swap) -> tuple[bytes, int, int]:
    """The first block of `data`'s container (header and payload) whose top plane is coded
    with `method`, its zstd frame (the pairs frame of a nibble plane) replaced by
    `swap(frame, content)`, every length and checksum recomputed; with its raw offset and
    length."""
    _, stored = encode(data, "zstd-bytegroup", block_size=frame.MIN_BLOCK << 4)
    blocks = _blocks(stored)
    i = next(i for i, (_, h) in enumerate(blocks) if h.planes[-1].method == method)
    pos, head = blocks[i]
    offset = sum(h.raw_len for _, h in blocks[:i])
    start = pos + frame.BLOCK_FIXED_SIZE + 5 * head.width + 4
    payload = stored[start : start + head.stored_len]
    at = head.phase + sum(p.stored_len for p in head.planes[:-1])
    plane = payload[at : at + head.planes[-1].stored_len]
    if method == frame.METHOD_NIBBLES:
        nib = frame.parse_nibbles_head(memoryview(plane), head.plane_len, "test")
        old = plane[frame.NIBBLES_HEAD_SIZE : nib.escapes_at]
        new = swap(old, _content(old))
        nib = frame.NibblesHead(nib.base, nib.escape_method, nib.escapes, len(new))
        plane = frame.pack_nibbles_head(nib) + new + plane[frame.NIBBLES_HEAD_SIZE + len(old) :]
    else:
        plane = swap(plane, _content(plane))
    payload = payload[:at] + plane + payload[at + head.planes[-1].stored_len :]
    entries = (*head.planes[:-1], frame.PlaneEntry(method, len(plane)))
    new_head = frame.BlockHeader(
        head.raw_len, head.width, head.transform, head.phase, head.checksum,
        xxhash.xxh3_64_intdigest(payload), entries,
    )
    return frame.pack_block_header(new_head) + payload, offset, head.raw_len


def _content(zframe: bytes) -> bytes:
    return zstandard.ZstdDecompressor().decompress(zframe)


def _recoded(content: bytes, declared: int) -> bytes:
    """A zstd frame of `content` that declares `declared` bytes."""
    return _set_content_size(zstandard.ZstdCompressor(level=3).compress(content), declared)


@pytest.mark.parametrize(
    ("swap", "error"),
    [
        (lambda f, c: f, None),  # the frame as written: decodes
        (lambda f, c: _set_content_size(f, len(c) + 1), "does not declare"),
        (lambda f, c: _set_content_size(f, len(c) - 1), "does not declare"),
        (lambda f, c: _recoded(c[:-1], len(c)), "plane 1: decompression error"),  # less
        (lambda f, c: _recoded(c + b"\x01", len(c)), "plane 1: decompression error"),  # more
        (lambda f, c: _recoded(c[:-1] + bytes([c[-1] ^ 1]), len(c)), "checksum"),  # other bytes
    ],
)
@pytest.mark.parametrize(
    ("dtype", "method"),
    [(torch.bfloat16, frame.METHOD_NIBBLES), (torch.float16, frame.METHOD_ZSTD)],
)
def test_a_plane_frame_must_hold_what_the_block_declares(
    swap: Swap, error: str | None, dtype: torch.dtype, method: int
) -> None:
    """Declared sizes, frames that hold less or more than they declare, and other bytes of the
    right length: each is CorruptData naming the block, never more output than declared."""
    from ckptd.codec.decoder import decode_container_block

    data = _weights(dtype, 0.01)
    block, offset, raw_len = _plane_frame_swapped(data, method, swap)
    out = bytearray(raw_len)
    if error is None:
        decode_container_block(memoryview(block), memoryview(out), 0, offset, frame.VERSION)
        assert bytes(out) == data[offset : offset + raw_len]
        return
    with pytest.raises(CorruptData, match=f"block 0 \\(raw offset {offset}\\).*{error}"):
        decode_container_block(memoryview(block), memoryview(out), 0, offset, frame.VERSION)
