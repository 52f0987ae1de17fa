"""The retention executor: the only code in the daemon that deletes checkpoint bytes.

Every destructive act is one of its entry points, each behind the safety nets of `_NETS`
(re-checked from `Guards` read just before) and, locally, crash-safe through the trash
(rename into `<root>/.ckptd/trash` under a journal, then removal):

- `execute_local`: a plan's local deletes; `execute_remote`: a plan's remote deletes;
  `execute_copies`: a plan's copy releases (through `release_copy`);
- `replace_originals`: compress-in-place, the originals go once their copy is verified;
- `release_copy`: a local compressed copy that is not needed any more (after upload, after
  its checkpoint was pruned, or one a crash left behind);
- `install_copy`: a re-save's new compressed copy takes the place of the superseded one;
- `replace_remote`: a re-save's earlier upload of the same step, before the new one goes up;
- `purge_trash`: start-up recovery, finishing (or undoing) what a crash left in the trash.

Remote deletes go through a function it is given. Never imports the store, the scheduler or
a stage; never follows a symlink; never decides what to delete (the planner and the lifecycle
table do) and never compresses (compress items come back as `deferred`).
"""

from __future__ import annotations

import os
import posixpath
import shutil
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from stat import S_ISDIR, S_ISLNK, S_ISREG
from typing import Any, Literal

from ckptd import fileio, inputs
from ckptd.backends import Backend
from ckptd.errors import CkptdError, CorruptData, StorageError
from ckptd.log import get_logger
from ckptd.model import CKPTD_DIR, Local, Remote
from ckptd.remote.manifest import step_prefix
from ckptd.retention.planner import Action, Plan, PlanItem, Tag

TRASH_DIR = "trash"  # <root>/.ckptd/trash: same filesystem as the checkpoints, so renames work
JOURNAL_NAME = "journal.json"
DATA_NAME = "data"  # <entry>/data/<root-relative path> of every moved name
_FORMAT = "ckptd-trash/1"
_MOVING, _TRASHED = "moving", "trashed"

TierName = Literal["local", "remote", "copy"]  # "copy": a local compressed copy beside originals
OutcomeAction = Literal["deleted", "trashed", "refused", "deferred", "failed"]
DeleteStep = Callable[[Backend, str, int], object]  # its result is ignored
OnTrashed = Callable[[int, Path], None]

# Refusal tags beyond the planner's vocabulary.
UNSAFE_PATH = "unsafe_path"  # outside the root, absolute, climbing, or ckptd's own files
SYMLINK = "symlink"  # a symlinked checkpoint directory, or a parent link leaving the root
NOT_ON_DISK = "not_on_disk"  # the store says the local copy is already gone
NO_TARGET = "no_target"  # the caller passed no (or a mismatched) Target for a planned step
SHARED = "shared_files"  # its files are also another checkpoint's
COMPRESSED = "compressed"  # the copy is the checkpoint's only local form


@dataclass(frozen=True)
class Target:
    """One checkpoint's local copy as the store knows it now. `path` is the root-relative anchor
    (its directory, or its main file); `files` are the root-relative member files. For a local
    compressed copy, pass its directory (e.g. `.ckptd/objects/step-<N>`) with `is_dir=True`.
    `remote` is informational: the nets read `Guards.remote_verified`."""

    step: int
    path: str
    files: tuple[str, ...]
    local: Local
    remote: Remote
    is_dir: bool


@dataclass(frozen=True)
class Guards:
    """Facts the safety nets check, read from the store right before executing (not the plan).

    `invalid`: steps the store holds invalid; they are never uploaded, so the not-uploaded net
    does not keep them (every other net still does). `shared`: steps whose local files (or
    whose directory) hold a file another checkpoint on disk counts as its own: deleting them
    would delete that one too, so they are never deleted locally."""

    latest_step: int | None
    best_step: int | None
    pinned: frozenset[int]
    in_use: frozenset[int]
    remote_verified: frozenset[int]
    upload_configured: bool
    invalid: frozenset[int] = frozenset()
    shared: frozenset[int] = frozenset()
    adopted: frozenset[int] = frozenset()  # adopted, no remote copy, and no --apply


@dataclass(frozen=True)
class Outcome:
    """What happened to one tier's copy of one step; the scheduler records it in the store."""

    step: int
    tier: TierName
    action: OutcomeAction
    reason: str
    bytes_freed: int = 0

    def as_json(self) -> dict[str, Any]:
        return {"step": self.step, "tier": self.tier, "action": self.action,
                "reason": self.reason, "bytes_freed": self.bytes_freed}


@dataclass(frozen=True)
class TrashRecord:
    """A checkpoint moved into the trash: record it as trashed, then `purge` (or `restore`) it.

    `root` is the root's resolved path; `moved` the root-relative names that now live under
    `entry/data/` (the anchor directory, or each member file); `bytes` their regular-file size."""

    step: int
    root: Path
    entry: Path
    moved: tuple[str, ...]
    bytes: int


class _Refusal(Exception):
    def __init__(self, tag: str, detail: str = "") -> None:
        super().__init__(f"{tag}: {detail}" if detail else tag)
        self.reason = str(self)


# --- the plan, carried out -------------------------------------------------------------------


def execute_local(
    root_dir: Path,
    plan: Plan,
    targets: Mapping[int, Target],
    guards: Guards,
    trash_dir: Path,
    *,
    on_trashed: OnTrashed | None = None,
    root: str | None = None,
) -> list[Outcome]:
    """Every local delete of `plan`, oldest first, each through `trash` then `purge`.

    `on_trashed(step, entry)` runs between the two so the store records "trashed" before any
    byte is removed; if it raises, the checkpoint is put back and the outcome is `failed`. An
    outcome `trashed` means gone from its place but not yet removed (purge_trash finishes it).
    Compress items come back as `deferred` (reason "compress"): the caller compresses in place.
    """
    log = get_logger(root=root or Path(root_dir).name)
    _trash_location(Path(root_dir).resolve(), trash_dir)  # a caller bug fails before any move
    out: list[Outcome] = []
    for item in plan.items:
        if item.local is Action.COMPRESS:
            out.append(Outcome(item.step, "local", "deferred", "compress"))
        elif item.local is Action.DELETE:
            target = targets.get(item.step)
            out.append(_delete_local(root_dir, item, target, guards, trash_dir, on_trashed, log))
    return out


def execute_remote(
    backend: Backend, root_name: str, plan: Plan, guards: Guards, delete_step: DeleteStep
) -> list[Outcome]:
    """Every remote delete of `plan`, oldest first, through `delete_step(backend, root, step)`
    (which must remove the step's manifest before its data objects)."""
    log = get_logger(root=root_name)
    out: list[Outcome] = []
    for item in plan.items:
        if item.remote is Action.DELETE:
            out.append(_delete_remote(backend, root_name, item, guards, delete_step, log))
    return out


def execute_copies(
    root_dir: Path,
    plan: Plan,
    targets: Mapping[int, Target],
    guards: Guards,
    *,
    root: str | None = None,
) -> list[Outcome]:
    """Every copy release of `plan` whose checkpoint's local copy stays (a copy that goes with
    its checkpoint's local delete is released after that delete is recorded), through
    `release_copy`; `targets` are the copies (`scheduler.copy_target`). Outcomes of tier
    "copy": the caller records a `deleted` one (`copy_dropped`)."""
    out: list[Outcome] = []
    for item in plan.items:
        if item.copy is not Action.DELETE or item.local is Action.DELETE:
            continue
        target = targets.get(item.step)
        if target is None or target.step != item.step:
            log = get_logger(root=root or Path(root_dir).name)
            out.append(_refused(log, item.step, "copy", _Refusal(NO_TARGET, "no copy recorded")))
            continue
        got = release_copy(root_dir, target, guards, root=root)
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
        return _refused(log, item.step, "local", _Refusal(NO_TARGET, "no record for this step"))
    try:
        got = trash(root_dir, target, guards, trash_dir, log=log)
    except OSError as exc:
        return _failed(log, item.step, "local", f"moving into the trash: {exc}")
    if isinstance(got, Outcome):
        return got
    if on_trashed is not None:
        try:
            on_trashed(item.step, got.entry)
        except Exception as exc:  # the store did not record it: disk must keep agreeing
            return _put_back(log, got, exc)
    try:
        freed = purge(got)
    except OSError as exc:
        # Gone from its place and recorded so; purge_trash at the next start finishes it.
        why = f"removing {got.entry} failed: {exc}; left for purge_trash"
        log.error("prune_failed", step=item.step, tier="local", reason=why)
        return Outcome(item.step, "local", "trashed", why)
    return _pruned(log, item, "local", freed)


def _put_back(log: Any, record: TrashRecord, cause: Exception) -> Outcome:
    try:
        restore(record)
    except OSError as exc:
        why = f"recording failed ({cause}); putting back failed too ({exc}), left in trash"
        return _failed(log, record.step, "local", why)
    return _failed(log, record.step, "local", f"recording failed ({cause}); put back")


def _delete_remote(
    backend: Backend,
    root_name: str,
    item: PlanItem,
    guards: Guards,
    delete_step: DeleteStep,
    log: Any,
) -> Outcome:
    try:
        _check_guards(item.step, "remote", guards)
    except _Refusal as refusal:
        return _refused(log, item.step, "remote", refusal)
    size = _remote_bytes(backend, root_name, item.step)
    try:
        delete_step(backend, root_name, item.step)
    except (StorageError, OSError) as exc:
        return _failed(log, item.step, "remote", str(exc))
    return _pruned(log, item, "remote", size)


def _remote_bytes(backend: Backend, root_name: str, step: int) -> int:
    """Stored size of a remote step, best effort: only a number for logs and metrics."""
    try:
        return sum(m.size for m in backend.list(step_prefix(root_name, step)))
    except StorageError:
        return 0


# --- safety nets -----------------------------------------------------------------------------


Act = Literal["prune_local", "prune_remote", "compress", "release_copy", "release_last",
              "replace_remote"]

# The nets that guard each act, checked in this order; the first that holds refuses the act.
# A net an act does not list cannot be hurt by it (docs/RETENTION.md, "Where deletion happens"):
# compress keeps the checkpoint whole and verified on disk (pinned and best ones are compressed
# like the others, a policy decision); a spare copy beside its originals loses nothing; a
# re-save's earlier upload is replaced by the same step's newer save.
_NETS: dict[str, tuple[str, ...]] = {
    "prune_local": ("latest", "best", "pinned", "in_use", "not_uploaded", "shared", "adopted"),
    "prune_remote": ("latest", "best", "pinned", "in_use", "remote_latest", "not_verified"),
    "compress": ("latest", "in_use", "invalid", "shared"),
    "release_copy": ("in_use",),  # the originals are on disk: the copy is a spare
    "release_last": ("latest", "best", "pinned", "in_use", "not_uploaded", "adopted"),
    "replace_remote": ("in_use",),
}


def _net_holds(net: str, step: int, g: Guards) -> bool:
    if net == "latest":
        return step == g.latest_step
    if net == "best":
        return step == g.best_step
    if net == "pinned":
        return step in g.pinned
    if net == "in_use":
        return step in g.in_use
    if net == "not_uploaded":
        return g.upload_configured and step not in g.remote_verified and step not in g.invalid
    if net == "shared":
        return step in g.shared
    if net == "adopted":
        return step in g.adopted
    if net == "remote_latest":
        return step == max(g.remote_verified, default=None)
    if net == "not_verified":  # not committed and verified: an upload may be writing it now
        return step not in g.remote_verified
    if net == "invalid":
        return step in g.invalid
    raise ValueError(f"unknown net {net!r}")


_NET_TAGS = {"remote_latest": str(Tag.LATEST), "not_verified": str(Tag.NOT_UPLOADED),
             "shared": SHARED}


def _check_nets(step: int, act: Act, g: Guards) -> None:
    """Raise _Refusal naming the first net that forbids `act` on `step`."""
    for net in _NETS[act]:
        if _net_holds(net, step, g):
            raise _Refusal(_NET_TAGS.get(net, net))


def _check_guards(step: int, tier: TierName, g: Guards) -> None:
    """Raise _Refusal naming the first net that forbids deleting `step` in `tier`."""
    _check_nets(step, "prune_local" if tier == "local" else "prune_remote", g)


def _relative(rel: str) -> str:
    """`rel` normalized; refused if empty, absolute, climbing out, or the root itself."""
    if not rel or "\x00" in rel:
        raise _Refusal(UNSAFE_PATH, f"bad relative path {rel!r}")
    if posixpath.isabs(rel) or os.path.isabs(rel):
        raise _Refusal(UNSAFE_PATH, f"{rel!r} is absolute")
    norm = posixpath.normpath(rel)
    if norm == ".." or norm.startswith("../"):
        raise _Refusal(UNSAFE_PATH, f"{rel!r} climbs out of the root")
    if norm == ".":
        raise _Refusal(UNSAFE_PATH, f"{rel!r} is the root itself")
    return norm


def _within(base: Path, path: Path) -> bool:
    return path == base or base in path.parents


def _locate(real_root: Path, norm: str) -> Path:
    """Where the name `norm` lives, its parent resolved; refused if the parent leaves the root.

    The last component is deliberately not resolved: a symlink there is itself what is moved
    and removed, and its target is never touched.
    """
    lexical = real_root / norm
    try:
        parent = lexical.parent.resolve()
    except (OSError, RuntimeError) as exc:  # a symlink loop, or an unreadable component
        raise _Refusal(SYMLINK, f"{norm!r} cannot be resolved: {exc}") from exc
    if not _within(real_root, parent):
        raise _Refusal(SYMLINK, f"{norm!r} reaches out of the root through a link (to {parent})")
    return parent / lexical.name


def _moves(real_root: Path, target: Target, trash_real: Path) -> list[tuple[str, Path]]:
    """(root-relative name, current path) of everything to move; refused as a whole or not
    at all. A directory checkpoint moves as one name; sibling files move one by one."""
    anchor = _relative(target.path)
    members = [_relative(f) for f in target.files]
    if target.is_dir:
        return _dir_move(real_root, anchor, members, trash_real)
    return _file_moves(real_root, list(dict.fromkeys([anchor, *members])))


def _dir_move(
    real_root: Path, anchor: str, members: list[str], trash_real: Path
) -> list[tuple[str, Path]]:
    for m in members:
        if m != anchor and not m.startswith(anchor + "/"):
            raise _Refusal(UNSAFE_PATH, f"member {m!r} is outside the directory {anchor!r}")
    src = _locate(real_root, anchor)
    if anchor == CKPTD_DIR or _within(src, trash_real) or _within(trash_real, src):
        raise _Refusal(UNSAFE_PATH, f"{anchor!r} holds or is inside ckptd's trash")
    st = _lstat(src)
    if st is None:
        return []
    if S_ISLNK(st.st_mode):
        # Unlinking would free nothing and the data it names was never ours to judge.
        raise _Refusal(SYMLINK, f"checkpoint directory {anchor!r} is a symlink")
    if not S_ISDIR(st.st_mode):
        raise _Refusal(UNSAFE_PATH, f"{anchor!r} is not a directory")
    return [(anchor, src)]


def _file_moves(real_root: Path, names: list[str]) -> list[tuple[str, Path]]:
    out: list[tuple[str, Path]] = []
    for norm in names:
        if norm.split("/", 1)[0] == CKPTD_DIR:
            raise _Refusal(UNSAFE_PATH, f"{norm!r} is one of ckptd's own files")
        src = _locate(real_root, norm)
        st = _lstat(src)
        if st is None:
            continue  # already gone: the rest still goes
        if S_ISDIR(st.st_mode):
            raise _Refusal(UNSAFE_PATH, f"member {norm!r} is a directory")
        out.append((norm, src))
    return out


def _trash_location(real_root: Path, trash_dir: Path) -> Path:
    trash_real = Path(trash_dir).resolve()
    if trash_real == real_root or not _within(real_root, trash_real):
        raise ValueError(f"trash dir {trash_dir} must be inside the root {real_root}")
    return trash_real


# --- trash, purge, restore -------------------------------------------------------------------


def trash_dir_for(root_dir: Path) -> Path:
    """`<root>/.ckptd/trash`: where this root's deletes pass through."""
    return Path(root_dir) / CKPTD_DIR / TRASH_DIR


def trash(
    root_dir: Path, target: Target, guards: Guards, trash_dir: Path, *, log: Any = None
) -> TrashRecord | Outcome:
    """Check every net, then move the checkpoint into the trash, durably.

    Returns a TrashRecord (record "trashed" in the store, then `purge` it), or a final Outcome:
    `refused` (logged as prune_refused), or `deleted` with 0 bytes when nothing was left on
    disk. Raises OSError when a move fails; whatever had moved is put back first.
    """
    if log is None:
        log = get_logger(root=Path(root_dir).name)
    real_root = Path(root_dir).resolve()
    trash_real = _trash_location(real_root, trash_dir)
    try:
        _check_guards(target.step, "local", guards)
        if target.local is Local.PRUNED:
            raise _Refusal(NOT_ON_DISK)
        moves = _moves(real_root, target, trash_real)
    except _Refusal as refusal:
        return _refused(log, target.step, "local", refusal)
    if not moves:
        log.info("checkpoint_pruned", step=target.step, tier="local", reason="already gone",
                 bytes_freed=0)
        return Outcome(target.step, "local", "deleted", "already gone")
    record = _move_into_trash(real_root, target.step, moves, trash_real)
    log.info("checkpoint_trashed", step=target.step, tier="local", trash=str(record.entry))
    return record


def purge(record: TrashRecord) -> int:
    """Remove a trashed checkpoint for good (never following a link); returns bytes freed."""
    _remove_tree(record.entry)
    fileio.fsync_dir(record.entry.parent)
    return record.bytes


def restore(record: TrashRecord) -> None:
    """Put a trashed checkpoint back where it was (its deletion was not recorded), then drop
    the trash entry. A name whose place was taken meanwhile stays trashed and is removed."""
    # Journal "moving" first: a crash halfway through is then finished by purge_trash putting
    # the rest back, instead of removing it and leaving half a checkpoint in place.
    _write_journal(record.entry, record.step, record.moved, _MOVING)
    left = _put_names_back(record.root, record.entry, record.moved)
    if left:
        get_logger().warning("trash_not_restored", step=record.step, names=left)
    _remove_tree(record.entry)
    fileio.fsync_dir(record.entry.parent)


def purge_trash(trash_dir: Path, root_dir: Path | None = None) -> int:
    """Startup recovery: empty the trash; returns how many trashed checkpoints were removed.

    An entry whose move had finished is a recorded delete and is removed. One whose move was
    cut short (its journal still says "moving") is put back whole first, so no checkpoint is
    left half in place. `root_dir` defaults to the root that holds `<root>/.ckptd/trash`.
    """
    trash_dir = Path(trash_dir)
    if not trash_dir.is_dir():
        return 0
    real_root = Path(root_dir or trash_dir.parent.parent).resolve()
    log = get_logger(root=real_root.name)
    purged = 0
    for path in sorted(trash_dir.iterdir()):
        st = _lstat(path)
        journal = _read_journal(path) if st is not None and S_ISDIR(st.st_mode) else None
        if journal is not None and journal[0] == _MOVING:
            left = _put_names_back(real_root, path, journal[1])
            log.warning("trash_restored", entry=path.name, left=left)
        else:
            purged += 1
        _remove_tree(path)
    fileio.fsync_dir(trash_dir)
    if purged:
        log.info("trash_purged", entries=purged)
    return purged


# --- the other destructive acts ---------------------------------------------------------------


def replace_originals(
    root_dir: Path,
    target: Target,
    guards: Guards,
    check: Callable[[], object],
    *,
    root: str | None = None,
) -> Outcome:
    """Compress-in-place: delete a checkpoint's original files, its verified local compressed
    copy staying the checkpoint's only local form.

    The nets of "compress" first; then `check()`, which must raise unless the copy is verified
    and durable and every original is still the file it holds (CorruptData, UnsafePath); then
    each member file moves into the trash (a directory never moves whole: files that are not
    the checkpoint's stay), the directories this emptied at and below `target.path` (or below
    the members' common directory) are removed, and the entry is purged. Returns `deleted`
    (bytes freed), `refused` (a net, a path), or `failed` (the check, a move)."""
    log = get_logger(root=root or Path(root_dir).name)
    real_root = Path(root_dir).resolve()
    try:
        trash_real = _own_trash(real_root)
        _check_nets(target.step, "compress", guards)
        members = list(dict.fromkeys(_relative(f) for f in target.files))
        moves = _file_moves(real_root, members)
    except _Refusal as refusal:
        return _refused(log, target.step, "local", refusal)
    try:
        check()
    except (CkptdError, OSError) as exc:
        return _failed(log, target.step, "local", f"originals kept: {exc}")
    if not moves:
        return Outcome(target.step, "local", "deleted", "already gone")
    try:
        record = _move_into_trash(real_root, target.step, moves, trash_real)
    except OSError as exc:
        return _failed(log, target.step, "local", f"moving into the trash: {exc}")
    _remove_emptied_dirs(real_root, target.path, [src for _, src in moves])
    freed = _purge_or_leave(log, record)
    log.info("originals_deleted", step=target.step, files=len(moves), bytes_freed=freed)
    return Outcome(target.step, "local", "deleted", "compress", freed)


def release_copy(
    root_dir: Path, target: Target, guards: Guards, *, root: str | None = None
) -> Outcome:
    """Delete a local compressed copy the lifecycle no longer counts on (`target.path` is its
    directory, `.ckptd/objects/step-<N>`). With the originals on disk (`target.local` present)
    it is a spare and only a reader holds it ("release_copy"); without them it is the last
    local form of the checkpoint and every prune net holds it ("release_last"). A copy that is
    the checkpoint (`compressed`) is never released. Through the trash, like every delete."""
    log = get_logger(root=root or Path(root_dir).name)
    if target.local is Local.COMPRESSED:
        why = _Refusal(COMPRESSED, "the copy is the checkpoint's local form")
        return _refused(log, target.step, "local", why)
    act: Act = "release_copy" if target.local is Local.PRESENT else "release_last"
    real_root = Path(root_dir).resolve()
    try:
        trash_real = _own_trash(real_root)
        _check_nets(target.step, act, guards)
        anchor = _relative(target.path)
        if not anchor.startswith(f"{CKPTD_DIR}/") or not target.is_dir:
            raise _Refusal(UNSAFE_PATH, f"{anchor!r} is not a compressed copy")
        moves = _dir_move(real_root, anchor, [], trash_real)
    except _Refusal as refusal:
        return _refused(log, target.step, "local", refusal)
    if not moves:
        return Outcome(target.step, "local", "deleted", "already gone")
    try:
        record = _move_into_trash(real_root, target.step, moves, trash_real)
    except OSError as exc:
        return _failed(log, target.step, "local", f"moving into the trash: {exc}")
    freed = _purge_or_leave(log, record)
    log.info("copy_released", step=target.step, bytes_freed=freed)
    return Outcome(target.step, "local", "deleted", act, freed)


def install_copy(root_dir: Path, step: int, staging: Path, final: Path) -> None:
    """Make the staged compressed copy `staging` the copy `final` of `step`. A copy already
    there is a superseded save's (a re-save of the step): it moves into the trash under a
    journal, the new one is renamed in, and the old one is purged. Plain renames only: an
    exchange of two watched directories confuses inotify watchers (watchdog loses track of
    both and its thread dies on the next delete). A crash between the two renames leaves no
    `final`: the copy is made again (the store then has no copy of the re-save yet)."""
    real_root = Path(root_dir).resolve()
    rel = posixpath.relpath(Path(final).resolve(strict=False).as_posix(), real_root.as_posix())
    record: TrashRecord | None = None
    try:
        trash_real = _own_trash(real_root)
        if not rel.startswith(f"{CKPTD_DIR}/"):
            raise _Refusal(UNSAFE_PATH, f"{final} is not a compressed copy inside the root")
        moves = _dir_move(real_root, _relative(rel), [], trash_real)
    except _Refusal as refusal:
        raise CkptdError(f"cannot replace the compressed copy of step {step}: "
                         f"{refusal.reason}") from None
    if moves:
        record = _move_into_trash(real_root, step, moves, trash_real)
    os.rename(staging, final)
    fileio.fsync_dir(Path(final).parent)
    if record is not None:
        _purge_or_leave(get_logger(root=real_root.name), record)


def replace_remote(
    backend: Backend, root_name: str, step: int, guards: Guards, delete_step: DeleteStep
) -> Outcome:
    """Delete the remote copy of `step` that an earlier save of it left, before a re-save of
    the step is uploaded in its place (manifest first, through `delete_step`). Refused while
    a client reads the step ("replace_remote" nets)."""
    log = get_logger(root=root_name)
    try:
        _check_nets(step, "replace_remote", guards)
    except _Refusal as refusal:
        return _refused(log, step, "remote", refusal)
    size = _remote_bytes(backend, root_name, step)
    try:
        delete_step(backend, root_name, step)
    except (StorageError, OSError) as exc:
        return _failed(log, step, "remote", str(exc))
    log.warning("remote_step_replaced", step=step, bytes_freed=size)
    return Outcome(step, "remote", "deleted", "replace_remote", size)


def _own_trash(real_root: Path) -> Path:
    """The root's trash, refused (not raised) when it would lie outside the root (a linked
    `.ckptd`): one odd root must not stop a caller's other work."""
    try:
        return _trash_location(real_root, trash_dir_for(real_root))
    except ValueError as exc:
        raise _Refusal(UNSAFE_PATH, str(exc)) from None


def _purge_or_leave(log: Any, record: TrashRecord) -> int:
    """Purge a trash entry; a failure leaves it for purge_trash at the next start."""
    try:
        return purge(record)
    except OSError as exc:
        log.error("purge_failed", step=record.step, entry=str(record.entry), error=str(exc))
        return 0


def _remove_emptied_dirs(real_root: Path, anchor: str, moved: Sequence[Path]) -> None:
    """Remove the directories that moving `moved` away left empty: the anchor directory and
    below when it is a real directory inside the root, else only below the moved files'
    common directory (never the root or a directory around other checkpoints)."""
    top: Path | None = None
    try:
        top = _locate(real_root, _relative(anchor))
    except _Refusal:
        top = None
    st = _lstat(top) if top is not None else None
    if top is not None and st is not None and S_ISDIR(st.st_mode) and top != real_root:
        inside = top

        def removable(d: Path) -> bool:
            return d == inside or inside in d.parents
    else:
        common = Path(os.path.commonpath([str(p.parent) for p in moved])) if moved else real_root

        def removable(d: Path) -> bool:
            return common in d.parents
    dirs: set[Path] = set()
    for path in moved:
        parent = path.parent
        while parent != real_root and removable(parent):
            dirs.add(parent)
            parent = parent.parent
    for d in sorted(dirs, key=lambda p: len(p.parts), reverse=True):
        try:
            os.rmdir(d)
        except OSError:  # not empty: other data lives there; keep it
            pass
    for d in sorted({d.parent for d in dirs} | {p.parent for p in moved},
                    key=lambda p: len(p.parts), reverse=True):
        if _lstat(d) is not None:
            fileio.fsync_dir(d)


def _move_into_trash(
    real_root: Path, step: int, moves: list[tuple[str, Path]], trash_real: Path
) -> TrashRecord:
    """Journal "moving", rename every name under entry/data, fsync both sides, journal
    "trashed". A crash before the last write leaves a "moving" entry purge_trash puts back."""
    trash_real.mkdir(parents=True, exist_ok=True)
    fileio.fsync_dir(trash_real.parent)  # the trash may be new: its own name must last too
    entry = trash_real / f"step-{step}.{uuid.uuid4().hex}"
    data = entry / DATA_NAME
    names = tuple(rel for rel, _ in moves)
    done: list[str] = []
    try:
        data.mkdir(parents=True)
        _write_journal(entry, step, names, _MOVING)
        fileio.fsync_dir(trash_real)
        for rel, src in moves:
            (data / rel).parent.mkdir(parents=True, exist_ok=True)
            os.rename(src, data / rel)
            done.append(rel)
        _fsync_all({src.parent for _, src in moves} | _dirs_up_to(data, names, entry))
        _write_journal(entry, step, names, _TRASHED)
    except BaseException:
        _put_names_back(real_root, entry, tuple(done))
        _remove_tree(entry)
        raise
    return TrashRecord(step, real_root, entry, names, _tree_bytes(data))


def _put_names_back(real_root: Path, entry: Path, names: Iterable[str]) -> list[str]:
    """Rename each trashed name back to its place if that place is free; return the others."""
    left: list[str] = []
    for rel in names:
        try:
            norm = _relative(rel)
            dst = _locate(real_root, norm)
        except _Refusal:
            left.append(rel)
            continue
        src = entry / DATA_NAME / norm
        if _lstat(src) is None:
            continue
        if _lstat(dst) is not None:
            left.append(rel)
            continue
        dst.parent.mkdir(parents=True, exist_ok=True)
        os.rename(src, dst)
        fileio.fsync_dir(dst.parent)
    return left


def _write_journal(entry: Path, step: int, names: tuple[str, ...], state: str) -> None:
    doc = {"format": _FORMAT, "step": step, "state": state, "names": list(names)}
    fileio.atomic_write_json(entry / JOURNAL_NAME, doc)


def _read_journal(entry: Path) -> tuple[str, tuple[str, ...]] | None:
    """(state, names) of a trash entry; None when it has no readable journal."""
    try:
        doc = inputs.read_json(entry / JOURNAL_NAME, inputs.JOURNAL)
        names = tuple(str(n) for n in doc["names"])
        state = doc["state"]
    except (OSError, CorruptData, ValueError, KeyError, TypeError, AttributeError):
        return None
    return (state, names) if doc.get("format") == _FORMAT and isinstance(state, str) else None


# --- filesystem helpers ----------------------------------------------------------------------


def _lstat(path: Path) -> os.stat_result | None:
    try:
        return os.lstat(path)
    except FileNotFoundError:
        return None


def _dirs_up_to(data: Path, names: Iterable[str], stop: Path) -> set[Path]:
    """Every directory from each moved name's new parent up to `stop`, inclusive."""
    out: set[Path] = set()
    for rel in names:
        d = (data / rel).parent
        while _within(stop, d) and d not in out:
            out.add(d)
            d = d.parent
    return out


def _fsync_all(dirs: Iterable[Path]) -> None:
    for d in sorted(dirs):
        fileio.fsync_dir(d)


def _remove_tree(top: Path) -> None:
    """Delete `top` and everything under it, never following a symlink (links are unlinked).

    Where the platform allows, shutil.rmtree works through directory file descriptors, so a
    directory swapped for a symlink mid-removal cannot lead it out of the tree; elsewhere an
    iterative walk that never follows links.
    """
    st = _lstat(top)
    if st is None:
        return
    if not S_ISDIR(st.st_mode):
        os.unlink(top)
        return
    if shutil.rmtree.avoids_symlink_attacks:
        try:
            shutil.rmtree(top)
            return
        except RecursionError:
            pass  # absurdly deep: finish iteratively below
    stack: list[tuple[Path, bool]] = [(top, False)]
    while stack:
        path, emptied = stack.pop()
        if emptied:
            os.rmdir(path)
            continue
        st = _lstat(path)
        if st is None:
            continue
        if not S_ISDIR(st.st_mode):
            os.unlink(path)
            continue
        stack.append((path, True))
        with os.scandir(path) as it:
            stack.extend((Path(e.path), False) for e in it)


def _tree_bytes(top: Path) -> int:
    """Size of the regular files under `top`; links count as nothing (their targets stay)."""
    total, stack = 0, [top]
    while stack:
        path = stack.pop()
        st = _lstat(path)
        if st is None:
            continue
        if S_ISREG(st.st_mode):
            total += st.st_size
        elif S_ISDIR(st.st_mode):
            with os.scandir(path) as it:
                stack.extend(Path(e.path) for e in it)
    return total


# --- outcomes and their events ---------------------------------------------------------------


def _tier_reasons(item: PlanItem, tier: TierName) -> str:
    return ",".join(r for r in item.reasons if r.startswith(f"{tier}:"))


def _pruned(log: Any, item: PlanItem, tier: TierName, freed: int) -> Outcome:
    reason = _tier_reasons(item, tier)
    log.info("checkpoint_pruned", step=item.step, tier=tier, reason=reason, bytes_freed=freed)
    return Outcome(item.step, tier, "deleted", reason, freed)


def _refused(log: Any, step: int, tier: TierName, refusal: _Refusal) -> Outcome:
    log.warning("prune_refused", step=step, tier=tier, reason=refusal.reason)
    return Outcome(step, tier, "refused", refusal.reason)


def _failed(log: Any, step: int, tier: TierName, reason: str) -> Outcome:
    log.error("prune_failed", step=step, tier=tier, reason=reason)
    return Outcome(step, tier, "failed", reason)
