"""How the upload stage is called for one claimed job: the local copy checked against the row's
files, then one node's upload (an earlier save's replaced through the executor) or a multi-node
share. Records nothing, decides nothing of the commit (`ckptd.stages.multinode.parts`).
"""

from __future__ import annotations

from collections.abc import Sequence

from ckptd.backends import Backend
from ckptd.config import RootConfig
from ckptd.copies import store as copies
from ckptd.errors import (
    CkptdError,
    CorruptData,
    NotFound,
    ObjectNotFound,
    PermanentError,
    TransientError,
)
from ckptd.remote import keys as remote
from ckptd.remote.manifest import Manifest, StoredFile
from ckptd.retention import executor
from ckptd.service.jobs import Changed
from ckptd.service.progress import Progress
from ckptd.stages.multinode import parts, records
from ckptd.stages.upload import UploadResult, delete_step, upload_step
from ckptd.store import Job
from ckptd.watch.scanner import member_stats, stats_fingerprint


class CopyMissing(NotFound):
    """The local compressed copy the store counts on is gone or is not this row's content: a
    failure, after which the store has the copy made again (`Store.copy_lost`)."""


def _local_copy(root: RootConfig, step: int, expected: Sequence[StoredFile]) -> Manifest:
    """The local compressed copy's manifest, when it holds exactly the validated files."""
    manifest = copies.read_local_manifest(root.path, step)
    if manifest is None:
        raise CopyMissing(f"no local compressed copy of step {step} to upload")
    if {(f.path, f.size, f.hash) for f in manifest.files} != {
            (f.path, f.size, f.hash) for f in expected}:
        raise CopyMissing(f"the local copy of step {step} does not match its validated files")
    return manifest


def run_upload(root: RootConfig, job: Job, progress: Progress, backend: Backend,
               expected: Sequence[StoredFile], nets: executor.Nets,
               replace_remote: bool = False) -> UploadResult:
    """Upload the local compressed copy. `expected` are the row's validated files: a copy
    that does not hold exactly those (an older save's, a damaged one) is never uploaded.
    `replace_remote`: this node uploaded an earlier save of the step that a re-save replaced,
    so a different remote copy of the step is that earlier save and may be replaced. Without
    it, a step committed remotely by someone else is never touched (the upload refuses).
    The replacement is the executor's `replace_remote`, which reads its nets itself under
    the lock: refused (TransientError, the upload retries later) while a client reads the
    step."""
    step = job.checkpoint.step
    manifest = _local_copy(root, step, expected)
    if replace_remote:
        _replace_older_remote(backend, root.name, manifest, nets)
    progress.total = manifest.stored_size
    return upload_step(backend, root.name, copies.objects_dir(root.path, step), manifest,
                       progress=progress.advance, concurrency=root.upload.concurrency)


def run_share_upload(root: RootConfig, job: Job, progress: Progress, backend: Backend,
                     expected: Sequence[StoredFile], node: str,
                     known_nodes: frozenset[str], now: float) -> parts.ShareResult | Changed:
    """A multi-node root: this node's share of the step (docs/MULTINODE.md), as of `now`. Raises
    NotCommitted while the step waits for other nodes' parts. Never replaces a remote step."""
    step = job.checkpoint.step
    manifest = _local_copy(root, step, expected)
    mtimes = validated_mtimes(root, job, manifest)
    if isinstance(mtimes, Changed):
        return mtimes
    reader = records.reader_for(manifest.layout, root.world_size)
    if reader is None:
        raise PermanentError(
            f"a {manifest.layout} checkpoint has no commit record a multi-node root understands"
            f" (docs/LAYOUTS.md); root {root.name!r} has nodes = {root.nodes}: it would never be"
            " committed. Use nodes = 1 for it (on a shared file system, with the lease)")
    record = reader(root.path, manifest, mtimes)
    share = parts.Share(node=node, commit_timeout=root.commit_timeout, mtimes=mtimes,
                        record=record, known_nodes=known_nodes,
                        current=lambda: validated_mtimes(root, job, manifest) == mtimes)
    progress.total = manifest.stored_size
    try:
        return parts.upload_share(backend, root.name, copies.objects_dir(root.path, step),
                                  manifest, share, now, progress=progress.advance,
                                  concurrency=root.upload.concurrency)
    except parts.ShareChanged as exc:
        return Changed(str(exc))


def validated_mtimes(root: RootConfig, job: Job, manifest: Manifest
                     ) -> dict[str, float] | Changed:
    """Each file's mtime (this node's clock), from the same stat pass that checks the files
    are still the ones validated (the row's fingerprint). The mtimes tie the part to its save
    attempt: read from files a re-save has rewritten since, they would name the re-save's
    attempt for the earlier save's bytes. A check of its own, not the worker's
    (`Workers._files_changed`): the upload reads the copy, but a part names the originals'
    mtimes, and the multi-node commit asks again (`Share.current`) before a node confirms its
    part and before it writes a commit."""
    stats = member_stats(root.path, dict.fromkeys([*job.files, *(f.path for f in manifest.files)]))
    if (stats_fingerprint(job.files, stats) != job.checkpoint.fingerprint
            or any(f.path not in stats for f in manifest.files)):
        return Changed(f"the files of step {job.checkpoint.step} changed since they were"
                       " validated; rescanning")
    return {f.path: stats[f.path].st_mtime_ns / 1e9 for f in manifest.files}


def known_nodes(backend: Backend, root_name: str) -> set[str]:
    """The nodes of the root's latest commit (none before the first)."""
    try:
        step = remote.read_latest(backend, root_name)
        if step is None:
            return set()
        return {n for n, _a, _r in remote.read_manifest(backend, root_name, step).nodes}
    except CkptdError:
        return set()


def _replace_older_remote(backend: Backend, root_name: str, manifest: Manifest,
                          nets: executor.Nets) -> None:
    """A step re-saved after an earlier save of it was uploaded: the later save wins remotely
    too. The old step is deleted (manifest first, by the executor) before the new one is sent."""
    there: Manifest | None
    try:
        there = remote.read_manifest(backend, root_name, manifest.step)
    except ObjectNotFound:
        return
    except CorruptData:
        there = None
    if there is not None and set(there.files) == set(manifest.files):
        return  # the same content: a re-run, which the upload stage makes idempotent
    out = executor.replace_remote(backend, root_name, manifest.step, nets, delete_step)
    if out.action != "deleted":
        raise TransientError(f"the earlier upload of step {manifest.step} was not replaced:"
                             f" {out.reason}")
