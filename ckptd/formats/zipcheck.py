"""Integrity of torch zip files in the single read pass: every member's local header, bounds and
CRC-32 (directories come from `zipdir`); plus bounded access to one member for others.

Checks bytes only; never unpickles, never imports torch. Members are stored (method 0, what torch
writes) or deflated (method 8, inflated streaming in bounded steps); others are bad_header.
"""

from __future__ import annotations

import io
import os
import zlib

try:  # ISA-L's CRC-32 is ~3.5x zlib's: the zip check stays a small part of the one read pass
    from isal.isal_zlib import crc32
except ImportError:  # pragma: no cover - the dependency is declared; zlib is the fallback
    from zlib import crc32
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import BinaryIO

from ckptd.errors import ValidationFailed
from ckptd.fileio import pread_exact
from ckptd.formats.zipdir import (
    LOCAL_HEADER,
    LOCAL_MAGIC,
    ZipArchive,
    ZipEntry,
    data_offset,
    is_zip_magic,
    read_archives,
    read_archives_fd,
)
from ckptd.model import Reason

__all__ = [
    "CAPTURE_LIMIT",
    "ZipArchive",
    "ZipCrcSink",
    "ZipEntry",
    "ZipMember",
    "find_entry",
    "is_pickle_member",
    "is_zip_magic",
    "open_stored_member",
    "read_archives",
    "read_archives_fd",
    "read_member",
    "zip_members",
]

# Members captured in memory as they stream by (data.pkl), at most this big each.
CAPTURE_LIMIT = 64 << 20
_INFLATE_STEP = 1 << 20  # bound on inflated bytes held at once


@dataclass(frozen=True)
class ZipMember:
    """A member's name, where its data begins in the file, its size and its CRC-32."""

    name: str
    offset: int
    size: int
    crc: int


# --- the streaming check ---------------------------------------------------------------------


def is_pickle_member(name: str) -> bool:
    """True for any pickle a loader might read from the archive: every `*.pkl` member, in
    any case (`archive/DATA.PKL` is scanned as surely as `archive/data.pkl`)."""
    return name.rsplit("/", 1)[-1].lower().endswith(".pkl")


@dataclass
class _Cursor:
    """Progress through one member: its local header first, then its data."""

    entry: ZipEntry
    header: bytearray = field(default_factory=bytearray)
    data_start: int = -1
    crc: int = 0
    inflated: int = 0
    inflater: zlib._Decompress | None = None
    captured: bytearray | None = None


class ZipCrcSink:
    """A `read_pass` sink that checks every member's local header and CRC-32 as bytes pass.

    Build it with `ZipCrcSink.for_file(path)`, which reads the archives' directories from the
    tail first (small reads). Members named by `capture` (default: data.pkl) up to
    `capture_limit` bytes are handed whole, once CRC-checked, to `on_capture` (default: kept in
    `captured`), so the pass is the only read of them; larger ones are listed in `uncaptured`.
    Raises ValidationFailed.
    """

    def __init__(
        self,
        path: str,
        archives: list[ZipArchive],
        capture: Callable[[str], bool] = is_pickle_member,
        on_capture: Callable[[ZipEntry, bytes], None] | None = None,
        capture_limit: int = CAPTURE_LIMIT,
    ) -> None:
        self.path = path
        self.archives = archives
        self.size = archives[-1].end if archives else 0
        self._entries = [e for a in archives for e in a.entries]
        self._next = 0
        self._cur: _Cursor | None = None
        self._capture = capture
        self._capture_limit = capture_limit
        self.captured: list[tuple[ZipEntry, bytes]] = []
        self._on_capture = on_capture or (lambda e, data: self.captured.append((e, data)))
        self.uncaptured: list[ZipEntry] = []
        self.members_checked = 0

    @classmethod
    def for_file(
        cls,
        path: str | os.PathLike[str],
        capture: Callable[[str], bool] = is_pickle_member,
        on_capture: Callable[[ZipEntry, bytes], None] | None = None,
    ) -> ZipCrcSink:
        return cls(str(path), read_archives(path), capture, on_capture)

    @classmethod
    def for_fd(
        cls,
        fd: int,
        path: str | os.PathLike[str],
        capture: Callable[[str], bool] = is_pickle_member,
        on_capture: Callable[[ZipEntry, bytes], None] | None = None,
    ) -> ZipCrcSink:
        """As `for_file`, reading the directories through `fd`, which the caller keeps open;
        `path` only names the file in messages (its name in the root, not the fd's link)."""
        return cls(str(path), read_archives_fd(fd, str(path)), capture, on_capture)

    def update(self, offset: int, view: memoryview) -> None:
        end = offset + len(view)
        while True:
            cur = self._cur or self._start_next()
            if cur is None or not self._feed(cur, offset, end, view):
                return

    def finish(self, total: int) -> None:
        if total != self.size:
            raise ValidationFailed(
                Reason.CHANGED, f"{self.path}: size changed during the check", self.path
            )
        if self._cur is not None or self._next < len(self._entries):
            name = (self._cur.entry if self._cur else self._entries[self._next]).name
            raise ValidationFailed(
                Reason.TRUNCATED, f"{self.path}: member {name} incomplete", self.path
            )

    def _start_next(self) -> _Cursor | None:
        if self._next >= len(self._entries):
            return None
        entry = self._entries[self._next]
        self._next += 1
        cur = _Cursor(entry)
        if entry.method == 8:
            cur.inflater = zlib.decompressobj(-15)
        if self._capture(entry.name):
            if entry.size <= self._capture_limit:
                cur.captured = bytearray()
            else:
                self.uncaptured.append(entry)
        self._cur = cur
        return cur

    def _feed(self, cur: _Cursor, offset: int, end: int, view: memoryview) -> bool:
        """Consume what `view` holds of the current member; True when the member is done."""
        if cur.data_start < 0:
            _take(cur.header, cur.entry.header_offset, LOCAL_HEADER.size, offset, view)
            if len(cur.header) < LOCAL_HEADER.size:
                return False
            cur.data_start = self._parse_local(cur)
        e = cur.entry
        stop = cur.data_start + e.compressed_size
        lo, hi = max(offset, cur.data_start), min(end, stop)
        if lo < hi:
            self._consume(cur, view[lo - offset : hi - offset])
        if end < stop:
            return False
        self._close(cur)
        return True

    def _parse_local(self, cur: _Cursor) -> int:
        e = cur.entry
        f = LOCAL_HEADER.unpack(cur.header)
        if f[0] != LOCAL_MAGIC:
            raise ValidationFailed(
                Reason.BAD_HEADER, f"{self.path}: no local header for {e.name}", self.path
            )
        data_start = e.header_offset + LOCAL_HEADER.size + int(f[9]) + int(f[10])
        if data_start + e.compressed_size > e.limit:
            # The directory promises more data than fits before the next member.
            raise ValidationFailed(
                Reason.TRUNCATED, f"{self.path}: member {e.name} runs past its space", self.path
            )
        return data_start

    def _consume(self, cur: _Cursor, data: memoryview) -> None:
        if cur.inflater is None:
            _emit(cur, data)
            return
        pending: bytes | memoryview = data
        # Inflate in bounded steps: a small hostile member must not expand to gigabytes at once.
        while pending and cur.inflated <= cur.entry.size:
            _emit(cur, cur.inflater.decompress(pending, _INFLATE_STEP))
            pending = cur.inflater.unconsumed_tail

    def _close(self, cur: _Cursor) -> None:
        e = cur.entry
        if cur.inflater is not None:
            while cur.inflated <= e.size and not cur.inflater.eof:
                out = cur.inflater.decompress(b"", _INFLATE_STEP)
                if not out:
                    break
                _emit(cur, out)
            if not cur.inflater.eof:
                raise ValidationFailed(
                    Reason.CRC_MISMATCH,
                    f"{self.path}: deflate stream of {e.name} is broken",
                    self.path,
                )
        if cur.inflated != e.size:
            raise ValidationFailed(
                Reason.SIZE_MISMATCH,
                f"{self.path}: member {e.name} holds {cur.inflated} bytes, directory says {e.size}",
                self.path,
            )
        if cur.crc != e.crc:
            raise ValidationFailed(
                Reason.CRC_MISMATCH,
                f"{self.path}: CRC-32 mismatch in member {e.name}"
                f" (computed {cur.crc:08x}, recorded {e.crc:08x})",
                self.path,
            )
        self.members_checked += 1
        self._cur = None
        if cur.captured is not None:
            self._on_capture(e, bytes(cur.captured))


def _emit(cur: _Cursor, data: bytes | memoryview) -> None:
    """Account for a member's (inflated) bytes: CRC, count, and the capture if any."""
    cur.crc = crc32(data, cur.crc)
    cur.inflated += len(data)
    if cur.captured is not None:
        cur.captured += data


def _take(buf: bytearray, start: int, size: int, offset: int, view: memoryview) -> None:
    """Append to `buf` the bytes of [start+len(buf), start+size) that `view` (at offset) holds."""
    want_lo = start + len(buf)
    lo, hi = max(offset, want_lo), min(offset + len(view), start + size)
    if lo < hi:
        buf += view[lo - offset : hi - offset]


# --- direct access for others (second reads, outside the validation pass) ----------------


def zip_members(path: str | os.PathLike[str]) -> list[ZipMember]:
    """Every member of every archive in `path`, with where its data begins. Raises
    ValidationFailed when the file is not a sound zip."""
    out: list[ZipMember] = []
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        for archive in read_archives(path):
            for e in archive.entries:
                out.append(ZipMember(e.name, data_offset(fd, e, str(path)), e.size, e.crc))
    finally:
        os.close(fd)
    return out


def find_entry(path: str | os.PathLike[str], name: str) -> ZipEntry:
    """The directory entry of member `name` (in the first archive that has one)."""
    for archive in read_archives(path):
        for e in archive.entries:
            if e.name == name:
                return e
    raise ValidationFailed(Reason.MISSING_FILE, f"{path}: no member {name}", str(path))


def read_member(path: str | os.PathLike[str], name: str, max_size: int = CAPTURE_LIMIT) -> bytes:
    """The bytes of member `name`, inflated if need be and CRC-checked; refuses (bad_header)
    members over `max_size` bytes so a hostile directory cannot make this allocate much."""
    e = find_entry(path, name)
    if max(e.size, e.compressed_size) > max_size:
        raise ValidationFailed(
            Reason.BAD_HEADER, f"{path}: member {name} exceeds {max_size} bytes", str(path)
        )
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        raw = pread_exact(fd, data_offset(fd, e, str(path)), e.compressed_size)
    finally:
        os.close(fd)
    if len(raw) != e.compressed_size:
        raise ValidationFailed(Reason.TRUNCATED, f"{path}: member {name} cut short", str(path))
    data = raw if e.method == 0 else zlib.decompressobj(-15).decompress(raw, e.size + 1)
    if len(data) != e.size:
        raise ValidationFailed(
            Reason.SIZE_MISMATCH, f"{path}: member {name} has the wrong size", str(path)
        )
    if crc32(data) != e.crc:
        raise ValidationFailed(
            Reason.CRC_MISMATCH, f"{path}: CRC-32 mismatch in member {name}", str(path)
        )
    return data


class _MemberReader(io.RawIOBase):
    """A read-only window of a file (one stored member), owning its descriptor."""

    def __init__(self, fd: int, start: int, size: int) -> None:
        self._fd, self._start, self._pos, self._end = fd, start, start, start + size

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        # Positions are relative to the member (pickletools asks for them).
        base = {io.SEEK_SET: self._start, io.SEEK_CUR: self._pos, io.SEEK_END: self._end}[whence]
        self._pos = min(max(base + offset, self._start), self._end)
        return self._pos - self._start

    def readinto(self, b: bytearray | memoryview) -> int:  # type: ignore[override]
        n = min(len(b), self._end - self._pos)
        if n <= 0:
            return 0
        data = os.pread(self._fd, n, self._pos)
        b[: len(data)] = data
        self._pos += len(data)
        return len(data)

    def close(self) -> None:
        if not self.closed:
            os.close(self._fd)
        super().close()


def open_stored_member(path: str | os.PathLike[str], entry: ZipEntry,
                       name: str | None = None) -> BinaryIO:
    """A buffered reader over a stored member's bytes, for scanning a member too big to hold in
    memory (a second read of that member only). Raises ValidationFailed for a compressed one.
    `name` names the file in messages (default `path`: give it when `path` is a
    /proc/self/fd link)."""
    name = str(path) if name is None else name
    if entry.method != 0:
        raise ValidationFailed(
            Reason.BAD_HEADER, f"{name}: compressed member {entry.name} too big to scan", name
        )
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        start = data_offset(fd, entry, name)
    except BaseException:
        os.close(fd)
        raise
    return io.BufferedReader(_MemberReader(fd, start, entry.size), 1 << 20)
