"""The local side of an upload: an object file as a put's source (fadvise, S3 etag on the fly),
S3 etags of local files, and the ledger of which remote objects this node put from which files.

Reads object files and writes only the ledger; knows nothing of manifests' meaning or the store.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import hashlib
import io
import json
import os
import stat
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ckptd import fileio, inputs
from ckptd.backends.base import ObjectMeta, bare, check_key, os_error, same_object
from ckptd.errors import BadInput, CkptdError, PermanentError
from ckptd.log import get_logger

LEDGER_NAME = ".upload-ledger.jsonl"
_LEDGER_FORMAT = "ckptd-upload-ledger/2"
_LEGACY_NAME = ".upload-ledger.json"  # the whole-document ledger of earlier versions
_LEGACY_FORMAT = "ckptd-upload-ledger/1"
_READ_LIMIT = 8 << 20  # largest single read from an object file
_DROP_STEP = 64 << 20  # drop cached pages behind the cursor in steps this big

Progress = Callable[[int], None]


class Meter:
    """Bytes sent (re-sends included) and step progress (high-water marks only)."""

    def __init__(self, progress: Progress | None) -> None:
        self._progress = progress
        self._lock = threading.Lock()
        self.sent_bytes = 0

    def sent(self, n: int) -> None:
        with self._lock:
            self.sent_bytes += n

    def advance(self, n: int) -> None:
        if self._progress is not None and n > 0:
            with self._lock:
                self._progress(n)


class _S3Etag:
    """A read-pass sink computing S3's etag of the bytes: the MD5 for a single-part object,
    else the MD5 of the parts' MD5s and "-<parts>" (parts of `part_size`, as the backend puts)."""

    def __init__(self, size: int, part_size: int) -> None:
        self.part_size = part_size if size > part_size else 0
        self._part = hashlib.md5(usedforsecurity=False)
        self._in_part = 0
        self._digests: list[bytes] = []

    def update(self, offset: int, view: memoryview) -> None:
        while len(view):
            take = len(view) if not self.part_size else min(
                len(view), self.part_size - self._in_part)
            self._part.update(view[:take])
            self._in_part += take
            view = view[take:]
            if self.part_size and self._in_part == self.part_size:
                self._close_part()

    def finish(self, total: int) -> None:
        pass

    def etag(self) -> str:
        if not self.part_size:
            return self._part.hexdigest()
        if self._in_part:
            self._close_part()
        whole = hashlib.md5(b"".join(self._digests), usedforsecurity=False).hexdigest()
        return f"{whole}-{len(self._digests)}"

    def _close_part(self) -> None:
        self._digests.append(self._part.digest())
        self._part = hashlib.md5(usedforsecurity=False)
        self._in_part = 0


def etag_matches_file(meta: ObjectMeta, path: Path, size: int, part_size: int) -> bool:
    """Does the store's etag equal the S3 etag of the local file? One read of the file."""
    if not meta.etag:
        return False
    etag = bare(meta.etag)
    parts = -(-size // part_size) if size > part_size else 0
    if etag.count("-") != (1 if parts else 0) or (parts and not etag.endswith(f"-{parts}")):
        return False  # not the shape our own put would produce: cannot be compared
    sink = _S3Etag(size, part_size)
    try:
        fileio.read_pass(path, [sink])
    except (OSError, CkptdError):
        return False
    return sink.etag() == etag


def _load_malloc_trim() -> Callable[[int], int] | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim: Callable[[int], int] = libc.malloc_trim
        return trim
    except (OSError, AttributeError):  # not glibc: nothing to trim
        return None


_MALLOC_TRIM = _load_malloc_trim()
TRIM_ABOVE = 8 << 20


def release_memory() -> None:
    """Give freed heap memory back to the OS after a big put.

    Puts run on several threads, and glibc gives each thread its own arena that keeps what was
    freed: without this, every worker thread holds a put's worth of buffers (measured: twice
    the peak of the same puts made one after another on one thread).
    """
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


def fingerprint(path: Path) -> list[int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return [st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev]


class ObjectReader(io.RawIOBase):
    """An object file as a put's source: sequential reads with fadvise (pages behind the cursor
    are dropped: the disk belongs to the training job), seekable for retries, counting bytes
    for progress and `sent_bytes`, and computing the S3 etag of what was read."""

    def __init__(self, path: Path, meter: Meter, part_size: int, md5: bool) -> None:
        super().__init__()
        self.path = path
        self._fd = -1  # so close() after a failed open has nothing to do
        try:
            self._fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            raise PermanentError(f"{path}: stored object missing on local disk") from None
        except OSError as exc:
            raise os_error(exc, f"open {path}") from None
        st = os.fstat(self._fd)
        self.size = st.st_size
        self.fingerprint = [st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev]
        self._meter = meter
        self._pos = self._high = self._dropped = 0
        self._hold = False
        self._hasher: _S3Etag | None = _S3Etag(self.size, part_size) if md5 else None
        self._md5 = md5
        self._part_size = part_size
        fileio.advise(self._fd, 0, 0, "POSIX_FADV_SEQUENTIAL")

    def readable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self._fd

    def hold_cache(self) -> None:
        """Stop dropping the pages behind the cursor: a backend sending this file's pages from
        a mapping drops them itself once they are sent (until close, which drops them all)."""
        self._hold = True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._pos, 2: self.size}[whence]
        self._pos = max(0, base + pos)
        # A retry starts over: hash afresh from 0; from anywhere else the hash is lost.
        fresh = self._md5 and self._pos == 0
        self._hasher = _S3Etag(self.size, self._part_size) if fresh else None
        return self._pos

    def read(self, n: int | None = -1) -> bytes:
        want = self.size - self._pos if n is None or n < 0 else n
        data = os.pread(self._fd, min(want, _READ_LIMIT), self._pos) if want > 0 else b""
        self._account(memoryview(data))
        return data

    def readinto(self, buf: Any) -> int:
        """Like read, into `buf` (a reused buffer: no allocation per read)."""
        view = memoryview(buf).cast("B")
        want = min(len(view), self.size - self._pos, _READ_LIMIT)
        got = os.preadv(self._fd, [view[:want]], self._pos) if want > 0 else 0
        self._account(view[:got])
        return got

    def _account(self, data: memoryview) -> None:
        """Hash, count and advance over `data`, just read at the cursor."""
        if self._hasher is not None:
            self._hasher.update(self._pos, data)
        self._pos += len(data)
        self._meter.sent(len(data))
        if self._pos > self._high:
            self._meter.advance(self._pos - self._high)
            self._high = self._pos
        if not self._hold and self._high - self._dropped >= _DROP_STEP:
            fileio.advise(self._fd, self._dropped, self._high - self._dropped)
            self._dropped = self._high

    def etag(self) -> str | None:
        """The S3 etag of the bytes read, if they were read once through from the start."""
        if self._hasher is None or self._pos != self.size:
            return None
        return self._hasher.etag()

    def close(self) -> None:
        if not self.closed and self._fd >= 0:
            fileio.advise(self._fd, 0, 0)
            os.close(self._fd)
        super().close()

    def __enter__(self) -> ObjectReader:
        return self


class Ledger:
    """Which remote objects this node put from which local files (`.upload-ledger.jsonl` in the
    step's objects dir), so a re-run skips them without reading anything. Only a hint: a lost
    or stale entry costs a re-check or a re-send, never a wrong skip, since an entry counts
    only while the local file (size, mtime, inode) and the remote object (etag, else mtime)
    are both unchanged. Written without fsync for the same reason.

    Append-only JSON lines, so recording an object costs one small write whatever the step's
    size: a header line (format and backend URL), then one line per object put or proven (a
    later line for a key replaces an earlier one). A torn last line (a kill mid-write) and any
    unparsable line are ignored; a ledger of another format or URL is started afresh. The
    whole-document ledger of earlier versions (`.upload-ledger.json`) is read as well, and
    folded into the new file when that is first written.
    """

    def __init__(self, path: Path, url: str, objects: dict[str, Any], valid: int = 0,
                 legacy: Path | None = None) -> None:
        self.path = path
        self.url = url
        self.objects = objects
        self._valid = valid  # bytes of whole lines, header first; 0: (re)write from scratch
        self._legacy = legacy  # an old-format ledger whose entries `objects` holds
        self._fd = -1
        self._lock = threading.Lock()

    @classmethod
    def load(cls, path: Path, url: str) -> Ledger:
        legacy = path.with_name(_LEGACY_NAME)
        objects = _read_legacy(legacy, url)
        valid = _read_lines(path, url, objects)
        return cls(path, url, objects, valid, legacy if legacy.exists() else None)

    def vouches(self, key: str, fingerprint: list[int], meta: ObjectMeta) -> bool:
        entry = self.objects.get(key)
        if not isinstance(entry, dict) or entry.get("local") != fingerprint:
            return False
        try:
            then = ObjectMeta(key, int(entry["size"]), float(entry["mtime"]), entry["etag"])
        except (KeyError, TypeError, ValueError):
            return False
        return same_object(then, meta)

    def sent(self) -> dict[str, ObjectMeta]:
        """Every object the ledger says this copy's save put or proved, as it was then; an
        entry that is malformed or names no valid key (the ledger lies in the root) is left
        out."""
        out: dict[str, ObjectMeta] = {}
        for key, entry in self.objects.items():
            try:
                check_key(key)
                out[key] = ObjectMeta(key, int(entry["size"]), float(entry["mtime"]),
                                      entry["etag"] if isinstance(entry["etag"], str) else None)
            except (CkptdError, KeyError, TypeError, ValueError):
                continue
        return out

    def record(self, key: str, fingerprint: list[int], meta: ObjectMeta) -> None:
        entry = {"local": fingerprint, "size": meta.size, "mtime": meta.mtime, "etag": meta.etag}
        line = _line({"key": key, **entry})
        with self._lock:
            try:
                self._append(line)
            except OSError as exc:
                self._close()  # the next record reopens and cuts what this one left
                get_logger().debug("upload_ledger_unwritable", path=str(self.path),
                                   error=str(exc))
            self.objects[key] = entry  # after: a new file's first write holds the others

    def close(self) -> None:
        with self._lock:
            self._close()

    def _append(self, line: bytes) -> None:
        if self._fd < 0:
            self._open()
        if os.write(self._fd, line) != len(line):
            raise OSError(errno.ENOSPC, "short write")
        self._valid += len(line)

    def _open(self) -> None:
        """Open for appending after the last whole line; a new file starts with its header
        and the old-format ledger's entries (the old file then goes)."""
        # Never through a link (it could lead out of the root) and never waiting on a FIFO.
        flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC | os.O_NOFOLLOW
        fd = os.open(self.path, flags | os.O_NONBLOCK, 0o644)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise OSError(errno.EINVAL, f"{self.path} is not a regular file")
            os.ftruncate(fd, self._valid)
            if self._valid == 0:
                start = _line({"format": _LEDGER_FORMAT, "url": self.url}) + b"".join(
                    _line({"key": k, **e}) for k, e in self.objects.items() if isinstance(e, dict))
                if os.write(fd, start) != len(start):
                    raise OSError(errno.ENOSPC, "short write")
                self._valid = len(start)
                if self._legacy is not None:  # folded in: the new file holds its entries
                    self._legacy.unlink(missing_ok=True)
                    self._legacy = None
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd

    def _close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def _line(doc: dict[str, Any]) -> bytes:
    return json.dumps(doc, separators=(",", ":")).encode() + b"\n"


def _read_lines(path: Path, url: str, objects: dict[str, Any]) -> int:
    """Add the entries of the JSON-lines ledger at `path` to `objects`; return the length of
    its whole lines, or 0 when it is missing, unreadable, or of another format or URL."""
    try:
        data = inputs.read_file(path, inputs.LEDGER)
    except (OSError, BadInput):
        return 0  # missing, a link, a FIFO, over its cap: started afresh, it only saves work
    end = data.rfind(b"\n") + 1  # past the last whole line: what follows is torn
    lines = data[:end].splitlines()
    if not lines or _header(lines[0]) != (_LEDGER_FORMAT, url):
        return 0
    for raw in lines[1:]:
        try:
            doc = json.loads(raw)
            key = doc.pop("key")
        except (ValueError, TypeError, KeyError, AttributeError):
            continue  # one damaged line hides only its own entry
        if isinstance(key, str):
            objects[key] = doc
    return end


def _header(raw: bytes) -> tuple[Any, Any]:
    try:
        doc = json.loads(raw)
        return doc.get("format"), doc.get("url")
    except (ValueError, AttributeError):
        return None, None


def _read_legacy(path: Path, url: str) -> dict[str, Any]:
    """The entries of an old whole-document ledger for `url`, else none."""
    try:
        doc = inputs.read_json(path, inputs.LEDGER)
        if doc.get("format") == _LEGACY_FORMAT and doc.get("url") == url:
            return dict(doc["objects"])
    except (OSError, BadInput, ValueError, TypeError, KeyError, AttributeError):
        pass
    return {}
