"""The `native` layout written by `ckptd.torch.save`: `step-<N>/` with `meta.json` and files.
Written as `step-<N>.tmp/` and renamed last; complete when every file `meta.json` lists exists
with its listed size. Pure: reads only the snapshot."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any

from ckptd import inputs
from ckptd.errors import BadInput
from ckptd.layouts import common
from ckptd.model import Candidate, Reason, RootOptions, Snapshot

NAME = "native"
META = "meta.json"
FORMAT_PREFIX = "ckptd-native/"
_STEP_DIR = re.compile(r"^step-(\d+)$", re.ASCII)
# The files `ckptd.torch.save` writes (a node's share holds some of them and no meta.json).
_FILE = re.compile(r"^((model|ema|scheduler|scaler|extra)\.pt|(optim|rng)\.rank\d+\.pt)$",
                   re.ASCII)


def step_of_dir(name: str) -> int | None:
    m = _STEP_DIR.match(name)
    return int(m.group(1)) if m else None


@dataclass(frozen=True)
class _Meta:
    sizes: dict[str, int]  # root-relative path -> listed size
    metrics: dict[str, float]


class NativeLayout:
    """`with_meta` finds committed dirs; `without_meta` reports dirs lacking `meta.json`.

    `detect` runs the two halves at different priorities: a `step-<N>/` dir without
    `meta.json` is offered to every other layout first (torchtitan writes DCP into `step-<N>/`).
    """

    name = NAME

    def __init__(self, with_meta: bool = True, without_meta: bool = True) -> None:
        self.with_meta = with_meta
        self.without_meta = without_meta

    def wants_content(self, rel: str) -> bool:
        parent = common.parent_of(rel)
        return (common.name_of(rel) == META and step_of_dir(common.name_of(parent)) is not None
                and not common.is_temp_path(rel))

    def candidates(
        self, snap: Snapshot, opts: RootOptions, now: float, claimed: frozenset[str]
    ) -> list[Candidate]:
        out: list[Candidate] = []
        for directory, (step, files) in sorted(common.group_dirs(snap, step_of_dir).items()):
            mine = common.members(files)
            if not mine or common.touches(mine, claimed):
                continue
            has_meta = common.join(directory, META) in snap.files
            if has_meta and self.with_meta:
                out.append(_committed(snap, directory, step, mine, files, opts.multi_node))
            elif not has_meta and self.without_meta:
                out.append(_without_meta(snap, opts, now, directory, step, mine, files))
        return out


def _without_meta(snap: Snapshot, opts: RootOptions, now: float, directory: str, step: int,
                  files: list[str], under: list[str]) -> Candidate:
    """Incomplete until meta.json comes; on a multi-node root, files that are all the
    writer's own names are a node's share once settled (node_local saves: rank 0's node alone
    writes meta.json, docs/MULTINODE.md)."""
    if not (opts.multi_node and all(_FILE.match(common.name_of(f)) for f in files)):
        return common.make(NAME, step, directory, files, [f"{META} (written last)"])
    problems = [common.open_problem(snap, files),
                common.unfinished_problem(snap, directory, under),
                common.settle_problem(snap, files, opts, now)]
    return dataclasses.replace(common.make(NAME, step, directory, files, problems),
                               node_share=True)


def _committed(snap: Snapshot, directory: str, step: int, files: list[str],
               under: list[str], multi_node: bool = False) -> Candidate:
    """`multi_node`: the coordinator's share; files meta.json lists that are not here are
    other nodes' (the commit, not this node, requires them)."""
    meta_rel = common.join(directory, META)
    problems = [common.open_problem(snap, files), common.unfinished_problem(snap, directory, under)]
    if bad := common.bad_content(snap, meta_rel):
        return common.make(NAME, step, directory, files, problems,
                           invalid_reason=str(Reason.BAD_METADATA), invalid_message=bad)
    if meta_rel not in snap.contents:
        problems.append(f"{meta_rel} to be readable")
        return common.make(NAME, step, directory, files, problems)
    try:
        meta = _parse(snap.contents[meta_rel], directory, step)
    except ValueError as exc:
        return common.make(NAME, step, directory, files, problems,
                           invalid_reason=str(Reason.BAD_METADATA),
                           invalid_message=f"{meta_rel}: {exc}")
    sizes = {rel: size for rel, size in meta.sizes.items()
             if not multi_node or rel in snap.files}
    problems.extend(_size_problems(snap, sizes))
    short = any(rel in snap.files and snap.files[rel].size != size for rel, size in sizes.items())
    cand = common.make(NAME, step, directory, files, problems, expected_sizes=sizes,
                       metrics=meta.metrics, truncated=short)
    return dataclasses.replace(cand, node_share=multi_node)


def _size_problems(snap: Snapshot, sizes: dict[str, int]) -> list[str]:
    out: list[str] = []
    for rel, size in sorted(sizes.items()):
        info = snap.files.get(rel)
        if info is None:
            out.append(f"{rel} (listed in {META})")
        elif info.size != size:
            out.append(f"{rel} to reach {size} bytes (has {info.size})")
    return out


def _parse(data: bytes, directory: str, step: int) -> _Meta:
    """The parts of `meta.json` the rule needs; ValueError names what is wrong."""
    obj = common.load_json(data)
    if not isinstance(obj, dict):
        raise ValueError("not a JSON object")
    fmt = obj.get("format")
    if not isinstance(fmt, str) or not fmt.startswith(FORMAT_PREFIX):
        raise ValueError(f"format {fmt!r} is not {FORMAT_PREFIX}*")
    listed_step = obj.get("step", step)
    if listed_step != step or isinstance(listed_step, bool):
        raise ValueError(f"step {listed_step!r} does not match directory step {step}")
    sizes = _listed_sizes(obj.get("files"), directory)
    return _Meta(sizes=sizes, metrics=common.numeric_metrics(obj.get("metrics")))


def _listed_sizes(listing: Any, directory: str) -> dict[str, int]:
    if not isinstance(listing, list):
        raise ValueError("'files' is not a list")
    sizes: dict[str, int] = {}
    for entry in listing:
        path = entry.get("path") if isinstance(entry, dict) else None
        size = entry.get("size") if isinstance(entry, dict) else None
        if not isinstance(path, str) or not _safe_relative(path):
            raise ValueError(f"bad file path {path!r}")
        try:
            sizes[common.join(directory, path)] = inputs.check_int(size, f"size of {path!r}")
        except BadInput as exc:
            raise ValueError(str(exc)) from None
    return sizes


def _safe_relative(path: str) -> bool:
    """A listed path must stay inside the step dir: no absolute path, no `..`, not meta.json."""
    if not path or path.startswith("/") or "\\" in path:
        return False
    parts = path.split("/")
    return all(p not in ("", ".", "..") for p in parts) and path != META


LAYOUT = NativeLayout()
