"""The `file://` backend's files on disk: an object's version tag, the temp file a put writes
(named so that only this backend's own are ever removed), the create-only link and the
conditional rename under a lock file beside the object, and the sweep of interrupted puts'
temp files. Never maps a key to a path or checks containment (that is `LocalBackend`'s).
"""

from __future__ import annotations

import fcntl
import os
import re
import secrets
import time
from collections.abc import Iterator
from contextlib import contextmanager
from os import stat_result
from stat import S_ISREG
from typing import BinaryIO

from ckptd.backends.base import COPY_CHUNK, Source
from ckptd.errors import ObjectExists, PermanentError, PreconditionFailed

# Marks our in-flight temp files; list() never shows them and keys may not contain it.
TMP_MARK = ".ckptd-tmp."
_TEMP_TOKEN_BYTES = 6
# The whole name `_write_temp` gives a temp file: ".<object name>.ckptd-tmp.<12 hex digits>".
_TEMP_NAME = re.compile(rf"\..+{re.escape(TMP_MARK)}[0-9a-f]{{{2 * _TEMP_TOKEN_BYTES}}}", re.S)
# Ends the name of the lock file of a conditionally written object (".LATEST.ckptd-lock").
LOCK_MARK = ".ckptd-lock"


def put_file(path: str, src: Source, size: int | None, create_only: bool,
             if_match: str | None, where: str) -> None:
    """Write the object file `path` (its directory exists) from `src` through a temp file
    beside it: renamed over it, linked in when `create_only`, or with `if_match` renamed
    over it under its lock while it is still that version. The temp file never stays."""
    tmp = _write_temp(os.path.dirname(path), os.path.basename(path), src, size, where)
    try:
        if if_match is None:
            _commit(tmp, path, create_only, where)
        else:
            _replace_if(tmp, path, if_match, where)
    finally:
        _unlink_quietly(tmp)


def delete_file(path: str) -> None:
    """Unlink the object file `path` under its lock, when a conditional put made one, and the
    lock file with it (a conditional put waiting on it re-checks the name and starts over).
    OSError as is (FileNotFoundError when it is gone)."""
    with _locked(_lock_path(path), create=False) as held:
        os.unlink(path)
        if held:
            _unlink_quietly(_lock_path(path))


def _write_temp(folder: str, name: str, src: Source, size: int | None, where: str) -> str:
    """A temp file beside the object `name` in `folder`, holding `src`, fsynced: the name
    `remove_stale_temp` recognizes. PermanentError when `src` is not `size` bytes long."""
    tmp = os.path.join(folder, f".{name}{TMP_MARK}{secrets.token_hex(_TEMP_TOKEN_BYTES)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
    try:
        with os.fdopen(fd, "wb") as out:
            written = _copy(src, out)
            out.flush()
            os.fsync(out.fileno())
        if size is not None and written != size:
            raise PermanentError(
                f"put {where}: source gave {written} bytes, expected {size}"
            )
    except BaseException:
        _unlink_quietly(tmp)
        raise
    return tmp


def _commit(tmp: str, path: str, create_only: bool, where: str) -> None:
    """The temp file `tmp` becomes the object `path`: renamed over it, or with `create_only`
    linked to the name, which fails (ObjectExists) when the name is taken."""
    if not create_only:
        os.replace(tmp, path)
        return
    try:
        # link() fails if the name exists, atomically, also on NFS: a create-only rename.
        os.link(tmp, path)
    except FileExistsError:
        raise ObjectExists(f"{where} already exists") from None


def _replace_if(tmp: str, path: str, if_match: str, where: str) -> None:
    """Rename `tmp` over `path` if `path` is still version `if_match`, under its lock."""
    with _locked(_lock_path(path), create=True):
        try:
            st = os.stat(path, follow_symlinks=False)
        except (FileNotFoundError, NotADirectoryError):
            st = None
        if st is None or not S_ISREG(st.st_mode) or version(st) != if_match:
            raise PreconditionFailed(
                f"{where} is gone or was changed since it was read"
            )
        os.replace(tmp, path)


def remove_stale_temp(base: str, older_than_s: float, now: float | None = None) -> int:
    """Delete the temp files under `base` of interrupted puts not written to for
    `older_than_s`; return the count. Walks `base` by directory fds without following a link,
    and removes only regular files named as `_write_temp` names them. OSError (other than a
    missing `base`) when it cannot be walked."""
    cutoff = (time.time() if now is None else now) - older_than_s
    removed = 0
    try:
        for _folder, _dirs, files, dir_fd in os.fwalk(base, follow_symlinks=False):
            for name in filter(_TEMP_NAME.fullmatch, files):
                removed += _unlink_if_older(name, dir_fd, cutoff)
    except FileNotFoundError:
        pass  # no base directory (nothing was ever put): nothing to clean
    return removed


def is_ours(name: str) -> bool:
    """A temp or lock file of this backend, never an object."""
    return TMP_MARK in name or name.endswith(LOCK_MARK)


def version(st: stat_result) -> str:
    """A file's version tag (what `get_versioned` and `stat` give and reads are pinned to): a
    rename-replaced file is another inode, a rewrite a new mtime or size."""
    return f"{st.st_dev:x}.{st.st_ino:x}.{st.st_mtime_ns:x}.{st.st_size:x}"


def _lock_path(path: str) -> str:
    return os.path.join(os.path.dirname(path), f".{os.path.basename(path)}{LOCK_MARK}")


@contextmanager
def _locked(lock: str, *, create: bool) -> Iterator[bool]:
    """Hold an exclusive flock on `lock`; yields False (no lock) if it is absent and not
    `create`. A lock file unlinked while we waited for it is opened again."""
    flags = os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW | (os.O_CREAT if create else 0)
    while True:
        try:
            fd = os.open(lock, flags, 0o666)
        except FileNotFoundError:
            if create:
                raise
            yield False
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            if _same_file(fd, lock):
                break
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)
    try:
        yield True
    finally:
        os.close(fd)  # closing releases the flock


def _same_file(fd: int, path: str) -> bool:
    try:
        named = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (held.st_dev, held.st_ino) == (named.st_dev, named.st_ino)


def _copy(src: Source, out: BinaryIO) -> int:
    if isinstance(src, bytes | bytearray | memoryview):
        out.write(src)
        return len(src)
    total = 0
    while chunk := src.read(COPY_CHUNK):
        out.write(chunk)
        total += len(chunk)
    return total


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _unlink_if_older(name: str, dir_fd: int, cutoff: float) -> int:
    """Unlink the regular file `name` in `dir_fd` if last written before `cutoff`: 1 if so."""
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        if not S_ISREG(st.st_mode) or st.st_mtime >= cutoff:
            return 0
        os.unlink(name, dir_fd=dir_fd)
    except FileNotFoundError:
        return 0  # renamed into place or removed meanwhile
    return 1
