"""The upload stage: one step's stored objects to a backend, verified, then MANIFEST.json
(create-only: the commit), then LATEST; and `delete_step`, the same protocol in reverse.

Never imports the store, the pipeline or another stage; never overwrites a committed step.
Deletes nothing itself: `delete_step` is only ever handed to the retention executor
(`execute_remote`, `replace_remote`), which calls it behind its nets.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import threading
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor, as_completed
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, cast

from ckptd import fileio
from ckptd.backends.base import Backend, ObjectMeta, bare, same_object
from ckptd.errors import (
    CkptdError,
    CorruptData,
    ObjectExists,
    PermanentError,
    TransientError,
    UnsafePath,
)
from ckptd.log import get_logger
from ckptd.remote.keys import (
    advance_latest,
    listed_committed,
    manifest_key,
    read_manifest,
    retreat_latest,
    step_objects,
)
from ckptd.remote.manifest import MANIFEST_NAME, Manifest, StoredFile, step_prefix
from ckptd.stages.sending.big import take_over, uploading
from ckptd.stages.sending.ledger import LEDGER_NAME, Ledger
from ckptd.stages.sending.reader import Meter, ObjectReader, etag_matches_file, fingerprint

Progress = Callable[[int], None]


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


@dataclass(frozen=True)
class UploadResult:
    """What one `upload_step` did. `sent_bytes` counts the object bytes handed to the backend
    (re-reads by a retried put included) plus the manifest's."""

    sent_bytes: int
    skipped_objects: int
    uploaded_objects: int
    checksum_verified: int = 0  # objects whose store etag equals the MD5 of what was sent
    latest_updated: bool = False


def upload_step(
    backend: Backend,
    root_name: str,
    objects_dir: Path,
    manifest: Manifest,
    progress: Progress | None = None,
    concurrency: int = 4,
) -> UploadResult:
    """Upload the stored objects of `manifest` from `objects_dir`, verify them, commit.

    Objects already on the backend and known to be ours (see docs/UPLOAD.md) are skipped, so
    a re-run after a crash or outage sends only what is missing. `concurrency` bounds the
    requests in flight: a multipart object counts as up to `concurrency` (its parts go up in
    parallel), so pass the same value the backend was made with. `progress(n)` is called with
    byte increments of the step's stored size, from worker threads, one call at a time.
    Raises TransientError (retry later) or PermanentError; on any error nothing is committed.
    """
    _check_manifest(root_name, manifest)
    # Multipart sends the step's validation started: waited for (bounded), so the ledger and
    # the listing below show what they completed, and those objects are not sent again; then
    # no early send writes the step's keys until the commit is done.
    take_over(backend.url, root_name, manifest.step)
    with uploading(backend.url, root_name, manifest.step):
        return _upload(backend, root_name, objects_dir, manifest, progress, concurrency)


def _upload(backend: Backend, root_name: str, objects_dir: Path, manifest: Manifest,
            progress: Progress | None, concurrency: int) -> UploadResult:
    remote = step_objects(backend, root_name, manifest.step)
    committed = _existing_commit(backend, root_name, manifest, remote)
    meter = Meter(progress)
    run = _Run(backend, step_prefix(root_name, manifest.step), objects_dir, meter)
    try:
        todo = [f for f in manifest.files
                if not run.already_there(f, remote.get(f.key), trust_size=committed)]
        _send_all(run, todo, max(1, concurrency))
    finally:
        run.ledger.close()
    verify_step(backend, root_name, manifest, run.expected)
    if not committed:
        meter.sent(_commit(backend, root_name, manifest))
    latest_updated = advance_latest(backend, root_name, manifest.step)
    result = UploadResult(
        sent_bytes=meter.sent_bytes,
        skipped_objects=len(manifest.files) - len(todo),
        uploaded_objects=len(todo),
        checksum_verified=run.checksummed,
        latest_updated=latest_updated,
    )
    get_logger().info("upload_committed", root=root_name, step=manifest.step,
                      url=backend.url, **result.__dict__)
    return result


def delete_step(backend: Backend, root_name: str, step: int) -> int:
    """Delete one step remotely; return how many objects were removed.

    MANIFEST.json goes first, so a half-deleted step is never listed as committed; then every
    object under the step's prefix (stragglers of interrupted uploads included); then LATEST
    is moved to the highest remaining committed step (or removed) if it named this one.
    Idempotent: re-run it after any failure. Called only by the retention executor.
    """
    backend.delete(manifest_key(root_name, step))
    objects = [m.key for m in backend.list(step_prefix(root_name, step))]
    for key in objects:
        backend.delete(key)
    retreat_latest(backend, root_name, step)
    get_logger().info("remote_step_deleted", root=root_name, step=step, url=backend.url,
                      objects=len(objects))
    return len(objects)


# -- before: what is there already -----------------------------------------------------------


def _check_manifest(root_name: str, manifest: Manifest) -> None:
    if manifest.root != root_name:
        raise PermanentError(f"manifest is for root {manifest.root!r}, not {root_name!r}")
    keys = [f.key for f in manifest.files]
    if len(set(keys)) != len(keys) or MANIFEST_NAME in keys:
        raise PermanentError(f"step {manifest.step}: manifest keys collide: {sorted(keys)}")


def _existing_commit(
    backend: Backend, root_name: str, manifest: Manifest, remote: dict[str, ObjectMeta]
) -> bool:
    """True if this very step is committed already; PermanentError if another one is.

    Checked before any put: sending objects into a committed step would change its data.
    """
    if not listed_committed(remote):
        return False
    _compare_commit(backend, root_name, manifest)
    get_logger().info("upload_already_committed", root=root_name, step=manifest.step)
    return True


def _compare_commit(backend: Backend, root_name: str, manifest: Manifest) -> None:
    where = f"{backend.url}/{manifest_key(root_name, manifest.step)}"
    try:
        there = read_manifest(backend, root_name, manifest.step)
    except CorruptData as exc:
        raise PermanentError(
            f"step {manifest.step} is committed remotely with an unreadable manifest ({exc}); "
            "delete the remote step to upload it again"
        ) from None
    if _content(there) != _content(manifest):
        raise PermanentError(
            f"step {manifest.step} already committed remotely with different content ({where})"
        )


def _content(m: Manifest) -> tuple[Any, ...]:
    """What makes two manifests the same checkpoint: the same files, stored the same way. Not
    `created`, nor metrics registered later, nor the layout's name for identical bytes."""
    return (m.root, m.step, tuple(sorted(m.files, key=lambda f: f.key)))


# -- sending ---------------------------------------------------------------------------------


class _Run:
    """State of one upload: where things are, the ledger, what each object should look like."""

    def __init__(self, backend: Backend, prefix: str, objects_dir: Path, meter: Meter):
        self.backend = backend
        self.prefix = prefix
        self.objects_dir = objects_dir
        self.meter = meter
        self.ledger = Ledger.load(objects_dir / LEDGER_NAME, backend.url)
        self.md5_etags = backend.md5_etags
        self.expected: dict[str, ObjectMeta] = {}  # key -> the object verification must find
        self.checksummed = 0
        self.stop = threading.Event()
        self._lock = threading.Lock()
        self._dirs: dict[str, Path] = {}  # directory key -> its checked local path

    def local(self, f: StoredFile) -> Path:
        """`objects_dir/key`, refused as `fileio.safe_join` refuses a path leading out of
        `objects_dir`. Each directory is resolved once a run, then a file costs one lstat
        instead of resolving every component of its path (measured: 9% of a 10,000-object
        upload's samples went to realpath)."""
        parent, _, name = f.key.rpartition("/")
        if not _plain(f.key):
            return self._safe_join(f.key)  # refused, with safe_join's reason
        base = self._dirs.get(parent)
        if base is None:
            base = self._safe_join(f.key, parent) if parent else self.objects_dir
            self._dirs[parent] = base
        path = base / name
        if path.is_symlink():
            return self._safe_join(f.key)  # where the link leads decides
        return path

    def _safe_join(self, key: str, rel: str | None = None) -> Path:
        try:
            return fileio.safe_join(self.objects_dir, key if rel is None else rel)
        except UnsafePath as exc:
            raise PermanentError(f"stored object {key!r}: {exc}") from None

    def already_there(self, f: StoredFile, meta: ObjectMeta | None, trust_size: bool) -> bool:
        """Is the remote object `meta` this file's bytes, without sending them again?

        Under a committed identical manifest the size is enough: the commit vouches for the
        objects. Otherwise the ledger must say this node put it from this very file, or (S3)
        the etag must equal the MD5 of the local file: cheap next to sending it again.
        """
        if meta is None or meta.size != f.stored_size:
            return False
        path = self.local(f)
        here = fingerprint(path)
        if trust_size or (here and self.ledger.vouches(f.key, here, meta)):
            return self._skip(f, meta)
        if self.md5_etags and etag_matches_file(meta, path, f.stored_size,
                                                 self.backend.part_size):
            if here:
                self.ledger.record(f.key, here, meta)
            return self._skip(f, meta)
        return False

    def _skip(self, f: StoredFile, meta: ObjectMeta) -> bool:
        self.expected[f.key] = meta
        self.meter.advance(f.stored_size)
        return True

    def send(self, f: StoredFile) -> None:
        key = f"{self.prefix}/{f.key}"
        with ObjectReader(self.local(f), self.meter, self.backend.part_size,
                           self.md5_etags) as src:
            if src.size != f.stored_size:
                raise PermanentError(
                    f"{src.path}: {src.size} bytes on disk, the manifest says {f.stored_size}"
                )
            try:
                meta = self.backend.put(key, cast(BinaryIO, src), f.stored_size)
            finally:
                if f.stored_size > TRIM_ABOVE:
                    release_memory()
            self._check_etag(key, meta, src.etag())
        with self._lock:
            self.expected[f.key] = meta
        self.ledger.record(f.key, src.fingerprint, meta)

    def _check_etag(self, key: str, meta: ObjectMeta, sent: str | None) -> None:
        if sent is None or not meta.etag:
            return
        if bare(meta.etag) == sent:
            with self._lock:
                self.checksummed += 1
            return
        # SSE-KMS/SSE-C objects have etags that are not MD5s, indistinguishable from a
        # corrupted upload here; restore checks every file's hash end to end.
        get_logger().warning("upload_etag_mismatch", key=key, etag=meta.etag, md5=sent)


def _plain(key: str) -> bool:
    """A relative key of plain names: nothing that could climb or be absolute."""
    return "\x00" not in key and not key.startswith("/") and all(
        part not in ("", ".", "..") for part in key.split("/"))


def _send_all(run: _Run, todo: list[StoredFile], concurrency: int) -> None:
    """Put `todo` with at most `concurrency` requests in flight, biggest objects first."""
    if not todo:
        return
    slots = _Slots(concurrency)
    part = max(1, run.backend.part_size)

    def one(f: StoredFile) -> None:
        weight = min(concurrency, max(1, -(-f.stored_size // part)))
        with slots.held(weight):
            if not run.stop.is_set():
                run.send(f)

    ordered = sorted(todo, key=lambda f: f.stored_size, reverse=True)
    errors: list[BaseException] = []
    with ThreadPoolExecutor(min(concurrency, len(todo)), "ckptd-upload") as pool:
        futures = [pool.submit(one, f) for f in ordered]
        for fut in as_completed(futures):
            if not fut.cancelled() and (exc := fut.exception()) is not None:
                errors.append(exc)
                _stop(run, futures)
    if errors:
        raise _worst(errors)


def _stop(run: _Run, futures: list[Future[None]]) -> None:
    run.stop.set()
    for fut in futures:
        fut.cancel()


def _worst(errors: list[BaseException]) -> BaseException:
    """The error to report: a permanent one wins, since retrying cannot fix it."""
    for exc in errors:
        if isinstance(exc, PermanentError):
            return exc
    for exc in errors:
        if isinstance(exc, CkptdError):
            return exc
    return errors[0]


class _Slots:
    """A weighted FIFO semaphore: request slots shared by concurrent puts. First come, first
    served, so an object that needs every slot is not starved by a stream of small ones."""

    def __init__(self, n: int) -> None:
        self._free = n
        self._queue: deque[object] = deque()
        self._cond = threading.Condition()

    @contextmanager
    def held(self, weight: int) -> Iterator[None]:
        ticket = object()
        with self._cond:
            self._queue.append(ticket)
            self._cond.wait_for(lambda: self._queue[0] is ticket and self._free >= weight)
            self._queue.popleft()
            self._free -= weight
            self._cond.notify_all()
        try:
            yield
        finally:
            with self._cond:
                self._free += weight
                self._cond.notify_all()


# -- verify, commit, point -------------------------------------------------------------------


def verify_step(
    backend: Backend, root_name: str, manifest: Manifest,
    expected: Mapping[str, ObjectMeta] | None = None,
) -> None:
    """The one check that a step's remote objects are whole, run before every commit: every
    object of `manifest` present with its stored size (one LIST of the step's prefix) and,
    for a key in `expected`, still the object put or checked (etag, else mtime). Else
    TransientError naming each problem: a re-run sends what is missing."""
    expected = expected or {}
    present = step_objects(backend, root_name, manifest.step)
    problems: list[str] = []
    for f in manifest.files:
        meta = present.get(f.key)
        if meta is None:
            problems.append(f"{f.key} missing")
        elif meta.size != f.stored_size:
            problems.append(f"{f.key} has {meta.size} bytes, expected {f.stored_size}")
        elif f.key in expected and not same_object(expected[f.key], meta):
            problems.append(f"{f.key} changed after it was uploaded")
    if problems:
        raise TransientError(
            f"step {manifest.step} at {backend.url}: verification failed: " + "; ".join(problems)
        )


def _commit(backend: Backend, root_name: str, manifest: Manifest) -> int:
    """Write MANIFEST.json create-only; an identical one already there is success."""
    body = manifest.to_bytes()
    try:
        backend.put(manifest_key(root_name, manifest.step), body, create_only=True)
    except ObjectExists:
        _compare_commit(backend, root_name, manifest)
    return len(body)
