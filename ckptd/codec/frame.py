"""Byte layout of the `zstd-bytegroup` container: file header, block headers, end record, index.

Owns packing and strict parsing of every fixed field documented in docs/FORMAT.md; holds no
compression logic and does no I/O. Every parse failure raises CorruptData naming what broke.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import xxhash

from ckptd.codec.planes import WIDTHS
from ckptd.errors import CorruptData

MAGIC = b"CKZG"
VERSION = 3  # what the encoder writes
VERSIONS = (1, 2, 3)  # what the decoder reads: 1 lacks METHOD_NIBBLES, 3 adds the block index
INDEXED = 3  # the first version with an index record and footer after the end record
INDEX_MAGIC = b"CKZI"
MIN_BLOCK = 1 << 10
MAX_BLOCK = 64 << 20

METHOD_RAW = 0
METHOD_ZSTD = 1
METHOD_NIBBLES = 2  # version 2, top plane only: exponent nibbles (see "Exponent nibbles")
ESCAPES_RAW = 0
ESCAPES_ZSTD = 1
TRANSFORM_NONE = 0
TRANSFORM_SIGN_ROTATE = 1

_FILE = struct.Struct("<4sBBHI")  # magic, version, flags, reserved, block_size
# raw_len, width, transform, planes, phase, xxh3_64 of the raw block, xxh3_64 of the payload
_BLOCK = struct.Struct("<IBBBBQQ")
_PLANE = struct.Struct("<BI")  # method, stored_len
_END = struct.Struct("<IIQ")  # zero marker, block count, total raw bytes
_CHECK = struct.Struct("<I")
_ENTRY = struct.Struct("<II")  # a block's stored length (header + payload), its raw length
# index record length, blocks, block_size, version, flags, reserved; then check and magic
_FOOTER = struct.Struct("<QIIBBH")
_NIBBLES = struct.Struct("<BBII")  # base, escape method, escape count, pairs frame length
NIBBLES_HEAD_SIZE = _NIBBLES.size

FILE_HEADER_SIZE = _FILE.size + _CHECK.size
BLOCK_FIXED_SIZE = _BLOCK.size
END_SIZE = _END.size + _CHECK.size
ENTRY_SIZE = _ENTRY.size
FOOTER_SIZE = _FOOTER.size + _CHECK.size + len(INDEX_MAGIC)
# The smallest stored block: a width-1 header (one plane entry) and one payload byte.
MIN_BLOCK_STORED = BLOCK_FIXED_SIZE + _PLANE.size + _CHECK.size + 1
# The longest block header (width 8). A payload is never longer than the block's raw bytes (a
# plane is zstd or nibbles only when shorter, else raw), so a block stores at most
# raw_len + MAX_BLOCK_HEADER bytes.
MAX_BLOCK_HEADER = BLOCK_FIXED_SIZE + max(WIDTHS) * _PLANE.size + _CHECK.size


@dataclass(frozen=True)
class PlaneEntry:
    method: int
    stored_len: int


@dataclass(frozen=True)
class BlockHeader:
    raw_len: int
    width: int
    transform: int
    phase: int  # bytes before the first element (stored raw ahead of the planes)
    checksum: int
    stored_checksum: int
    planes: tuple[PlaneEntry, ...]

    @property
    def plane_len(self) -> int:
        return (self.raw_len - self.phase) // self.width

    @property
    def tail_len(self) -> int:
        return (self.raw_len - self.phase) % self.width

    @property
    def stored_len(self) -> int:
        """Payload bytes after the header: the phase bytes, every plane, then the tail."""
        return self.phase + sum(p.stored_len for p in self.planes) + self.tail_len


def _check(data: bytes) -> bytes:
    return _CHECK.pack(xxhash.xxh32_intdigest(data))


def pack_file_header(block_size: int) -> bytes:
    head = _FILE.pack(MAGIC, VERSION, 0, 0, block_size)
    return head + _check(head)


def parse_file_header(data: bytes) -> tuple[int, int]:
    """(block size, version), after checking magic, version and header checksum."""
    if len(data) < FILE_HEADER_SIZE:
        raise CorruptData("zstd-bytegroup: truncated file header")
    magic, version, flags, _, block_size = _FILE.unpack_from(data)
    if magic != MAGIC:
        raise CorruptData(f"zstd-bytegroup: bad magic {magic!r} (not a ckptd container)")
    if data[_FILE.size : FILE_HEADER_SIZE] != _check(data[: _FILE.size]):
        raise CorruptData("zstd-bytegroup: file header checksum mismatch")
    if version not in VERSIONS or flags != 0:
        raise CorruptData(f"zstd-bytegroup: unsupported version {version} flags {flags}")
    if not MIN_BLOCK <= block_size <= MAX_BLOCK:
        raise CorruptData(f"zstd-bytegroup: block size {block_size} out of range")
    return int(block_size), int(version)


def pack_block_header(head: BlockHeader) -> bytes:
    fixed = _BLOCK.pack(
        head.raw_len,
        head.width,
        head.transform,
        len(head.planes),
        head.phase,
        head.checksum,
        head.stored_checksum,
    )
    table = b"".join(_PLANE.pack(p.method, p.stored_len) for p in head.planes)
    return fixed + table + _check(fixed + table)


def is_end(marker: bytes) -> bool:
    """Whether the 4 bytes where a block header starts begin the end record instead."""
    return marker == b"\0\0\0\0"


def table_size(fixed: bytes) -> int:
    """Bytes of plane table plus header check that follow a block's fixed part."""
    return fixed[6] * _PLANE.size + _CHECK.size


def parse_block_header(
    fixed: bytes, rest: bytes, index: int, block_size: int, version: int = VERSION
) -> BlockHeader:
    """Parse and check one block header; `index` names the block in errors."""
    raw_len, width, transform, nplanes, phase, checksum, stored_checksum = _BLOCK.unpack(fixed)
    table, check = rest[: -_CHECK.size], rest[-_CHECK.size :]
    if check != _check(fixed + table):
        raise CorruptData(f"zstd-bytegroup: block {index}: header checksum mismatch")
    planes = tuple(PlaneEntry(*_PLANE.unpack_from(table, i * _PLANE.size)) for i in range(nplanes))
    head = BlockHeader(raw_len, width, transform, phase, checksum, stored_checksum, planes)
    _validate(head, index, block_size)
    _validate_planes(head, index, version)
    return head


def _validate(head: BlockHeader, index: int, block_size: int) -> None:
    """Reject headers the encoder never writes, so decoding stays within bounded memory."""
    where = f"zstd-bytegroup: block {index}"
    if not 0 < head.raw_len <= block_size:
        raise CorruptData(f"{where}: raw length {head.raw_len} out of range")
    if head.width not in WIDTHS or len(head.planes) != head.width:
        raise CorruptData(f"{where}: bad element width {head.width}/{len(head.planes)} planes")
    if head.transform not in (TRANSFORM_NONE, TRANSFORM_SIGN_ROTATE):
        raise CorruptData(f"{where}: unknown transform {head.transform}")
    if head.transform == TRANSFORM_SIGN_ROTATE and head.width == 1:
        raise CorruptData(f"{where}: sign rotation on width 1")
    if head.phase >= head.width or head.phase > head.raw_len:
        raise CorruptData(f"{where}: phase {head.phase} out of range")


def _validate_planes(head: BlockHeader, index: int, version: int) -> None:
    where = f"zstd-bytegroup: block {index}"
    top = head.width - 1
    for i, plane in enumerate(head.planes):
        if plane.method == METHOD_RAW and plane.stored_len != head.plane_len:
            raise CorruptData(f"{where}: raw plane {i} length {plane.stored_len}")
        if plane.method == METHOD_ZSTD and not 0 < plane.stored_len < head.plane_len:
            raise CorruptData(f"{where}: zstd plane {i} length {plane.stored_len}")
        if plane.method == METHOD_NIBBLES:
            if version < 2 or i != top or top == 0:
                raise CorruptData(f"{where}: nibble method on plane {i} (version {version})")
            if not NIBBLES_HEAD_SIZE < plane.stored_len < head.plane_len:
                raise CorruptData(f"{where}: nibble plane {i} length {plane.stored_len}")
        if plane.method not in (METHOD_RAW, METHOD_ZSTD, METHOD_NIBBLES):
            raise CorruptData(f"{where}: unknown plane method {plane.method}")


@dataclass(frozen=True)
class NibblesHead:
    base: int
    escape_method: int
    escapes: int
    pairs_len: int

    @property
    def escapes_at(self) -> int:
        return NIBBLES_HEAD_SIZE + self.pairs_len


def pack_nibbles_head(head: NibblesHead) -> bytes:
    return _NIBBLES.pack(head.base, head.escape_method, head.escapes, head.pairs_len)


def parse_nibbles_head(data: memoryview, plane_len: int, where: str) -> NibblesHead:
    """The head of a nibble plane whose stored bytes are `data`, checked against its length."""
    head = NibblesHead(*_NIBBLES.unpack_from(data))
    left = len(data) - head.escapes_at
    if head.base > 255 - 15 or head.escapes > plane_len or left < 0 or head.pairs_len == 0:
        raise CorruptData(f"{where}: bad nibble plane head {head}")
    if head.escape_method == ESCAPES_RAW and left != head.escapes:
        raise CorruptData(f"{where}: {left} escape bytes stored, {head.escapes} declared")
    if head.escape_method == ESCAPES_ZSTD and not 0 < left < head.escapes:
        raise CorruptData(f"{where}: zstd escapes of {left} bytes for {head.escapes}")
    if head.escape_method not in (ESCAPES_RAW, ESCAPES_ZSTD):
        raise CorruptData(f"{where}: unknown escape method {head.escape_method}")
    return head


def pack_end(blocks: int, total: int) -> bytes:
    body = _END.pack(0, blocks, total)
    return body + _check(body)


def read_end(data: bytes | memoryview) -> tuple[int, int]:
    """(block count, total raw bytes) of an end record, after checking its marker and check."""
    if len(data) < END_SIZE:
        raise CorruptData("zstd-bytegroup: truncated end record")
    data = bytes(data[:END_SIZE])
    if not is_end(data[:4]) or data[_END.size :] != _check(data[: _END.size]):
        raise CorruptData("zstd-bytegroup: end record checksum mismatch")
    _, blocks, total = _END.unpack_from(data)
    return int(blocks), int(total)


def parse_end(data: bytes, blocks: int, total: int) -> None:
    """Check the end record against what was decoded."""
    want_blocks, want_total = read_end(data)
    if (want_blocks, want_total) != (blocks, total):
        raise CorruptData(
            f"zstd-bytegroup: end record says {want_blocks} blocks / {want_total} bytes, "
            f"decoded {blocks} / {total}"
        )


def pack_entry(stored_len: int, raw_len: int) -> bytes:
    return _ENTRY.pack(stored_len, raw_len)


def entries(index: bytes | memoryview) -> npt.NDArray[np.uint32]:
    """One row (stored length, raw length) per block of an index record: a view of its bytes,
    no Python object per entry; the values are the caller's to check (`ckptd.codec.index`)."""
    if len(index) % ENTRY_SIZE:
        raise CorruptData(f"zstd-bytegroup: index record of {len(index)} bytes")
    return np.frombuffer(index, dtype="<u4").reshape(-1, 2)


def pack_index(index: bytes | bytearray, block_size: int) -> bytes:
    """The index record `index` (packed entries) followed by its footer."""
    body = _FOOTER.pack(len(index), len(index) // ENTRY_SIZE, block_size, VERSION, 0, 0)
    check = xxhash.xxh32(index)
    check.update(body)
    return bytes(index) + body + _CHECK.pack(check.intdigest()) + INDEX_MAGIC


def has_index(tail: bytes | memoryview) -> bool:
    """Whether `tail` (an object's last bytes) ends with an index footer's magic."""
    return len(tail) >= FOOTER_SIZE and bytes(tail[-len(INDEX_MAGIC) :]) == INDEX_MAGIC


@dataclass(frozen=True)
class IndexFooter:
    index_len: int  # bytes of the index record before the footer
    blocks: int
    block_size: int
    version: int
    check: int


def parse_index_footer(data: bytes | memoryview) -> IndexFooter:
    """The fixed footer at the very end of a version 3 object (its last FOOTER_SIZE bytes)."""
    if len(data) != FOOTER_SIZE or bytes(data[-len(INDEX_MAGIC) :]) != INDEX_MAGIC:
        raise CorruptData("zstd-bytegroup: no index footer at the end of the object")
    index_len, blocks, block_size, version, flags, reserved = _FOOTER.unpack_from(data)
    (check,) = _CHECK.unpack_from(data, _FOOTER.size)
    if version not in VERSIONS or version < INDEXED or flags or reserved:
        raise CorruptData(f"zstd-bytegroup: index footer of version {version} flags {flags}")
    if not MIN_BLOCK <= block_size <= MAX_BLOCK:
        raise CorruptData(f"zstd-bytegroup: index footer block size {block_size} out of range")
    if index_len != blocks * ENTRY_SIZE:
        raise CorruptData(f"zstd-bytegroup: index of {index_len} bytes for {blocks} blocks")
    return IndexFooter(int(index_len), int(blocks), int(block_size), int(version), int(check))


def check_index(index: bytes | memoryview, footer: bytes | memoryview) -> None:
    """Check the footer's checksum over the index record and the footer's own fields."""
    check = xxhash.xxh32(index)
    check.update(footer[: _FOOTER.size])
    if _CHECK.pack(check.intdigest()) != bytes(footer[_FOOTER.size : _FOOTER.size + 4]):
        raise CorruptData("zstd-bytegroup: index checksum mismatch")
