"""Every file primitive once: the bounded read pass, atomic writes, fsync, fadvise, tree removal.
A root's member is only opened with `open_beneath`; `safe_join` only names paths under
directories ckptd made. Knows nothing of checkpoint formats, the store or stages.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import posixpath
import secrets
import stat
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Protocol

import xxhash

from ckptd.errors import CkptdError, DiskFull, UnsafePath, ValidationFailed
from ckptd.model import Reason

CHUNK_SIZE = 8 << 20
HASH_ALG = "xxh3-128"
# Every temp file ckptd creates starts with this, so startup recovery deletes its own leftovers
# and never anything a training job wrote.
TEMP_PREFIX = ".ckptd-tmp-"
# Drop cached pages in steps of this many bytes rather than after every chunk: one syscall per
# step keeps the pass cheap while the cache footprint stays a few chunks.
_DROP_STEP = 64 << 20
_MIN_BUFFER = 64 << 10  # the smallest read_pass buffer


class Sink(Protocol):
    """Consumer of one read pass. `view` is only valid during the call (the buffer is reused)."""

    def update(self, offset: int, view: memoryview) -> None: ...

    def finish(self, total: int) -> None: ...


class HashSink:
    """The content hash of a file (xxh3-128, hex), named in manifests as `HASH_ALG`."""

    alg = HASH_ALG

    def __init__(self) -> None:
        self._h = xxhash.xxh3_128()
        self.digest = ""
        self.size = 0

    def update(self, offset: int, view: memoryview) -> None:
        self._h.update(view)

    def finish(self, total: int) -> None:
        self.size = total
        self.digest = self._h.hexdigest()


def read_pass(
    path: str | os.PathLike[str],
    sinks: Sequence[Sink],
    chunk_size: int = CHUNK_SIZE,
    drop_cache: bool = True,
    fd: int | None = None,
) -> int:
    """Read `path` once, front to back, handing each chunk to every sink; return bytes read.

    With `fd`, reads that open descriptor (from its start) instead of opening `path`, which
    then only names the file in messages. Memory is one reused buffer of `chunk_size`. With
    `drop_cache`, pages behind the cursor are dropped from the page cache as the pass goes, so
    validating a checkpoint does not evict the training job's data. Raises
    ValidationFailed(reason "changed") when the file's size changes during the pass; OSError
    as is; whatever a sink raises stops the pass.
    """
    if chunk_size <= 0:
        raise ValueError("chunk_size must be positive")
    own = fd is None
    if fd is None:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    else:
        os.lseek(fd, 0, os.SEEK_SET)  # the caller's descriptor (`open_beneath`), from the top
    try:
        size_at_open = os.fstat(fd).st_size
        advise(fd, 0, 0, "POSIX_FADV_SEQUENTIAL")
        # A buffer no bigger than the file (+1 so one read finds its end): a fresh 8 MiB
        # buffer per 60 KiB file was 0.6 ms of zeroing each, most of a small file's read.
        buf_size = min(chunk_size, max(size_at_open + 1, _MIN_BUFFER))
        total = _stream(fd, sinks, buf_size, drop_cache)
        if total != size_at_open or os.fstat(fd).st_size != total:
            raise ValidationFailed(
                Reason.CHANGED, f"{path} changed size while being read", str(path)
            )
    finally:
        if own:
            os.close(fd)
    for sink in sinks:
        sink.finish(total)
    return total


def _stream(fd: int, sinks: Sequence[Sink], chunk_size: int, drop_cache: bool) -> int:
    buf = memoryview(bytearray(chunk_size))
    offset = dropped = 0
    try:
        while n := os.readv(fd, [buf]):
            with buf[:n] as view:
                for sink in sinks:
                    sink.update(offset, view)
            offset += n
            if drop_cache and offset - dropped >= _DROP_STEP:
                advise(fd, dropped, offset - dropped, "POSIX_FADV_DONTNEED")
                dropped = offset
    finally:
        if drop_cache and offset > dropped:
            advise(fd, dropped, offset - dropped, "POSIX_FADV_DONTNEED")
    return offset


def drop_cache(path: str | os.PathLike[str]) -> None:
    """Ask the kernel to forget the clean cached pages of `path` (after an mmap'd scan)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return
    try:
        advise(fd, 0, 0, "POSIX_FADV_DONTNEED")
    finally:
        os.close(fd)


def advise(fd: int, offset: int, length: int, name: str = "POSIX_FADV_DONTNEED") -> None:
    """posix_fadvise `name` on a range of `fd` (length 0: to the end). The one place ckptd
    gives the kernel page-cache advice: only a hint, so a platform without it or an error is
    ignored. DONTNEED drops clean pages and starts writeback of dirty ones without waiting."""
    advice = getattr(os, name, None)
    if advice is not None:
        with contextlib.suppress(OSError):
            os.posix_fadvise(fd, offset, length, advice)


def pread_exact(fd: int, offset: int, n: int) -> bytes:
    """Up to `n` bytes at `offset` (fewer only at end of file)."""
    parts: list[bytes] = []
    got = 0
    while got < n:
        part = os.pread(fd, n - got, offset + got)
        if not part:
            break
        parts.append(part)
        got += len(part)
    return b"".join(parts)


# --- atomic writes, fsync, tree removal ------------------------------------------------------


def temp_name(final: Path) -> Path:
    """A fresh temp path beside `final` that startup recovery recognizes as ckptd's own."""
    return final.with_name(f"{TEMP_PREFIX}{final.name}.{os.getpid()}-{secrets.token_hex(4)}")


def atomic_write_bytes(
    path: str | os.PathLike[str], data: bytes, *, dir_fd: int | None = None
) -> None:
    """Replace `path` with `data` so a crash leaves either the old or the new file, never half:
    a temp name beside it (`temp_name`), write, fsync, rename, fsync the directory.

    With `dir_fd`, `path` is a plain name in that directory (a writer beneath a root's fd); the
    temp file is created there with O_NOFOLLOW|O_EXCL, so no link is ever written through.
    """
    final = Path(path)
    if dir_fd is not None and final.name != os.fspath(path):
        raise ValueError(f"with dir_fd, {os.fspath(path)!r} must be a plain name")
    tmp = temp_name(final)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(tmp, flags, 0o644, dir_fd=dir_fd)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, final, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp, dir_fd=dir_fd)
        raise
    if dir_fd is None:
        fsync_dir(final.parent)
    else:
        os.fsync(dir_fd)


def atomic_write_json(
    path: str | os.PathLike[str], obj: Any, *, dir_fd: int | None = None
) -> None:
    """`atomic_write_bytes` of `obj` as indented JSON with sorted keys and a trailing newline.
    NaN is written as Python's json writes it: callers whose documents must be strict check
    their input at the door (the save door's request head is)."""
    data = (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode()
    atomic_write_bytes(path, data, dir_fd=dir_fd)


def raise_open_file_limit() -> int:
    """Raise this process's soft limit on open files to its hard limit; return the limit in
    force. Validation holds every file of a step open at once (a file swapped after it was
    opened is never what gets read), so a 10,000-file DCP step needs more than the 1,024 a
    login shell or a Slurm step often starts with; the hard limit is the administrator's."""
    try:
        import resource
    except ImportError:  # not on this platform: nothing to raise
        return 1 << 20
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else 1 << 20
    if soft == resource.RLIM_INFINITY or soft >= want:
        return want if soft == resource.RLIM_INFINITY else soft
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        return want
    return soft


def open_file_limit() -> int:
    """The soft limit on open files in force now (1 << 20 where there is none)."""
    try:
        import resource
    except ImportError:
        return 1 << 20
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return 1 << 20 if soft == resource.RLIM_INFINITY else soft


def fsync_file(path: str | os.PathLike[str], drop: bool = False) -> None:
    """Flush a file's data and metadata to disk (it may have been written by another process).
    With `drop`, then forget its cached pages: the ones the writer's own writes brought in were
    dirty during the read pass (which drops only clean pages) and are clean only now."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
        if drop:
            advise(fd, 0, 0, "POSIX_FADV_DONTNEED")
    finally:
        os.close(fd)


# fsyncs in flight at once by `fsync_many`: concurrent fsyncs share the filesystem's journal
# commits (ext4, XFS), so a step of 10,000 small files does not pay 10,000 commits in a row.
FSYNC_THREADS = 8


def fsync_many(files: Sequence[int | str | os.PathLike[str]], drop: bool = False) -> None:
    """`fsync_file` (an open descriptor as is, a path opened for it) for every item, several at
    once; every item is attempted, and the first OSError is raised after all have been. The
    durability of each file is what one fsync of it gives; only the waiting is shared."""
    def one(item: int | str | os.PathLike[str]) -> None:
        if not isinstance(item, int):
            fsync_file(item, drop=drop)
            return
        os.fsync(item)
        if drop:
            advise(item, 0, 0, "POSIX_FADV_DONTNEED")

    if len(files) <= 1:
        for item in files:
            one(item)
        return
    errors: list[OSError] = []
    with ThreadPoolExecutor(min(FSYNC_THREADS, len(files)), "ckptd-fsync") as pool:
        for fut in [pool.submit(one, item) for item in files]:
            exc = fut.exception()
            if isinstance(exc, OSError):
                errors.append(exc)
            elif exc is not None:
                raise exc
    if errors:
        raise errors[0]


def fsync_dir(path: str | os.PathLike[str], *, quiet: bool = False) -> None:
    """Make the names in a directory durable (after a create, rename or delete). With `quiet`,
    an OSError is swallowed: for a delete, whose durability is best effort (the name is gone
    either way)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        if not quiet:
            raise


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


# --- untrusted paths -----------------------------------------------------------------------


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
        real_root = base.resolve()
        real = joined.resolve()
    except (RuntimeError, OSError) as exc:  # a symlink loop, or an unreadable component
        raise UnsafePath(f"{rel!r} cannot be resolved under {root}: {exc}") from exc
    if real != real_root and real_root not in real.parents:
        raise UnsafePath(f"{rel!r} leads out of {root} (to {real})")
    return joined


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


# --- writing and reading large files without filling the page cache ---

# Written data is pushed to disk and dropped from the page cache in steps of this size, so a
# compressed copy never sits in memory that the training job's data needs.
WRITEBACK_STEP = 32 << 20


def write_error(exc: OSError, what: str) -> CkptdError:
    """An OSError met while writing a copy, as ckptd's error. Never an OSError: validation
    would take that for a fault of the checkpoint being read."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return DiskFull(f"no space left on device while writing {what}; the original files are "
                        "untouched (free space and retry)")
    return CkptdError(f"cannot write {what}: {exc.strerror or exc}")


class DurableWriter:
    """A new file written through a raw fd: written pages are pushed out and dropped from the
    page cache as it grows; `close_durably` fsyncs. Write errors become `write_error`s."""

    def __init__(self, path: Path, what: str) -> None:
        self.path, self.what = path, what
        self.size = 0
        self._cleaned = self._pushed = 0
        try:
            self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise write_error(exc, what) from exc
        self._open = True

    def write(self, data: bytes | memoryview) -> int:
        view = memoryview(data).cast("B")
        n = len(view)
        try:
            while view:
                view = view[os.write(self._fd, view) :]
        except OSError as exc:
            raise write_error(exc, self.what) from exc
        self.size += n
        if self.size - self._pushed >= WRITEBACK_STEP:
            # DONTNEED starts writeback of the new dirty pages and drops the earlier ones,
            # which are clean by now: the cache holds about two steps, without a blocking sync.
            advise(self._fd, self._cleaned, self.size - self._cleaned)
            self._cleaned, self._pushed = self._pushed, self.size
        return n

    def close_durably(self) -> None:
        try:
            os.fsync(self._fd)
        except OSError as exc:
            raise write_error(exc, self.what) from exc
        finally:
            advise(self._fd, 0, 0)
            self.close()

    def close_written(self) -> None:
        """Close with writeback started but not waited for: the caller makes the file durable
        later (`fsync_many` over many files at once), before anything names it as done."""
        advise(self._fd, self._cleaned, 0)
        self.close()

    def close(self) -> None:
        if self._open:
            self._open = False
            os.close(self._fd)


class DropBehindReader:
    """An object read front to back through its fd, dropping what is behind the cursor from
    the page cache, so verifying or restoring a copy does not evict the training job's data."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.pos = self._dropped = 0

    def read(self, n: int) -> bytes:
        data = os.read(self.fd, n)
        self._advance(len(data))
        return data

    def readinto(self, buf: memoryview) -> int:
        n = os.readv(self.fd, [buf])
        self._advance(n)
        return n

    def _advance(self, n: int) -> None:
        self.pos += n
        if self.pos - self._dropped >= WRITEBACK_STEP:
            advise(self.fd, self._dropped, self.pos - self._dropped)
            self._dropped = self.pos

