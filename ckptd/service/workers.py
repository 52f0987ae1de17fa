"""Stage workers: claim the stage the lifecycle left due on a checkpoint, run it under that
claim (renewed while it runs), record the outcome as a lifecycle event.

Owns worker threads' loops (each a supervised service), claims, priorities of background work
and the preemption flush. Which code runs a stage is the runner table's (`service.runners`);
stages get plain paths and options; only the store records, and the effects hook does what
follows a transition. Reads time only from the clock it is given.
"""

from __future__ import annotations

import os
import threading
import uuid
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

from ckptd.backends import Backend
from ckptd.clock import SYSTEM, Clock
from ckptd.config import RootConfig
from ckptd.errors import CkptdError, PermanentError
from ckptd.lifecycle import answers
from ckptd.lifecycle.table import Stage
from ckptd.log import get_logger
from ckptd.model import CheckpointRecord, RootError, State, Tier, ValidationResult
from ckptd.retention.views import StoreNets
from ckptd.service.commits import Waiting, newest_local
from ckptd.service.jobs import Changed, Damaged
from ckptd.service.metrics import Metrics
from ckptd.service.progress import Progress, StageCancelled
from ckptd.service.runners import Crew, Done, StageRunner, runners
from ckptd.service.supervisor import Call, Calls
from ckptd.service.uploads import CopyMissing
from ckptd.stages.multinode.parts import NotCommitted
from ckptd.store import Job, Store
from ckptd.watch.scanner import file_fingerprint

CLAIM_S = 60.0  # a worker's claim on its job lasts this long unless renewed
# After files changed under a stage, wait for the scanner to see the change before retrying.
RESCAN_DEFER_S = 1.0
# Reasons that prove a once-valid checkpoint's bytes are damaged (not a passing I/O error or
# files changing under the read).
CONTENT_REASONS = frozenset({"crc_mismatch", "size_mismatch", "truncated", "bad_header",
                             "bad_metadata", "nan", "unsafe_pickle", "empty_file"})
NICE = 10
IDLE_WAIT_S = 1.0
# How long one stage call may go without progress (no byte read, hashed or sent) before it is
# stuck (docs/OPERATIONS.md, "Health"). A read pass moves every few milliseconds; an upload's
# slowest quiet stretch is one request, which the backend bounds by its request timeout
# (600 s), or verifying a step's objects one stat at a time.
STAGE_BOUNDS_S: Mapping[str, float] = {Stage.VALIDATE: 300.0, Stage.COMPRESS: 300.0,
                                       Stage.UPLOAD: 900.0}
# An upload quiet this long (or past its bound, if shorter) holds back its root's other
# uploads: a second worker must not walk into the same stalled remote before the first is
# called stuck. A working upload moves bytes every moment, so this costs it nothing.
HOLD_AFTER_S = 30.0


class Workers:
    """A pool of stage workers over the store; each worker is one supervised service."""

    def __init__(self, store: Store, roots: Callable[[], Mapping[str, RootConfig]],
                 count: int, rescan: Callable[[], None],
                 backend_for: Callable[[RootConfig], Backend | None], metrics: Metrics,
                 *, nets: AbstractContextManager[Any], node: str = "",
                 calls: Calls | None = None,
                 bounds: Mapping[str, float] | None = None, clock: Clock = SYSTEM) -> None:
        """`nets`: the lock pins and readers' holds take (the retention service's), under
        which every delete a stage asks of the executor reads its nets; `calls`: the
        supervisor's call board, where each worker says what it is busy with and beats while
        it makes progress; `bounds`: how long a stage may go quiet (stage -> seconds;
        `STAGE_BOUNDS_S` for the ones not given); `clock`: what claims, deferrals and the
        quiet of a call are timed by (the board's own clock when `calls` is given)."""
        self.clock = clock
        self.store = store
        self.node = node  # daemon.node: this node's id on multi-node roots
        self.roots = roots
        self.count = count
        self.rescan = rescan
        self.backend_for = backend_for
        self.metrics = metrics
        self.owner = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._wake = threading.Event()
        self._cancel = threading.Event()  # set when a stop's grace ran out
        self._lock = threading.Lock()
        self._flushing: dict[str, int] = {}  # root -> step being flushed to the remote first
        self.calls = calls if calls is not None else Calls(clock)
        self.bounds = {**STAGE_BOUNDS_S, **(bounds or {})}
        self.inflight: dict[int, Progress] = {}
        self.log = get_logger()
        # Multi-node roots: steps whose part is written and wait for the commit.
        self.waiting = Waiting()
        self._nets_lock = nets
        self.runners = runners(Crew(store, backend_for, self.waiting, node, clock))

    @property
    def names(self) -> list[str]:
        return [f"worker-{i}" for i in range(self.count)]

    def wake(self) -> None:
        self._wake.set()

    def cancel(self) -> None:
        """Past a stop's grace: end read passes at their next chunk, so a stage aborts (its
        staging dir removed) instead of being cut off mid-write when the process exits."""
        self._cancel.set()
        self._wake.set()

    # -- the preemption flush ----------------------------------------------------------------

    def flush(self) -> dict[str, int]:
        """Preemption: the newest valid, not yet uploaded step of each uploading root goes
        first; other copies and uploads yield until those are uploaded. Returns root -> step."""
        targets = {}
        for name, root in self.roots().items():
            if not root.upload.enabled:
                continue
            rec = (self.store.latest(name, Tier.LOCAL) if not root.multi_node else
                   newest_local(self.store.checkpoints(name)))  # latest waits for commits
            if rec is not None and not answers.is_committed(rec):
                targets[name] = rec.step
                self.store.expedite(name, rec.step)  # no waiting out an earlier backoff
        with self._lock:
            self._flushing = targets
        self.log.info("flush_requested", targets=targets or None)
        self.wake()
        return targets

    def flushing(self) -> dict[str, int]:
        with self._lock:
            return dict(self._flushing)

    def _flush_targets(self) -> frozenset[tuple[str, int]] | None:
        """The flush's steps still to upload; None when no flush is on."""
        with self._lock:
            flushing = dict(self._flushing)
        if not flushing:
            return None
        left = {}
        roots = self.roots()
        for name, step in flushing.items():
            if name not in roots or not roots[name].upload.enabled:
                continue  # the root stopped uploading (reload): nothing left to flush there
            rec = self.store.checkpoint(name, step)
            if rec is not None and rec.state is State.VALID and not answers.was_committed(rec):
                left[name] = step
        with self._lock:
            if self._flushing == flushing:
                if not left:
                    self.log.info("flush_done", roots=sorted(flushing))
                self._flushing = left
        return frozenset(left.items()) or None

    def _abandon_flush(self, root: str, step: int, log: Any, error: str) -> None:
        with self._lock:
            if self._flushing.get(root) != step:
                return
            # A flush must not hold other work hostage to a remote that is failing.
            self._flushing.pop(root, None)
        log.warning("flush_abandoned", error=error)

    def stuck(self) -> list[str]:
        """Workers in a stage call quiet for longer than its bound."""
        names = set(self.names)
        return [c.who for c in self.calls.stuck() if c.who in names]

    def _held_back(self) -> frozenset[tuple[str, str]]:
        """(root, "upload") for each root with an upload quiet for HOLD_AFTER_S (or stuck):
        that root's other uploads wait (they talk to the same remote, and would most likely
        stall the same way) so that one stalled remote never takes every worker; validation,
        copies and other roots go on. A quiet local stage holds nothing back: the next
        checkpoint's files are others."""
        names = set(self.names)
        now = self.calls.clock.monotonic()
        return frozenset((c.root, c.stage) for c in self.calls.all()
                         if c.who in names and c.stage == Stage.UPLOAD.value
                         and c.quiet_s(now) > min(HOLD_AFTER_S, c.bound_s))

    # -- one worker --------------------------------------------------------------------------

    def run(self, name: str, stop: threading.Event) -> None:
        """A worker's loop until `stop`: claim, run, record. A job that raised out of the
        recording is given back (retried after backoff) before the worker crashes."""
        lower_priority()
        while not stop.is_set():
            job = self.store.claim(f"{self.owner}/{name}/{uuid.uuid4().hex[:8]}", self.clock.time(),
                                   CLAIM_S, only=self._flush_targets(),
                                   roots=frozenset(self.roots()), stuck=self._held_back())
            if job is None:
                self._wake.wait(IDLE_WAIT_S)
                self._wake.clear()
                continue
            rec = job.checkpoint
            self.calls.begin(name, job.stage, rec.root, rec.step,
                             self.bounds.get(job.stage, max(STAGE_BOUNDS_S.values())))
            try:
                self._run(job, name)
            except BaseException as exc:
                self.store.fail_attempt(job, job.owner, f"{job.stage}: {type(exc).__name__}:"
                                        f" {exc}", self.clock.time())
                raise
            finally:
                self.calls.end(name)
                self.wake()  # a (root, stage) held back behind this call may go on

    def _run(self, job: Job, worker: str) -> None:
        root = self.roots().get(job.checkpoint.root)
        if root is None:
            return  # root removed from config; the claim just expires
        rec = job.checkpoint
        runner = self.runners[job.stage]
        log = self.log.bind(root=rec.root, step=rec.step, stage=job.stage, layout=rec.layout)
        fp = rec.fingerprint
        if (runner.checks_files and rec.local.value == "present"
                and self._files_changed(root, job, fp)):
            self._changed(job, log, "files changed since completion; rescanning")
            return
        log.info("stage_started")
        started = self.clock.monotonic()
        total = sum(_size(root.path / f) for f in job.files)
        progress = Progress(rec.root, rec.step, job.stage, total, lambda: self._tick(worker),
                            cancelled=self._cancel.is_set)
        self.inflight[rec.id] = progress
        with _ClaimRenewer(self.store, rec.id, job.owner, self.clock):
            try:
                outcome = runner.run(root, job, progress,
                                     StoreNets(self.store, root, self._nets_lock, self.clock.time))
            except StageCancelled:
                log.warning("stage_cancelled")
                return  # its claim is released at the next start; the stage is redone then
            except NotCommitted as exc:
                delay = self.waiting.wait(rec.root, rec.step, exc)
                log.info("commit_waiting", error=str(exc), missing_nodes=exc.missing_nodes,
                         retry_in_s=delay)
                self.store.defer(job, job.owner, delay, self.clock.time())
                return
            except Exception as exc:  # broad: an OS, storage or code failure: retry, never crash
                self._failed(job, log, exc)
                return
            finally:
                self.inflight.pop(rec.id, None)
        if isinstance(outcome, Changed):
            self._changed(job, log, outcome.why)
        elif isinstance(outcome, Damaged):
            self._damaged(root, job, fp, outcome.result, log)
        else:
            seconds = round(self.clock.monotonic() - started, 3)
            done = Done(root, job, fp, log, seconds, progress.total)
            self._record(runner, done, progress, outcome)

    def _files_changed(self, root: RootConfig, job: Job, fp: str) -> bool:
        """Whether the checkpoint's files on disk are no longer the ones the row's fingerprint
        `fp` names: the one check of "did the files change under a stage", made before a
        stage that reads the originals starts, and again after one whose verdict (valid,
        invalid, damaged) holds only for the files it read. (A multi-node upload also reads
        its files' mtimes for its part, `uploads.validated_mtimes`, from a stat pass of its
        own.)"""
        return file_fingerprint(root.path, job.files) != fp

    def _record(self, runner: StageRunner[Any], done: Done, progress: Progress, outcome: Any
                ) -> None:
        """A stage that went through: counted, then recorded by its runner, unless its verdict
        is on files that changed while it read them."""
        job = done.job
        self.metrics.observe_stage(job.stage, done.seconds)
        runner.measure(self.metrics, job.checkpoint.root, progress, outcome)
        # That stage works again.
        self.store.clear_root_error(done.root.name, *RootError.cleared_by_stage(job.stage))
        if runner.judges_files and self._files_changed(done.root, job, done.fingerprint):
            self._changed(job, done.log, "files changed during validation; rescanning")
            return
        runner.record(done, outcome)

    def _changed(self, job: Job, log: Any, why: str) -> None:
        log.info("stage_deferred", why=why)
        self.store.defer(job, job.owner, RESCAN_DEFER_S, self.clock.time())
        self.rescan()

    def _damaged(self, root: RootConfig, job: Job, fp: str, result: ValidationResult,
                 log: Any) -> None:
        """A later read pass found the checkpoint no longer valid: invalid when the reason
        proves damage and the files are still the ones read; else a failure, and a rescan."""
        if result.reason in CONTENT_REASONS and not self._files_changed(root, job, fp):
            if self.store.invalidate(job, job.owner, result.reason, result.message,
                                     self.clock.time()):
                log.warning("checkpoint_invalid", reason=result.reason,
                            message=result.message, found_by=job.stage)
            return
        # An I/O error, or files changing under the pass: not proof of damage.
        self._failed(job, log, RuntimeError(f"{result.reason}: {result.message}"))
        self.rescan()

    def _failed(self, job: Job, log: Any, exc: Exception) -> None:
        self.metrics.error(job.stage)
        if isinstance(exc, CopyMissing):
            self.store.copy_lost(job, job.owner, self.clock.time())  # compress redoes it
        rec = job.checkpoint
        self._abandon_flush(rec.root, rec.step, log, str(exc))
        permanent = isinstance(exc, PermanentError)
        delay = self.store.fail_attempt(job, job.owner, f"{job.stage}: {type(exc).__name__}:"
                                        f" {exc}", self.clock.time(), permanent=permanent)
        log.error("stage_failed", error=str(exc), kind=type(exc).__name__, retry_in_s=delay,
                  exc_info=not permanent and not isinstance(exc, OSError | CkptdError))

    def _tick(self, worker: str) -> None:
        self.calls.beat(worker)

    def set_aside(self, call: Call, stuck: bool) -> None:
        """The supervisor saw a worker's call go past its bound (or move again): say so where
        an operator looks (the root's last error, the error count). The item stays claimed by
        the stuck call, so no second worker runs into the same stall or races it; a quiet
        upload holds back its root's other uploads (`_held_back`); every other item goes on.
        When the call returns, its outcome is recorded as any other (a failure backs off)."""
        if call.who not in self.names:
            return
        if stuck:
            self.metrics.error(f"stuck:{call.stage}")
            words = call.words(self.calls.clock.monotonic())
            self.store.set_root_error(call.root, RootError.of_stage(call.stage, stuck=True),
                                      f"{call.stage}: stuck: {words}; set aside",
                                      self.clock.time())
        else:
            self.store.clear_root_error(call.root, RootError.of_stage(call.stage, stuck=True))
        self.wake()

    def uncommitted(self, root: str, nodes: int) -> list[dict[str, Any]]:
        return self.waiting.uncommitted(root, nodes)

    def part_states(self, root: RootConfig, rec: CheckpointRecord) -> dict[str, str]:
        """Each node's part state of one step of a multi-node root, as this node knows it:
        from its last look at the parts while the step waited, else this node's own."""
        seen = self.waiting.node_states(root.name, rec.step)
        if seen is not None:
            return seen
        nodes = self.waiting.committed(root.name, rec.step)
        if nodes is not None and answers.is_committed(rec):
            return dict.fromkeys(sorted(nodes), "committed")
        if answers.is_committed(rec):
            return {self.node: "committed"}
        return {self.node: "uploading" if rec.remote.value == "uploading" else "local"}

    def in_flight(self) -> list[dict[str, Any]]:
        return [p.as_json() for p in list(self.inflight.values())]


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


class _ClaimRenewer:
    """Renews a worker's claim on its job in the background while the stage runs, so a long
    stage keeps it and a dead daemon's claim expires."""

    def __init__(self, store: Store, cid: int, owner: str, clock: Clock) -> None:
        self._store, self._cid, self._owner, self._clock = store, cid, owner, clock
        self._done = threading.Event()
        self._t = threading.Thread(target=self._loop, daemon=True, name="ckptd-claim")

    def __enter__(self) -> _ClaimRenewer:
        self._t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._t.join()

    def _loop(self) -> None:
        while not self._done.wait(CLAIM_S / 3):
            try:
                self._store.renew_claim(self._cid, self._owner, self._clock.time(), CLAIM_S)
            except Exception as exc:  # broad: the claim then expires; the stage goes on
                get_logger().warning("claim_renew_failed", error=str(exc))


def lower_priority(idle: bool = True, nice: int = NICE) -> None:
    """Run the calling thread at low CPU priority: SCHED_IDLE where allowed (it runs only on
    a core nothing else wants), else, or with `idle` False, `nice` (a small share even on
    a machine kept busy, so its work is slowed, never stopped)."""
    tid = threading.get_native_id()
    if idle:
        try:
            os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
            return
        except (AttributeError, OSError):
            pass
    try:
        os.setpriority(os.PRIO_PROCESS, tid, nice)
    except OSError:
        pass
