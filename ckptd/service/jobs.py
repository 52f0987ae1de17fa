"""How each stage is called for one claimed job: a Job and the root's config become the stage's
plain arguments (a Candidate, a Stager, a backend and the expected files).

Decides nothing and records nothing: the stages do the work, the workers record the outcome.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

from ckptd.config import RootConfig
from ckptd.copies import store as copies
from ckptd.errors import DiskFull, PermanentError
from ckptd.lifecycle.table import Policy
from ckptd.log import get_logger
from ckptd.model import Candidate, ValidationResult
from ckptd.remote.manifest import Manifest, StoredFile
from ckptd.retention import executor
from ckptd.stages import compress, parts, records
from ckptd.stages.parts import NotCommitted as NotCommitted
from ckptd.stages.upload import UploadResult, upload_step
from ckptd.stages.validate import validate
from ckptd.store import Job
from ckptd.watch import member_stats, stats_fingerprint


@dataclass(frozen=True)
class Validated:
    result: ValidationResult
    stored: tuple[StoredFile, ...] = ()


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


def policy_of(root: RootConfig) -> Policy:
    """What the lifecycle needs of a root's config to know which stages its checkpoints need:
    a compressed copy when it uploads or may keep copies instead of originals."""
    return Policy(uploads=root.upload.enabled, keeps_copies=root.retention.local.compress_older,
                  committed_only=root.multi_node)


def stager_for(root: RootConfig, job: Job) -> compress.Stager:
    """A Stager whose finished copy is installed by the executor (`install_copy`): a re-save's
    copy replaces the superseded save's through the trash."""
    c = root.compress
    step = job.checkpoint.step
    return compress.Stager(root.path, root.name, step, job.checkpoint.layout,
                           c.codec, c.level, c.threads, c.min_saving,
                           install=partial(executor.install_copy, root.path, step))


def run_validate(root: RootConfig, job: Job, progress: Any) -> Validated:
    """Validate, and when the root wants a compressed copy, build it in the same read pass."""
    cand = candidate_of(job, node_share=root.multi_node)
    if cand.invalid_reason:
        return Validated(ValidationResult(False, cand.invalid_reason, cand.invalid_message))
    if not policy_of(root).wants_copy:
        return Validated(validate(root.path, cand, **_checks(root),
                                  extra_sinks=lambda _rel: [progress]))
    stager = stager_for(root, job)
    try:
        result = validate(root.path, cand, **_checks(root),
                          extra_sinks=lambda rel: [progress, *stager.sinks_for(rel)])
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
        return Validated(validate(root.path, cand, **_checks(root),
                                  extra_sinks=lambda _rel: [progress]))
    except BaseException:
        stager.abort()
        raise


def run_compress(root: RootConfig, job: Job, progress: Any) -> Sequence[StoredFile]:
    """Make the compressed copy of an already valid checkpoint (upload enabled later, or the
    copy was deferred for space). The read pass re-checks the files as it goes."""
    stager = stager_for(root, job)
    try:
        result = validate(root.path, candidate_of(job, node_share=root.multi_node), deep=False,
                          trusted=frozenset(root.trusted_globals),
                          extra_sinks=lambda rel: [progress, *stager.sinks_for(rel)])
        if not result.valid:
            stager.abort()
            raise NoLongerValid(result)
        return stager.commit(result.files, result.metrics).files
    except BaseException:
        stager.abort()
        raise


class StageCancelled(BaseException):
    """A stop past its grace period ends a read pass early. A BaseException, so the stage's
    own error handling never records it as a failure; the stage's cleanup (a Stager's abort,
    which removes its staging dir) still runs."""


class FilesChanged(Exception):
    """The files on disk are no longer the ones the row was validated from (a re-save under
    way): the stage is put off and the root rescanned."""


class NoLongerValid(Exception):
    """A later read pass over a valid checkpoint found it damaged (bit rot, an edit)."""

    def __init__(self, result: ValidationResult) -> None:
        super().__init__(f"{result.reason}: {result.message}")
        self.result = result


class CopyMissing(Exception):
    """The local compressed copy the store counts on is gone or is not this row's content."""


def _local_copy(root: RootConfig, step: int, expected: Sequence[StoredFile]) -> Manifest:
    """The local compressed copy's manifest, when it holds exactly the validated files."""
    manifest = copies.read_local_manifest(root.path, step)
    if manifest is None:
        raise CopyMissing(f"no local compressed copy of step {step} to upload")
    if {(f.path, f.size, f.hash) for f in manifest.files} != {
            (f.path, f.size, f.hash) for f in expected}:
        raise CopyMissing(f"the local copy of step {step} does not match its validated files")
    return manifest


def run_upload(root: RootConfig, job: Job, progress: Any, backend: Any,
               expected: Sequence[StoredFile], replace_remote: bool = False,
               in_use: frozenset[int] = frozenset()) -> UploadResult:
    """Upload the local compressed copy. `expected` are the row's validated files: a copy
    that does not hold exactly those (an older save's, a damaged one) is never uploaded.
    `replace_remote`: this node uploaded an earlier save of the step that a re-save replaced,
    so a different remote copy of the step is that earlier save and may be replaced. Without
    it, a step committed remotely by someone else is never touched (the upload refuses).
    The replacement is the executor's `replace_remote`: refused (TransientError, the upload
    retries later) while a client reads the step (`in_use`: the root's leased steps)."""
    step = job.checkpoint.step
    manifest = _local_copy(root, step, expected)
    if replace_remote:
        _replace_older_remote(backend, root.name, manifest, in_use)
    progress.total = manifest.stored_size
    return upload_step(backend, root.name, copies.objects_dir(root.path, step), manifest,
                       progress=progress.advance, concurrency=root.upload.concurrency)


def run_share_upload(root: RootConfig, job: Job, progress: Any, backend: Any,
                     expected: Sequence[StoredFile], node: str,
                     known_nodes: frozenset[str]) -> parts.ShareResult:
    """A multi-node root: this node's share of the step (docs/MULTINODE.md). Raises
    NotCommitted while the step waits for other nodes' parts. Never replaces a remote step."""
    step = job.checkpoint.step
    manifest = _local_copy(root, step, expected)
    mtimes = _validated_mtimes(root, job, manifest)
    readers: dict[str, records.RecordReader] = {
        "dcp": records.dcp_record, "megatron": records.megatron_record,
        "deepspeed": records.deepspeed_record, "native": records.native_record,
        "ranked": partial(records.ranked_record, world_size=root.world_size)}
    reader = readers.get(manifest.layout)
    if reader is None:
        raise PermanentError(
            f"a {manifest.layout} checkpoint has no commit record a multi-node root understands"
            f" (docs/LAYOUTS.md); root {root.name!r} has nodes = {root.nodes}: it would never be"
            " committed. Use nodes = 1 for it (on a shared file system, with the lease)")
    record = reader(root.path, manifest, mtimes)
    share = parts.Share(node=node, commit_timeout=root.commit_timeout, mtimes=mtimes,
                        record=record, known_nodes=known_nodes)
    progress.total = manifest.stored_size
    return parts.upload_share(backend, root.name, copies.objects_dir(root.path, step),
                              manifest, share, time.time(), progress=progress.advance,
                              concurrency=root.upload.concurrency)


def _validated_mtimes(root: RootConfig, job: Job, manifest: Manifest) -> dict[str, float]:
    """Each file's mtime (this node's clock), from the same stat pass that checks the files
    are still the ones validated (the row's fingerprint). The mtimes tie the part to its save
    attempt: read from files a re-save has rewritten since, they would name the re-save's
    attempt for the earlier save's bytes."""
    stats = member_stats(root.path, dict.fromkeys([*job.files, *(f.path for f in manifest.files)]))
    if (stats_fingerprint(job.files, stats) != job.checkpoint.fingerprint
            or any(f.path not in stats for f in manifest.files)):
        raise FilesChanged(f"the files of step {job.checkpoint.step} changed since they were"
                           " validated; rescanning")
    return {f.path: stats[f.path].st_mtime_ns / 1e9 for f in manifest.files}


def known_nodes(backend: Any, root_name: str) -> set[str]:
    """The nodes of the root's latest commit (none before the first)."""
    from ckptd.errors import CkptdError
    from ckptd.remote import layout as remote

    try:
        step = remote.read_latest(backend, root_name)
        if step is None:
            return set()
        return {n for n, _a, _r in remote.read_manifest(backend, root_name, step).nodes}
    except CkptdError:
        return set()


def _replace_older_remote(backend: Any, root_name: str, manifest: Any,
                          in_use: frozenset[int] = frozenset()) -> None:
    """A step re-saved after an earlier save of it was uploaded: the later save wins remotely
    too. The old step is deleted (manifest first, by the executor) before the new one is sent."""
    from ckptd.errors import CorruptData, ObjectNotFound, TransientError
    from ckptd.remote import layout as remote
    from ckptd.stages.upload import delete_step

    try:
        there = remote.read_manifest(backend, root_name, manifest.step)
    except ObjectNotFound:
        return
    except CorruptData:
        there = None
    if there is not None and set(there.files) == set(manifest.files):
        return  # the same content: a re-run, which the upload stage makes idempotent
    guards = executor.Guards(latest_step=None, best_step=None, pinned=frozenset(),
                             in_use=in_use, remote_verified=frozenset(), upload_configured=True)
    out = executor.replace_remote(backend, root_name, manifest.step, guards, delete_step)
    if out.action != "deleted":
        raise TransientError(f"the earlier upload of step {manifest.step} was not replaced:"
                             f" {out.reason}")
