"""The per-stage runner table: for each lifecycle Stage, how a worker runs it for a claimed job,
records its outcome in the store and counts it in the metrics. The one place a stage's name
picks its code; the worker's loop (claims, renewals, failures) is `ckptd.service.workers`'s.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from ckptd.backends import Backend
from ckptd.clock import SYSTEM, Clock
from ckptd.config import RootConfig
from ckptd.errors import CkptdError, PermanentError
from ckptd.lifecycle.policy import policy_of
from ckptd.lifecycle.table import Stage
from ckptd.remote.manifest import StoredFile
from ckptd.retention.executor import Nets
from ckptd.service import jobs, uploads
from ckptd.service.commits import Waiting
from ckptd.service.jobs import Changed, Damaged, Validated
from ckptd.service.metrics import Metrics
from ckptd.service.progress import Progress
from ckptd.stages.upload import UploadResult
from ckptd.store import Job, Store

OutcomeT = TypeVar("OutcomeT")  # what a stage's run gives back when it went through


@dataclass(frozen=True)
class Crew:
    """What the runners share with the workers that call them."""

    store: Store
    backend_for: Callable[[RootConfig], Backend | None]
    waiting: Waiting  # multi-node roots: steps whose part is written, waiting for the commit
    node: str
    clock: Clock = SYSTEM  # what outcomes are recorded at


@dataclass(frozen=True)
class Done:
    """A stage that went through, as the worker hands it to `record`."""

    root: RootConfig
    job: Job
    fingerprint: str  # the files' fingerprint when the stage started
    log: Any
    seconds: float
    size: int  # the checkpoint's bytes on disk


class StageRunner(Generic[OutcomeT]):
    """One stage's code. `checks_files`: its input is the checkpoint's files on disk, so the
    worker checks them against the row's fingerprint before it runs; `judges_files`: what it
    records is a verdict on the files it read, so the worker checks them again after."""

    checks_files = True
    judges_files = False

    def __init__(self, crew: Crew) -> None:
        self.crew = crew

    def run(self, root: RootConfig, job: Job, progress: Progress, nets: Nets
            ) -> OutcomeT | Changed | Damaged:
        """`nets`: the root's nets, read under the lock pins and readers' holds take: what
        every executor call the stage makes is given."""
        raise NotImplementedError

    def record(self, done: Done, outcome: OutcomeT) -> None:
        """Record `outcome` (the claim may be lost meanwhile: the store refuses it then)."""
        raise NotImplementedError

    def measure(self, metrics: Metrics, root: str, progress: Progress, outcome: OutcomeT) -> None:
        raise NotImplementedError


def _written(metrics: Metrics, root: str, progress: Progress,
             stored: Sequence[StoredFile]) -> None:
    metrics.add_bytes("read", root, progress.done)
    written = sum(f.stored_size for f in stored)
    if written:
        metrics.add_bytes("written", root, written)


class ValidateRunner(StageRunner[Validated]):
    judges_files = True

    def run(self, root: RootConfig, job: Job, progress: Progress, nets: Nets) -> Validated:
        return jobs.run_validate(root, job, progress, nets, self._early_backend(root))

    def _early_backend(self, root: RootConfig) -> Backend | None:
        """Where objects may be sent while validation goes on; None if it cannot be had
        (the upload stage reports why): validation never fails for the store's sake."""
        if not policy_of(root).sends_early:
            return None
        try:
            return self.crew.backend_for(root)
        except (CkptdError, OSError):  # a bad remote is the upload stage's error to report
            return None

    def record(self, done: Done, outcome: Validated) -> None:
        job, result, log = done.job, outcome.result, done.log
        if not self.crew.store.finish_validation(job, job.owner, done.fingerprint, result,
                                                 self.crew.clock.time(), stored=outcome.stored,
                                                 size_on_disk=done.size):
            return
        if result.valid:
            log.info("checkpoint_valid", seconds=done.seconds,
                     bytes=sum(f.size for f in result.files),
                     stored_bytes=sum(f.stored_size for f in outcome.stored) or None)
        else:
            log.warning("checkpoint_invalid", reason=result.reason, message=result.message,
                        seconds=done.seconds)

    def measure(self, metrics: Metrics, root: str, progress: Progress,
                outcome: Validated) -> None:
        _written(metrics, root, progress, outcome.stored)


class CompressRunner(StageRunner[Sequence[StoredFile]]):
    def run(self, root: RootConfig, job: Job, progress: Progress, nets: Nets
            ) -> Sequence[StoredFile] | Damaged:
        return jobs.run_compress(root, job, progress, nets)

    def record(self, done: Done, outcome: Sequence[StoredFile]) -> None:
        job = done.job
        if self.crew.store.finish_compress(job, job.owner, outcome, self.crew.clock.time()):
            done.log.info("stage_succeeded", seconds=done.seconds)

    def measure(self, metrics: Metrics, root: str, progress: Progress,
                outcome: Sequence[StoredFile]) -> None:
        _written(metrics, root, progress, outcome)


class UploadRunner(StageRunner[UploadResult]):
    checks_files = False  # it reads the compressed copy, checked against the row's files

    def run(self, root: RootConfig, job: Job, progress: Progress, nets: Nets
            ) -> UploadResult | Changed:
        crew, rec = self.crew, job.checkpoint
        backend = crew.backend_for(root)
        if backend is None:
            raise PermanentError(f"root {root.name} has no upload.url")
        expected = crew.store.stored_files(rec.id)
        if not root.multi_node:
            return uploads.run_upload(
                root, job, progress, backend, expected, nets,
                replace_remote=crew.store.replaced_upload(rec.root, rec.step))
        known = crew.waiting.known(root.name)
        if len(known) < root.nodes:  # looked up again while not every node is known
            known = crew.waiting.learn(root.name, uploads.known_nodes(backend, root.name))
        result = uploads.run_share_upload(root, job, progress, backend, expected, crew.node,
                                          known, crew.clock.time())
        if not isinstance(result, Changed):
            crew.waiting.done(rec.root, rec.step, result.nodes)
        return result

    def record(self, done: Done, outcome: UploadResult) -> None:
        job = done.job
        if self.crew.store.finish_upload(job, job.owner, self.crew.clock.time()):
            done.log.info("checkpoint_uploaded", seconds=done.seconds,
                          sent_bytes=outcome.sent_bytes,
                          skipped_objects=outcome.skipped_objects)

    def measure(self, metrics: Metrics, root: str, progress: Progress,
                outcome: UploadResult) -> None:
        metrics.add_bytes("uploaded", root, int(outcome.sent_bytes))


def runners(crew: Crew) -> Mapping[Stage, StageRunner[Any]]:
    """The table: every Stage of the lifecycle has its runner."""
    table: dict[Stage, StageRunner[Any]] = {Stage.VALIDATE: ValidateRunner(crew),
                                       Stage.COMPRESS: CompressRunner(crew),
                                       Stage.UPLOAD: UploadRunner(crew)}
    assert set(table) == set(Stage), "a stage without a runner"
    return table
