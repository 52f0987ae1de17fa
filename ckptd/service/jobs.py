"""How validate and compress are called for one claimed job (a Candidate, a Stager), and the two
answers that are not failures: `Changed`, `Damaged`. Records nothing (the workers record; the
upload's call is `service.uploads`). Decides only how a stage is called: whether the copy is
built in validation's read pass and its objects sent early, and that a full disk defers the
copy instead of failing the validation.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

from ckptd.backends import Backend
from ckptd.config import RootConfig
from ckptd.errors import DiskFull
from ckptd.lifecycle.policy import policy_of
from ckptd.log import get_logger
from ckptd.model import Candidate, ValidationResult
from ckptd.remote.manifest import StoredFile
from ckptd.retention import executor
from ckptd.service.progress import Progress
from ckptd.stages import compress
from ckptd.stages.sending.early import EarlySender
from ckptd.stages.validate import validate
from ckptd.store import Job


@dataclass(frozen=True)
class Validated:
    """A validation's result, and the compressed copy's files when one was made alongside."""

    result: ValidationResult
    stored: tuple[StoredFile, ...] = ()


@dataclass(frozen=True)
class Changed:
    """The files on disk are no longer the ones the row was validated from (a re-save under
    way): the stage is put off and the root rescanned."""

    why: str


@dataclass(frozen=True)
class Damaged:
    """A later read pass over a valid checkpoint found it damaged (bit rot, an edit), or could
    not tell (an I/O error): `result` says which."""

    result: ValidationResult


def candidate_of(job: Job, node_share: bool = False) -> Candidate:
    """`node_share`: the root is multi-node, so files the record names may be elsewhere."""
    rec = job.checkpoint
    return Candidate(
        layout=rec.layout, step=rec.step, path=rec.path, files=job.files, complete=True,
        expected_sizes=job.expected_sizes, min_sizes=job.min_sizes, metrics=dict(rec.metrics),
        invalid_reason=job.invalid_reason, invalid_message=job.invalid_message,
        opaque=job.opaque, rank_files=job.rank_files, node_share=node_share,
    )


def _checks(root: RootConfig) -> dict[str, Any]:
    return {"deep": root.deep_validate, "trusted": frozenset(root.trusted_globals)}


def stager_for(root: RootConfig, job: Job, nets: executor.Nets) -> compress.Stager:
    """A Stager whose finished copy is installed by the executor (`install_copy`, under the
    nets' lock): a re-save's copy replaces the superseded save's through the trash."""
    c = root.compress
    step = job.checkpoint.step
    return compress.Stager(root.path, root.name, step, job.checkpoint.layout,
                           c.codec, c.level, c.threads, c.min_saving,
                           install=partial(executor.install_copy, root.path, step, nets=nets))


def run_validate(root: RootConfig, job: Job, progress: Progress, nets: executor.Nets,
                 backend: Backend | None = None) -> Validated:
    """Validate, and when the root wants a compressed copy, build it in the same read pass.
    With `backend` (a single-node root that uploads), each object is also sent as soon as it
    is finished (`stages.sending.early`); the upload stage still verifies and commits."""
    cand = candidate_of(job, node_share=root.multi_node)
    if cand.invalid_reason:
        return Validated(ValidationResult(False, cand.invalid_reason, cand.invalid_message))
    policy = policy_of(root)
    if not policy.wants_copy:
        return Validated(validate(root.path, cand, **_checks(root), every_file=[progress]))
    stager = stager_for(root, job, nets)
    if backend is not None and policy.sends_early:
        step = job.checkpoint.step
        stager.send_early(
            EarlySender(backend, root.name, step, stager.staging, root.upload.concurrency),
            partial(executor.discard_early, backend, root.name, step, nets=nets))
    try:
        result = validate(root.path, cand, **_checks(root), every_file=[progress],
                          extra_sinks=stager.sinks_for)
        if not result.valid:
            stager.abort()
            return Validated(result)
        return Validated(result, stager.commit(result.files, result.metrics).files)
    except DiskFull as exc:
        # No room for the copy must not hold back the resume point: validate without it; the
        # compress stage makes the copy later, when there is space.
        stager.abort()
        get_logger().warning("compressed_copy_deferred", root=root.name,
                             step=job.checkpoint.step, error=str(exc))
        progress.done = 0
        return Validated(validate(root.path, cand, **_checks(root), every_file=[progress]))
    except BaseException:
        stager.abort()
        raise


def run_compress(root: RootConfig, job: Job, progress: Progress, nets: executor.Nets
                 ) -> Sequence[StoredFile] | Damaged:
    """Make the compressed copy of an already valid checkpoint (upload enabled later, or the
    copy was deferred for space). The read pass re-checks the files as it goes."""
    stager = stager_for(root, job, nets)
    try:
        result = validate(root.path, candidate_of(job, node_share=root.multi_node), deep=False,
                          trusted=frozenset(root.trusted_globals), every_file=[progress],
                          extra_sinks=stager.sinks_for)
        if not result.valid:
            stager.abort()
            return Damaged(result)
        return stager.commit(result.files, result.metrics).files
    except BaseException:
        stager.abort()
        raise
