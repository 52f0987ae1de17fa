"""The upload stage of a multi-node root (docs/MULTINODE.md): this node's objects of one save
attempt under `<node>.<attempt>/`, its part create-only, then the commit once the parts cover
the coordinator's save. Decisions are `ckptd.cluster.commit`'s; never imports the store.
"""

from __future__ import annotations

import json
import os
import posixpath
import re
import threading
import uuid
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import xxhash

from ckptd import fileio
from ckptd.backends.base import Backend, ObjectMeta
from ckptd.cluster import commit as cc
from ckptd.errors import (
    CorruptData,
    ObjectExists,
    ObjectNotFound,
    PermanentError,
    StorageError,
    TransientError,
    ValidationFailed,
)
from ckptd.formats.dcpmeta import parse_dcp_metadata
from ckptd.formats.torchhead import HEAD_BYTES, leading_fields
from ckptd.layouts import ranked
from ckptd.log import get_logger
from ckptd.manifest import Manifest, StoredFile, step_prefix
from ckptd.remote import advance_latest, manifest_key, read_manifest, step_objects
from ckptd.stages.upload import UploadResult

Progress = Callable[[int], None]
# A layout's commit record of this node's share (None: the share holds none).
RecordReader = Callable[[Path, Manifest, Mapping[str, float]], "cc.Record | None"]
PROBE_DIR = "_probe"
MAX_PARTS = 100_000


@dataclass(frozen=True)
class Share:
    """This node's side of a multi-node upload: who it is, its files' mtimes, its record."""

    node: str
    commit_timeout: float
    mtimes: Mapping[str, float]  # original path -> mtime (this node's clock)
    record: cc.Record | None = None
    known_nodes: frozenset[str] = frozenset()


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
    part = part_of(manifest, share)
    sent, skipped = _send(backend, root_name, objects_dir, manifest, part, concurrency,
                          progress)
    _write_part(backend, root_name, manifest.step, part)
    committed = read_commit(backend, root_name, manifest.step)
    latest = False
    if committed is None:
        committed = _try_commit(backend, root_name, manifest, share, now)
        latest = advance_latest(backend, root_name, manifest.step)
    if (share.node, part.attempt) not in {(n, a) for n, a, _r in committed.nodes}:
        raise PermanentError(
            f"step {manifest.step} is committed without this node's files of this save"
            f" ({part.name}); the committed nodes: {[f'{n}.{a}' for n, a, _ in committed.nodes]}")
    get_logger().info("part_committed", root=root_name, step=manifest.step, part=part.name)
    return ShareResult(sent_bytes=sent, skipped_objects=skipped,
                       uploaded_objects=len(manifest.files) - skipped, latest_updated=latest,
                       nodes=tuple(n for n, _a, _r in committed.nodes))


def part_of(manifest: Manifest, share: Share) -> cc.Part:
    """This node's part: its files under `<node>.<attempt>/`, the attempt from their stats."""
    stats = [(f.path, f.size, int(share.mtimes[f.path] * 1e9)) for f in manifest.files]
    attempt = cc.attempt_id(stats)
    files = tuple(cc.PartFile(path=f.path, size=f.size, mtime=share.mtimes[f.path], hash=f.hash,
                              hash_alg=f.hash_alg, codec=f.codec, stored_size=f.stored_size,
                              key=f"{share.node}.{attempt}/{f.key}")
                  for f in manifest.files)
    return cc.Part(share.node, attempt, manifest.layout, files, share.record)


def dcp_record(root_dir: Path, manifest: Manifest, mtimes: Mapping[str, float]
               ) -> cc.Record | None:
    """The commit record of a DCP share, when it holds `.metadata`: every storage file it
    references with the least size. The file is read again and must be the validated bytes."""
    metas = [f for f in manifest.files if posixpath.basename(f.path) == ".metadata"]
    if len(metas) != 1:
        return None
    f = metas[0]
    fd = fileio.open_beneath(root_dir, f.path)
    with os.fdopen(fd, "rb") as fh:
        data = fh.read(f.size + 1)
    if len(data) != f.size or xxhash.xxh3_128_hexdigest(data) != f.hash:
        raise TransientError(f"{f.path} changed since it was validated; rescanning")
    try:
        meta = parse_dcp_metadata(data, f.path)
    except ValidationFailed as exc:
        raise PermanentError(str(exc)) from None
    base = posixpath.dirname(f.path)
    expected = {posixpath.join(base, name): least for name, least in meta.references.items()}
    return cc.Record(path=f.path, mtime=mtimes[f.path], expected=expected)


_DS_MODEL = re.compile(r"^mp_rank_(\d+)_model_states\.pt$", re.ASCII)
_DS_OPTIM = re.compile(r"^(bf16_)?zero_pp_rank_\d+_mp_rank_\d+_optim_states\.pt$", re.ASCII)


def deepspeed_record(root_dir: Path, manifest: Manifest, mtimes: Mapping[str, float]
                     ) -> cc.Record | None:
    """The commit record of a DeepSpeed share that holds the model states (ZeRO-1/2): the
    model states of every model-parallel rank here and, when the save has optimizer shards,
    one per data-parallel rank as `dp_world_size` in the model states records."""
    names = {posixpath.basename(f.path): f.path for f in manifest.files}
    models = {int(m.group(1)): path for n, path in names.items() if (m := _DS_MODEL.match(n))}
    if not models:
        return None
    record = models[min(models)]
    fd = fileio.open_beneath(root_dir, record)
    with os.fdopen(fd, "rb") as fh:
        fields = leading_fields(fh.read(HEAD_BYTES), record) or {}
    dp = fields.get("dp_world_size")
    if type(dp) is not int or not 0 < dp <= 1 << 20:
        raise PermanentError(f"{record} records no dp_world_size: the optimizer shards this"
                             " save needs from other nodes are unknown")
    base = posixpath.dirname(record)
    expected = {path: 0 for path in models.values()}
    optims = [n for n in names if _DS_OPTIM.match(n)]
    prefix = "bf16_" if any(n.startswith("bf16_") for n in optims) else ""
    if optims:
        expected.update({posixpath.join(base, f"{prefix}zero_pp_rank_{r}_mp_rank_{mp:02d}"
                                              "_optim_states.pt"): 0
                         for r in range(dp) for mp in models})
    return cc.Record(path=record, mtime=mtimes[record], expected=expected, after=cc.SPREAD_S)


def ranked_record(root_dir: Path, manifest: Manifest, mtimes: Mapping[str, float],
                  world_size: int = 0) -> cc.Record | None:
    """The commit record of a `ranked` share that holds `meta_<N>.json` (the coordinator's):
    `model_<N>.pt`, the meta and `optim_<N>_rank<R>.pt` for every rank below the world_size
    the meta records (else the root's `world_size`). The meta is read again and must be the
    validated bytes. The ranks write their shards after it, so `after` is SPREAD_S."""
    metas = [f for f in manifest.files if ranked.is_meta(posixpath.basename(f.path))]
    if len(metas) != 1:
        return None
    f = metas[0]
    if f.size > ranked.META_MAX_BYTES:
        raise PermanentError(f"{f.path} has {f.size} bytes, more than the"
                             f" {ranked.META_MAX_BYTES} a commit record may")
    fd = fileio.open_beneath(root_dir, f.path)
    with os.fdopen(fd, "rb") as fh:
        data = fh.read(f.size + 1)
    if len(data) != f.size or xxhash.xxh3_128_hexdigest(data) != f.hash:
        raise TransientError(f"{f.path} changed since it was validated; rescanning")
    try:
        doc = json.loads(data.decode("utf-8"))
    except (ValueError, RecursionError):
        raise PermanentError(f"{f.path} is not valid JSON") from None
    if not isinstance(doc, dict):
        raise PermanentError(f"{f.path} is not a JSON object")
    recorded = doc.get("world_size")
    world = recorded if type(recorded) is int and 0 < recorded <= 1 << 20 else world_size
    if world <= 0:
        raise PermanentError(f"{f.path} records no world_size and the root sets none: the"
                             " optimizer shards this save needs from other nodes are unknown")
    base, name = posixpath.split(f.path)
    step = name.removeprefix("meta_").removesuffix(".json")
    expected = {posixpath.join(base, n): 0 for n in (
        f"model_{step}.pt", name, *(f"optim_{step}_rank{r}.pt" for r in range(world)))}
    return cc.Record(path=f.path, mtime=mtimes[f.path], expected=expected, after=cc.SPREAD_S)


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
        there = cc.parse_part(backend.get_bytes(key), key)
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


_PARTS: dict[tuple[str, str], cc.Part] = {}  # (url, key) -> part: parts never change
_PARTS_LOCK = threading.Lock()


def read_parts(backend: Backend, root_name: str, step: int) -> list[cc.Part]:
    """Every part written at the step (any node, any attempt); unreadable ones are logged
    and left out (they can cover nothing)."""
    prefix = f"{step_prefix(root_name, step)}/{cc.PARTS_DIR}/"
    out = []
    for meta in list(backend.list(prefix))[:MAX_PARTS]:
        with _PARTS_LOCK:
            part = _PARTS.get((backend.url, meta.key))
        if part is None:
            if meta.size > cc.MAX_PART_BYTES:
                get_logger().warning("part_unreadable", key=meta.key, error="too large")
                continue
            try:
                part = cc.parse_part(backend.get_bytes(meta.key), meta.key, meta.mtime)
            except (cc.BadPart, ObjectNotFound) as exc:
                get_logger().warning("part_unreadable", key=meta.key, error=str(exc))
                continue
            with _PARTS_LOCK:
                _PARTS[(backend.url, meta.key)] = part
        out.append(part)
    return out


def _try_commit(backend: Backend, root_name: str, manifest: Manifest, share: Share,
                now: float) -> Manifest:
    parts = read_parts(backend, root_name, manifest.step)
    plan = cc.choose(parts, share.known_nodes)
    if not cc.may_commit(plan, share.node, now, share.commit_timeout):
        raise NotCommitted(manifest.step, plan, cc.node_states(parts, None, share.known_nodes))
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
