"""The trash: a local delete is a rename into `<root>/.ckptd/trash` under a journal, then `purge`
(or `restore`, or `purge_trash` after a crash), of names inside the root, never through a link.
Checks no net and decides nothing: the executor calls it after the nets (and start-up recovery).
"""

from __future__ import annotations

import os
import posixpath
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from stat import S_ISDIR, S_ISLNK, S_ISREG
from typing import Any

from ckptd import fileio, inputs
from ckptd.errors import CorruptData
from ckptd.log import get_logger
from ckptd.model import CKPTD_DIR
from ckptd.retention.nets import SYMLINK, UNSAFE_PATH, DeleteRefused

TRASH_DIR = "trash"  # <root>/.ckptd/trash: same filesystem as the checkpoints, so renames work
JOURNAL_NAME = "journal.json"
DATA_NAME = "data"  # <entry>/data/<root-relative path> of every moved name
_FORMAT = "ckptd-trash/1"
_MOVING, _TRASHED = "moving", "trashed"

Moves = list[tuple[str, Path]]  # (root-relative name, current path) of each name to move


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



# --- the names a delete may move -------------------------------------------------------------


def relative(rel: str) -> str:
    """`rel` normalized; refused if empty, absolute, climbing out, or the root itself."""
    if not rel or "\x00" in rel:
        raise DeleteRefused(UNSAFE_PATH, f"bad relative path {rel!r}")
    if posixpath.isabs(rel) or os.path.isabs(rel):
        raise DeleteRefused(UNSAFE_PATH, f"{rel!r} is absolute")
    norm = posixpath.normpath(rel)
    if norm == ".." or norm.startswith("../"):
        raise DeleteRefused(UNSAFE_PATH, f"{rel!r} climbs out of the root")
    if norm == ".":
        raise DeleteRefused(UNSAFE_PATH, f"{rel!r} is the root itself")
    return norm


def _within(base: Path, path: Path) -> bool:
    return path == base or base in path.parents


def locate(real_root: Path, norm: str) -> Path:
    """Where the name `norm` lives, its parent resolved; refused if the parent leaves the root.

    The last component is deliberately not resolved: a symlink there is itself what is moved
    and removed, and its target is never touched.
    """
    lexical = real_root / norm
    try:
        parent = lexical.parent.resolve()
    except (OSError, RuntimeError) as exc:  # a symlink loop, or an unreadable component
        raise DeleteRefused(SYMLINK, f"{norm!r} cannot be resolved: {exc}") from exc
    if not _within(real_root, parent):
        raise DeleteRefused(SYMLINK,
                            f"{norm!r} reaches out of the root through a link (to {parent})")
    return parent / lexical.name


def moves(real_root: Path, path: str, files: Sequence[str], is_dir: bool, trash_real: Path
          ) -> Moves:
    """(root-relative name, current path) of everything to move of the checkpoint anchored
    at `path` with member `files`; refused as a whole or not at all. A directory checkpoint
    (`is_dir`) moves as one name; sibling files move one by one."""
    anchor = relative(path)
    members = [relative(f) for f in files]
    if is_dir:
        return dir_move(real_root, anchor, members, trash_real)
    return file_moves(real_root, list(dict.fromkeys([anchor, *members])))


def dir_move(
    real_root: Path, anchor: str, members: list[str], trash_real: Path
) -> Moves:
    for m in members:
        if m != anchor and not m.startswith(anchor + "/"):
            raise DeleteRefused(UNSAFE_PATH, f"member {m!r} is outside the directory {anchor!r}")
    src = locate(real_root, anchor)
    if anchor == CKPTD_DIR or _within(src, trash_real) or _within(trash_real, src):
        raise DeleteRefused(UNSAFE_PATH, f"{anchor!r} holds or is inside ckptd's trash")
    st = _lstat(src)
    if st is None:
        return []
    if S_ISLNK(st.st_mode):
        # Unlinking would free nothing and the data it names was never ours to judge.
        raise DeleteRefused(SYMLINK, f"checkpoint directory {anchor!r} is a symlink")
    if not S_ISDIR(st.st_mode):
        raise DeleteRefused(UNSAFE_PATH, f"{anchor!r} is not a directory")
    return [(anchor, src)]


def file_moves(real_root: Path, names: list[str]) -> Moves:
    out: list[tuple[str, Path]] = []
    for norm in names:
        if norm.split("/", 1)[0] == CKPTD_DIR:
            raise DeleteRefused(UNSAFE_PATH, f"{norm!r} is one of ckptd's own files")
        src = locate(real_root, norm)
        st = _lstat(src)
        if st is None:
            continue  # already gone: the rest still goes
        if S_ISDIR(st.st_mode):
            raise DeleteRefused(UNSAFE_PATH, f"member {norm!r} is a directory")
        out.append((norm, src))
    return out


def trash_location(real_root: Path, trash_dir: Path) -> Path:
    trash_real = Path(trash_dir).resolve()
    if trash_real == real_root or not _within(real_root, trash_real):
        raise ValueError(f"trash dir {trash_dir} must be inside the root {real_root}")
    return trash_real


def trash_dir_for(root_dir: Path) -> Path:
    """`<root>/.ckptd/trash`: where this root's deletes pass through."""
    return Path(root_dir) / CKPTD_DIR / TRASH_DIR


def own_trash(real_root: Path) -> Path:
    """The root's trash, refused (not raised) when it would lie outside the root (a linked
    `.ckptd`): one odd root must not stop a caller's other work."""
    try:
        return trash_location(real_root, trash_dir_for(real_root))
    except ValueError as exc:
        raise DeleteRefused(UNSAFE_PATH, str(exc)) from None


# --- into the trash, and out of it ------------------------------------------------------------


def purge(record: TrashRecord) -> int:
    """Remove a trashed checkpoint for good (never following a link); returns bytes freed."""
    fileio.remove_tree(record.entry)
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
    fileio.remove_tree(record.entry)
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
        fileio.remove_tree(path)
    fileio.fsync_dir(trash_dir)
    if purged:
        log.info("trash_purged", entries=purged)
    return purged


def purge_or_leave(log: Any, record: TrashRecord) -> int:
    """Purge a trash entry; a failure leaves it for purge_trash at the next start."""
    try:
        return purge(record)
    except OSError as exc:
        log.error("purge_failed", step=record.step, entry=str(record.entry), error=str(exc))
        return 0


def remove_emptied_dirs(real_root: Path, anchor: str, moved: Sequence[Path]) -> None:
    """Remove the directories that moving `moved` away left empty: the anchor directory and
    below when it is a real directory inside the root, else only below the moved files'
    common directory (never the root or a directory around other checkpoints)."""
    top: Path | None = None
    try:
        top = locate(real_root, relative(anchor))
    except DeleteRefused:
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


def move_into_trash(
    real_root: Path, step: int, moves: Moves, trash_real: Path
) -> TrashRecord | None:
    """Journal "moving", rename every name under entry/data, fsync both sides, journal
    "trashed". A crash before the last write leaves a "moving" entry purge_trash puts back.

    A name that is gone by the time it is renamed (another owner's delete got there first,
    or a hand) is skipped: what is not there is deleted already. None when nothing moved."""
    if not moves:
        return None
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
            if _rename_unless_gone(src, data / rel):
                done.append(rel)
        if not done:
            fileio.remove_tree(entry)
            fileio.fsync_dir(trash_real)
            return None
        moved = tuple(done)
        _fsync_all({src.parent for _, src in moves} | _dirs_up_to(data, moved, entry))
        _write_journal(entry, step, moved, _TRASHED)
    except BaseException:
        _put_names_back(real_root, entry, tuple(done))
        fileio.remove_tree(entry)
        raise
    return TrashRecord(step, real_root, entry, moved, _tree_bytes(data))


def _rename_unless_gone(src: Path, dst: Path) -> bool:
    """Rename `src` to `dst`; False when `src` no longer exists (any other error raises)."""
    try:
        os.rename(src, dst)
    except FileNotFoundError:
        if _lstat(src) is not None or _lstat(dst.parent) is None:
            raise  # the source is there: the failure is another one
        return False
    return True


def _put_names_back(real_root: Path, entry: Path, names: Iterable[str]) -> list[str]:
    """Rename each trashed name back to its place if that place is free; return the others."""
    left: list[str] = []
    for rel in names:
        try:
            norm = relative(rel)
            dst = locate(real_root, norm)
        except DeleteRefused:
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
