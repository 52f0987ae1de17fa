"""The seek table of codec `zstd`: zstd's seekable format, one skippable frame after the frames.

Owns packing and strict parsing of that table (and of skippable-frame headers); holds no
compression logic and does no I/O. Every parse failure raises CorruptData naming what broke.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from ckptd.errors import CorruptData

SKIPPABLE_FIRST = 0x184D2A50  # skippable frames: any magic 0x184D2A50..0x184D2A5F
SKIPPABLE_LAST = 0x184D2A5F
TABLE_MAGIC = 0x184D2A5E  # the skippable magic the seekable format uses for its table
SEEKABLE_MAGIC = 0x8F92EAB1
CHECKSUM_FLAG = 0x80
# The smallest frame ckptd could have written: magic, header, one empty block, checksum.
MIN_FRAME = 9

_SKIP = struct.Struct("<II")  # skippable magic, frame size (bytes after these 8)
_FOOTER = struct.Struct("<IBI")  # number of frames, descriptor, seekable magic
_WITH_CHECK = struct.Struct("<III")  # compressed size, decompressed size, checksum
_NO_CHECK = struct.Struct("<II")
SKIP_HEADER_SIZE = _SKIP.size
FOOTER_SIZE = _FOOTER.size


Column = npt.NDArray[np.uint32]


@dataclass(frozen=True)
class Table:
    """A seek table's columns, one element per frame: views of the table's bytes (no Python
    object per entry, however many the table lists)."""

    stored_len: Column
    raw_len: Column
    check: Column | None  # low 32 bits of XXH64 of each frame's content (its zstd checksum)

    def __len__(self) -> int:
        return len(self.stored_len)


def skippable(head: bytes | memoryview) -> tuple[int, int] | None:
    """(magic, bytes after the 8-byte header) when `head` starts a skippable frame, else None."""
    if len(head) < SKIP_HEADER_SIZE:
        return None
    magic, size = _SKIP.unpack_from(head)
    return (int(magic), int(size)) if SKIPPABLE_FIRST <= magic <= SKIPPABLE_LAST else None


def pack_rows(rows: bytes | bytearray) -> bytes:
    """The whole skippable frame around packed rows (see `row`): ckptd's frames all carry a
    checksum, so its tables do too."""
    footer = _FOOTER.pack(len(rows) // _WITH_CHECK.size, CHECKSUM_FLAG, SEEKABLE_MAGIC)
    return _SKIP.pack(TABLE_MAGIC, len(rows) + len(footer)) + bytes(rows) + footer


def has_table(tail: bytes | memoryview) -> bool:
    """Whether `tail` (an object's last bytes) ends with the seekable format's footer magic."""
    return len(tail) >= FOOTER_SIZE and _FOOTER.unpack_from(tail, len(tail) - FOOTER_SIZE)[2] == (
        SEEKABLE_MAGIC
    )


def parse_footer(footer: bytes | memoryview) -> tuple[int, bool]:
    """(number of frames, whether entries carry checksums) from the 9-byte footer."""
    frames, descriptor, magic = _FOOTER.unpack(footer)
    if magic != SEEKABLE_MAGIC:
        raise CorruptData("zstd: no seek table footer at the end of the object")
    if descriptor not in (0, CHECKSUM_FLAG):
        raise CorruptData(f"zstd: seek table descriptor {descriptor:#x} not understood")
    return int(frames), bool(descriptor & CHECKSUM_FLAG)


def table_size(frames: int, checked: bool) -> int:
    """Bytes of the whole skippable frame holding `frames` entries."""
    entry = _WITH_CHECK.size if checked else _NO_CHECK.size
    return SKIP_HEADER_SIZE + frames * entry + FOOTER_SIZE


def parse(table: bytes | memoryview) -> Table:
    """Every entry of a whole seek table frame (header, entries, footer), its framing checked;
    the entries' values are the caller's to check (see `ckptd.codec.index`)."""
    frames, checked = parse_footer(table[-FOOTER_SIZE:])
    if len(table) != table_size(frames, checked):
        raise CorruptData(f"zstd: seek table of {len(table)} bytes for {frames} frames")
    magic, size = _SKIP.unpack_from(table)
    if magic != TABLE_MAGIC or size != len(table) - SKIP_HEADER_SIZE:
        raise CorruptData(f"zstd: seek table frame header {magic:#x}/{size} does not match")
    columns = 3 if checked else 2
    rows = np.frombuffer(table, dtype="<u4", count=frames * columns, offset=SKIP_HEADER_SIZE)
    rows = rows.reshape(frames, columns)
    return Table(rows[:, 0], rows[:, 1], rows[:, 2] if checked else None)


def strip_checks(rows: bytes | bytearray, checked: bool) -> bytes:
    """Packed 12-byte rows (see `row`) as a table with or without checksums stores them."""
    if checked:
        return bytes(rows)
    return b"".join(_NO_CHECK.pack(s, r) for s, r, _ in _WITH_CHECK.iter_unpack(rows))


def row(stored_len: int, raw_len: int, check: int) -> bytes:
    """One entry with its checksum, as `pack` writes it."""
    return _WITH_CHECK.pack(stored_len, raw_len, check)
