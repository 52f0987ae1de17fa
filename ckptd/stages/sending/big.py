"""Objects larger than one part sent early, as multipart uploads started as soon as the object
being written has passed one part (its parts read as they become final: `growing`), or when it
is finished on local disk, and their hand-off from the validating job to the upload job
(docs/UPLOAD.md, "Sending early").

A multipart upload cannot be create-only on every store, so these objects go only into keys
that the step's listing showed absent and a lookup just before the upload still finds absent,
and the object is looked up again after: only one that is still exactly what was sent (etag,
else size and mtime) is recorded. Parts are read from the local file as the backend sends
them (at most the backend's `concurrency` parts in flight), never the whole object in memory.
A cancelled send fails its next read, which makes the store client abort the multipart upload
(its parts are deleted); what completed before a cancel is handed back for discarding.

Within the daemon, a step's keys are overwritten by one writer at a time (`_Gate`): at most one
early multipart send per step, never beside the step's upload (which cancels one under way and
holds the gate until its commit is done), and each send looks MANIFEST.json up again while it
holds the gate, so nothing is sent into a step committed meanwhile.

Never commits, never deletes, never reads the store's state beyond the lookups above.
"""

from __future__ import annotations

import errno
import threading
import weakref
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO, cast

from ckptd.backends.base import Backend, ObjectMeta, bare, same_object
from ckptd.errors import CkptdError, ObjectNotFound, TransientError
from ckptd.log import get_logger
from ckptd.remote.keys import manifest_key
from ckptd.stages.sending.growing import GrowingReader, Growth
from ckptd.stages.sending.ledger import LEDGER_NAME, Ledger
from ckptd.stages.sending.reader import Meter, ObjectReader

# How long the upload stage waits for the multipart sends a step's validation started before
# it cancels them and sends those objects itself.
HANDOFF_WAIT_S = 600.0
# How long a cancel waits for the sends to stop (each stops at its next read of a part).
CANCEL_WAIT_S = 10.0
# Objects waiting for the sending thread, at most (each holds its file open: the copy's renames
# happen meanwhile); more are left to the upload stage.
QUEUED_MAX = 64
# Steps whose sends wait for their upload, at most: a step superseded before its upload never
# takes its sends over; past this many, the oldest are closed (their completions unrecorded).
HANDOFFS_MAX = 64

Sent = tuple[list[int], ObjectMeta]  # the local file's fingerprint, the stored object
StepKey = tuple[str, str, int]  # backend URL, root, step


class _Cancellable(ObjectReader):
    """An object file as a put's source whose reads fail once `cancel` is set: the store
    client then aborts the multipart upload. Not seekable, so no wrapper retries it."""

    def __init__(self, path: Path, part_size: int, md5: bool, cancel: threading.Event) -> None:
        super().__init__(path, Meter(None), part_size, md5)
        self._cancel = cancel

    def seekable(self) -> bool:
        return False

    def read(self, n: int | None = -1) -> bytes:
        self._check()
        return super().read(n)

    def readinto(self, buf: Any) -> int:
        self._check()
        return super().readinto(buf)

    def _check(self) -> None:
        if self._cancel.is_set():
            raise OSError(errno.ECANCELED, "early send cancelled")


Source = _Cancellable | GrowingReader


class BigSends:
    """One step's multipart early sends, one object at a time on one thread (each with the
    backend's parts in flight). `ready(key)` says whether the key may be written (the step
    uncommitted, the key not listed). Completed sends are kept in memory until `installed`
    names the copy's ledger, then recorded there as they complete, until `close`."""

    def __init__(self, backend: Backend, prefix: str, ready: Callable[[str], bool],
                 step: StepKey) -> None:
        self.backend, self.prefix, self._ready, self._step = backend, prefix, ready, step
        self._cancel = threading.Event()
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._futures: list[Future[None]] = []
        self._queued: set[Source] = set()  # opened, not yet being sent
        self.done: dict[str, Sent] = {}
        self._ledger: Ledger | None = None
        self._closed = False

    def offer(self, key: str, path: Path, size: int) -> None:
        """`path` holds the finished object `key`: open it now (it is renamed before long)
        and send it when the thread is free."""
        with self._lock:
            if self._closed or self._cancel.is_set() or len(self._queued) >= QUEUED_MAX:
                return
            try:
                src = _Cancellable(path, self.backend.part_size, self.backend.md5_etags,
                                   self._cancel)
            except (CkptdError, OSError):
                return
            if src.size != size:
                src.close()
                return
            self._queue(key, src)

    def stream(self, key: str, path: Path) -> Growth | None:
        """`path` is being written, append-only, as the object `key` and is past one part
        already: send it as it grows. The Growth its writer reports to (a send that ends
        without the finished object is aborted), or None: then offer it when finished."""
        with self._lock:
            if self._closed or self._cancel.is_set() or len(self._queued) >= QUEUED_MAX:
                return None
            growth = Growth(key)
            try:
                src = GrowingReader(path, growth, self.backend.part_size,
                                    self.backend.md5_etags, self._cancel)
            except (CkptdError, OSError):
                return None
            self._queue(key, src)
            _streaming.add(self)
            return growth

    def _queue(self, key: str, src: Source) -> None:
        self._queued.add(src)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, "ckptd-early-big")
        self._futures.append(self._pool.submit(self._guarded, key, src))

    def any(self) -> bool:
        with self._lock:
            return bool(self._futures)

    def _guarded(self, key: str, src: Source) -> None:
        with self._lock:
            if src not in self._queued:
                return  # closed meanwhile
            self._queued.discard(src)
        try:
            with src:
                self._send(key, src)
        except Exception as exc:  # broad: a failed early send only leaves it to the upload
            get_logger().info("early_upload_stopped", key=f"{self.prefix}/{key}",
                              error=repr(exc))

    def _send(self, key: str, src: Source) -> None:
        if self._cancel.is_set() or not self._ready(key):
            return
        gate = _enter_early(self._step, self)
        if gate is None:
            return  # the step's upload, or another save's send, writes it: left to the upload
        try:
            self._send_alone(key, src)
        finally:
            _leave_early(self._step, gate)

    def _send_alone(self, key: str, src: Source) -> None:
        full = f"{self.prefix}/{key}"
        try:
            self.backend.stat(manifest_key(self._step[1], self._step[2]))
            return  # committed meanwhile: never written into
        except ObjectNotFound:
            pass
        try:
            self.backend.stat(full)
            return  # there now: never replaced, the upload stage compares it
        except ObjectNotFound:
            pass
        try:
            # A growing object's size is known at its end, where the source checks it.
            meta = self.backend.put(full, cast(BinaryIO, src), src.size)
            sent_md5, fingerprint = src.etag(), src.fingerprint
            after = self.backend.stat(full)
        except (CkptdError, OSError) as exc:
            get_logger().info("early_upload_stopped", key=full, error=str(exc))
            return
        if sent_md5 is not None and meta.etag and bare(meta.etag) != sent_md5:
            return  # not vouched for: the upload stage sends it again
        if not same_object(after, meta) or fingerprint is None or after.size != fingerprint[0]:
            return  # replaced meanwhile: the upload stage compares it
        get_logger().info("early_upload_multipart", root=self._step[1], step=self._step[2],
                          key=key, bytes=after.size,
                          streamed=isinstance(src, GrowingReader))
        with self._lock:
            self.done[key] = (fingerprint, after)
            if self._ledger is not None and not self._closed:
                self._ledger.record(key, fingerprint, after)

    def installed(self, objects_dir: Path) -> None:
        """The copy is in place at `objects_dir`: record what completed in its ledger, and
        what completes from now on."""
        with self._lock:
            if self._closed or not self._futures:
                self._closed = True  # nothing was offered: no ledger to keep open
                return
            self._ledger = Ledger.load(objects_dir / LEDGER_NAME, self.backend.url)
            for key, (fingerprint, meta) in self.done.items():
                self._ledger.record(key, fingerprint, meta)

    def stop(self) -> None:
        """Cancel the send under way and the rest, without waiting."""
        self._cancel.set()

    def wait(self, timeout: float) -> bool:
        """Wait up to `timeout` for every send to end; True if they all did."""
        with self._lock:
            futures = list(self._futures)
        return not wait(futures, timeout=timeout)[1]

    def cancel(self, timeout: float = CANCEL_WAIT_S) -> Mapping[str, ObjectMeta]:
        """Stop every send (a multipart upload in flight is aborted), wait up to `timeout`,
        close; what completed, for discarding."""
        self.stop()
        self.wait(timeout)
        return {key: meta for key, (_fp, meta) in self.close().items()}

    def close(self) -> dict[str, Sent]:
        """No more recording (what completes later is left to the upload stage's listing)."""
        with self._lock:
            self._closed = True
            if self._ledger is not None:
                self._ledger.close()
            pool, queued = self._pool, list(self._queued)
            self._queued.clear()
            done = dict(self.done)
        for src in queued:
            src.close()
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
        return done


class _Gate:
    """Who overwrites one step's keys now: one early send (`early`), or uploads."""

    def __init__(self) -> None:
        self.early: BigSends | None = None
        self.uploads = 0


_gates: dict[StepKey, _Gate] = {}
_gates_cond = threading.Condition()


def _enter_early(step: StepKey, sends: BigSends) -> _Gate | None:
    with _gates_cond:
        gate = _gates.setdefault(step, _Gate())
        if gate.uploads or gate.early is not None:
            return None
        gate.early = sends
        return gate


def _leave_early(step: StepKey, gate: _Gate) -> None:
    with _gates_cond:
        gate.early = None
        if not gate.uploads:
            _gates.pop(step, None)
        _gates_cond.notify_all()


@contextmanager
def uploading(url: str, root_name: str, step: int) -> Iterator[None]:
    """Held by a step's upload from its first put to its commit: an early send under way
    for the step (another save's, or one handed over late) is cancelled and waited for, and
    none starts meanwhile. TransientError if one does not stop in time."""
    key = (url, root_name, step)
    with _gates_cond:
        gate = _gates.setdefault(key, _Gate())
        gate.uploads += 1
        if gate.early is not None:
            gate.early.stop()
        stopped = _gates_cond.wait_for(lambda: gate.early is None, CANCEL_WAIT_S)
    try:
        if not stopped:
            raise TransientError(f"step {step} of {root_name}: an early send did not stop")
        yield
    finally:
        with _gates_cond:
            gate.uploads -= 1
            if not gate.uploads and gate.early is None:
                _gates.pop(key, None)


# Sends with an object still being written: a daemon stopping stops them, whatever its read
# passes do (such a send waits on its writer, not only on the store).
_streaming: weakref.WeakSet[BigSends] = weakref.WeakSet()

# Sends handed from a step's validation to its upload: (backend URL, root, step) -> sends.
_handoffs: dict[StepKey, BigSends] = {}
_handoffs_lock = threading.Lock()


def hand_over(url: str, root_name: str, step: int, sends: BigSends) -> None:
    """Validation passed with multipart sends under way: the step's upload takes them over."""
    with _handoffs_lock:
        old = [_handoffs.pop((url, root_name, step), None)]  # a save whose upload never came
        _handoffs[(url, root_name, step)] = sends
        while len(_handoffs) > HANDOFFS_MAX:
            old.append(_handoffs.pop(next(iter(_handoffs))))
    for stale in old:
        if stale is not None:
            stale.stop()  # superseded: its objects are the later save's upload's to send
            stale.close()


def stop_all(timeout: float = CANCEL_WAIT_S) -> None:
    """The daemon stops: cancel every send handed over whose upload has not taken it (a
    multipart upload in flight is aborted), so that no sending thread outlives the daemon
    and the process exits without sending the queued objects first. Sends streaming an
    object still being written are stopped too (a read pass left running no longer feeds
    them)."""
    with _handoffs_lock:
        pending = list(_handoffs.values())
        _handoffs.clear()
    for streaming in list(_streaming):
        streaming.stop()
    for sends in pending:
        sends.stop()
    for sends in pending:
        sends.cancel(timeout)


def take_over(url: str, root_name: str, step: int, timeout: float = HANDOFF_WAIT_S) -> int:
    """The upload of a step: wait (at most `timeout`) for the multipart sends its validation
    started, cancel what is still running, and stop their recording, so that the ledger and
    the listing the upload reads next hold what completed. How many completed."""
    with _handoffs_lock:
        sends = _handoffs.pop((url, root_name, step), None)
    if sends is None:
        return 0
    if not sends.wait(timeout):
        get_logger().info("early_upload_late", root=root_name, step=step, waited_s=timeout)
        sends.cancel()
    return len(sends.close())
