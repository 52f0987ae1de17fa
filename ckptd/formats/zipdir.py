"""Reads the directories of zip files as torch writes them (torch.save archives, and DCP `.distcp`
files, which are such archives laid end to end): end records (zip64 too) and member tables.

Small reads from a file's tail only; the streaming CRC check lives in `zipcheck`.
"""

from __future__ import annotations

import os
import stat
import struct
from dataclasses import dataclass

from ckptd.errors import ValidationFailed
from ckptd.fileio import pread_exact
from ckptd.model import Reason

LOCAL_MAGIC = b"PK\x03\x04"
EMPTY_ZIP_MAGIC = b"PK\x05\x06"
_EOCD = struct.Struct("<4sHHHHIIH")  # end of central directory record
_LOC64 = struct.Struct("<4sIQI")  # zip64 end of central directory locator
_EOCD64 = struct.Struct("<4sQHHIIQQQQ")  # zip64 end of central directory record
_CDIR = struct.Struct("<4sHHHHHHIIIHHHHHII")  # central directory file header
LOCAL_HEADER = struct.Struct("<4sHHHHHIIIHH")  # local file header
_MAX_COMMENT = 0xFFFF
# A central directory beyond this is not a torch checkpoint's: refuse rather than buffer it.
MAX_DIRECTORY_BYTES = 256 << 20
# Deflate gives at most ~1032 bytes per byte it reads; a member claiming more is not one.
_MAX_INFLATE_RATIO = 1032


@dataclass(frozen=True)
class ZipEntry:
    """One member as its archive's central directory describes it (offsets absolute in file)."""

    name: str
    header_offset: int
    method: int
    compressed_size: int
    size: int
    crc: int
    limit: int  # where the next member's header (or the directory) starts: data must end by here


@dataclass(frozen=True)
class ZipArchive:
    """One zip archive occupying [start, end) of a file; its directory occupies [cd_start, end)."""

    start: int
    cd_start: int
    end: int
    entries: tuple[ZipEntry, ...]


def is_zip_magic(head: bytes) -> bool:
    return head[:4] in (LOCAL_MAGIC, EMPTY_ZIP_MAGIC)


def read_archives(path: str | os.PathLike[str]) -> list[ZipArchive]:
    """Every archive in the file, front to back: one for torch.save, one per item for `.distcp`.

    Walks end records backwards: each archive's directory says where the archive begins, and the
    archive before it must end exactly there, so the archives tile the whole file.
    """
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return read_archives_fd(fd, str(path))
    finally:
        os.close(fd)


def read_archives_fd(fd: int, path: str) -> list[ZipArchive]:
    """`read_archives` of a file the caller holds open (`path` only names it in messages): no
    second open, which through /proc/self/fd costs a path walk per file of a many-file step."""
    end = os.fstat(fd).st_size
    archives: list[ZipArchive] = []
    while end > 0 or not archives:
        archive = _read_archive(fd, end, path, outermost=not archives)
        archives.append(archive)
        end = archive.start
    return archives[::-1]


def read_archive(fd: int, end: int, path: str) -> ZipArchive:
    """The one archive that ends at `end` in `fd` (an archive embedded in a larger buffer)."""
    return _read_archive(fd, end, path, outermost=True)


def _read_archive(fd: int, end: int, path: str, outermost: bool) -> ZipArchive:
    eocd_pos, eocd = _find_eocd(fd, end, path, outermost)
    disk, cd_disk, disk_count, count, cd_size, cd_offset = eocd[:6]
    if disk or cd_disk or disk_count != count:
        raise ValidationFailed(
            Reason.BAD_HEADER, f"{path}: multi-disk zip archives are not supported", path
        )
    # torch (miniz) writes zip64 records even for small files; they sit before the end record.
    zip64 = _read_zip64(fd, eocd_pos, path)
    if zip64 is not None:
        cd_end, count, cd_size, cd_offset = zip64
    elif count == 0xFFFF or 0xFFFFFFFF in (cd_size, cd_offset):
        raise ValidationFailed(Reason.BAD_HEADER, f"{path}: zip64 end record missing", path)
    else:
        cd_end = eocd_pos
    cd_start = cd_end - cd_size
    start = cd_start - cd_offset
    if cd_start < 0 or start < 0 or cd_size > MAX_DIRECTORY_BYTES:
        raise ValidationFailed(Reason.BAD_HEADER, f"{path}: central directory out of bounds", path)
    directory = pread_exact(fd, cd_start, cd_size)
    entries = _parse_directory(directory, count, start, cd_start, path)
    return ZipArchive(start, cd_start, end, entries)


def _find_eocd(fd: int, end: int, path: str, outermost: bool) -> tuple[int, tuple[int, ...]]:
    # torch writes no archive comment, so the record is almost always the last 22 bytes.
    for window in (_EOCD.size, _EOCD.size + _MAX_COMMENT):
        lo = max(0, end - window)
        tail = pread_exact(fd, lo, end - lo)
        pos = tail.rfind(EMPTY_ZIP_MAGIC)
        while pos >= 0:
            if pos + _EOCD.size <= len(tail):
                rec = _EOCD.unpack_from(tail, pos)
                if lo + pos + _EOCD.size + rec[7] == end:
                    return lo + pos, rec[1:]
            pos = tail.rfind(EMPTY_ZIP_MAGIC, 0, pos)
    if outermost:
        # A file that opens as a zip but has no end record was cut short while written.
        head = pread_exact(fd, 0, 4)
        if is_zip_magic(head):
            raise ValidationFailed(
                Reason.TRUNCATED, f"{path}: zip end record missing (truncated?)", path
            )
    raise ValidationFailed(
        Reason.BAD_HEADER, f"{path}: no zip end record before offset {end}", path
    )


def _read_zip64(fd: int, eocd_pos: int, path: str) -> tuple[int, int, int, int] | None:
    """(directory end, entry count, directory size, directory offset) from the zip64 records
    before the end record, or None when there are none."""
    rec_pos = eocd_pos - _LOC64.size - _EOCD64.size
    if rec_pos < 0:
        return None
    both = pread_exact(fd, rec_pos, _EOCD64.size + _LOC64.size)
    if both[_EOCD64.size : _EOCD64.size + 4] != b"PK\x06\x07":
        return None
    if both[:4] != b"PK\x06\x06":
        raise ValidationFailed(Reason.BAD_HEADER, f"{path}: zip64 end record missing", path)
    fields = _EOCD64.unpack_from(both)
    if fields[4] or fields[5] or fields[6] != fields[7]:
        raise ValidationFailed(
            Reason.BAD_HEADER, f"{path}: multi-disk zip archives are not supported", path
        )
    return rec_pos, fields[7], fields[8], fields[9]


def _parse_directory(
    data: bytes, count: int, start: int, cd_start: int, path: str
) -> tuple[ZipEntry, ...]:
    raw: list[tuple[str, int, int, int, int, int]] = []
    if count > len(data) // _CDIR.size:
        raise ValidationFailed(Reason.BAD_HEADER, f"{path}: central directory claims {count}"
                               f" entries in {len(data)} bytes", path)
    pos = 0
    for _ in range(count):
        if pos + _CDIR.size > len(data):
            raise ValidationFailed(Reason.BAD_HEADER, f"{path}: central directory cut short", path)
        f = _CDIR.unpack_from(data, pos)
        if f[0] != b"PK\x01\x02":
            raise ValidationFailed(Reason.BAD_HEADER, f"{path}: bad central directory entry", path)
        flags, method, crc, csize, usize = f[3], f[4], f[7], f[8], f[9]
        n, m, k = f[10], f[11], f[12]
        name_end = pos + _CDIR.size + n
        if name_end + m + k > len(data):
            raise ValidationFailed(Reason.BAD_HEADER, f"{path}: central directory cut short", path)
        try:
            name = data[pos + _CDIR.size : name_end].decode("utf-8" if flags & 0x800 else "cp437")
        except UnicodeDecodeError:
            raise ValidationFailed(Reason.BAD_HEADER, f"{path}: a member name is not the UTF-8"
                                   " its entry declares", path) from None
        extra = data[name_end : name_end + m]
        usize, csize, offset = _zip64_extra(extra, usize, csize, f[16], path)
        _check_member(name, flags, method, csize, usize, path)
        _check_kind(name, f[1], f[15], path)
        raw.append((name, start + offset, method, csize, usize, crc))
        pos = name_end + m + k
    return _with_limits(raw, start, cd_start, path)


def _zip64_extra(extra: bytes, usize: int, csize: int, offset: int, path: str) -> tuple[int, ...]:
    wanted = [v == 0xFFFFFFFF for v in (usize, csize, offset)]
    if not any(wanted):
        return usize, csize, offset
    values = [usize, csize, offset]
    pos = 0
    while pos + 4 <= len(extra):
        tag, size = struct.unpack_from("<HH", extra, pos)
        if tag == 0x0001:
            body, at = extra[pos + 4 : pos + 4 + size], 0
            for i, want in enumerate(wanted):
                if want:
                    if at + 8 > len(body):
                        break
                    values[i] = struct.unpack_from("<Q", body, at)[0]
                    at += 8
            else:
                return tuple(values)
        pos += 4 + size
    raise ValidationFailed(
        Reason.BAD_HEADER, f"{path}: zip64 sizes missing from directory entry", path
    )


def _check_member(name: str, flags: int, method: int, csize: int, usize: int, path: str) -> None:
    if flags & 0x1:
        raise ValidationFailed(Reason.BAD_HEADER, f"{path}: member {name} is encrypted", path)
    if method not in (0, 8):
        raise ValidationFailed(
            Reason.BAD_HEADER, f"{path}: member {name} uses compression {method}", path
        )
    if method == 0 and csize != usize:
        raise ValidationFailed(
            Reason.BAD_HEADER, f"{path}: stored member {name} has two sizes", path
        )
    if usize > csize * _MAX_INFLATE_RATIO + 1024:
        raise ValidationFailed(Reason.BAD_HEADER, f"{path}: member {name} claims {usize} bytes"
                               f" from {csize} deflated ones, more than deflate can give", path)


def _check_kind(name: str, made_by: int, external: int, path: str) -> None:
    """A member recorded by a Unix zip tool as a symlink, device, FIFO or socket is not data a
    loader can use: judged bad_header rather than silently skipped."""
    mode = external >> 16
    if made_by >> 8 != 3 or not mode:  # not made on Unix, or no mode recorded
        return
    kind = stat.S_IFMT(mode)
    if kind and kind not in (stat.S_IFREG, stat.S_IFDIR):
        what = "a symbolic link" if kind == stat.S_IFLNK else "a special file"
        raise ValidationFailed(Reason.BAD_HEADER, f"{path}: member {name} is {what}", path)


def _with_limits(
    raw: list[tuple[str, int, int, int, int, int]], start: int, cd_start: int, path: str
) -> tuple[ZipEntry, ...]:
    raw.sort(key=lambda r: r[1])
    out: list[ZipEntry] = []
    for i, (name, offset, method, csize, usize, crc) in enumerate(raw):
        limit = raw[i + 1][1] if i + 1 < len(raw) else cd_start
        if offset < start or offset + LOCAL_HEADER.size > limit:
            raise ValidationFailed(
                Reason.BAD_HEADER, f"{path}: member {name} overlaps another", path
            )
        if offset + LOCAL_HEADER.size + csize > limit:
            # Sizes are bounded by the space the file gives the member, not by what the entry
            # claims (up to 2^64): nothing downstream ever walks a range past the file's end.
            raise ValidationFailed(Reason.TRUNCATED, f"{path}: member {name} claims {csize}"
                                   f" bytes, more than the {limit - offset} before the next"
                                   " member", path)
        out.append(ZipEntry(name, offset, method, csize, usize, crc, limit))
    return tuple(out)


def data_offset(fd: int, e: ZipEntry, path: str) -> int:
    """Where member `e`'s data begins: after its local header, whose extra field torch pads.
    Refused (truncated) when its data would not end before the next member or directory."""
    head = pread_exact(fd, e.header_offset, LOCAL_HEADER.size)
    if len(head) != LOCAL_HEADER.size or head[:4] != LOCAL_MAGIC:
        raise ValidationFailed(Reason.BAD_HEADER, f"{path}: no local header for {e.name}", path)
    f = LOCAL_HEADER.unpack(head)
    start = e.header_offset + LOCAL_HEADER.size + int(f[9]) + int(f[10])
    if start + e.compressed_size > e.limit:
        raise ValidationFailed(
            Reason.TRUNCATED, f"{path}: member {e.name} runs past its space", path
        )
    return start
