"""The retention executor: the only code that deletes checkpoint bytes, each act an entry point
behind the safety nets (`nets`), locally through the trash (`trash`). Every entry point reads its
own guards, under the lock that pins and readers' holds take (`Nets.held`): no caller hands it
guards. Never imports the store, the scheduler or a stage; never follows a symlink; never
decides what to delete or compresses.
"""

from __future__ import annotations

import os
import posixpath
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from ckptd import fileio
from ckptd.backends import Backend, ObjectMeta
from ckptd.backends.base import same_object
from ckptd.errors import CkptdError, ObjectNotFound, StorageError
from ckptd.log import get_logger
from ckptd.model import CKPTD_DIR, Local, Remote
from ckptd.remote.keys import manifest_key
from ckptd.remote.manifest import step_prefix
from ckptd.retention import outcomes
from ckptd.retention import trash as trashcan  # (`trash` is the guarded move below)
from ckptd.retention.nets import (
    COMPRESSED,
    NO_TARGET,
    NOT_ON_DISK,
    UNSAFE_PATH,
    Act,
    DeleteRefused,
    check_nets,
)
from ckptd.retention.nets import Guards as Guards  # what `Nets.held` yields
from ckptd.retention.outcomes import Outcome, already_gone, failed, pruned, refused, remote_bytes
from ckptd.retention.planner import Action, Plan, PlanItem
from ckptd.retention.trash import TrashRecord

DeleteStep = Callable[[Backend, str, int], object]  # its result is ignored
OnTrashed = Callable[[int, Path], None]


class Nets(Protocol):
    """Where an entry point reads its guards: `held()` takes the lock that pins and readers'
    holds take, and yields the guards read from the store under it; the entry point checks
    them and deletes before it lets go, so no pin or hold lands in between. The daemon's one
    is `views.StoreNets`; nothing else in ckptd builds Guards."""

    def held(self) -> AbstractContextManager[Guards]: ...


@dataclass(frozen=True)
class Target:
    """One checkpoint's local copy as the store knows it now. `path` is the root-relative anchor
    (its directory, or its main file); `files` are the root-relative member files. For a local
    compressed copy, pass its directory (e.g. `.ckptd/objects/step-<N>`) with `is_dir=True`.
    `remote` is informational: the nets read `Guards.committed`."""

    step: int
    path: str
    files: tuple[str, ...]
    local: Local
    remote: Remote
    is_dir: bool


# --- the plan, carried out -------------------------------------------------------------------


def execute_local(
    root_dir: Path,
    plan: Plan,
    targets: Mapping[int, Target],
    nets: Nets,
    trash_dir: Path,
    *,
    on_trashed: OnTrashed | None = None,
    root: str | None = None,
) -> outcomes.LocalRun:
    """Every local delete of `plan`, oldest first, each through `trash` then `purge`.

    `on_trashed(step, entry)` runs between the two so the store records "trashed" before any
    byte is removed; if it raises, the checkpoint is put back and the outcome is `failed`. An
    outcome `trashed` means gone from its place but not yet removed (purge_trash finishes it).
    Compress items are left to the caller (`LocalRun.compress`), which replaces their
    originals (`replace_originals`).
    """
    log = get_logger(root=root or Path(root_dir).name)
    # A caller bug fails before any move.
    trashcan.trash_location(Path(root_dir).resolve(), trash_dir)
    out: list[Outcome] = []
    with nets.held() as guards:
        for item in plan.items:
            if item.local is Action.COMPRESS:
                out.append(Outcome(item.step, "local", "deferred", "compress"))
            elif item.local is Action.DELETE:
                target = targets.get(item.step)
                out.append(_delete_local(root_dir, item, target, guards, trash_dir, on_trashed,
                                         log))
    return outcomes.LocalRun(out, tuple(i.step for i in plan.items if i.local is Action.COMPRESS))


def execute_remote(
    backend: Backend, root_name: str, plan: Plan, nets: Nets, delete_step: DeleteStep
) -> list[Outcome]:
    """Every remote delete of `plan`, oldest first, through `delete_step(backend, root, step)`
    (which must remove the step's manifest before its data objects). Each step's guards are
    read under the lock and held through its delete only: a pin waits for one step's
    requests, never for the whole run's."""
    log = get_logger(root=root_name)
    out: list[Outcome] = []
    for item in plan.items:
        if item.remote is Action.DELETE:
            with nets.held() as guards:
                out.append(_delete_remote(backend, root_name, item, guards, delete_step, log))
    return out


def execute_copies(
    root_dir: Path,
    plan: Plan,
    targets: Mapping[int, Target],
    nets: Nets,
    *,
    root: str | None = None,
) -> list[Outcome]:
    """Every copy release of `plan` whose checkpoint's local copy stays (a copy that goes with
    its checkpoint's local delete is released after that delete is recorded), through
    `release_copy`; `targets` are the copies (`views.copy_target`). Outcomes of tier
    "copy": the caller records a `deleted` one (`copy_dropped`)."""
    out: list[Outcome] = []
    for item in plan.items:
        if item.copy is not Action.DELETE or item.local is Action.DELETE:
            continue
        target = targets.get(item.step)
        if target is None or target.step != item.step:
            log = get_logger(root=root or Path(root_dir).name)
            out.append(refused(log, item.step, "copy",
                               DeleteRefused(NO_TARGET, "no copy recorded")))
            continue
        got = release_copy(root_dir, target, nets, root=root)
        out.append(Outcome(got.step, "copy", got.action, got.reason, got.bytes_freed))
    return out


def _delete_local(
    root_dir: Path,
    item: PlanItem,
    target: Target | None,
    guards: Guards,
    trash_dir: Path,
    on_trashed: OnTrashed | None,
    log: Any,
) -> Outcome:
    if target is None or target.step != item.step:
        return refused(log, item.step, "local", DeleteRefused(NO_TARGET, "no record for this step"))
    try:
        got = _trash(root_dir, target, guards, trash_dir, log)
    except OSError as exc:
        return failed(log, item.step, "local", f"moving into the trash: {exc}")
    if isinstance(got, Outcome):
        return got
    if on_trashed is not None:
        try:
            on_trashed(item.step, got.entry)
        except Exception as exc:  # broad: the store did not record it: disk must keep agreeing
            return _put_back(log, got, exc)
    try:
        freed = trashcan.purge(got)
    except OSError as exc:
        # Gone from its place and recorded so; purge_trash at the next start finishes it.
        why = f"removing {got.entry} failed: {exc}; left for purge_trash"
        log.error("prune_failed", step=item.step, tier="local", reason=why)
        return Outcome(item.step, "local", "trashed", why)
    return pruned(log, item, "local", freed)


def _put_back(log: Any, record: TrashRecord, cause: Exception) -> Outcome:
    try:
        trashcan.restore(record)
    except OSError as exc:
        why = f"recording failed ({cause}); putting back failed too ({exc}), left in trash"
        return failed(log, record.step, "local", why)
    return failed(log, record.step, "local", f"recording failed ({cause}); put back")


def _delete_remote(
    backend: Backend,
    root_name: str,
    item: PlanItem,
    guards: Guards,
    delete_step: DeleteStep,
    log: Any,
) -> Outcome:
    got = _remove_remote(backend, root_name, item.step, "prune_remote", guards, delete_step, log)
    return got if isinstance(got, Outcome) else pruned(log, item, "remote", got)


def _remove_remote(backend: Backend, root_name: str, step: int, act: Act, guards: Guards,
                   delete_step: DeleteStep, log: Any) -> int | Outcome:
    """The nets of `act`, then `delete_step`: the bytes it freed, or a refused/failed Outcome."""
    try:
        check_nets(step, act, guards)
    except DeleteRefused as refusal:
        return refused(log, step, "remote", refusal)
    size = remote_bytes(backend, root_name, step)
    try:
        delete_step(backend, root_name, step)
    except (StorageError, OSError) as exc:
        return failed(log, step, "remote", str(exc))
    return size


def trash(
    root_dir: Path, target: Target, nets: Nets, trash_dir: Path, *, log: Any = None
) -> TrashRecord | Outcome:
    """Check every net (read under the lock), then move the checkpoint into the trash,
    durably, before the lock is let go.

    Returns a TrashRecord (record "trashed" in the store, then `purge` it), or a final Outcome:
    `refused` (logged as prune_refused), or `deleted` with 0 bytes when nothing was left on
    disk. Raises OSError when a move fails; whatever had moved is put back first.
    """
    with nets.held() as guards:
        return _trash(root_dir, target, guards, trash_dir,
                      log if log is not None else get_logger(root=Path(root_dir).name))


def _trash(root_dir: Path, target: Target, guards: Guards, trash_dir: Path, log: Any
           ) -> TrashRecord | Outcome:
    real_root = Path(root_dir).resolve()
    trash_real = trashcan.trash_location(real_root, trash_dir)
    try:
        check_nets(target.step, "prune_local", guards)
        if target.local is Local.PRUNED:
            raise DeleteRefused(NOT_ON_DISK)
        moves = trashcan.moves(real_root, target.path, target.files, target.is_dir, trash_real)
    except DeleteRefused as refusal:
        return refused(log, target.step, "local", refusal)
    record = trashcan.move_into_trash(real_root, target.step, moves, trash_real)
    if record is None:
        return already_gone(log, target.step)
    log.info("checkpoint_trashed", step=target.step, tier="local", trash=str(record.entry))
    return record


# --- the other destructive acts ---------------------------------------------------------------


def replace_originals(
    root_dir: Path,
    target: Target,
    nets: Nets,
    check: Callable[[], object],
    *,
    root: str | None = None,
) -> Outcome:
    """Compress-in-place: delete a checkpoint's original files, its verified local compressed
    copy staying the checkpoint's only local form.

    Its nets first; then `check()`, which must raise unless the copy is verified
    and durable and every original is still the file it holds (CorruptData, UnsafePath); then
    each member file moves into the trash (a directory never moves whole: files that are not
    the checkpoint's stay), the directories this emptied at and below `target.path` (or below
    the members' common directory) are removed, and the entry is purged. Returns `deleted`
    (bytes freed), `refused` (a net, a path), or `failed` (the check, a move). The lock is
    held from the nets' reading to the last move."""
    log = get_logger(root=root or Path(root_dir).name)
    real_root = Path(root_dir).resolve()
    with nets.held() as guards:
        try:
            trash_real = trashcan.own_trash(real_root)
            check_nets(target.step, "replace_originals", guards)
            members = list(dict.fromkeys(trashcan.relative(f) for f in target.files))
            moves = trashcan.file_moves(real_root, members)
        except DeleteRefused as refusal:
            return refused(log, target.step, "local", refusal)
        try:
            check()
        except (CkptdError, OSError) as exc:
            return failed(log, target.step, "local", f"originals kept: {exc}")
        try:
            record = trashcan.move_into_trash(real_root, target.step, moves, trash_real)
        except OSError as exc:
            return failed(log, target.step, "local", f"moving into the trash: {exc}")
    if record is None:
        return Outcome(target.step, "local", "deleted", "already gone")
    gone = set(record.moved)
    trashcan.remove_emptied_dirs(real_root, target.path, [src for rel, src in moves if rel in gone])
    freed = trashcan.purge_or_leave(log, record)
    log.info("originals_deleted", step=target.step, files=len(record.moved), bytes_freed=freed)
    return Outcome(target.step, "local", "deleted", "compress", freed)


def release_copy(
    root_dir: Path, target: Target, nets: Nets, *, root: str | None = None
) -> Outcome:
    """Delete a local compressed copy the lifecycle no longer counts on (`target.path` is its
    directory, `.ckptd/objects/step-<N>`). With the originals on disk (`target.local` present)
    it is a spare and only a reader holds it ("release_copy"); without them it is the last
    local form of the checkpoint and every prune net holds it ("release_last"). A copy that is
    the checkpoint (`compressed`) is never released. Through the trash, like every delete; a
    copy another owner released first is "already gone", not a failure."""
    log = get_logger(root=root or Path(root_dir).name)
    if target.local is Local.COMPRESSED:
        why = DeleteRefused(COMPRESSED, "the copy is the checkpoint's local form")
        return refused(log, target.step, "local", why)
    act: Act = "release_copy" if target.local is Local.PRESENT else "release_last"
    real_root = Path(root_dir).resolve()
    with nets.held() as guards:
        try:
            trash_real = trashcan.own_trash(real_root)
            check_nets(target.step, act, guards)
            anchor = trashcan.relative(target.path)
            if not anchor.startswith(f"{CKPTD_DIR}/") or not target.is_dir:
                raise DeleteRefused(UNSAFE_PATH, f"{anchor!r} is not a compressed copy")
            moves = trashcan.dir_move(real_root, anchor, [], trash_real)
        except DeleteRefused as refusal:
            return refused(log, target.step, "local", refusal)
        try:
            record = trashcan.move_into_trash(real_root, target.step, moves, trash_real)
        except OSError as exc:
            return failed(log, target.step, "local", f"moving into the trash: {exc}")
    if record is None:
        return Outcome(target.step, "local", "deleted", "already gone")
    freed = trashcan.purge_or_leave(log, record)
    log.info("copy_released", step=target.step, bytes_freed=freed)
    return Outcome(target.step, "local", "deleted", act, freed)


def install_copy(root_dir: Path, step: int, staging: Path, final: Path, *, nets: Nets) -> None:
    """Make the staged compressed copy `staging` the copy `final` of `step`. A copy already
    there is a superseded save's (a re-save of the step): it moves into the trash under a
    journal, the new one is renamed in, and the old one is purged; both under the nets' lock,
    so no other delete of the copy runs in between. Plain renames only: an exchange of two
    watched directories confuses inotify watchers (watchdog loses track of both and its
    thread dies on the next delete). A crash between the two renames leaves no `final`: the
    copy is made again (the store then has no copy of the re-save yet)."""
    real_root = Path(root_dir).resolve()
    rel = posixpath.relpath(Path(final).resolve(strict=False).as_posix(), real_root.as_posix())
    record: TrashRecord | None = None
    with nets.held():
        try:
            trash_real = trashcan.own_trash(real_root)
            if not rel.startswith(f"{CKPTD_DIR}/"):
                raise DeleteRefused(UNSAFE_PATH,
                                    f"{final} is not a compressed copy inside the root")
            moves = trashcan.dir_move(real_root, trashcan.relative(rel), [], trash_real)
        except DeleteRefused as refusal:
            raise CkptdError(f"cannot replace the compressed copy of step {step}: "
                             f"{refusal.reason}") from None
        record = trashcan.move_into_trash(real_root, step, moves, trash_real)
        os.rename(staging, final)
        fileio.fsync_dir(Path(final).parent)
    if record is not None:
        trashcan.purge_or_leave(get_logger(root=real_root.name), record)


def replace_save(root_dir: Path, step: int, swap: Callable[[], str | None], *,
                 nets: Nets) -> bool:
    """The async-save writer's commit of a save of `step` over an earlier save of it (the
    trainer saves the step again). Under the lock: the "replace_save" nets (a client reading
    the step); then `swap()`, the writer's renames (the earlier save aside to the name it
    returns, root-relative, None when there was none; the new one in); then the earlier save
    through the trash. False (nothing done) while a net holds: the writer waits and asks
    again. Raises what `swap` raises."""
    log = get_logger(root=Path(root_dir).name)
    real_root = Path(root_dir).resolve()
    record: TrashRecord | None = None
    with nets.held() as guards:
        try:
            trash_real = trashcan.own_trash(real_root)
            check_nets(step, "replace_save", guards)
        except DeleteRefused as refusal:
            log.info("save_replace_waiting", step=step, reason=refusal.reason)
            return False
        aside = swap()
        if aside is None:
            return True
        try:
            moves = trashcan.dir_move(real_root, trashcan.relative(aside), [], trash_real)
            record = trashcan.move_into_trash(real_root, step, moves, trash_real)
        except (DeleteRefused, OSError) as exc:  # committed already: the leftover is only named
            log.error("prune_failed", step=step, tier="local",
                      reason=f"the earlier save {aside} was left: {exc}")
            return True
    if record is not None:
        freed = trashcan.purge_or_leave(log, record)
        log.info("earlier_save_replaced", step=step, bytes_freed=freed)
    return True


def replace_remote(
    backend: Backend, root_name: str, step: int, nets: Nets, delete_step: DeleteStep
) -> Outcome:
    """Delete the remote copy of `step` that an earlier save of it left, before a re-save of
    the step is uploaded in its place (manifest first, through `delete_step`). Refused while
    a client reads the step ("replace_remote" nets, read under the lock, held through the
    delete)."""
    log = get_logger(root=root_name)
    with nets.held() as guards:
        got = _remove_remote(backend, root_name, step, "replace_remote", guards, delete_step,
                             log)
    if isinstance(got, Outcome):
        return got
    log.warning("remote_step_replaced", step=step, bytes_freed=got)
    return Outcome(step, "remote", "deleted", "replace_remote", got)


def discard_early(backend: Backend, root_name: str, step: int,
                  sent: Mapping[str, ObjectMeta], *, nets: Nets) -> int:
    """Delete the objects an early sender put for `step` (`stages.sending.early`) when that save of
    the step will not commit (invalid, superseded, judged damaged): only while the step is
    uncommitted remotely, and only each object that is still the very one put (same size and
    etag, else mtime). Under the nets' lock like every delete (an uncommitted step has no
    reader to guard). Best effort: what is left is a straggler the next upload of the step
    replaces; never raises. Returns how many went."""
    with nets.held():
        return _discard_early(backend, root_name, step, sent)


def _discard_early(backend: Backend, root_name: str, step: int,
                   sent: Mapping[str, ObjectMeta]) -> int:
    log = get_logger(root=root_name)
    prefix = step_prefix(root_name, step)
    try:
        backend.stat(manifest_key(root_name, step))
        log.warning("early_objects_kept", step=step, why="the step is committed remotely")
        return 0
    except ObjectNotFound:
        pass
    except (CkptdError, OSError) as exc:
        log.warning("early_objects_kept", step=step, why=str(exc))
        return 0
    gone = 0
    for key, meta in sent.items():
        try:
            if same_object(meta, backend.stat(f"{prefix}/{key}")):
                backend.delete(f"{prefix}/{key}")
                gone += 1
        except (CkptdError, OSError):  # a forged key in a ledger too
            continue  # gone already, or the store fails: a straggler at worst
    log.info("early_objects_discarded", step=step, objects=gone, of=len(sent))
    return gone
