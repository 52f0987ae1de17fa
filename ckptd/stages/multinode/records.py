"""The commit records of multi-node shares (docs/MULTINODE.md): per layout, read from the
coordinator's record file (read again beneath the root; it must still be the validated bytes),
the expected set of the save it commits. A share without the record gives None."""

from __future__ import annotations

import os
import posixpath
import re
from collections.abc import Callable, Mapping
from functools import partial
from pathlib import Path

import xxhash

from ckptd import fileio, inputs
from ckptd.cluster import commit as cc
from ckptd.errors import BadInput, PermanentError, TransientError, ValidationFailed
from ckptd.formats.dcpmeta import parse_once
from ckptd.formats.torchhead import HEAD_BYTES, leading_fields
from ckptd.layouts import dcp, deepspeed, megatron, native, ranked
from ckptd.remote.manifest import Manifest, StoredFile

RecordReader = Callable[[Path, Manifest, Mapping[str, float]], "cc.CommitRecord | None"]


def reader_for(layout: str, world_size: int = 0) -> RecordReader | None:
    """How a multi-node share of a `layout` save finds its commit record: the one table of
    the layouts a multi-node root can commit; None for the others. `world_size` is the
    root's (0: none set)."""
    readers: dict[str, RecordReader] = {
        dcp.NAME: dcp_record, megatron.NAME: megatron_record,
        deepspeed.NAME: deepspeed_record, native.NAME: native_record,
        ranked.NAME: partial(ranked_record, world_size=world_size)}
    return readers.get(layout)


def dcp_record(root_dir: Path, manifest: Manifest, mtimes: Mapping[str, float]
               ) -> cc.CommitRecord | None:
    """The commit record of a DCP share, when it holds `.metadata`: every storage file it
    references with the least size. The file is read again and must be the validated bytes."""
    f = _one_file(manifest, lambda name: name == ".metadata")
    if f is None:
        return None
    data = _validated_bytes(root_dir, f.path, f.size, f.hash)
    try:
        meta = parse_once(data, f.path)
    except ValidationFailed as exc:
        raise PermanentError(str(exc)) from None
    base = posixpath.dirname(f.path)
    expected = {posixpath.join(base, name): least for name, least in meta.references.items()}
    return cc.CommitRecord(path=f.path, mtime=mtimes[f.path], expected=expected)


def megatron_record(root_dir: Path, manifest: Manifest, mtimes: Mapping[str, float]
                    ) -> cc.CommitRecord | None:
    """Megatron's torch_dist save is DCP's (`.metadata` in `iter_N/`). Its legacy format
    (`mp_rank_XX/model_optim_rng.pt`) records the parallel sizes only in the pickled `args`:
    no expected set can be read, so it is refused rather than left waiting."""
    if any(posixpath.basename(f.path) == "model_optim_rng.pt" for f in manifest.files):
        raise PermanentError("Megatron's legacy format (mp_rank_XX/model_optim_rng.pt) has no"
                             " commit record a multi-node root understands; use nodes = 1")
    return dcp_record(root_dir, manifest, mtimes)


def native_record(root_dir: Path, manifest: Manifest, mtimes: Mapping[str, float]
                  ) -> cc.CommitRecord | None:
    """The commit record of a native share that holds `meta.json` (rank 0's node of a
    `node_local` save): every file it lists, at its listed size. Written after every rank's
    files (the ranks' write results are gathered first), like DCP's `.metadata`."""
    f = _one_file(manifest, lambda name: name == "meta.json")
    if f is None:
        return None
    if f.size > inputs.ROOT_META.cap:
        raise PermanentError(f"{f.path} has {f.size} bytes, over the {inputs.ROOT_META.cap}"
                             " a metadata file may")
    data = _validated_bytes(root_dir, f.path, f.size, f.hash)
    try:
        listing = inputs.loads(data, f.path, nan=True).get("files")
        base = posixpath.dirname(f.path)
        expected = {posixpath.join(base, e["path"]): inputs.check_int(e["size"], e["path"])
                    for e in listing}
    except (BadInput, ValueError, TypeError, KeyError, AttributeError):
        raise PermanentError(f"{f.path}: no file listing the commit can read") from None
    return cc.CommitRecord(path=f.path, mtime=mtimes[f.path], expected=expected, exact=True)


def _one_file(manifest: Manifest, named: Callable[[str], bool]) -> StoredFile | None:
    """The share's one record file (by its name), or None (none, or several: no record)."""
    found = [f for f in manifest.files if named(posixpath.basename(f.path))]
    return found[0] if len(found) == 1 else None


def _validated_bytes(root_dir: Path, path: str, size: int, digest: str) -> bytes:
    """A record file read again beneath the root; it must still be the validated bytes."""
    fd = fileio.open_beneath(root_dir, path)
    with os.fdopen(fd, "rb") as fh:
        data = fh.read(size + 1)
    if len(data) != size or xxhash.xxh3_128_hexdigest(data) != digest:
        raise TransientError(f"{path} changed since it was validated; rescanning")
    return data


_DS_MODEL = re.compile(r"^mp_rank_(\d+)_model_states\.pt$", re.ASCII)
_DS_ZERO3 = re.compile(r"^zero_pp_rank_0_mp_rank_(\d+)_model_states\.pt$", re.ASCII)
_DS_OPTIM = re.compile(r"^(bf16_)?zero_pp_rank_\d+_mp_rank_\d+_optim_states\.pt$", re.ASCII)


def deepspeed_record(root_dir: Path, manifest: Manifest, mtimes: Mapping[str, float]
                     ) -> cc.CommitRecord | None:
    """The commit record of a DeepSpeed share that holds the model states: ZeRO-1/2's
    `mp_rank_<MP>_model_states.pt` (every model-parallel rank's here) or ZeRO-3's data-parallel
    rank 0's `zero_pp_rank_0_mp_rank_<MP>_model_states.pt`. Expected: those, every
    data-parallel rank's ZeRO-3 model states (`dp_world_size` as the file records it) and,
    when the save has optimizer shards, one per data-parallel rank."""
    names = {posixpath.basename(f.path): f.path for f in manifest.files}
    models = {int(m.group(1)): path for n, path in names.items() if (m := _DS_MODEL.match(n))}
    zero3 = not models
    if zero3:
        models = {int(m.group(1)): path for n, path in names.items()
                  if (m := _DS_ZERO3.match(n))}
    if not models:
        return None
    record = models[min(models)]
    fd = fileio.open_beneath(root_dir, record)
    with os.fdopen(fd, "rb") as fh:
        fields = leading_fields(fh.read(HEAD_BYTES), record) or {}
    dp = fields.get("dp_world_size")
    if type(dp) is not int or not 0 < dp <= 1 << 20:
        raise PermanentError(f"{record} records no dp_world_size: the shards this save needs"
                             " from other nodes are unknown")
    base = posixpath.dirname(record)
    expected = {path: 0 for path in models.values()}
    if zero3:
        expected.update({posixpath.join(base, f"zero_pp_rank_{r}_mp_rank_{mp:02d}"
                                              "_model_states.pt"): 0
                         for r in range(dp) for mp in models})
    optims = [n for n in names if _DS_OPTIM.match(n)]
    prefix = "bf16_" if any(n.startswith("bf16_") for n in optims) else ""
    if optims:
        expected.update({posixpath.join(base, f"{prefix}zero_pp_rank_{r}_mp_rank_{mp:02d}"
                                              "_optim_states.pt"): 0
                         for r in range(dp) for mp in models})
    return cc.CommitRecord(path=record, mtime=mtimes[record], expected=expected, after=cc.SPREAD_S)


def ranked_record(root_dir: Path, manifest: Manifest, mtimes: Mapping[str, float],
                  world_size: int = 0) -> cc.CommitRecord | None:
    """The commit record of a `ranked` share that holds `meta_<N>.json` (the coordinator's):
    `model_<N>.pt`, the meta and `optim_<N>_rank<R>.pt` for every rank below the root's
    `world_size` (else the one the meta records), the order the single-node rule uses. The
    meta is read again and must be the validated bytes. The ranks write their shards after
    it, so `after` is SPREAD_S."""
    f = _one_file(manifest, ranked.is_meta)
    if f is None:
        return None
    if f.size > ranked.META_MAX_BYTES:
        raise PermanentError(f"{f.path} has {f.size} bytes, more than the"
                             f" {ranked.META_MAX_BYTES} a commit record may")
    data = _validated_bytes(root_dir, f.path, f.size, f.hash)
    try:
        doc = inputs.loads(data, f.path, nan=True)
    except BadInput as exc:
        raise PermanentError(f"{f.path} is not valid JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise PermanentError(f"{f.path} is not a JSON object")
    recorded = doc.get("world_size")
    world = world_size or (recorded if type(recorded) is int and 0 < recorded <= 1 << 20
                           else 0)  # the root's, else the meta's, as on one node
    if world <= 0:
        raise PermanentError(f"{f.path} records no world_size and the root sets none: the"
                             " optimizer shards this save needs from other nodes are unknown")
    base, name = posixpath.split(f.path)
    step = name.removeprefix("meta_").removesuffix(".json")
    expected = {posixpath.join(base, n): 0 for n in (
        f"model_{step}.pt", name, *(f"optim_{step}_rank{r}.pt" for r in range(world)))}
    return cc.CommitRecord(path=f.path, mtime=mtimes[f.path], expected=expected, after=cc.SPREAD_S)
