"""Per-block decisions and coding: sample a block, pick raw / plain zstd / byte planes, encode.

Owns the choice rules and the zstd parameter sets; does no I/O and keeps no state between
blocks (so blocks can be coded on any thread). Layout of the output is in `frame`.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import xxhash
import zstandard

from ckptd.codec import frame, planes
from ckptd.codec.frame import BlockHeader, PlaneEntry
from ckptd.codec.planes import Workspace

# Measured on bf16/fp32 exponent planes: fast strategy with a tiny hash table and the longest
# minimum match leaves nearly everything to the Huffman literal coder: ~0.342 vs 0.370 for level 1
# (the order-0 entropy is 0.342) and ~2.5x faster. Higher levels only find short useless matches.
PLANE_PARAMS = zstandard.ZstdCompressionParameters(
    window_log=17,
    hash_log=6,
    chain_log=6,
    search_log=1,
    min_match=7,
    target_length=0,
    strategy=zstandard.STRATEGY_FAST,
    write_content_size=True,
    write_checksum=False,
)
# Many small slices rather than a few big ones: a block often holds several tensors, and a
# compressible one covering a tenth of the block is missed by 4 slices (measured on MiniLM fp32).
SAMPLE_SLICES = 16
SAMPLE_SLICE = 4 << 10
# A plane whose sample saves less than this is stored raw: decoding it would cost more than
# the bytes are worth. Kept below the block-level min_saving because exponent planes carry the
# saving and a 2% mantissa plane still adds to it cheaply.
PLANE_MIN_SAVING = 0.01


@dataclass(frozen=True)
class Policy:
    """What a block may become: plain zstd (auto only), byte planes of these widths, or raw."""

    level: int
    min_saving: float
    widths: tuple[int, ...]
    allow_plain: bool


@dataclass(frozen=True)
class Choice:
    width: int  # 1 with zstd_planes=(True,) is plain zstd; 1 with (False,) is raw
    zstd_planes: tuple[bool, ...]


RAW = Choice(1, (False,))
PLAIN = Choice(1, (True,))


class Coders(threading.local):
    """One set of zstd contexts per thread: sharing one context between threads crashes."""

    def __init__(self, level: int) -> None:
        self.level = level
        self.frame = zstandard.ZstdCompressor(
            level=level, write_checksum=True, write_content_size=True
        )
        self.plane = zstandard.ZstdCompressor(compression_params=PLANE_PARAMS)


def sample(data: memoryview) -> memoryview | bytes:
    """A few slices spread over the block, each starting at a multiple of 8 within it."""
    if len(data) <= SAMPLE_SLICES * SAMPLE_SLICE:
        return data
    step = len(data) // SAMPLE_SLICES
    starts = [(i * step) & ~7 for i in range(SAMPLE_SLICES)]
    return b"".join(data[s : s + SAMPLE_SLICE] for s in starts)


def choose(data: memoryview, policy: Policy, coders: Coders, ws: Workspace) -> Choice:
    """The cheapest representation of the block, judged on a sample."""
    probe = sample(data)
    size = len(probe)
    best, best_cost = RAW, size * (1.0 - policy.min_saving)
    if policy.allow_plain:
        cost = len(coders.frame.compress(probe))
        if cost < best_cost:
            best, best_cost = PLAIN, cost
    for width in policy.widths:
        if width >= size:
            continue
        choice, cost = _plane_choice(probe, width, coders, ws)
        if cost < best_cost:
            best, best_cost = choice, cost
    return best


def _plane_choice(
    probe: memoryview | bytes, width: int, coders: Coders, ws: Workspace
) -> tuple[Choice, int]:
    cost = len(probe) % width
    flags = []
    for plane in planes.split(probe, width, True, ws):
        packed = len(coders.plane.compress(plane.data))
        pays = packed < len(plane) * (1.0 - PLANE_MIN_SAVING)
        flags.append(pays)
        cost += packed if pays else len(plane)
    return Choice(width, tuple(flags)), cost


@dataclass
class Encoded:
    """One coded block: its container header and payload pieces, in write order."""

    kind: str  # "raw", "zstd" (payload is one zstd frame with checksum) or "planes"
    raw_len: int
    header: bytes
    payload: list[bytes | memoryview]

    def pieces(self) -> list[bytes | memoryview]:
        return [self.header, *self.payload]

    def owned(self) -> Encoded:
        """A copy that no longer points into the caller's buffers."""
        return Encoded(self.kind, self.raw_len, self.header, [bytes(p) for p in self.payload])


def encode_frame(data: memoryview, coders: Coders) -> bytes:
    """One stock zstd frame (content size and checksum included) for the `zstd` codec."""
    return coders.frame.compress(data)


def encode_block(data: memoryview, policy: Policy, coders: Coders, ws: Workspace) -> Encoded:
    """Choose and encode one container block; raw planes in the result point into `ws`."""
    return encode(data, choose(data, policy, coders, ws), coders, ws)


def encode(data: memoryview, choice: Choice, coders: Coders, ws: Workspace) -> Encoded:
    """Encode one container block as `choice` says (falling back to raw when it does not pay)."""
    checksum = xxhash.xxh3_64_intdigest(data)
    if choice.width == 1:
        return _encode_single(data, choice, coders, checksum)
    return _encode_planes(data, choice, coders, checksum, ws)


def _encode_single(data: memoryview, choice: Choice, coders: Coders, checksum: int) -> Encoded:
    if choice.zstd_planes[0]:
        packed = coders.frame.compress(data)
        if len(packed) < len(data):
            head = _header(data, 1, checksum, [(frame.METHOD_ZSTD, len(packed))], [packed])
            return Encoded("zstd", len(data), head, [packed])
    head = _header(data, 1, checksum, [(frame.METHOD_RAW, len(data))], [data])
    return Encoded("raw", len(data), head, [data])


def _encode_planes(
    data: memoryview, choice: Choice, coders: Coders, checksum: int, ws: Workspace
) -> Encoded:
    width = choice.width
    entries: list[tuple[int, int]] = []
    payload: list[bytes | memoryview] = []
    for plane, wanted in zip(planes.split(data, width, True, ws), choice.zstd_planes, strict=True):
        packed = coders.plane.compress(plane.data) if wanted else b""
        if wanted and len(packed) < len(plane):
            entries.append((frame.METHOD_ZSTD, len(packed)))
            payload.append(packed)
        else:
            entries.append((frame.METHOD_RAW, len(plane)))
            payload.append(plane.data)
    if all(method == frame.METHOD_RAW for method, _ in entries):
        return _encode_single(data, RAW, coders, checksum)
    tail = len(data) % width
    if tail:
        payload.append(data[len(data) - tail :])
    head = _header(data, width, checksum, entries, payload)
    return Encoded("planes", len(data), head, payload)


def _header(
    data: memoryview,
    width: int,
    checksum: int,
    entries: list[tuple[int, int]],
    payload: list[bytes | memoryview],
) -> bytes:
    stored = xxhash.xxh3_64()
    for piece in payload:
        stored.update(piece)
    transform = frame.TRANSFORM_SIGN_ROTATE if width > 1 else frame.TRANSFORM_NONE
    head = BlockHeader(
        raw_len=len(data),
        width=width,
        transform=transform,
        checksum=checksum,
        stored_checksum=stored.intdigest(),
        planes=tuple(PlaneEntry(m, n) for m, n in entries),
    )
    return frame.pack_block_header(head)
