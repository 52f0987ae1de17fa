"""The `file://` backend: objects are files under one directory (a local disk or an NFS mount).

Writes are temp-name, fsync, rename, fsync-dir; nothing is written or read outside `base_dir`.
A conditional put holds an flock on a lock file beside the object while it compares and renames.
This module maps keys to paths inside `base_dir` and reads; the files' own protocol (temp
names, the lock, version tags) is `localfiles`'.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator
from os import stat_result
from stat import S_ISREG
from typing import BinaryIO

from ckptd import fileio, inputs
from ckptd.backends import localfiles
from ckptd.backends.base import (
    COPY_CHUNK,
    DEFAULT_PART_SIZE,
    SMALL_OBJECT_MAX,
    ObjectMeta,
    Source,
    check_key,
    check_prefix,
    check_put_mode,
    check_range,
    join_url,
    os_error,
    past_end,
)
from ckptd.errors import (
    ObjectNotFound,
    PermanentError,
    PreconditionFailed,
    TransientError,
)


class LocalBackend:
    """Objects as regular files under `base_dir`; see `Backend` for the rules."""

    def __init__(self, base_dir: str | os.PathLike[str], *, part_size: int = DEFAULT_PART_SIZE):
        # realpath once: containment checks compare resolved paths against it.
        self.base = os.path.realpath(os.fspath(base_dir))
        self.url = "file://" + self.base
        self.part_size = part_size
        self.md5_etags = False  # no etags at all

    def __repr__(self) -> str:
        return f"LocalBackend({self.base!r})"

    # -- the contract ----------------------------------------------------------------------

    def put(
        self,
        key: str,
        src: Source,
        size: int | None = None,
        *,
        create_only: bool = False,
        if_match: str | None = None,
    ) -> ObjectMeta:
        check_put_mode(create_only, if_match)
        path = self._path(key)
        folder = os.path.dirname(path)
        try:
            self._makedirs(folder)
            localfiles.put_file(path, src, size, create_only, if_match, self._where(key))
            fileio.fsync_dir(folder)
            st = os.stat(path)
        except OSError as exc:
            raise os_error(exc, f"put {self._where(key)}") from None
        return ObjectMeta(key=key, size=st.st_size, mtime=st.st_mtime, etag=None,
                          version=localfiles.version(st))

    def get(self, key: str, dst: BinaryIO, etag: str | None = None) -> int:
        """The bytes of the file opened (a rename over the name meanwhile does not change
        them); its version tag is compared with `etag` when given, and again after each
        read, before its bytes are handed on: a rewrite in place while reading is
        PreconditionFailed, and no byte read after it reaches `dst`."""
        total = 0
        where = self._where(key)
        with self._open(key) as f:
            first = self._fstat_version(f, where)
            if etag is not None and first != etag:
                raise PreconditionFailed(f"get {where}: not version {etag}")
            while chunk := self._read(f, key):
                if self._fstat_version(f, where) != first:
                    raise PreconditionFailed(f"get {where}: the file changed while it was read")
                try:
                    dst.write(chunk)
                except OSError as exc:
                    raise os_error(exc, f"get {where}: writing the destination") from None
                total += len(chunk)
        return total

    def get_bytes(self, key: str, limit: int = SMALL_OBJECT_MAX) -> bytes:
        return self._read_small(key, limit)[0]

    def get_versioned(self, key: str, limit: int = SMALL_OBJECT_MAX) -> tuple[bytes, str]:
        data, st = self._read_small(key, limit)
        return data, localfiles.version(st)

    def get_range(
        self, key: str, start: int, end: int, etag: str | None = None
    ) -> bytes | memoryview:
        """pread of [start, end) from the descriptor `get` would read (no link followed,
        regular files only); `etag` is compared with the version tag `get_versioned` gives,
        before the read and again after it (a rewrite in place while reading changes it)."""
        check_range(key, start, end)
        where = self._where(key)
        with self._open(key) as f:
            try:
                st = os.fstat(f.fileno())
                self._check_span(where, st, start, end, etag)
                data = _pread_all(f.fileno(), start, end)
                if etag is not None:
                    self._check_span(where, os.fstat(f.fileno()), start, end, etag)
            except OSError as exc:
                raise os_error(exc, f"get_range {where}") from None
        if len(data) != end - start:  # the file shrank under the read
            raise TransientError(f"get_range {where}: got {len(data)} bytes of [{start}, {end})")
        return data

    def stat(self, key: str) -> ObjectMeta:
        path = self._path(key)
        try:
            self._inside(os.path.dirname(path), key)
            st = os.stat(path, follow_symlinks=False)
        except (FileNotFoundError, NotADirectoryError):
            raise ObjectNotFound(f"no object {self._where(key)}") from None
        except OSError as exc:
            raise os_error(exc, f"stat {self._where(key)}") from None
        if not S_ISREG(st.st_mode):
            raise ObjectNotFound(f"no object {self._where(key)}")
        return ObjectMeta(key=key, size=st.st_size, mtime=st.st_mtime, etag=None,
                          version=localfiles.version(st))

    def list(self, prefix: str = "") -> Iterator[ObjectMeta]:
        start = check_prefix(prefix)
        top = os.path.join(self.base, *start.split("/")) if start else self.base
        self._inside(top, start)
        try:
            yield from self._walk(top, start)
        except OSError as exc:
            raise os_error(exc, f"list {self._where(start)}") from None

    def delete(self, key: str) -> None:
        path = self._path(key)
        try:
            self._inside(os.path.dirname(path), key)
            localfiles.delete_file(path)
        except (FileNotFoundError, NotADirectoryError):
            return
        except IsADirectoryError:
            return  # a "directory" key holds no object: nothing to delete
        except OSError as exc:
            raise os_error(exc, f"delete {self._where(key)}") from None
        folder = os.path.dirname(path)
        fileio.fsync_dir(folder, quiet=True)  # a delete: best effort
        self._prune_empty_dirs(folder)

    # -- housekeeping ----------------------------------------------------------------------

    def remove_stale_temp(self, older_than_s: float, now: float | None = None) -> int:
        """Delete temp files of interrupted puts not written to for `older_than_s`; return the
        count. Meant for daemon start-up (a put in flight, here or on another node sharing the
        directory, keeps its temp file's mtime fresh). Walks `base_dir` by directory fds
        without following a link, and removes only regular files named as `_write_temp`
        names them: nothing outside the directory, nothing that is not this backend's own.
        OSError (other than a missing `base_dir`) when it cannot be walked."""
        return localfiles.remove_stale_temp(self.base, older_than_s, now)

    # -- helpers ---------------------------------------------------------------------------

    def _where(self, key: str) -> str:
        return join_url(self.url, key)

    def _path(self, key: str) -> str:
        check_key(key)
        for mark in (localfiles.TMP_MARK, localfiles.LOCK_MARK):
            if mark in key:
                raise PermanentError(f"invalid storage key {key!r}: contains {mark!r}")
        return os.path.join(self.base, *key.split("/"))

    def _inside(self, path: str, key: str) -> None:
        """Refuse a path that resolves (through a symlink) outside the base directory."""
        real = os.path.realpath(path)
        if real != self.base and not real.startswith(self.base + os.sep):
            raise PermanentError(f"{self._where(key)} resolves outside {self.base}: refused")

    def _makedirs(self, folder: str) -> None:
        """Create missing directories one at a time, fsyncing each new entry's parent."""
        missing: list[str] = []
        probe = folder
        while not os.path.isdir(probe):
            missing.append(probe)
            parent = os.path.dirname(probe)
            if parent == probe:
                break
            probe = parent
        # Check before creating anything: a symlinked ancestor could point outside the base.
        if probe.startswith(self.base + os.sep):
            self._inside(probe, os.path.relpath(probe, self.base))
        for d in reversed(missing):
            try:
                os.mkdir(d)
            except FileExistsError:
                continue  # a concurrent put made it
            fileio.fsync_dir(os.path.dirname(d))

    def _open(self, key: str) -> BinaryIO:
        """The object's file, opened for reading; symlinks, directories, FIFOs and devices are
        not objects. Opened non-blocking (a FIFO's open would wait for a writer) and never
        through a link; what is not a regular file is refused before anything is read."""
        path = self._path(key)
        missing = ObjectNotFound(f"no object {self._where(key)}")
        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
        try:
            self._inside(os.path.dirname(path), key)
            fd = os.open(path, flags)
        except (FileNotFoundError, NotADirectoryError):
            raise missing from None
        except OSError as exc:
            if exc.errno == errno.ELOOP:  # O_NOFOLLOW met a symlink
                raise missing from None
            raise os_error(exc, f"get {self._where(key)}") from None
        if not S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise ObjectNotFound(f"no object {self._where(key)} (not a regular file)")
        return os.fdopen(fd, "rb")

    def _read_small(self, key: str, limit: int) -> tuple[bytes, stat_result]:
        """At most `limit` bytes of the object (fstat says first; at most limit + 1 are read)
        and the fstat of the descriptor read after reading: the version of exactly these
        bytes."""
        with self._open(key) as f:
            try:
                data = inputs.read_fd(f.fileno(), inputs.Kind("small object", limit),
                                      self._where(key))
                return data, os.fstat(f.fileno())
            except OSError as exc:
                raise os_error(exc, f"get {self._where(key)}") from None

    @staticmethod
    def _check_span(where: str, st: stat_result, start: int, end: int, etag: str | None) -> None:
        if etag is not None and localfiles.version(st) != etag:
            raise PreconditionFailed(f"get_range {where}: not version {etag}")
        if end > st.st_size:
            raise past_end(where, start, end, st.st_size)

    @staticmethod
    def _fstat_version(f: BinaryIO, where: str) -> str:
        try:
            return localfiles.version(os.fstat(f.fileno()))
        except OSError as exc:
            raise os_error(exc, f"get {where}") from None

    def _read(self, f: BinaryIO, key: str) -> bytes:
        try:
            return f.read(COPY_CHUNK)
        except OSError as exc:
            raise os_error(exc, f"get {self._where(key)}") from None

    def _walk(self, top: str, rel: str) -> Iterator[ObjectMeta]:
        try:
            entries = sorted(os.scandir(top), key=lambda e: e.name)
        except (FileNotFoundError, NotADirectoryError):
            return
        for entry in entries:
            key = f"{rel}/{entry.name}" if rel else entry.name
            if entry.is_dir(follow_symlinks=False):
                yield from self._walk(entry.path, key)
            elif entry.is_file(follow_symlinks=False) and not localfiles.is_ours(entry.name):
                st = entry.stat(follow_symlinks=False)
                yield ObjectMeta(key=key, size=st.st_size, mtime=st.st_mtime, etag=None,
                                 version=localfiles.version(st))

    def _prune_empty_dirs(self, folder: str) -> None:
        """Remove directories a delete left empty, up to (not including) the base."""
        while folder != self.base and folder.startswith(self.base + os.sep):
            try:
                os.rmdir(folder)
            except OSError:
                return  # not empty, or gone: either way stop
            fileio.fsync_dir(os.path.dirname(folder), quiet=True)
            folder = os.path.dirname(folder)


def _pread_all(fd: int, start: int, end: int) -> bytes:
    """Bytes [start, end) of `fd`, fewer only at end of file (a read may return short)."""
    chunks: list[bytes] = []
    pos = start
    while pos < end and (chunk := os.pread(fd, end - pos, pos)):
        chunks.append(chunk)
        pos += len(chunk)
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)
