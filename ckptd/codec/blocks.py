"""Per-block decisions and coding: sample a block, pick raw / plain zstd / byte planes, encode.

Owns the choice rules and the zstd parameter sets; does no I/O and keeps no state between
blocks (so blocks can be coded on any thread). Layout of the output is in `frame`.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
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
# Bytes of the sample used to find the element phase: a byte histogram needs far less than zstd.
PHASE_PROBE = 16 << 10
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
    phase: int = 0  # bytes before the first element, for tensors not aligned to the block


RAW = Choice(1, (False,))
PLAIN = Choice(1, (True,))
# A sample that zstd, run over it whole, shrinks by less than this is incompressible (random,
# already compressed): float data always gives 5-25% through its exponent bytes.
INCOMPRESSIBLE = 0.99


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
    whole = coders.frame if policy.allow_plain else coders.plane
    cost = len(whole.compress(probe))
    if cost >= size * INCOMPRESSIBLE:
        return RAW
    if policy.allow_plain and cost < best_cost:
        best, best_cost = PLAIN, cost
    hist8 = _column_hist(probe)
    for width in policy.widths:
        if width >= size:
            continue
        for phase in _phases(hist8, width):
            choice, cost = _plane_choice(probe, width, phase, coders, ws)
            if cost < best_cost:
                best, best_cost = choice, cost
    return best


def _phases(hist8: npt.NDArray[np.float64], width: int) -> list[int]:
    """Phase 0, and the phase that puts the lowest-entropy byte column on top of each element.

    Tensors inside a DCP shard start at arbitrary offsets, so a float's exponent byte need not
    be the last of each `width` bytes counted from the block start.
    """
    if width == 1:
        return [0]
    hist = hist8.reshape(8 // width, width, 256).sum(axis=0)
    freq = hist / np.maximum(hist.sum(axis=1, keepdims=True), 1.0)
    logs = np.log2(freq, out=np.zeros_like(freq), where=freq > 0)
    entropy = -(freq * logs).sum(axis=1)
    phase = (int(np.argmin(entropy)) + 1) % width
    return [0] if phase == 0 else [0, phase]


def _column_hist(probe: memoryview | bytes) -> npt.NDArray[np.float64]:
    """Byte histogram of each column `offset mod 8` over the first PHASE_PROBE bytes."""
    count = min(len(probe), PHASE_PROBE) // 8
    cols = np.frombuffer(probe, dtype=np.uint8, count=count * 8).reshape(count, 8)
    keys = cols.astype(np.uint16) + np.arange(8, dtype=np.uint16) * 256
    return np.bincount(keys.ravel(), minlength=8 * 256).astype(np.float64)


def _plane_choice(
    probe: memoryview | bytes, width: int, phase: int, coders: Coders, ws: Workspace
) -> tuple[Choice, int]:
    body = memoryview(probe)[phase:]
    cost = phase + len(body) % width
    flags = []
    for plane in planes.split(body, width, True, ws):
        packed = len(coders.plane.compress(plane.data))
        pays = packed < len(plane) * (1.0 - PLANE_MIN_SAVING)
        flags.append(pays)
        cost += packed if pays else len(plane)
    return Choice(width, tuple(flags), phase), cost


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
            head = _header(data, Choice(1, (True,)), checksum, [len(packed)], [packed])
            return Encoded("zstd", len(data), head, [packed])
    # A raw block's payload is the block itself: its two checksums are the same number.
    head = _header(data, RAW, checksum, [len(data)], [], stored_checksum=checksum)
    return Encoded("raw", len(data), head, [data])


def _encode_planes(
    data: memoryview, choice: Choice, coders: Coders, checksum: int, ws: Workspace
) -> Encoded:
    width, phase = choice.width, choice.phase
    body = data[phase:]
    sizes: list[int] = []
    packed_planes: list[bytes | memoryview] = []
    methods: list[bool] = []
    split = planes.split(body, width, True, ws)
    for plane, wanted in zip(split, choice.zstd_planes, strict=True):
        packed = coders.plane.compress(plane.data) if wanted else b""
        use = wanted and len(packed) < len(plane)
        methods.append(use)
        sizes.append(len(packed) if use else len(plane))
        packed_planes.append(packed if use else plane.data)
    if not any(methods):
        return _encode_single(data, RAW, coders, checksum)
    tail = len(body) % width
    payload = [data[:phase], *packed_planes, body[len(body) - tail :]]
    payload = [piece for piece in payload if len(piece)]
    final = Choice(width, tuple(methods), phase)
    return Encoded("planes", len(data), _header(data, final, checksum, sizes, payload), payload)


def _header(
    data: memoryview,
    choice: Choice,
    checksum: int,
    sizes: list[int],
    payload: list[bytes | memoryview],
    stored_checksum: int | None = None,
) -> bytes:
    if stored_checksum is None:
        stored = xxhash.xxh3_64()
        for piece in payload:
            stored.update(piece)
        stored_checksum = stored.intdigest()
    methods = [frame.METHOD_ZSTD if z else frame.METHOD_RAW for z in choice.zstd_planes]
    head = BlockHeader(
        raw_len=len(data),
        width=choice.width,
        transform=frame.TRANSFORM_SIGN_ROTATE if choice.width > 1 else frame.TRANSFORM_NONE,
        phase=choice.phase,
        checksum=checksum,
        stored_checksum=stored_checksum,
        planes=tuple(PlaneEntry(m, n) for m, n in zip(methods, sizes, strict=True)),
    )
    return frame.pack_block_header(head)
