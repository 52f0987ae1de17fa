"""Paths ckptd did not choose: a root's member opened beneath the root's descriptor and a tree
removed, neither following a symbolic link; a relative name joined under a directory ckptd
made, refused where it leads out. Never reads or writes a file's bytes.
"""

from __future__ import annotations

import contextlib
import errno
import os
import posixpath
import stat
from pathlib import Path

from ckptd.errors import UnsafePath


def safe_join(root: str | os.PathLike[str], rel: str) -> Path:
    """`root/rel`, refusing (UnsafePath) anything that lands outside `root`.

    Only for directories ckptd made (a local copy's objects, a staging dir) or a restore
    target the user named: a root's member is opened with `open_beneath`, never through this.
    `rel` comes from a manifest or a client: it must be relative, must not climb with `..`,
    and no symlink along it may lead out of `root`. Checked at call time: a link swapped in
    afterwards is not seen, so callers open the returned path promptly.
    """
    if not rel or "\x00" in rel:
        raise UnsafePath(f"bad relative path {rel!r}")
    if posixpath.isabs(rel) or os.path.isabs(rel):
        raise UnsafePath(f"{rel!r} is absolute")
    norm = posixpath.normpath(rel)
    if norm == ".." or norm.startswith("../"):
        raise UnsafePath(f"{rel!r} climbs out of its root")
    base = Path(root)
    joined = base / norm
    try:
        real_root = real_path(os.fspath(base))
        real = real_path(os.fspath(joined))
    except (RuntimeError, OSError) as exc:  # a symlink loop, or an unreadable component
        raise UnsafePath(f"{rel!r} cannot be resolved under {root}: {exc}") from exc
    if real != real_root and not real.startswith(real_root.rstrip("/") + "/"):
        raise UnsafePath(f"{rel!r} leads out of {root} (to {real})")
    return joined


_O_PATH = getattr(os, "O_PATH", 0)


def real_path(path: str) -> str:
    """`path` with every symbolic link along it resolved, as `os.path.realpath` (not strict)
    gives it, in a few system calls instead of one `lstat` per component: what exists is
    opened O_PATH and named back by the kernel (/proc/self/fd); a name that does not exist
    yet is resolved through its parent. Anything unusual (a dangling link, a file where a
    directory should be, no /proc, a relative path or a `..`) goes the long way,
    `Path.resolve`. Raises OSError (or RuntimeError) for a symlink loop."""
    if not _O_PATH or not os.path.isabs(path) or "/.." in path:
        return _long_way(path)
    try:
        fd = os.open(path, _O_PATH | os.O_CLOEXEC)
    except FileNotFoundError:
        head, name = os.path.split(path)
        if not name or head == path or _lexists(path):  # "/", or a dangling link
            return _long_way(path)
        parent = real_path(head)
        return parent.rstrip("/") + "/" + name
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise
        return _long_way(path)
    try:
        named = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return _long_way(path)
    finally:
        os.close(fd)
    if not named.startswith("/") or named.endswith(" (deleted)"):
        return _long_way(path)
    return named


def _long_way(path: str) -> str:
    return os.fspath(Path(path).resolve())


def _lexists(path: str) -> bool:
    try:
        os.lstat(path)
    except OSError:
        return False
    return True


def open_beneath(root: str | os.PathLike[str], rel: str) -> int:
    """A read-only descriptor of the regular file `root/rel`, opened component by component
    beneath the root's own descriptor with O_NOFOLLOW: no symlink is followed anywhere along
    the way, and a file swapped for a link after a check is refused, never read. Everything
    that reads the file afterwards (hash, CRC, format checks, the compressor) reads this one
    descriptor. Raises UnsafePath for a link or a climb, FileNotFoundError, or OSError."""
    parts = _parts(rel)
    flags = os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW
    fd = os.open(root, flags | os.O_DIRECTORY)
    try:
        for part in parts[:-1]:
            nxt = _open_at(fd, part, rel, flags | os.O_DIRECTORY)
            os.close(fd)
            fd = nxt
        file_fd = _open_at(fd, parts[-1], rel, flags | os.O_NONBLOCK)
    finally:
        os.close(fd)
    st = os.fstat(file_fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(file_fd)
        raise UnsafePath(f"{rel!r} is not a regular file")
    os.set_blocking(file_fd, True)
    return file_fd


def _parts(rel: str) -> list[str]:
    if not rel or "\x00" in rel or posixpath.isabs(rel):
        raise UnsafePath(f"bad relative path {rel!r}")
    parts = [p for p in rel.split("/") if p not in ("", ".")]
    if not parts or ".." in parts:
        raise UnsafePath(f"{rel!r} climbs out of its root")
    return parts


def _open_at(dir_fd: int, name: str, rel: str, flags: int) -> int:
    try:
        return os.open(name, flags, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR) and _is_link(dir_fd, name):
            raise UnsafePath(f"{rel!r}: {name!r} is a symlink; ckptd never follows a"
                             " symbolic link inside a root") from None
        raise


def _is_link(dir_fd: int, name: str) -> bool:
    try:
        return stat.S_ISLNK(os.lstat(name, dir_fd=dir_fd).st_mode)
    except OSError:
        return False

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def remove_tree(path: str | os.PathLike[str], *, dir_fd: int | None = None) -> None:
    """Delete `path` and everything beneath it, never following a symbolic link: a link is
    unlinked and its target stays. With `dir_fd`, `path` is relative to that directory.

    Works through directory descriptors opened with O_NOFOLLOW, iteratively (one descriptor
    per level of depth), so a directory swapped for a link mid-removal is refused, never
    entered. Something already gone is not an error; any other OSError is raised as is.
    """
    name = os.fspath(path)
    top = _open_dir_or_unlink(name, dir_fd)
    if top is None:
        return
    fds, names, pending = [top], [name], [os.listdir(top)]
    try:
        while fds:
            if pending[-1]:
                entry = pending[-1].pop()
                sub = _open_dir_or_unlink(entry, fds[-1])
                if sub is not None:
                    fds.append(sub)
                    names.append(entry)
                    pending.append(os.listdir(sub))
                continue
            os.close(fds.pop())
            pending.pop()
            with contextlib.suppress(FileNotFoundError):
                os.rmdir(names.pop(), dir_fd=fds[-1] if fds else dir_fd)
    finally:
        for fd in fds:
            os.close(fd)


def _open_dir_or_unlink(name: str, dir_fd: int | None) -> int | None:
    """A descriptor of the directory `name`; or, for anything else (a link included), unlink
    it and None. None too when it is gone."""
    try:
        return os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno not in (errno.ENOTDIR, errno.ELOOP):
            raise
    with contextlib.suppress(FileNotFoundError):
        os.unlink(name, dir_fd=dir_fd)
    return None
