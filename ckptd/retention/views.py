"""Store rows as the planner's and the executor's plain types: a record as a `CheckpointView`,
a root's config as a `Disk`, the nets as `Guards` read now, a record as a `Target`.
Reads the store and the disk; decides nothing and deletes nothing.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

from ckptd.config import RootConfig
from ckptd.copies.store import objects_dir
from ckptd.lifecycle import answers
from ckptd.model import CheckpointRecord, Local, Remote, State, Tier
from ckptd.retention import planner
from ckptd.retention.executor import Target
from ckptd.retention.nets import Guards
from ckptd.store import Store


class StoreNets:
    """One root's nets as every executor entry point reads them (`executor.Nets`): under
    `lock`, the one lock pins and readers' holds take (the retention service's `nets`), from
    the store, at `clock()`. The only way ckptd hands guards to the executor."""

    def __init__(self, store: Store, root: RootConfig, lock: AbstractContextManager[Any],
                 clock: Callable[[], float], delete_adopted: bool = False,
                 also_in_use: frozenset[int] = frozenset()) -> None:
        self.store, self.root, self.lock = store, root, lock
        self.clock, self.delete_adopted = clock, delete_adopted
        self.also_in_use = also_in_use  # held outside the store: hold objects in the bucket

    @contextmanager
    def held(self) -> Iterator[Guards]:
        with self.lock:
            guards = guards_for(self.store, self.root, self.clock(), self.delete_adopted)
            yield replace(guards, in_use=guards.in_use | self.also_in_use)


def guards_for(store: Store, root: RootConfig, now: float,
               delete_adopted: bool = False) -> Guards:
    """The nets, read from the store now: what every executor entry point checks, read by
    `StoreNets.held` under its lock (and by nothing else that deletes)."""
    records = store.checkpoints(root.name)
    latest = store.latest(root.name, Tier.ANY)
    best = store.best(root.name, root.metric, root.metric_mode)
    return Guards(
        latest_step=latest.step if latest else None,
        best_step=best.step if best else None,
        pinned=frozenset(r.step for r in records if r.pinned),
        in_use=store.in_use(root.name, now),
        committed=frozenset(r.step for r in records if answers.is_committed(r)),
        upload_configured=root.upload.enabled,
        invalid=frozenset(r.step for r in records if r.state is State.INVALID),
        shared=_shared(store, root, records),
        adopted=frozenset() if delete_adopted else frozenset(
            r.step for r in records if r.adopted and not answers.is_committed(r)),
    )


# Per root, the inputs of the last `_shared` answer (each present step's path, whether it is a
# directory now and its member list as stored) and the answer: the nets are read before every
# delete, and between two saves they see the same lists. Compared whole, never by a digest.
_SHARED_LAST: dict[str, tuple[tuple[tuple[int, str, bool, str], ...], frozenset[int]]] = {}
_SHARED_LOCK = threading.Lock()


def _shared(store: Store, root: RootConfig, records: list[CheckpointRecord]) -> frozenset[int]:
    """Steps on disk whose files, or whose directory, hold another on-disk checkpoint's
    file: a file belongs to one checkpoint, so a delete never reaches past its own. Worked
    out again only when a present step, its path, its being a directory or its member list
    changed since the root's last answer (`_SHARED_LAST`)."""
    present = [r for r in records if r.local is Local.PRESENT]
    texts = store.member_texts([r.id for r in present])
    key = tuple(sorted((r.step, r.path, _real_dir(root.path / r.path), texts.get(r.id, "[]"))
                       for r in present))
    with _SHARED_LOCK:
        last = _SHARED_LAST.get(root.name)
    if last is not None and last[0] == key:
        return last[1]
    members: dict[int, list[str]] = {}
    for step, _, _, text in key:
        members.setdefault(step, []).extend(json.loads(text))
    answer = shared_steps(members, {step: path for step, path, is_dir, _ in key if is_dir})
    with _SHARED_LOCK:
        _SHARED_LAST[root.name] = (key, answer)
    return answer


def shared_steps(members: Mapping[int, Iterable[str]], dirs: Mapping[int, str]) -> frozenset[int]:
    """`_shared` on plain values: each step's member paths, and the directory of each step that
    is one. A step is shared when one of its files is another step's too, or when a file under
    its directory (at any depth) is another step's. One pass over the files, each looked up by
    its parent directories: the cost follows the files held, not files times steps."""
    owners: dict[str, set[int]] = {}
    for step, files in members.items():
        for f in files:
            owners.setdefault(f, set()).add(step)
    shared = {s for steps in owners.values() if len(steps) > 1 for s in steps}
    under: dict[str, list[int]] = {}
    for step, path in dirs.items():
        under.setdefault(path.rstrip("/"), []).append(step)
    if under:
        for f, steps in owners.items():
            cut = f.find("/")
            while cut >= 0:  # f[:cut] is each directory f lies under ("" for a leading "/")
                for step in under.get(f[:cut], ()):
                    if len(steps) > 1 or step not in steps:
                        shared.add(step)
                cut = f.find("/", cut + 1)
    return frozenset(shared)


def copy_target(step: int, local: Local, remote: Remote) -> Target:
    """A step's local compressed copy as the executor's Target (`release_copy`)."""
    return Target(step, objects_dir(Path(), step).as_posix(), (), local, remote, True)


def target_of(root: RootConfig, r: CheckpointRecord, members: tuple[str, ...]) -> Target:
    """A record's local form as the executor's Target: its copy when that is all there is."""
    if r.local is Local.COMPRESSED:
        return copy_target(r.step, r.local, r.remote)
    return Target(r.step, r.path, members, r.local, r.remote, _real_dir(root.path / r.path))


def view_of(r: CheckpointRecord, metric: str, in_use: bool,
            copy: bool = False) -> planner.CheckpointView:
    return planner.CheckpointView(
        step=r.step, state=r.state, local=r.local, remote=r.remote,
        completed=r.completed if r.completed is not None else r.created, bytes=r.bytes,
        metric=r.metrics.get(metric) if metric else None, pinned=r.pinned, in_use=in_use,
        adopted=r.adopted, copy=copy)


def disk_of(root: RootConfig) -> planner.Disk | None:
    try:
        usage = shutil.disk_usage(root.path)
    except OSError:
        return None
    need = root.retention.local.min_free.required(usage.total)
    return planner.Disk(usage.free, usage.total, need)


def _real_dir(path: Path) -> bool:
    """A directory, not a link to one. Any error (a name too long, a permission) is "no": one
    checkpoint's odd path never fails the run for the others."""
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except (OSError, ValueError):
        return False
