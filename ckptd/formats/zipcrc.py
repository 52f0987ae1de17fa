"""Fills in the CRC-32 fields of torch.save archives written without them (an async save's
arena: the trainer skips the CRC pass, the daemon computes it while the training runs on).

Patches only the 4-byte CRC fields of each member's data descriptor and central-directory
entry, in a writable buffer; never moves or re-serialises a byte of member data.
"""

from __future__ import annotations

import struct
import zlib

from ckptd.errors import ValidationFailed
from ckptd.formats import zipdir
from ckptd.model import Reason

_DESCRIPTOR_MAGIC = b"PK\x07\x08"
_CDIR_MAGIC = b"PK\x01\x02"
_CRC_CHUNK = 8 << 20


def fill_crcs(buf: memoryview, fd: int, begin: int, end: int, what: str) -> int:
    """Compute and write the CRC-32 of every member of the archive at [begin, end) of `fd`,
    whose bytes `buf` maps (offsets alike); return the number of members."""
    archive = zipdir.read_archive(fd, end, what)
    if archive.start != begin:
        raise ValidationFailed(Reason.BAD_HEADER, f"{what}: the archive does not start at"
                               f" {begin} (its directory says {archive.start})", what)
    cd_crc = _directory_crc_fields(buf, archive, what)
    for e in archive.entries:
        if e.method != 0:
            raise ValidationFailed(Reason.BAD_HEADER, f"{what}: {e.name} is compressed", what)
        if e.compressed_size == 0:  # torch writes no descriptor; the CRC of nothing is 0
            continue
        start = zipdir.data_offset(fd, e, what)
        crc = 0
        for pos in range(start, start + e.compressed_size, _CRC_CHUNK):
            crc = zlib.crc32(buf[pos:min(start + e.compressed_size, pos + _CRC_CHUNK)], crc)
        struct.pack_into("<I", buf, _descriptor_crc_field(buf, e, start, what), crc)
        struct.pack_into("<I", buf, cd_crc[e.name], crc)
    return len(archive.entries)


def _descriptor_crc_field(buf: memoryview, e: zipdir.ZipEntry, start: int, what: str) -> int:
    """Where the member's data descriptor keeps its CRC (the descriptor follows the data, with
    or without its signature, with 4- or 8-byte sizes)."""
    pos = start + e.compressed_size
    if bytes(buf[pos:pos + 4]) == _DESCRIPTOR_MAGIC:
        pos += 4
    for fmt in ("<QQ", "<II"):
        size = struct.calcsize(fmt)
        if pos + 4 + size <= e.limit and struct.unpack_from(fmt, buf, pos + 4) == (
                e.compressed_size, e.size):
            return pos
    raise ValidationFailed(Reason.BAD_HEADER, f"{what}: no data descriptor after {e.name}", what)


def _directory_crc_fields(buf: memoryview, archive: zipdir.ZipArchive, what: str
                          ) -> dict[str, int]:
    """Each member's name -> where its central-directory entry keeps its CRC."""
    fields: dict[str, int] = {}
    pos = archive.cd_start
    for _ in archive.entries:
        if bytes(buf[pos:pos + 4]) != _CDIR_MAGIC:
            raise ValidationFailed(Reason.BAD_HEADER, f"{what}: bad central directory", what)
        flags, n, m, k = struct.unpack_from("<H", buf, pos + 8) + struct.unpack_from(
            "<HHH", buf, pos + 28)
        name = bytes(buf[pos + 46:pos + 46 + n]).decode("utf-8" if flags & 0x800 else "cp437")
        fields[name] = pos + 16
        pos += 46 + n + m + k
    if set(fields) != {e.name for e in archive.entries}:
        raise ValidationFailed(Reason.BAD_HEADER, f"{what}: central directory mismatch", what)
    return fields
