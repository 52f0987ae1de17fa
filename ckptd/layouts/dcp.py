"""The `dcp` layout (torch.distributed.checkpoint, torchtitan, NeMo 2): `.metadata` + `*.distcp`.
DCP renames `.metadata` in last; complete when it parses, every file it references has the bytes
it references, and no data file that was there changed after ckptd last saw it change (a re-save
under way). A shard shorter than `.metadata` says, once every file has settled, was cut short:
the checkpoint is complete and invalid (`truncated`) rather than waiting for bytes that will not
come."""

from __future__ import annotations

import dataclasses
from typing import Any

from ckptd.errors import ValidationFailed
from ckptd.formats.dcpmeta import DcpMetadata, parse_once
from ckptd.layouts import common
from ckptd.model import Candidate, FileInfo, Reason, RootOptions, Snapshot

NAME = "dcp"
METADATA = ".metadata"
DATA_SUFFIX = ".distcp"


def is_dcp_file(rel: str) -> bool:
    name = common.name_of(rel)
    return name == METADATA or name.endswith(DATA_SUFFIX)


def dcp_dirs(files: list[str]) -> list[str]:
    """The directories among `files` that hold DCP metadata or data files."""
    return sorted({common.parent_of(f) for f in files
                   if is_dcp_file(f) and not common.is_temp_path(f)})


class DcpLayout:
    name = NAME

    def wants_content(self, rel: str) -> bool:
        return common.name_of(rel) == METADATA and not common.is_temp_path(rel)

    def candidates(
        self, snap: Snapshot, opts: RootOptions, now: float, claimed: frozenset[str]
    ) -> list[Candidate]:
        out: list[Candidate] = []
        tree = common.Tree(snap)
        for step_dir, (step, inner) in sorted(_step_dirs(snap, claimed).items()):
            files = common.members(tree.under(step_dir))
            if common.touches(files, claimed):
                continue
            if opts.multi_node:
                out.append(_node_candidate(snap, tree, step_dir, step, inner, files, opts, now))
            else:
                out.append(_candidate(snap, tree, step_dir, step, inner, files, opts, now))
        return out


def _step_dirs(snap: Snapshot, claimed: frozenset[str]) -> dict[str, tuple[int, list[str]]]:
    """step dir -> (step, DCP dirs inside it). The step dir is the DCP dir itself or its nearest
    ancestor whose name carries a step (NeMo 2 keeps DCP in `<name>-step=N-.../weights/`)."""
    found: dict[str, tuple[int, list[str]]] = {}
    unclaimed = [f for f in snap.files if f not in claimed]
    for dcp_dir in dcp_dirs(unclaimed):
        hit = common.nearest_dir(common.join(dcp_dir, METADATA), common.dir_step)
        if hit is None or common.is_temp_path(hit[0]):
            continue
        found.setdefault(hit[0], (hit[1], []))[1].append(dcp_dir)
    return found


def _candidate(snap: Snapshot, tree: common.Tree, step_dir: str, step: int, inner: list[str],
               files: list[str], opts: RootOptions, now: float) -> Candidate:
    problems = [common.open_problem(snap, files),
                common.unfinished_problem(snap, step_dir, tree.under(step_dir))]
    verdicts = [check_dir(snap, tree, dcp_dir) for dcp_dir in inner]
    problems += [p for v in verdicts for p in v.problems]
    return _made(snap, step_dir, step, files, problems, verdicts, opts, now)


def _made(snap: Snapshot, step_dir: str, step: int, files: list[str], problems: list[str],
          verdicts: list[DirVerdict], opts: RootOptions, now: float) -> Candidate:
    problems, extras = cut_short(snap, files, problems, verdicts, opts, now)
    return common.make(NAME, step, step_dir, files, problems, **extras)


def cut_short(snap: Snapshot, files: list[str], problems: list[str], verdicts: list[DirVerdict],
              opts: RootOptions, now: float) -> tuple[list[str], dict[str, Any]]:
    """The problems left and the candidate's extras. A checkpoint whose only problem is a shard
    short of what `.metadata` references, every file settled, is complete and `truncated`: DCP
    writes `.metadata` only after every shard is whole, so no more bytes are coming (a copy
    still under way keeps changing). The dcp and megatron (torch_dist) layouts share it."""
    extras = verdict_extras(verdicts)
    short = [s for v in verdicts for s in v.short]
    rest = [p for p in problems if p and p not in short]
    if short and not rest and not extras.get("invalid_reason") and not (
            common.settle_problem(snap, files, opts, now)):
        extras.update(invalid_reason=str(Reason.TRUNCATED),
                      invalid_message=f"{short[0]}, unchanged for {opts.settle:g}s after"
                      f" {METADATA} was written: cut short")
        problems = rest
    extras["truncated"] = any(s in problems for s in short)
    return problems, extras


def _node_candidate(snap: Snapshot, tree: common.Tree, step_dir: str, step: int,
                    inner: list[str], files: list[str], opts: RootOptions,
                    now: float) -> Candidate:
    """A multi-node root (docs/MULTINODE.md): this node's share of the save. A directory with
    `.metadata` (the coordinator's) is held to the rule for the files it names that are here;
    the others are expected from other nodes. Without it, the files once settled."""
    problems = [common.open_problem(snap, files),
                common.unfinished_problem(snap, step_dir, tree.under(step_dir))]
    verdicts = [check_dir(snap, tree, d, here_only=True) for d in inner
                if common.join(d, METADATA) in snap.files]
    problems += [p for v in verdicts for p in v.problems]
    if not verdicts:
        problems.append(common.settle_problem(snap, files, opts, now))
    cand = _made(snap, step_dir, step, files, problems, verdicts, opts, now)
    return dataclasses.replace(cand, node_share=True)


def verdict_extras(verdicts: list[DirVerdict]) -> dict[str, Any]:
    """Candidate fields from DCP verdicts: min sizes, and the first invalid metadata found."""
    extra: dict[str, Any] = {"min_sizes": {k: v for d in verdicts for k, v in d.min_sizes.items()}}
    invalid = [bad for d in verdicts for bad in d.invalid]
    if invalid:
        extra.update(invalid_reason=str(invalid[0][0]), invalid_message=invalid[0][1])
    return extra


class DirVerdict:
    """What the DCP rule says about one directory holding `.metadata` and data files."""

    def __init__(self) -> None:
        self.problems: list[str] = []
        self.short: list[str] = []  # those of `problems` that are a shard short of its bytes
        self.min_sizes: dict[str, int] = {}
        self.invalid: list[tuple[str, str]] = []  # (reason, message) from the parser


def check_dir(snap: Snapshot, tree: common.Tree, dcp_dir: str,
              here_only: bool = False) -> DirVerdict:
    """Apply the DCP commit rule to one directory (also used by the megatron layout).
    `here_only`: referenced files absent here are another node's (a multi-node root)."""
    verdict = DirVerdict()
    meta_rel = common.join(dcp_dir, METADATA)
    meta = snap.files.get(meta_rel)
    if meta is None:
        verdict.problems.append(f"{meta_rel} (written last)")
        return verdict
    newer = [f for f in _data_files(tree, dcp_dir) if _changed_since(snap.files[f], meta)]
    if newer:
        verdict.problems.append(f"re-save in progress: {newer[0]} changed after {meta_rel}")
        return verdict
    data = snap.contents.get(meta_rel)
    if data is None:
        verdict.problems.append(f"{meta_rel} to be readable")
        return verdict
    _check_references(snap, dcp_dir, meta_rel, data, verdict, here_only)
    return verdict


def _changed_since(data: FileInfo, meta: FileInfo) -> bool:
    """A shard of the committed save that changed after ckptd last saw `.metadata` change: a
    re-save writing over the shards while the old `.metadata` still stands. A shard of the
    committed save was there when ckptd saw the metadata, and was then no newer than it. Judged
    by what ckptd observed, not by the mtimes alone: a `cp -r` gives every file a new mtime in
    copy order, and a shard that first appeared after the metadata, or was first seen newer
    than it (a copy still going), is no re-save; its bytes are held to what `.metadata`
    references."""
    committed = data.first_mtime is None or data.first_mtime <= meta.mtime
    return committed and data.first_seen <= meta.changed_at < data.changed_at


def _data_files(tree: common.Tree, dcp_dir: str) -> list[str]:
    return [f for f in tree.children(dcp_dir) if f.endswith(DATA_SUFFIX)
            and not common.is_temp_path(f)]


def _parsed(data: bytes, meta_rel: str) -> DcpMetadata | ValidationFailed:
    """One parse per `.metadata` content (`dcpmeta.parse_once`): a rescan (every few seconds
    while a root settles) and the validation after it never parse an unchanged file again."""
    try:
        return parse_once(data, meta_rel)
    except ValidationFailed as exc:
        return exc


def _check_references(snap: Snapshot, dcp_dir: str, meta_rel: str, data: bytes,
                      verdict: DirVerdict, here_only: bool = False) -> None:
    parsed = _parsed(data, meta_rel)
    if isinstance(parsed, ValidationFailed):
        verdict.invalid.append((parsed.reason, parsed.message))
        return
    refs = parsed.references
    for name, size in sorted(refs.items()):
        rel = common.join(dcp_dir, name)
        info = snap.files.get(rel)
        if info is None and here_only:
            continue
        if info is None:
            verdict.problems.append(f"{rel} (referenced by {METADATA})")
        elif info.size < size:
            verdict.problems.append(f"{rel} to reach {size} bytes (has {info.size})")
            verdict.short.append(verdict.problems[-1])
        verdict.min_sizes[rel] = size


LAYOUT = DcpLayout()
