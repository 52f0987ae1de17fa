"""The `megatron` layout: `iter_<N:07d>/`, committed by `latest_checkpointed_iteration.txt`.
Rank 0 writes that tracker after every rank finished; complete when it names N or later and the
dir settled (plus, for torch_dist saves, megatron-core's `metadata.json` and the DCP rule)."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable

from ckptd.layouts import common, dcp
from ckptd.model import Candidate, RootOptions, Snapshot

NAME = "megatron"
TRACKER = "latest_checkpointed_iteration.txt"
_DIR = re.compile(r"^iter_(\d{7,})$", re.ASCII)
# Files that only Megatron puts in an iter dir: legacy per-rank dirs, torch_dist side files.
_TELLS = re.compile(r"^mp_rank_\d+(?:_\d+)*$", re.ASCII)
COMMON = "common.pt"  # megatron-core dist_checkpointing: rank 0 writes it first ...
CONFIG = "metadata.json"  # ... and this last, once every rank's sharded save is done
_TOP_TELLS = (CONFIG, COMMON)


def step_of_dir(name: str) -> int | None:
    m = _DIR.match(name)
    return int(m.group(1)) if m else None


class MegatronLayout:
    name = NAME

    def pointer_files(self, files: tuple[str, ...]) -> dict[str, bytes]:
        """Megatron-LM's tracker naming the checkpoint's iteration (`restored_tracker`)."""
        return restored_tracker(files)

    def wants_content(self, rel: str) -> bool:
        name = common.name_of(rel)
        return (name == TRACKER or dcp.LAYOUT.wants_content(rel)) and not common.is_temp_path(rel)

    def candidates(
        self, snap: Snapshot, opts: RootOptions, now: float, claimed: frozenset[str]
    ) -> list[Candidate]:
        out: list[Candidate] = []
        tree = common.Tree(snap)
        for directory, (step, under) in sorted(common.group_dirs(snap, step_of_dir).items()):
            files = common.members(under)
            if not files or common.touches(files, claimed) or not _is_megatron(snap, directory,
                                                                              files):
                continue
            out.append(_candidate(snap, tree, opts, now, directory, step, under, files))
        return out


def _is_megatron(snap: Snapshot, directory: str, files: list[str]) -> bool:
    """Claim an `iter_N` dir only with a Megatron sign, so a plain DCP dir named `iter_0000100`
    without a tracker stays with the dcp layout instead of waiting forever here."""
    if common.join(common.parent_of(directory), TRACKER) in snap.files:
        return True
    for f in files:
        rest = f[len(directory) + 1:].split("/")
        if (len(rest) > 1 and _TELLS.match(rest[0])) or (len(rest) == 1 and rest[0] in _TOP_TELLS):
            return True
    return False


def _candidate(snap: Snapshot, tree: common.Tree, opts: RootOptions, now: float,
               directory: str, step: int, under: list[str], files: list[str]) -> Candidate:
    problems = [common.unfinished_problem(snap, directory, under),
                _tracker_problem(snap, directory, step),
                _dist_problem(directory, files)]
    # torch_dist format; on a multi-node root the files .metadata names may be on other nodes
    verdicts = [dcp.check_dir(snap, tree, d, here_only=opts.multi_node)
                for d in dcp.dcp_dirs(files)]
    problems += [p for v in verdicts for p in v.problems]
    problems.append(common.settle_problem(snap, under, opts, now))
    problems, extras = dcp.cut_short(snap, under, problems, verdicts, opts, now)
    cand = common.make(NAME, step, directory, files, problems, **extras)
    return dataclasses.replace(cand, node_share=opts.multi_node)


def _dist_problem(directory: str, files: list[str]) -> str:
    """A megatron-core dist checkpoint (`common.pt`, written first) is whole only with its
    `metadata.json`, written after the sharded save: without it a save killed early (nothing
    but `common.pt`) would pass once the tracker names a later iteration."""
    if common.join(directory, COMMON) in files and common.join(directory, CONFIG) not in files:
        return f"{common.join(directory, CONFIG)} (written last by megatron-core)"
    return ""


def _tracker_problem(snap: Snapshot, directory: str, step: int) -> str:
    """The tracker sits in the save dir beside the iter dirs; "release" names no iteration."""
    return common.pointer_problem(
        snap, directory, TRACKER, str(step),
        lambda text: (text.isascii() and text.isdigit() and len(text) <= 19
                      and int(text) >= step))


def restored_tracker(paths: Iterable[str]) -> dict[str, bytes]:
    """The tracker a restore writes beside the restored `iter_N` dir (its path relative to the
    restore's target, and its bytes as Megatron-LM writes them: the number, no newline). The
    tracker belongs to no checkpoint, and the one on disk may name a later iteration: Megatron
    resumes from what it names, so a restored iteration needs its own."""
    for rel in paths:
        parts = rel.split("/")
        for i, part in enumerate(parts[:-1]):
            step = step_of_dir(part)
            if step is not None:
                return {common.join("/".join(parts[:i]), TRACKER): str(step).encode()}
    return {}


LAYOUT = MegatronLayout()
