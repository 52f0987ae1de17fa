"""The compress stage: local compressed copies under `<root>/.ckptd/objects/step-<N>/`, encoded
inside validation's single read pass, then verified before any original is replaced.

Owns the staging, commit and verification of those copies, and the checks that must pass
before originals may be replaced by one; never imports the store, the pipeline or another
stage, and never holds a whole file in memory. Deletes nothing but its own staging: the
retention executor (`ckptd/retention/executor.py`) installs a copy over a superseded one,
releases copies and deletes originals.
"""

from __future__ import annotations

import errno
import io
import os
import shutil
import stat
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, cast

from ckptd import fileio, inputs
from ckptd.codec import decode_stream, make_encoder
from ckptd.codec.encoder import Encoder
from ckptd.errors import CkptdError, CorruptData, DiskFull, UnsafePath
from ckptd.fileio import HASH_ALG, HashSink, Sink
from ckptd.manifest import MANIFEST_NAME, Manifest, StoredFile, parse_manifest
from ckptd.model import CKPTD_DIR, FileRecord

OBJECTS_DIR = "objects"
# Written data is pushed to disk and dropped from the page cache in steps of this size, so a
# compressed copy never sits in memory that the training job's data needs.
WRITEBACK_STEP = 32 << 20

Progress = Callable[[int], None]


def objects_root(root_dir: Path) -> Path:
    """`<root>/.ckptd/objects`: the parent of every local compressed copy of a root."""
    return Path(root_dir) / CKPTD_DIR / OBJECTS_DIR


def objects_dir(root_dir: Path, step: int) -> Path:
    """`<root>/.ckptd/objects/step-<N>`: where the compressed copy of one step lives."""
    return objects_root(root_dir) / f"step-{step}"


def read_local_manifest(root_dir: Path, step: int) -> Manifest | None:
    """The manifest of step's local compressed copy, or None when there is no (committed) copy."""
    path = objects_dir(root_dir, step) / MANIFEST_NAME
    try:  # in the root, so outside input: bounded, never a link or a FIFO
        data = inputs.read_file(path, inputs.MANIFEST)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as exc:
        raise CorruptData(f"{path}: cannot be read ({exc})") from None
    manifest = parse_manifest(data, str(path))
    if manifest.step != step:
        raise CorruptData(f"{path}: describes step {manifest.step}, not {step}")
    return manifest


def local_steps(root_dir: Path) -> list[int]:
    """Steps with a committed local compressed copy, ascending."""
    try:
        names = os.listdir(objects_root(root_dir))
    except FileNotFoundError:
        return []
    nums = [n.removeprefix("step-") for n in names if n.startswith("step-")]
    steps = [int(n) for n in nums if n.isdigit() and str(int(n)) == n]
    return sorted(s for s in steps if (objects_dir(root_dir, s) / MANIFEST_NAME).exists())


def remove_stale_staging(root_dir: Path) -> int:
    """Delete staging dirs a crash left in `<root>/.ckptd/objects` (call once at start-up, while
    no Stager of this root runs); returns how many went."""
    removed = 0
    try:
        entries = list(os.scandir(objects_root(root_dir)))
    except FileNotFoundError:
        return 0
    for e in entries:
        if not e.name.startswith(fileio.TEMP_PREFIX):
            continue
        if e.is_dir(follow_symlinks=False):
            shutil.rmtree(e.path, ignore_errors=True)
        else:
            Path(e.path).unlink(missing_ok=True)
        removed += 1
    return removed


# --- writing objects -------------------------------------------------------------------------


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
            _advise(self._fd, self._cleaned, self.size - self._cleaned)
            self._cleaned, self._pushed = self._pushed, self.size
        return n

    def close_durably(self) -> None:
        try:
            os.fsync(self._fd)
        except OSError as exc:
            raise write_error(exc, self.what) from exc
        finally:
            _advise(self._fd, 0, 0)
            self.close()

    def close(self) -> None:
        if self._open:
            self._open = False
            os.close(self._fd)


def _advise(fd: int, offset: int, length: int) -> None:
    try:
        os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)
    except (AttributeError, OSError):  # advice only: never worth failing a copy over
        pass


@dataclass(frozen=True)
class _Stored:
    """One finished object in the staging dir."""

    tmp: Path
    codec: str
    suffix: str
    raw_size: int
    stored_size: int


class _ObjectSink:
    """One file's encoder, fed by the validation read pass; records what it wrote on finish."""

    def __init__(self, rel: str, tmp: Path, make: Callable[[BinaryIO], Encoder]) -> None:
        self.rel, self.tmp = rel, tmp
        self.out = DurableWriter(tmp, f"the compressed copy of {rel}")
        self.encoder = make(cast(BinaryIO, self.out))
        self.result: _Stored | None = None

    def update(self, offset: int, view: memoryview) -> None:
        self.encoder.update(offset, view)

    def finish(self, total: int) -> None:
        self.encoder.finish(total)
        self.out.close_durably()
        enc = self.encoder
        self.result = _Stored(self.tmp, enc.codec, enc.suffix, enc.raw_size, enc.stored_size)

    def close(self) -> None:
        self.encoder.close()
        self.out.close()

    def discard(self) -> None:
        self.close()
        self.tmp.unlink(missing_ok=True)


class Stager:
    """Builds a step's compressed copy in a staging dir during validation; `commit` installs it.

    Usage: `validate(root, cand, extra_sinks=stager.sinks_for)`, then `commit(result.files,
    result.metrics)` if valid, else (or on any error) `abort()`. The staging dir starts with
    `fileio.TEMP_PREFIX`, so what a crash leaves is removed by `remove_stale_staging`.
    `install(staging, final)` moves the finished copy into place; the daemon passes the
    executor's `install_copy`, the one that may replace a superseded copy. Without it a copy
    already at `step-<N>/` is an error (CkptdError) and nothing is replaced.
    """

    def __init__(
        self,
        root_dir: Path,
        root_name: str,
        step: int,
        layout: str,
        codec: str,
        level: int,
        threads: int,
        min_saving: float,
        install: Callable[[Path, Path], None] | None = None,
    ) -> None:
        self.root_dir, self.root_name = Path(root_dir), root_name
        self._install = install or _install_new
        self.step, self.layout = step, layout
        self.final = objects_dir(self.root_dir, step)
        self.staging = fileio.temp_name(self.final)
        self._make: Callable[[BinaryIO], Encoder] = lambda out: make_encoder(
            codec, out, level=level, threads=threads, min_saving=min_saving
        )
        make_encoder(codec, io.BytesIO(), level, threads, min_saving).close()  # bad args fail here
        self._sinks: dict[str, _ObjectSink] = {}

    def sinks_for(self, rel: str) -> list[Sink]:
        """The sinks to add to `rel`'s read pass: its encoder, writing into the staging dir."""
        if rel in self._sinks:
            self._sinks.pop(rel).discard()  # a second pass over one file replaces the first
        dest = fileio.safe_join(self.staging, rel)
        try:
            dest.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise write_error(exc, f"the staging dir {self.staging}") from exc
        sink = _ObjectSink(rel, fileio.temp_name(dest), self._make)
        self._sinks[rel] = sink
        return [sink]

    def commit(self, records: Sequence[FileRecord], metrics: Mapping[str, float]) -> Manifest:
        """Name each object by its codec, write MANIFEST.json, make it all durable, and move the
        staging dir to `step-<N>/` through `install`. Aborts on failure."""
        try:
            files = [self._stored_file(rec) for rec in records]
            _check_keys(files)
            manifest = Manifest(self.root_name, self.step, self.layout, tuple(files),
                                metrics=dict(metrics))
            self._name_objects(files)
            fileio.atomic_write_bytes(self.staging / MANIFEST_NAME, manifest.to_bytes())
            self._install(self.staging, self.final)
        except OSError as exc:
            self.abort()
            raise write_error(exc, f"the compressed copy of step {self.step}") from exc
        except BaseException:
            self.abort()
            raise
        return manifest

    def abort(self) -> None:
        """Drop everything staged (idempotent); the originals are never touched."""
        for sink in self._sinks.values():
            sink.close()
        self._sinks.clear()
        shutil.rmtree(self.staging, ignore_errors=True)

    def _stored_file(self, rec: FileRecord) -> StoredFile:
        sink = self._sinks.get(rec.path)
        done = sink.result if sink else None
        if done is None:
            raise CkptdError(f"{rec.path}: no compressed object staged (was the read pass given "
                             "this Stager's sinks_for?)")
        if done.raw_size != rec.size:
            raise CkptdError(f"{rec.path}: staged {done.raw_size} bytes, validated {rec.size}")
        return StoredFile(rec.path, rec.size, rec.hash, rec.hash_alg, done.codec,
                          done.stored_size, rec.path + done.suffix)

    def _name_objects(self, files: Sequence[StoredFile]) -> None:
        dirs = {self.staging}
        for f in files:
            final = self.staging / f.key
            os.rename(self._sinks[f.path].tmp, final)
            parent = final.parent
            while parent != self.staging and parent not in dirs:
                dirs.add(parent)
                parent = parent.parent
        for d in sorted(dirs, key=lambda p: len(p.parts), reverse=True):
            fileio.fsync_dir(d)


def _check_keys(files: Sequence[StoredFile]) -> None:
    """Object names must not collide (`a` stored as `a.zst` beside a file named `a.zst`), and
    no key may also be a directory of another."""
    keys: set[str] = set()
    for f in files:
        if f.key in keys or f.key == MANIFEST_NAME:
            raise CkptdError(f"cannot store {f.path} as {f.key!r}: another object (or the "
                             "manifest) has that name; object names collide")
        keys.add(f.key)
    for key in keys:
        parts = key.split("/")
        for i in range(1, len(parts)):
            if "/".join(parts[:i]) in keys:
                raise CkptdError(f"object {key!r} would sit inside object {'/'.join(parts[:i])!r}")


def _install_new(staging: Path, final: Path) -> None:
    """Rename `staging` to `final`, which must not exist (an empty directory is replaced)."""
    try:
        os.rename(staging, final)
    except OSError as exc:
        if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
            raise
        raise CkptdError(f"{final} holds an older compressed copy; only the retention "
                         "executor replaces one (executor.install_copy)") from None
    fileio.fsync_dir(final.parent)


# --- reading objects back --------------------------------------------------------------------


class _Checker:
    """The decoder's output: hashes and counts the original bytes, refuses more than expected
    (a corrupt object must not fill a disk), and forwards them to `out` if given."""

    def __init__(self, f: StoredFile, out: DurableWriter | None, progress: Progress | None):
        self.f, self.out, self.progress = f, out, progress
        self.hash = HashSink()
        self.size = 0

    def write(self, data: bytes | memoryview) -> int:
        n = len(data)
        if self.size + n > self.f.size:
            raise CorruptData(f"{self.f.path}: decodes to more than its {self.f.size} bytes")
        self.hash.update(self.size, memoryview(data))
        self.size += n
        if self.out is not None:
            self.out.write(data)
        if self.progress is not None:
            self.progress(n)
        return n

    def check(self) -> None:
        self.hash.finish(self.size)
        f = self.f
        if self.size != f.size:
            raise CorruptData(f"{f.path}: decodes to {self.size} bytes, the manifest says {f.size}")
        if self.hash.digest != f.hash:
            raise CorruptData(f"{f.path}: content hash mismatch (decoded {self.hash.digest}, "
                              f"manifest {f.hash}): the stored object {f.key} is corrupt")


class _Source:
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
            _advise(self.fd, self._dropped, self.pos - self._dropped)
            self._dropped = self.pos


def decode_object(
    src: Path, f: StoredFile, out: DurableWriter | None = None, progress: Progress | None = None
) -> None:
    """Decode the stored object at `src` (streaming), checking size and hash against `f`;
    the original bytes go to `out` when given. Raises CorruptData naming the file."""
    if f.hash_alg != HASH_ALG:
        raise CorruptData(f"{f.path}: hash algorithm {f.hash_alg!r} is not {HASH_ALG!r}")
    fd = os.open(src, os.O_RDONLY | os.O_CLOEXEC)
    try:
        stored = os.fstat(fd).st_size
        if stored != f.stored_size:
            raise CorruptData(f"{f.path}: stored object {f.key} has {stored} bytes, the "
                              f"manifest says {f.stored_size}")
        decode_checked(cast(BinaryIO, _Source(fd)), f, out, progress)
    finally:
        _advise(fd, 0, 0)
        os.close(fd)


def decode_checked(src: BinaryIO, f: StoredFile, out: DurableWriter | None = None,
                   progress: Progress | None = None) -> None:
    """Decode the stored object read from `src` (streaming), checking size and hash against
    `f`; the original bytes go to `out` when given. Raises CorruptData naming the file."""
    if f.hash_alg != HASH_ALG:
        raise CorruptData(f"{f.path}: hash algorithm {f.hash_alg!r} is not {HASH_ALG!r}")
    checker = _Checker(f, out, progress)
    try:
        decode_stream(f.codec, src, cast(BinaryIO, checker))
    except CorruptData as exc:
        if str(exc).startswith(f"{f.path}: "):
            raise
        raise CorruptData(f"{f.path}: stored object {f.key} is corrupt: {exc}") from exc
    checker.check()


def verify_copy(objects_dir: Path, manifest: Manifest) -> None:
    """Decode every object of a copy and check it against the manifest; CorruptData names the
    first bad file. Reads the copy once, dropping it from the page cache behind itself."""
    for f in manifest.files:
        src = fileio.safe_join(objects_dir, f.key)
        try:
            decode_object(src, f)
        except FileNotFoundError:
            raise CorruptData(f"{f.path}: stored object {src} is missing") from None


# --- replacing originals ---------------------------------------------------------------------


def check_replaceable(
    root_dir: Path,
    manifest: Manifest,
    original_paths: Sequence[str],
    *,
    verify: bool = True,
    rehash: bool = True,
) -> list[str]:
    """Check that a step's originals may be replaced by its local compressed copy; deletes
    nothing (the executor's `replace_originals` does, calling this first).

    With `verify`, the copy is decoded against its manifest and made durable; then every
    original still there is checked against the manifest: a regular file not reached through
    a symlink, its size, and with `rehash` its content (a re-save in place must not be
    deleted). Raises CorruptData or UnsafePath naming the file; returns the originals present.
    """
    root_dir = Path(root_dir)
    if verify:
        copy = objects_dir(root_dir, manifest.step)
        verify_copy(copy, manifest)
        _fsync_copy(copy, manifest)
    by_path = {f.path: f for f in manifest.files}
    present = [(rel, p) for rel in original_paths if (p := _original(root_dir, rel, by_path))]
    for rel, path in present:
        _check_original(path, by_path[rel], rehash)
    return [rel for rel, _ in present]


def _fsync_copy(copy: Path, manifest: Manifest) -> None:
    for f in manifest.files:
        fileio.fsync_file(copy / f.key)
    fileio.fsync_file(copy / MANIFEST_NAME)
    fileio.fsync_dir(copy)
    fileio.fsync_dir(copy.parent)


def _original(root_dir: Path, rel: str, by_path: Mapping[str, StoredFile]) -> Path | None:
    """The original's path if it still exists; UnsafePath for anything reached through a link."""
    if rel not in by_path:
        raise UnsafePath(f"{rel} is not in the compressed copy: refusing to delete it")
    path = fileio.safe_join(root_dir, rel)
    if path.resolve() != root_dir.resolve() / os.path.normpath(rel):
        raise UnsafePath(f"{rel} is reached through a symlink: refusing to delete it")
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    if not stat.S_ISREG(st.st_mode):
        raise UnsafePath(f"{rel} is not a regular file: refusing to delete it")
    return path


def _check_original(path: Path, f: StoredFile, rehash: bool) -> None:
    size = os.stat(path).st_size
    if size != f.size:
        raise CorruptData(f"{f.path} has {size} bytes, its copy {f.size}: it changed after "
                          "compression; not deleting it")
    if rehash:
        hasher = HashSink()
        fileio.read_pass(path, [hasher])
        if hasher.digest != f.hash:
            raise CorruptData(f"{f.path} differs from its compressed copy (changed after "
                              "compression); not deleting it")
