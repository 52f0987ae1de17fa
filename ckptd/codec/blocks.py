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

from ckptd.codec import frame, nibbles, planes
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
# The top plane is coded as exponent nibbles when a 15-value window holds at least this share
# of the sample (the rest are escapes, one byte each); on trained bf16/fp32 weights the window
# holds 99.9% and the nibble pairs reach the plane's Huffman size at 4x zstd's speed.
NIBBLE_MIN_SHARE = 0.8
# Above this share, nibbles are taken without pricing plain zstd on the plane too.
NIBBLE_SURE_SHARE = 0.99
# Byte columns whose entropies differ by less than this from the columns 2 bytes on are taken
# as 2-periodic. bf16 MiniLM/TinyLM samples differ by at most ~0.1 bit; fp32 by ~5 bits.
PERIODIC_BITS = 0.5
# Escape lists shorter than this stay raw: a zstd frame would not pay for its call.
ESCAPES_MIN_ZSTD = 256


@dataclass(frozen=True)
class BlockPolicy:
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
    nibble_base: int = -1  # >= 0: the top plane is coded as exponent nibbles from this base


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
    """A few slices spread over the block, each starting at a multiple of 8 within it.

    Each slice sits in the middle of its sixteenth of the block: slices at the very start
    over-weighted a file's header (a 5 KB safetensors header made 8% of the sample and sent a
    random mantissa plane through zstd for nothing).
    """
    if len(data) <= SAMPLE_SLICES * SAMPLE_SLICE:
        return data
    step = len(data) // SAMPLE_SLICES
    offset = (step - SAMPLE_SLICE) // 2
    starts = [(i * step + offset) & ~7 for i in range(SAMPLE_SLICES)]
    return b"".join(data[s : s + SAMPLE_SLICE] for s in starts)


def choose(data: memoryview, policy: BlockPolicy, coders: Coders, ws: Workspace) -> Choice:
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
    skip = _narrower_suffices(hist8, policy.widths)
    for width in policy.widths:
        if width >= size or width in skip:
            continue
        for phase in _phases(hist8, width):
            choice, cost = _plane_choice(probe, width, phase, coders, ws)
            if cost < best_cost:
                best, best_cost = choice, cost
    return best


def _column_entropy(hist8: npt.NDArray[np.float64], width: int) -> npt.NDArray[np.float64]:
    """Order-0 entropy (bits) of each byte column `offset mod width`."""
    hist = hist8.reshape(8 // width, width, 256).sum(axis=0)
    freq = hist / np.maximum(hist.sum(axis=1, keepdims=True), 1.0)
    logs = np.log2(freq, out=np.zeros_like(freq), where=freq > 0)
    return np.asarray(-(freq * logs).sum(axis=1))


def _narrower_suffices(hist8: npt.NDArray[np.float64], widths: tuple[int, ...]) -> set[int]:
    """Widths not worth pricing: 4 when the byte columns repeat every 2 bytes (bf16, fp16),
    since 4 planes then hold the same statistics as 2 (saves a quarter of the choice's time)."""
    if not {2, 4} <= set(widths):
        return set()
    cols = _column_entropy(hist8, 8)
    return {4} if float(np.abs(cols[:6] - cols[2:]).max()) < PERIODIC_BITS else set()


def _phases(hist8: npt.NDArray[np.float64], width: int) -> list[int]:
    """Phase 0, and the phase that puts the lowest-entropy byte column on top of each element.

    Tensors inside a DCP shard start at arbitrary offsets, so a float's exponent byte need not
    be the last of each `width` bytes counted from the block start.
    """
    if width == 1:
        return [0]
    phase = (int(np.argmin(_column_entropy(hist8, width))) + 1) % width
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
    split = planes.split(body, width, True, ws)
    base, nibble_cost, sure = _nibble_price(split[-1], coders, ws) if width > 1 else (-1, 0, False)
    for i, plane in enumerate(split):
        raw = len(plane)
        packed = raw if i == width - 1 and sure else len(coders.plane.compress(plane.data))
        if i == width - 1 and base >= 0:
            if nibble_cost < min(packed, raw * (1.0 - PLANE_MIN_SAVING)):
                flags.append(False)
                cost += nibble_cost
                continue
            base = -1
        pays = packed < raw * (1.0 - PLANE_MIN_SAVING)
        flags.append(pays)
        cost += packed if pays else raw
    return Choice(width, tuple(flags), phase, base), cost


def _nibble_price(top: planes.Plane, coders: Coders, ws: Workspace) -> tuple[int, int, bool]:
    """(base, stored bytes, sure to win) of `top` as exponent nibbles; base -1 when they do
    not apply (too many exponents outside any 15-value window)."""
    base, share = nibbles.nibble_base(top)
    if len(top) < 2 or share < NIBBLE_MIN_SHARE:
        return -1, 0, False
    pairs, escapes = nibbles.pack_nibbles(top, base, ws)
    kept = len(escapes)
    if kept >= 16:  # priced as the block would code them (zstd from ESCAPES_MIN_ZSTD)
        kept = min(kept, len(coders.plane.compress(escapes.tobytes())))
    cost = frame.NIBBLES_HEAD_SIZE + len(coders.plane.compress(pairs.data)) + kept
    return base, cost, share >= NIBBLE_SURE_SHARE


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


def encode_block(data: memoryview, policy: BlockPolicy, coders: Coders, ws: Workspace) -> Encoded:
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
            head = _header(data, PLAIN, checksum, [(frame.METHOD_ZSTD, len(packed))], [packed])
            return Encoded("zstd", len(data), head, [packed])
    # A raw block's payload is the block itself: its two checksums are the same number.
    table = [(frame.METHOD_RAW, len(data))]
    head = _header(data, RAW, checksum, table, [], stored_checksum=checksum)
    return Encoded("raw", len(data), head, [data])


def _encode_planes(
    data: memoryview, choice: Choice, coders: Coders, checksum: int, ws: Workspace
) -> Encoded:
    width, phase = choice.width, choice.phase
    body = data[phase:]
    table: list[tuple[int, int]] = []
    stored: list[bytes | memoryview] = []
    if choice.nibble_base >= 0:
        lower, pairs, escapes = nibbles.split_packed(body, width, choice.nibble_base, ws)
    else:
        lower = planes.split(body, width, True, ws)
    for plane, wanted in zip(lower, choice.zstd_planes, strict=False):
        method, pieces = _zstd_plane(plane, wanted, coders)
        table.append((method, sum(len(p) for p in pieces)))
        stored += pieces
    if choice.nibble_base >= 0:
        count = len(body) // width
        method, pieces = _nibbles(pairs, escapes, choice.nibble_base, count, coders, ws)
        table.append((method, sum(len(p) for p in pieces)))
        stored += pieces
    if all(method == frame.METHOD_RAW for method, _ in table):
        return _encode_single(data, RAW, coders, checksum)
    tail = len(body) % width
    payload = [data[:phase], *stored, body[len(body) - tail :]]
    payload = [piece for piece in payload if len(piece)]
    head = _header(data, choice, checksum, table, payload)
    return Encoded("planes", len(data), head, payload)


Pieces = list[bytes | memoryview]


def _zstd_plane(plane: planes.Plane, wanted: bool, coders: Coders) -> tuple[int, Pieces]:
    if wanted:
        packed = coders.plane.compress(plane.data)
        if len(packed) < len(plane):
            return frame.METHOD_ZSTD, [packed]
    return frame.METHOD_RAW, [plane.data]


def _nibbles(
    pairs: planes.Plane,
    escapes: planes.Plane,
    base: int,
    count: int,
    coders: Coders,
    ws: Workspace,
) -> tuple[int, Pieces]:
    """The top plane as exponent nibbles (docs/FORMAT.md), or raw if that is not shorter."""
    packed = coders.plane.compress(pairs.data)
    method, kept = frame.ESCAPES_RAW, escapes.tobytes()
    if len(escapes) >= ESCAPES_MIN_ZSTD:
        squeezed = coders.plane.compress(kept)
        if len(squeezed) < len(kept):
            method, kept = frame.ESCAPES_ZSTD, squeezed
    head = frame.pack_nibbles_head(frame.NibblesHead(base, method, len(escapes), len(packed)))
    if len(head) + len(packed) + len(kept) < count:
        return frame.METHOD_NIBBLES, [head, packed, kept]
    return frame.METHOD_RAW, [nibbles.unpack_nibbles(pairs, base, count, escapes, ws)[0].data]


def _header(
    data: memoryview,
    choice: Choice,
    checksum: int,
    table: list[tuple[int, int]],
    payload: Pieces,
    stored_checksum: int | None = None,
) -> bytes:
    if stored_checksum is None:
        stored = xxhash.xxh3_64()
        for piece in payload:
            stored.update(piece)
        stored_checksum = stored.intdigest()
    head = BlockHeader(
        raw_len=len(data),
        width=choice.width,
        transform=frame.TRANSFORM_SIGN_ROTATE if choice.width > 1 else frame.TRANSFORM_NONE,
        phase=choice.phase,
        checksum=checksum,
        stored_checksum=stored_checksum,
        planes=tuple(PlaneEntry(method, size) for method, size in table),
    )
    return frame.pack_block_header(head)
