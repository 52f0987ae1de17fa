"""The upload stage of a multi-node root (docs/MULTINODE.md): this node's objects of one save
attempt under `<node>.<attempt>/`, its part create-only, then the commit once the parts cover
the coordinator's save. Decisions are `ckptd.cluster.commit`'s; never imports the store.
"""

from __future__ import annotations

import json
import threading
import uuid
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from itertools import islice
from pathlib import Path

from ckptd import fileio
from ckptd.backends.base import Backend, ObjectMeta
from ckptd.cluster import commit as cc
from ckptd.errors import (
    BadPart,
    CorruptData,
    ObjectExists,
    ObjectNotFound,
    PermanentError,
    StorageError,
    TransientError,
)
from ckptd.log import get_logger
from ckptd.remote.keys import advance_latest, manifest_key, read_manifest, step_objects
from ckptd.remote.manifest import Manifest, StoredFile, step_prefix
from ckptd.stages.upload import UploadResult

Progress = Callable[[int], None]
# Where the create-only check puts its probe objects, under the root's remote prefix.
PROBE_DIR = "_probe"
# The most parts of one step a listing is read for (nodes times attempts): what a bucket holds
# cannot make this node keep more.
MAX_PARTS = 100_000


def _unchanged() -> bool:
    return True


@dataclass(frozen=True)
class Share:
    """This node's side of a multi-node upload: who it is, its files' mtimes, its record."""

    node: str
    commit_timeout: float
    mtimes: Mapping[str, float]  # original path -> mtime (this node's clock)
    record: cc.CommitRecord | None = None
    known_nodes: frozenset[str] = frozenset()
    # Whether this node's files are still the validated ones (stat them again): asked after
    # the coordinator's record was seen, before this node confirms its part for that save,
    # and before this node writes a commit.
    current: Callable[[], bool] = _unchanged


class ShareChanged(TransientError):
    """This node's files changed since they were validated (a re-save under way): its part
    is neither confirmed nor committed; the root is rescanned."""


@dataclass(frozen=True)
class ShareResult(UploadResult):
    """An upload of a share that ended in the commit: also the nodes the commit holds."""

    nodes: tuple[str, ...] = ()


class NotCommitted(TransientError):
    """The part is written; the step waits for other nodes' parts (or for the coordinator)."""

    def __init__(self, step: int, plan: cc.Plan, states: dict[str, str]) -> None:
        why = "; ".join(plan.problems[:3]) or "waiting for the coordinator to commit"
        super().__init__(f"step {step} not committed yet: {why}")
        self.step = step
        self.missing_nodes = list(plan.missing_nodes)
        self.states = states


def upload_share(backend: Backend, root_name: str, objects_dir: Path, manifest: Manifest,
                 share: Share, now: float, progress: Progress | None = None,
                 concurrency: int = 4) -> ShareResult:
    """Send this node's objects, write its part, commit when the parts cover the save.
    Returns once the step is committed with this node's part; NotCommitted while it waits;
    PermanentError when the step was committed without this node's files of this save."""
    require_create_only(backend, root_name)
    earlier = [p for p in read_parts(backend, root_name, manifest.step) if p.node == share.node]
    part = part_of(manifest, share, earlier)
    sent, skipped = _send(backend, root_name, objects_dir, manifest, part, concurrency,
                          progress)
    _write_part(backend, root_name, manifest.step, part)
    committed = read_commit(backend, root_name, manifest.step)
    latest = False
    if committed is None:
        committed = _try_commit(backend, root_name, manifest, share, part, now)
        latest = advance_latest(backend, root_name, manifest.step)
    if (share.node, part.attempt) not in {(n, a) for n, a, _r in committed.nodes}:
        raise PermanentError(
            f"step {manifest.step} is committed without this node's files of this save"
            f" ({part.name}); the committed nodes: {[f'{n}.{a}' for n, a, _ in committed.nodes]}")
    get_logger().info("part_committed", root=root_name, step=manifest.step, part=part.name)
    return ShareResult(sent_bytes=sent, skipped_objects=skipped,
                       uploaded_objects=len(manifest.files) - skipped, latest_updated=latest,
                       nodes=tuple(n for n, _a, _r in committed.nodes))


def part_of(manifest: Manifest, share: Share, earlier: Sequence[cc.Part] = ()) -> cc.Part:
    """This node's part: its files under `<node>.<attempt>/`, the attempt from their stats. A
    file this node already sent unchanged in an earlier part of the step (the same path, size,
    hash, codec and mtime: a share that grew, e.g. the coordinator's shard before `.metadata`
    came) keeps that part's key, so it is not sent twice."""
    stats = [(f.path, f.size, int(share.mtimes[f.path] * 1e9)) for f in manifest.files]
    attempt = cc.attempt_id(stats)
    sent = {(pf.path, pf.size, pf.hash, pf.codec, pf.stored_size, pf.mtime): pf.key
            for p in earlier for pf in p.files}
    files = []
    for f in manifest.files:
        mtime = share.mtimes[f.path]
        key = sent.get((f.path, f.size, f.hash, f.codec, f.stored_size, mtime),
                       f"{share.node}.{attempt}/{f.key}")
        files.append(cc.PartFile(path=f.path, size=f.size, mtime=mtime, hash=f.hash,
                                 hash_alg=f.hash_alg, codec=f.codec,
                                 stored_size=f.stored_size, key=key))
    return cc.Part(share.node, attempt, manifest.layout, tuple(files), share.record)


# -- the probe -------------------------------------------------------------------------------

_PROBED: dict[tuple[str, str], str] = {}  # (url, root) -> "" (enforced) or why not
_PROBE_LOCK = threading.Lock()


def require_create_only(backend: Backend, root_name: str) -> None:
    """Once per process and root: write a probe key create-only twice; a store that accepts
    the second write ignores conditional writes, and the root refuses to commit."""
    with _PROBE_LOCK:
        why = _PROBED.get((backend.url, root_name))
        if why is None:
            why = _probe(backend, root_name)
            _PROBED[(backend.url, root_name)] = why
    if why:
        raise PermanentError(why)


def _probe(backend: Backend, root_name: str) -> str:
    key = f"{root_name}/{PROBE_DIR}/{uuid.uuid4().hex}"
    backend.put(key, b"probe\n", create_only=True)
    try:
        backend.put(key, b"again\n", create_only=True)
        why = (f"{backend.url} accepted a second create-only write of {key}: it ignores"
               " conditional writes, so this multi-node root refuses to commit")
    except ObjectExists:
        why = ""
    try:
        backend.delete(key)
    except StorageError as exc:
        get_logger().warning("probe_not_deleted", key=key, error=str(exc))
    return why


# -- sending ---------------------------------------------------------------------------------


def _send(backend: Backend, root_name: str, objects_dir: Path, manifest: Manifest,
          part: cc.Part, concurrency: int, progress: Progress | None) -> tuple[int, int]:
    """Put each object not already under its attempt-unique key (keys are never reused for
    other bytes, and puts are atomic: an object of the right size there is this one)."""
    prefix = step_prefix(root_name, manifest.step)
    there = step_objects(backend, root_name, manifest.step)
    todo: list[tuple[StoredFile, str]] = []
    skipped = 0
    for f, pf in zip(manifest.files, part.files, strict=True):
        meta = there.get(pf.key)
        if meta is not None and meta.size == f.stored_size:
            skipped += 1
            if progress:
                progress(f.stored_size)
        else:
            todo.append((f, pf.key))

    def one(item: tuple[StoredFile, str]) -> ObjectMeta:
        f, key = item
        path = fileio.safe_join(objects_dir, f.key)
        with open(path, "rb") as src:
            meta = backend.put(f"{prefix}/{key}", src, f.stored_size)
        if meta.size != f.stored_size:
            raise TransientError(f"{key}: {meta.size} bytes stored, {f.stored_size} sent")
        if progress:
            progress(f.stored_size)
        return meta

    with ThreadPoolExecutor(max(1, min(concurrency, len(todo) or 1)), "ckptd-part") as pool:
        list(pool.map(one, todo))
    return sum(f.stored_size for f, _k in todo), skipped


def _write_part(backend: Backend, root_name: str, step: int, part: cc.Part) -> None:
    key = f"{step_prefix(root_name, step)}/{cc.PARTS_DIR}/{part.name}.json"
    try:
        backend.put(key, part.to_bytes(), create_only=True)
    except ObjectExists:
        try:
            there = cc.parse_part(backend.get_bytes(key, cc.MAX_PART_BYTES), key)
        except (BadPart, CorruptData) as exc:
            raise PermanentError(f"{key} exists and is not this part ({exc})") from None
        if (there.files, there.record) != (part.files, part.record):
            raise PermanentError(f"{key} exists with other content") from None


# -- the commit ------------------------------------------------------------------------------


def read_commit(backend: Backend, root_name: str, step: int) -> Manifest | None:
    try:
        return read_manifest(backend, root_name, step)
    except ObjectNotFound:
        return None
    except CorruptData as exc:
        raise PermanentError(f"step {step}: unreadable commit ({exc})") from None


class _PartCache:
    """Parsed parts by (url, key), least recently used dropped first: parts never change, but
    a bucket may hold any number of them, so at most `entries` parts and `size` bytes (of
    their objects) are kept."""

    def __init__(self, entries: int = 4096, size: int = 64 << 20) -> None:
        self.entries, self.size = entries, size
        self._items: OrderedDict[tuple[str, str], tuple[cc.Part, int]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, key: tuple[str, str]) -> cc.Part | None:
        with self._lock:
            item = self._items.get(key)
            if item is None:
                return None
            self._items.move_to_end(key)
            return item[0]

    def put(self, key: tuple[str, str], part: cc.Part, nbytes: int) -> None:
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self._bytes -= old[1]
            self._items[key] = (part, nbytes)
            self._bytes += nbytes
            while self._items and (len(self._items) > self.entries or self._bytes > self.size):
                _k, (_p, n) = self._items.popitem(last=False)
                self._bytes -= n

    def __len__(self) -> int:
        return len(self._items)

    @property
    def held_bytes(self) -> int:
        return self._bytes


_PARTS = _PartCache()


def read_parts(backend: Backend, root_name: str, step: int) -> list[cc.Part]:
    """Every part written at the step (any node, any attempt); unreadable ones (over
    `inputs.PART`'s cap, not strict JSON, malformed) are logged and left out (they can cover
    nothing)."""
    prefix = f"{step_prefix(root_name, step)}/{cc.PARTS_DIR}/"
    out = []
    for meta in list(backend.list(prefix))[:MAX_PARTS]:
        part = _PARTS.get((backend.url, meta.key))
        if part is None:
            if meta.size > cc.MAX_PART_BYTES:
                get_logger().warning("part_unreadable", key=meta.key, error="too large")
                continue
            try:
                data = backend.get_bytes(meta.key, cc.MAX_PART_BYTES)
                part = cc.parse_part(data, meta.key, meta.mtime)
            except (BadPart, CorruptData, ObjectNotFound) as exc:
                get_logger().warning("part_unreadable", key=meta.key, error=str(exc))
                continue
            _PARTS.put((backend.url, meta.key), part, len(data))
        out.append(part)
    return out


def read_confirms(backend: Backend, root_name: str, step: int) -> dict[str, frozenset[str]]:
    """The confirmations written at the step (`cc.parse_confirms`; one LIST, no reads)."""
    prefix = f"{step_prefix(root_name, step)}/{cc.CONFIRMS_DIR}/"
    keys = [m.key[len(prefix):] for m in islice(backend.list(prefix), MAX_PARTS)]
    return cc.parse_confirms(keys)


def _confirm(backend: Backend, root_name: str, step: int, coord: cc.Part, part: cc.Part,
             share: Share, confirmed: Mapping[str, frozenset[str]]) -> None:
    """Confirm this node's part for the save of `coord`'s record: only once the record was
    seen (read from the store before this is called) and the files are found unchanged
    after that. The record is written after every rank's files of its save (DCP, native),
    so files still unchanged after it are that save's files, never an earlier attempt's:
    a part of a crashed attempt whose files a re-save has rewritten is never confirmed,
    however the nodes' uploads are timed."""
    if part.name in confirmed.get(coord.name, ()):
        return
    if not share.current():
        raise ShareChanged(f"the files of step {step} changed since they were validated;"
                           " rescanning")
    key = f"{step_prefix(root_name, step)}/{cc.confirm_key(coord, part)}"
    body = json.dumps({"format": cc.CONFIRM_FORMAT, "node": part.node,
                       "attempt": part.attempt, "for": coord.name}).encode() + b"\n"
    try:
        backend.put(key, body, create_only=True)
    except ObjectExists:
        pass  # confirmed by an earlier look: the key alone says it
    get_logger().info("part_confirmed", root=root_name, step=step, part=part.name,
                      coordinator=coord.name)


def _try_commit(backend: Backend, root_name: str, manifest: Manifest, share: Share,
                part: cc.Part, now: float) -> Manifest:
    parts = read_parts(backend, root_name, manifest.step)
    confirmed = read_confirms(backend, root_name, manifest.step)
    coord = cc.coordinator(parts)
    if coord is not None and coord.node != share.node:
        _confirm(backend, root_name, manifest.step, coord, part, share, confirmed)
        confirmed = {**confirmed, coord.name: confirmed.get(coord.name, frozenset()) | {
            part.name}}
    plan = cc.choose(parts, share.known_nodes, confirmed)
    if not cc.may_commit(plan, share.node, now, share.commit_timeout):
        raise NotCommitted(manifest.step, plan, cc.node_states(parts, None, share.known_nodes))
    if not share.current():
        raise ShareChanged(f"the files of step {manifest.step} changed since they were"
                           " validated; rescanning")
    coord = plan.chosen[0]
    commit = Manifest(
        root=root_name, step=manifest.step, layout=coord.layout,
        files=tuple(StoredFile(path=f.path, size=f.size, hash=f.hash, hash_alg=f.hash_alg,
                               codec=f.codec, stored_size=f.stored_size, key=f.key)
                    for f in plan.files),
        metrics=dict(manifest.metrics) if coord.node == share.node else {},
        nodes=tuple((p.node, p.attempt, p.record.path if p.record else "")
                    for p in plan.chosen))
    try:
        backend.put(manifest_key(root_name, manifest.step), commit.to_bytes(), create_only=True)
        get_logger().info("step_committed", root=root_name, step=manifest.step,
                          nodes=[p.name for p in plan.chosen], by=share.node)
        return commit
    except ObjectExists:
        there = read_commit(backend, root_name, manifest.step)
        if there is None:
            raise TransientError(f"step {manifest.step}: the commit vanished") from None
        return there
