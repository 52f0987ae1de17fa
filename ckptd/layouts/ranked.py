"""The `ranked` layout: `model_<N>.pt` once, `meta_<N>.json`, `optim_<N>_rank<R>.pt` per rank.
No commit marker: complete when model, meta and ranks 0..W-1 are present and settled (W from
the root's world_size, else meta's, else the contiguous ranks seen). On a multi-node root each
node's files of a step are its share (docs/MULTINODE.md). Pure: reads only the snapshot."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any

from ckptd.layouts import common
from ckptd.model import Candidate, Reason, RootOptions, Snapshot

NAME = "ranked"
_MODEL = re.compile(r"^model_(\d+)\.pt$", re.ASCII)
_META = re.compile(r"^meta_(\d+)\.json$", re.ASCII)
_OPTIM = re.compile(r"^optim_(\d+)_rank(\d+)\.pt$", re.ASCII)
# The most a `meta_<N>.json` may hold on a multi-node root: its commit record is read again
# whole at upload (ckptd.stages.multinode.records.ranked_record).
META_MAX_BYTES = 1 << 20


def is_meta(name: str) -> bool:
    """`meta_<N>.json`: the commit record of a ranked save split over nodes."""
    return _META.match(name) is not None


@dataclass
class _Group:
    model: str = ""
    meta: str = ""
    ranks: dict[int, str] = field(default_factory=dict)

    def files(self) -> list[str]:
        return sorted([f for f in (self.model, self.meta) if f] + list(self.ranks.values()))


class RankedLayout:
    name = NAME

    def wants_content(self, rel: str) -> bool:
        return bool(_META.match(common.name_of(rel))) and not common.is_temp_path(rel)

    def candidates(
        self, snap: Snapshot, opts: RootOptions, now: float, claimed: frozenset[str]
    ) -> list[Candidate]:
        groups = _groups(snap)
        # A lone `model_<N>.pt` is a single-file checkpoint, unless the dir saves ranked ones.
        ranked_dirs = {d for (d, _), g in groups.items() if g.meta or g.ranks}
        out: list[Candidate] = []
        for (directory, step), group in sorted(groups.items()):
            if directory not in ranked_dirs or common.touches(group.files(), claimed):
                continue
            if opts.multi_node:
                out.append(_node_share(snap, opts, now, directory, step, group))
            else:
                out.append(_candidate(snap, opts, now, directory, step, group))
        return out


def _groups(snap: Snapshot) -> dict[tuple[str, int], _Group]:
    groups: dict[tuple[str, int], _Group] = {}
    for rel in snap.files:
        name = common.name_of(rel)
        if not name.startswith(("model_", "meta_", "optim_")) or common.is_temp_path(rel):
            continue
        directory = common.parent_of(rel)
        if m := _MODEL.match(name):
            groups.setdefault((directory, int(m.group(1))), _Group()).model = rel
        elif m := _META.match(name):
            groups.setdefault((directory, int(m.group(1))), _Group()).meta = rel
        elif m := _OPTIM.match(name):
            groups.setdefault((directory, int(m.group(1))), _Group()).ranks[int(m.group(2))] = rel
    return groups


def _candidate(snap: Snapshot, opts: RootOptions, now: float, directory: str, step: int,
               group: _Group) -> Candidate:
    model = group.model or common.join(directory, f"model_{step}.pt")
    problems = [model] if not group.model else []
    if not group.meta:
        problems.append(common.join(directory, f"meta_{step}.json"))
    meta, bad = _meta(snap, group.meta)
    if group.meta and group.meta not in snap.contents and not opts.world_size and not bad:
        problems.append(f"{group.meta} to be readable")
    bad = bad or _ranks_problem(group, meta)
    if not bad:
        world = opts.world_size or _meta_world(meta) or 1 + max(group.ranks, default=-1)
        missing = common.missing_ranks(group.ranks, max(world, 1))
        if missing:
            more = world - sum(1 for r in group.ranks if r < world) - len(missing)
            problems.append(f"optimizer shards for ranks {', '.join(map(str, missing))}"
                            + (f" and {more} more" if more > 0 else ""))
    problems.append(common.unfinished_problem(snap, model))
    problems.append(common.settle_problem(snap, group.files(), opts, now))
    extra: dict[str, Any] = {"metrics": common.numeric_metrics(meta.get("metrics"))}
    if bad:
        extra.update(invalid_reason=str(Reason.BAD_METADATA), invalid_message=bad)
    return common.make(NAME, step, model, group.files(), problems, **extra)


def _node_share(snap: Snapshot, opts: RootOptions, now: float, directory: str, step: int,
                group: _Group) -> Candidate:
    """A multi-node root (docs/MULTINODE.md): this node's files of the step, once settled and
    closed. The coordinator writes the model and `meta_<N>.json` (the commit record): a share
    holding either holds both, and its meta must parse. Ranks not here are other nodes'. A
    share of ranks only is anchored at its lowest rank's file, which is on this node."""
    model = group.model or common.join(directory, f"model_{step}.pt")
    problems = [common.unfinished_problem(snap, model),
                common.settle_problem(snap, group.files(), opts, now)]
    extra: dict[str, Any] = {}
    anchor = model
    if not (group.model or group.meta):
        anchor = group.ranks[min(group.ranks)]
    else:
        if not group.model:
            problems.append(model)
        if not group.meta:
            problems.append(common.join(directory, f"meta_{step}.json"))
        meta, bad = _meta(snap, group.meta)
        size = snap.files[group.meta].size if group.meta else 0
        if size > META_MAX_BYTES:
            bad = f"{group.meta} has {size} bytes, more than the {META_MAX_BYTES} a record may"
        elif group.meta and group.meta not in snap.contents and not bad:
            problems.append(f"{group.meta} to be readable")
        bad = bad or _ranks_problem(group, meta)
        extra["metrics"] = common.numeric_metrics(meta.get("metrics"))
        if bad:
            extra.update(invalid_reason=str(Reason.BAD_METADATA), invalid_message=bad)
    cand = common.make(NAME, step, anchor, group.files(), problems, **extra)
    return dataclasses.replace(cand, node_share=True)


def _meta(snap: Snapshot, rel: str) -> tuple[dict[str, Any], str]:
    """meta_<N>.json as a dict, and why it is bad ("" when fine or not there yet)."""
    if bad := common.bad_content(snap, rel):
        return {}, bad
    if not rel or rel not in snap.contents:
        return {}, ""
    try:
        obj = common.load_json(snap.contents[rel], rel)
    except ValueError as exc:
        return {}, str(exc)
    return (obj, "") if isinstance(obj, dict) else ({}, f"{rel}: not a JSON object")


def _meta_world(meta: dict[str, Any]) -> int:
    w = meta.get("world_size")
    return w if isinstance(w, int) and not isinstance(w, bool) and w > 0 else 0


def _ranks_problem(group: _Group, meta: dict[str, Any]) -> str:
    """A world size in meta_<N>.json or a rank in a file name past MAX_RANKS: the step is
    invalid (bad_metadata), never expanded into a list of that many ranks."""
    top = max(group.ranks, default=0)
    return (common.rank_problem([_meta_world(meta)], f"{group.meta}: world_size")
            or common.rank_problem(group.ranks, f"{group.ranks.get(top, '')}: rank"))


LAYOUT = RankedLayout()
