"""The `deepspeed` layout: `global_step<N>/`, `*model_states.pt` and per-rank `*optim_states.pt`.
Rank 0 writes `latest` BEFORE the final barrier, so complete also needs every expected rank's
files, settled. Pure: reads only the snapshot."""

from __future__ import annotations

import re

from ckptd.layouts import common
from ckptd.model import Candidate, RootOptions, Snapshot

NAME = "deepspeed"
LATEST = "latest"
_DIR = re.compile(r"^global_step(\d+)$", re.ASCII)
# mp_rank_00_model_states.pt; ZeRO-3 writes one per data-parallel rank:
# zero_pp_rank_3_mp_rank_00_model_states.pt
_MODEL = re.compile(r"^(?:zero_pp_rank_(\d+)_)?mp_rank_(\d+)_model_states\.pt$", re.ASCII)
# [bf16_]zero_pp_rank_<dp>_mp_rank_<mp>_optim_states.pt
_OPTIM = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$", re.ASCII)

Cell = tuple[int, int]  # (data-parallel rank, model-parallel rank)


def step_of_dir(name: str) -> int | None:
    m = _DIR.match(name)
    return int(m.group(1)) if m else None


def step_of_tag(tag: str) -> int | None:
    return step_of_dir(tag) if step_of_dir(tag) is not None else common.dir_step(tag)


class DeepSpeedLayout:
    name = NAME

    def wants_content(self, rel: str) -> bool:
        return common.name_of(rel) == LATEST and not common.is_temp_path(rel)

    def candidates(
        self, snap: Snapshot, opts: RootOptions, now: float, claimed: frozenset[str]
    ) -> list[Candidate]:
        out: list[Candidate] = []
        groups = common.group_dirs(snap, step_of_dir)
        tops = {d: _top_names(d, under) for d, (_, under) in groups.items()}
        zero_dirs = {common.parent_of(d) for d, top in tops.items() if _cells(_OPTIM, top)}
        for directory, (step, under) in sorted(groups.items()):
            files, top = common.members(under), tops[directory]
            if not _is_deepspeed(top) or common.touches(files, claimed):
                continue
            expect_optim = common.parent_of(directory) in zero_dirs
            problems = [
                common.unfinished_problem(snap, directory, under),
                _latest_problem(snap, directory, step),
                *_rank_problems(top, opts.world_size, expect_optim),
                common.settle_problem(snap, under, opts, now),
            ]
            out.append(common.make(NAME, step, directory, files, problems))
        return out


def _top_names(directory: str, under: list[str]) -> list[str]:
    return [common.name_of(f) for f in common.members(under) if common.parent_of(f) == directory]


def _is_deepspeed(names: list[str]) -> bool:
    return any(_MODEL.match(n) or _OPTIM.match(n) for n in names)


def _latest_problem(snap: Snapshot, directory: str, step: int) -> str:
    """`latest` lives in the save dir, beside the tag dirs."""
    name = common.name_of(directory)

    def accepts(tag: str) -> bool:
        tag_step = step_of_tag(tag)
        return tag == name or (tag_step is not None and tag_step >= step)

    return common.pointer_problem(snap, directory, LATEST, name, accepts)


def _rank_problems(names: list[str], world_size: int, expect_optim: bool) -> list[str]:
    """Every (dp, mp) cell must have its optimizer states (and, for ZeRO-3, model states).

    Rank 0 writes its own optimizer file before `latest`, so a tag with no optimizer file at
    all is a ZeRO-0 save (optimizer inside the model states) unless its sibling tags have them.
    """
    optim = _cells(_OPTIM, names)
    zero3 = _cells(_MODEL, names, zero3=True)
    plain_mp = {int(m.group(2)) for n in names if (m := _MODEL.match(n)) and m.group(1) is None}
    mp_size = 1 + max([mp for _, mp in optim | zero3] + list(plain_mp), default=0)
    problems = _missing("model states for mp rank", plain_mp, mp_size) if plain_mp else []
    if not plain_mp and not zero3:
        problems.append("mp_rank_00_model_states.pt")
    dp_size = _dp_size(optim | zero3, mp_size, world_size)
    if dp_size is None:
        return [*problems, f"world_size {world_size} to be a multiple of {mp_size} mp ranks"]
    if optim or expect_optim:
        problems += _missing_cells("optimizer states", optim, dp_size, mp_size)
    if zero3:
        problems += _missing_cells("ZeRO-3 model states", zero3, dp_size, mp_size)
    return problems


def _cells(pattern: re.Pattern[str], names: list[str], zero3: bool = False) -> set[Cell]:
    out: set[Cell] = set()
    for n in names:
        m = pattern.match(n)
        if m and (not zero3 or m.group(1) is not None):
            out.add((int(m.group(1)), int(m.group(2))))
    return out


def _dp_size(cells: set[Cell], mp_size: int, world_size: int) -> int | None:
    """Data-parallel ranks expected: world_size / mp ranks when known, else the highest seen."""
    if world_size > 0:
        return world_size // mp_size if world_size % mp_size == 0 else None
    return 1 + max((dp for dp, _ in cells), default=0)


def _missing(what: str, have: set[int], size: int) -> list[str]:
    gone = [r for r in range(size) if r not in have]
    return [f"{what} {', '.join(map(str, gone))}"] if gone else []


def _missing_cells(what: str, have: set[Cell], dp_size: int, mp_size: int) -> list[str]:
    gone = [(dp, mp) for mp in range(mp_size) for dp in range(dp_size) if (dp, mp) not in have]
    if not gone:
        return []
    shown = ", ".join(f"dp {dp}/mp {mp}" for dp, mp in gone[:8])
    more = f" and {len(gone) - 8} more" if len(gone) > 8 else ""
    return [f"{what} for {shown}{more}"]


LAYOUT = DeepSpeedLayout()
