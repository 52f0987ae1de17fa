"""Stage workers: claim (checkpoint, stage) work from the store under a lease, run the stage,
record the outcome, and republish each root's latest.

Owns threads, leases and priorities of background work. Stages get plain paths and options;
only this module and the api talk to the store on their behalf.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from ckptd import fileio, runners
from ckptd.changes import Changes
from ckptd.config import RootConfig
from ckptd.errors import CkptdError, PermanentError
from ckptd.log import get_logger
from ckptd.model import CKPTD_DIR, Tier
from ckptd.store import STAGE_COMPRESS, STAGE_UPLOAD, STAGE_VALIDATE, Job, Store
from ckptd.watch import file_fingerprint

LEASE_S = 60.0
# After files changed under a stage, wait for the scanner to see the change before retrying.
RESCAN_DEFER_S = 1.0
# After a stop's grace: how long read passes get to notice the cancel and clean up.
CANCEL_WAIT_S = 5.0
# Reasons that prove a once-valid checkpoint's bytes are damaged (not a passing I/O error or
# files changing under the read).
CONTENT_REASONS = frozenset({"crc_mismatch", "size_mismatch", "truncated", "bad_header",
                             "bad_metadata", "nan", "unsafe_pickle", "empty_file"})
NICE = 10


class LatestPublisher:
    """Keeps `<root>/.ckptd/latest.json` equal to the store's latest valid step of each root."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self._lock = threading.Lock()
        self.log = get_logger()

    def publish(self, root: RootConfig) -> None:
        with self._lock:
            rec = self.store.latest(root.name, Tier.ANY)
            step = rec.step if rec else None
            target = root.path / CKPTD_DIR / "latest.json"
            published = self.store.root_info(root.name)["latest_step"]
            if published == step and (step is None or target.exists()):
                return
            if rec is None:
                target.unlink(missing_ok=True)
            else:
                doc = {
                    "step": rec.step, "path": str(root.path / rec.path),
                    "updated": datetime.now(UTC).isoformat(timespec="seconds"),
                    "layout": rec.layout, "local": str(rec.local), "remote": str(rec.remote),
                }
                try:
                    target.parent.mkdir(exist_ok=True)
                    fileio.atomic_write_json(target, doc)
                except OSError as exc:
                    self.log.warning("latest_write_failed", root=root.name, error=str(exc))
                    return
            self.store.set_published_latest(root.name, step)
            self.log.info("latest_changed", root=root.name, step=step, previous=published)


class Pipeline:
    """A pool of stage workers over the store."""

    def __init__(self, store: Store, roots: Callable[[], Mapping[str, RootConfig]],
                 changes: Changes, publisher: LatestPublisher, workers: int,
                 on_resave: Callable[[], None],
                 after_stage: Callable[[str], None] = lambda root: None,
                 backend_for: Callable[[RootConfig], Any] = lambda root: None,
                 metrics: Any = None) -> None:
        self.store = store
        self.roots = roots
        self.changes = changes
        self.publisher = publisher
        self.n_workers = workers
        self.on_resave = on_resave
        self.after_stage = after_stage
        self.backend_for = backend_for
        self.metrics = metrics
        self.owner = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._cancel = threading.Event()  # set when a stop's grace ran out
        self._threads: list[threading.Thread] = []
        self.progress: dict[str, float] = {}  # worker -> last time it made progress
        self.busy: dict[str, bool] = {}
        self.inflight: dict[int, Progress] = {}
        self.flushing: dict[str, int] = {}  # root -> step being flushed to the remote first
        self.log = get_logger()

    def start(self) -> None:
        for i in range(self.n_workers):
            t = threading.Thread(target=self._worker, args=(f"w{i}",), name=f"ckptd-worker-{i}",
                                 daemon=True)
            t.start()
            self._threads.append(t)

    def wake(self) -> None:
        self._wake.set()

    def stop(self, grace: float) -> bool:
        """Stop claiming work; wait up to `grace` seconds for in-flight stages. True if all done."""
        self._stopping.set()
        self._wake.set()
        deadline = time.monotonic() + grace
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        if any(t.is_alive() for t in self._threads):
            # Past the grace: end read passes at their next chunk, so a stage aborts (its
            # staging dir removed) instead of being cut off mid-write when the process exits.
            self._cancel.set()
            deadline = time.monotonic() + CANCEL_WAIT_S
            for t in self._threads:
                t.join(max(0.0, deadline - time.monotonic()))
        return not any(t.is_alive() for t in self._threads)

    def flush(self) -> dict[str, int]:
        """Preemption: the newest valid, not yet uploaded step of each uploading root goes
        first; other work yields until those are uploaded. Returns root -> step."""
        targets = {}
        for name, root in self.roots().items():
            if not root.upload.enabled:
                continue
            rec = self.store.latest(name, Tier.LOCAL)
            if rec is not None and rec.remote.value != "uploaded":
                targets[name] = rec.step
                self.store.expedite(name, rec.step)  # no waiting out an earlier backoff
        self.flushing = targets
        self.log.info("flush_requested", targets=targets or None)
        self.wake()
        return targets

    def _flush_targets(self) -> frozenset[tuple[str, int]] | None:
        """The flush's steps still to upload; None when no flush is on."""
        if not self.flushing:
            return None
        left = {}
        roots = self.roots()
        for name, step in self.flushing.items():
            if name not in roots or not roots[name].upload.enabled:
                continue  # the root stopped uploading (reload): nothing left to flush there
            rec = self.store.checkpoint(name, step)
            if rec is not None and rec.state.value == "valid" and rec.remote.value in (
                    "none", "uploading"):
                left[name] = step
        if self.flushing and not left:
            self.log.info("flush_done", roots=sorted(self.flushing))
        self.flushing = left
        return frozenset(left.items()) or None

    def stalled(self, now: float, limit: float) -> list[str]:
        """Workers busy on one job without progress for longer than `limit` seconds."""
        return [w for w, t in self.progress.items() if self.busy.get(w) and now - t > limit]

    # -- worker ------------------------------------------------------------------------------

    def _worker(self, name: str) -> None:
        lower_priority()
        self.progress[name] = time.time()
        while not self._stopping.is_set():
            self.progress[name] = time.time()
            roots = self.roots()
            job = self.store.claim(
                f"{self.owner}/{name}/{uuid.uuid4().hex[:8]}", time.time(), LEASE_S,
                upload_roots=frozenset(n for n, r in roots.items() if r.upload.enabled),
                copy_roots=frozenset(n for n, r in roots.items()
                                     if runners.wants_copy(r)),
                only=self._flush_targets())
            if job is None:
                self._wake.wait(1.0)
                self._wake.clear()
                continue
            self.busy[name] = True
            try:
                self._run(job, name)
            except runners.StageCancelled:
                self.log.warning("stage_cancelled", root=job.checkpoint.root,
                                 step=job.checkpoint.step, stage=job.stage)
                return  # its lease is released at the next start; the stage is redone then
            finally:
                self.busy[name] = False
                self.changes.notify()

    def _run(self, job: Job, worker: str) -> None:
        root = self.roots().get(job.checkpoint.root)
        if root is None:
            return  # root removed from config; the lease just expires
        rec = job.checkpoint
        log = self.log.bind(root=rec.root, step=rec.step, stage=job.stage, layout=rec.layout)
        fp = rec.fingerprint
        if job.stage != STAGE_UPLOAD and rec.local.value == "present":
            fp = file_fingerprint(root.path, job.files)
            if fp != rec.fingerprint:
                log.info("stage_deferred", why="files changed since completion; rescanning")
                self.store.defer(job, job.owner, RESCAN_DEFER_S, time.time())
                self.on_resave()
                return
        log.info("stage_started")
        started = time.monotonic()
        total = sum(_size(root.path / f) for f in job.files)
        progress = Progress(rec.root, rec.step, job.stage, total, lambda: self._tick(worker),
                            cancelled=self._cancel.is_set)
        self.inflight[rec.id] = progress
        with _Renewer(self.store, rec.id, job.owner):
            try:
                outcome = self._stage(root, job, progress)
            except runners.NoLongerValid as exc:
                if (exc.result.reason in CONTENT_REASONS
                        and file_fingerprint(root.path, job.files) == fp):
                    if self.store.invalidate(job, job.owner, exc.result.reason,
                                             exc.result.message):
                        log.warning("checkpoint_invalid", reason=exc.result.reason,
                                    message=exc.result.message, found_by=job.stage)
                        self.publisher.publish(root)
                    return
                # An I/O error, or files changing under the pass: not proof of damage.
                self._failed(job, log, RuntimeError(f"{exc.result.reason}: {exc.result.message}"))
                self.on_resave()
                return
            except Exception as exc:  # an OS, storage or code failure: retry later, never crash
                self._failed(job, log, exc)
                return
            finally:
                self.inflight.pop(rec.id, None)
        elapsed = round(time.monotonic() - started, 3)
        self._measure(job, rec.root, progress, elapsed, outcome)
        if job.stage == STAGE_VALIDATE:
            self._validated(root, job, fp, outcome, log, elapsed, progress.total)
        elif job.stage == STAGE_COMPRESS:
            if self.store.finish_compress(job, job.owner, outcome):
                log.info("stage_succeeded", seconds=elapsed)
        elif self.store.finish_upload(job, job.owner, time.time()):
            log.info("checkpoint_uploaded", seconds=elapsed, sent_bytes=outcome.sent_bytes,
                     skipped_objects=outcome.skipped_objects)
            # The copy of a compressed row is its only local copy: never dropped here.
            if rec.local.value == "present" and runners.drop_copy_after_upload(root,
                                                                               rec.step):
                self.store.drop_copy(rec.root, rec.step)
            self.publisher.publish(root)
            self.after_stage(root.name)

    def _stage(self, root: RootConfig, job: Job, progress: Progress) -> Any:
        if job.stage == STAGE_VALIDATE:
            return runners.run_validate(root, job, progress)
        if job.stage == STAGE_COMPRESS:
            return runners.run_compress(root, job, progress)
        backend = self.backend_for(root)
        if backend is None:
            raise PermanentError(f"root {root.name} has no upload.url")
        rec = job.checkpoint
        return runners.run_upload(root, job, progress, backend,
                                  self.store.stored_files(rec.id),
                                  replace_remote=self.store.replaced_upload(rec.root, rec.step))

    def _measure(self, job: Job, root: str, progress: Progress, seconds: float,
                 outcome: Any) -> None:
        if self.metrics is None:
            return
        self.metrics.observe_stage(job.stage, seconds)
        if job.stage == STAGE_UPLOAD:
            self.metrics.add_bytes("uploaded", root, int(outcome.sent_bytes))
            return
        self.metrics.add_bytes("read", root, progress.done)
        stored = outcome.stored if job.stage == STAGE_VALIDATE else outcome
        written = sum(f.stored_size for f in stored)
        if written:
            self.metrics.add_bytes("written", root, written)

    def _failed(self, job: Job, log: Any, exc: Exception) -> None:
        if self.metrics is not None:
            self.metrics.error(job.stage)
        if isinstance(exc, runners.CopyMissing):
            self.store.copy_lost(job, job.owner)  # compress redoes it (or local is gone)
        rec = job.checkpoint
        if self.flushing.get(rec.root) == rec.step:
            # A flush must not hold other work hostage to a remote that is failing.
            self.flushing.pop(rec.root, None)
            log.warning("flush_abandoned", error=str(exc))
        permanent = isinstance(exc, PermanentError)
        delay = self.store.fail_attempt(job, job.owner, f"{job.stage}: {type(exc).__name__}:"
                                        f" {exc}", time.time(), permanent=permanent)
        log.error("stage_failed", error=str(exc), kind=type(exc).__name__, retry_in_s=delay,
                  exc_info=not permanent and not isinstance(exc, OSError | CkptdError))

    def _validated(self, root: RootConfig, job: Job, fp: str, outcome: runners.Validated,
                   log: Any, elapsed: float, size: int) -> None:
        result = outcome.result
        if file_fingerprint(root.path, job.files) != fp:
            log.info("stage_deferred", why="files changed during validation; rescanning")
            self.store.defer(job, job.owner, RESCAN_DEFER_S, time.time())
            self.on_resave()
            return
        if not self.store.finish_validation(job, job.owner, fp, result, time.time(),
                                            stored=outcome.stored, size_on_disk=size):
            return
        if result.valid:
            log.info("checkpoint_valid", seconds=elapsed, bytes=sum(f.size for f in result.files),
                     stored_bytes=sum(f.stored_size for f in outcome.stored) or None)
        else:
            log.warning("checkpoint_invalid", reason=result.reason, message=result.message,
                        seconds=elapsed)
        self.publisher.publish(root)
        self.after_stage(root.name)

    def _tick(self, worker: str) -> None:
        self.progress[worker] = time.time()


class Progress:
    """A read-pass sink that counts bytes a stage has processed (status, and the watchdog's
    notion of a worker making progress)."""

    def __init__(self, root: str, step: int, stage: str, total: int,
                 tick: Callable[[], Any], cancelled: Callable[[], bool] = lambda: False
                 ) -> None:
        self.root, self.step, self.stage, self.total = root, step, stage, total
        self.done = 0
        self._tick = tick
        self._cancelled = cancelled

    def update(self, offset: int, chunk: memoryview) -> None:
        if self._cancelled():
            raise runners.StageCancelled(f"{self.stage} of step {self.step} cancelled by stop")
        self.done += len(chunk)
        self._tick()

    def finish(self, total: int) -> None:
        self._tick()

    def advance(self, n: int) -> None:
        """Byte-count progress from stages that are not read passes (upload)."""
        self.done += n
        self._tick()

    def as_json(self) -> dict[str, Any]:
        return {"root": self.root, "step": self.step, "stage": self.stage,
                "done_bytes": self.done, "total_bytes": self.total}


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


class _Renewer:
    """Renews a job's lease in the background while the stage runs, so a long stage keeps it
    and a dead daemon's lease expires."""

    def __init__(self, store: Store, cid: int, owner: str) -> None:
        self._store, self._cid, self._owner = store, cid, owner
        self._done = threading.Event()
        self._t = threading.Thread(target=self._loop, daemon=True, name="ckptd-lease")

    def __enter__(self) -> _Renewer:
        self._t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._t.join()

    def _loop(self) -> None:
        while not self._done.wait(LEASE_S / 3):
            self._store.renew(self._cid, self._owner, time.time(), LEASE_S)


def lower_priority() -> None:
    """Run the calling thread at low CPU priority (SCHED_IDLE where allowed, else nice)."""
    tid = threading.get_native_id()
    try:
        os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
        return
    except (AttributeError, OSError):
        pass
    try:
        os.setpriority(os.PRIO_PROCESS, tid, NICE)
    except OSError:
        pass
