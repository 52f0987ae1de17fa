"""Objects sent while the rest of their step is still being validated: the overlap of the save
and the upload (docs/UPLOAD.md, "Sending early").

As validation finishes each file's compressed object, `EarlySender.offer` queues it; a few
threads put it, create-only, under the step's remote prefix, and record it in the upload ledger
of the staging dir, which the copy keeps. The upload stage then finds those objects vouched for
by the ledger and skips them: it still verifies every object and alone writes MANIFEST.json,
after validation passed for every file. Nothing here ever commits, overwrites or deletes:
create-only puts never replace an object, and the objects of a step that turns out invalid are
handed to the retention executor (`executor.discard_early`), which removes only what this
sender put and only while the step is uncommitted.

Validation never waits on the store: offers beyond the queue's bound are dropped (the upload
stage sends them), a failed put stops early sending for the step, and `finish` waits at most
`FINISH_WAIT_S` for the puts in flight (each at most one part). Objects larger than one part go
up as multipart uploads (`big`), begun as soon as the object being written passes one part
(`stream`): `finish` does not wait for them but hands them to the step's upload, which waits
for them and records them instead of sending them again.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections import deque
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, cast

from ckptd import fileio
from ckptd.backends.base import Backend, ObjectMeta, bare
from ckptd.errors import CkptdError, ObjectExists, ObjectNotFound
from ckptd.log import get_logger
from ckptd.remote.keys import manifest_key, step_objects
from ckptd.remote.manifest import step_prefix
from ckptd.stages.sending.big import BigSends, hand_over
from ckptd.stages.sending.growing import Growth
from ckptd.stages.sending.ledger import LEDGER_NAME, Ledger
from ckptd.stages.sending.reader import Meter, ObjectReader

# Offers waiting for a thread, at most: a path and a few numbers each, so a step of a million
# files holds a bounded queue; what does not fit is left to the upload stage.
QUEUE_MAX = 4096
# Objects up to this size are read whole and put as bytes (at most this much per thread).
WHOLE_MAX = 4 << 20
# How long the end of validation waits for the puts in flight before going on without them
# (a put that ends later is not recorded: the upload stage compares or re-sends its object),
# and how long an invalid step's end waits, so that what it sent can be discarded.
FINISH_WAIT_S = 2.0
ABANDON_WAIT_S = 10.0


@dataclass(frozen=True)
class _Offer:
    key: str  # relative to the step's prefix, as the manifest will name it
    path: Path
    size: int


class EarlySender:
    """One step's early puts. `offer` from the validating thread; then exactly one of `finish`
    (valid: the ledger keeps what was sent) or `abandon` (invalid, or an error: what was sent
    is returned for the executor to discard)."""

    def __init__(self, backend: Backend, root_name: str, step: int, staging: Path,
                 concurrency: int) -> None:
        self.backend, self.root_name, self.step = backend, root_name, step
        self.prefix = step_prefix(root_name, step)
        self.max_object = max(1, backend.part_size)  # one request each; larger: `big`
        self.sent: dict[str, ObjectMeta] = {}
        self._fingerprints: dict[str, list[int]] = {}
        self._staging = staging
        self._queue: deque[_Offer] = deque()
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._md5 = backend.md5_etags
        self._threads = max(1, concurrency)
        self._pool: ThreadPoolExecutor | None = None
        self._running = 0
        self._futures: list[Future[None]] = []
        self._frozen = False  # after `_stop`: what ends later is not recorded
        self._checked = threading.Lock()
        self._committed: bool | None = None  # looked up by the first put, off the reader
        self._present: frozenset[str] = frozenset()  # keys an earlier try left: not re-sent
        self._big = BigSends(backend, self.prefix,
                             lambda key: self._uncommitted() and key not in self._present,
                             (backend.url, root_name, step))

    def _uncommitted(self) -> bool:
        """Early puts only into a step nobody committed: a committed step's objects are
        compared and verified by the upload stage, never written into. One lookup, by the
        first thread to put, then one listing of the step's prefix: what an earlier try left
        there (a daemon killed mid-way) is not sent again but left to the upload stage, which
        compares it. A failing store stops early sending."""
        with self._checked:
            if self._committed is None:
                try:
                    self.backend.stat(manifest_key(self.root_name, self.step))
                    self._committed = True
                except ObjectNotFound:
                    self._committed = False
                    self._present = frozenset(step_objects(self.backend, self.root_name,
                                                           self.step))
                except (CkptdError, OSError) as exc:
                    self._committed = True
                    get_logger().info("early_upload_off", root=self.root_name,
                                      step=self.step, error=str(exc))
                if self._committed:
                    self._stopped.set()
            return not self._committed

    def offer(self, key: str, path: Path, size: int) -> None:
        """`path` holds the finished object `key` (`size` bytes): send it if there is room."""
        if self._stopped.is_set():
            return
        if size > self.max_object:
            self._big.offer(key, path, size)
            return
        with self._lock:
            if len(self._queue) >= QUEUE_MAX:
                return
            self._queue.append(_Offer(key, path, size))
            if self._running >= self._threads:
                return
            self._running += 1
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self._threads, "ckptd-early")
            self._futures.append(self._pool.submit(self._drain))

    def stream(self, key: str, path: Path) -> Growth | None:
        """`path`, still being written append-only as `key`, is past one part: send it as it
        grows (`BigSends.stream`). The Growth to report its progress to, or None: then offer
        it when finished."""
        if self._stopped.is_set():
            return None
        return self._big.stream(key, path)

    def pending(self) -> int:
        """Offers queued or being put now."""
        with self._lock:
            return len(self._queue) + self._running

    def _drain(self) -> None:
        while True:
            with self._lock:  # the check and the count together: an offer never strands
                if self._stopped.is_set():
                    self._queue.clear()  # never to be put: the upload stage sends them
                if not self._queue:
                    self._running -= 1
                    return
                offer = self._queue.popleft()
            try:
                self._put(offer)
            except Exception as exc:  # broad: never let one object end the sending silently
                self._stopped.set()
                get_logger().warning("early_upload_stopped", root=self.root_name,
                                     step=self.step, key=offer.key, error=repr(exc))

    def _put(self, offer: _Offer) -> None:
        if not self._uncommitted() or offer.key in self._present:
            return
        try:
            if offer.size <= WHOLE_MAX:
                got = self._put_whole(offer)
                if got is None:
                    return
                meta, sent_md5, fingerprint = got
            else:
                with ObjectReader(offer.path, Meter(None), self.backend.part_size,
                                  self._md5) as src:
                    if src.size != offer.size:
                        return
                    meta = self.backend.put(f"{self.prefix}/{offer.key}",
                                            cast(BinaryIO, src), offer.size, create_only=True)
                    sent_md5 = src.etag()
                    fingerprint = src.fingerprint
        except ObjectExists:
            return  # a straggler of an earlier try: the upload stage compares it
        except (CkptdError, OSError) as exc:
            self._stopped.set()  # the store is failing: leave the rest to the upload stage
            get_logger().info("early_upload_stopped", root=self.root_name, step=self.step,
                              key=offer.key, error=str(exc))
            return
        if sent_md5 is not None and meta.etag and bare(meta.etag) != sent_md5:
            return  # not vouched for: the upload stage sends it again
        with self._lock:
            if not self._frozen:
                self.sent[offer.key] = meta
                self._fingerprints[offer.key] = fingerprint

    def _put_whole(self, offer: _Offer) -> tuple[ObjectMeta, str | None, list[int]] | None:
        """A small object read in one call and put as bytes: the request then runs without
        the interpreter lock instead of calling back into Python for each chunk, which the
        validating thread beside it needs."""
        fd = os.open(offer.path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            st = os.fstat(fd)
            if st.st_size != offer.size:
                return None
            data = fileio.pread_exact(fd, 0, offer.size)
            fileio.advise(fd, 0, 0)  # the disk's cache belongs to the training job
        finally:
            os.close(fd)
        if len(data) != offer.size:
            return None
        md5 = hashlib.md5(data, usedforsecurity=False).hexdigest() if self._md5 else None
        meta = self.backend.put(f"{self.prefix}/{offer.key}", data, offer.size,
                                create_only=True)
        return meta, md5, [st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev]

    def _stop(self, timeout: float) -> None:
        """No more puts: drop the queue, wait up to `timeout` for the ones in flight; a put
        that ends later goes unrecorded (`sent` is frozen here)."""
        self._stopped.set()
        with self._lock:
            self._queue.clear()
            pool, futures = self._pool, list(self._futures)
        if pool is not None:
            _done, late = wait(futures, timeout=timeout)
            pool.shutdown(wait=False, cancel_futures=True)
            if late:
                get_logger().info("early_upload_late", root=self.root_name, step=self.step,
                                  in_flight=len(late), waited_s=timeout)
        with self._lock:
            self._frozen = True

    def finish(self) -> int:
        """Validation passed: stop, and record what was sent in the staging dir's ledger, for
        the upload stage to skip; hand the multipart sends still going to the step's upload
        (`installed` then names the copy's ledger for them). Returns how many objects were
        sent in single requests."""
        self._stop(FINISH_WAIT_S)
        if self._big.any():
            hand_over(self.backend.url, self.root_name, self.step, self._big)
        with self._lock:
            sent, fingerprints = dict(self.sent), dict(self._fingerprints)
        if not sent:
            return 0
        ledger = Ledger.load(self._staging / LEDGER_NAME, self.backend.url)
        try:
            for key, meta in sent.items():
                ledger.record(key, fingerprints[key], meta)
        finally:
            ledger.close()
        get_logger().info("early_upload_done", root=self.root_name, step=self.step,
                          objects=len(sent), bytes=sum(m.size for m in sent.values()))
        return len(sent)

    def installed(self, objects_dir: Path) -> None:
        """The copy `finish` was called for is in place at `objects_dir`."""
        self._big.installed(objects_dir)

    def abandon(self) -> Mapping[str, ObjectMeta]:
        """Validation failed or was given up: stop, cancel the multipart sends (an upload in
        flight is aborted); what was sent, for the executor."""
        big = self._big.cancel()
        self._stop(ABANDON_WAIT_S)
        with self._lock:
            return {**self.sent, **big}

    def abandon_big(self) -> Mapping[str, ObjectMeta]:
        """After `finish`, the copy could not be installed: cancel the multipart sends; what
        completed, for the executor."""
        return self._big.cancel()
