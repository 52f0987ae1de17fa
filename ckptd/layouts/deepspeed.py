"""The `deepspeed` layout: `global_step<N>/`, `*model_states.pt` and per-rank `*optim_states.pt`.
Rank 0 writes `latest` BEFORE the final barrier, so complete also needs every expected rank's
files, settled: as many data-parallel ranks as the model states record (`dp_world_size`, read
from the file's first bytes by the scanner), else the root's `world_size`, else those seen.
Pure: reads only the snapshot."""

from __future__ import annotations

import dataclasses
import itertools
import re
from collections.abc import Callable

from ckptd.layouts import common
from ckptd.model import Candidate, RankFiles, Reason, RootOptions, Snapshot

NAME = "deepspeed"
LATEST = "latest"
_DIR = re.compile(r"^global_step(\d+)$", re.ASCII)
# mp_rank_00_model_states.pt; ZeRO-3 writes one per data-parallel rank:
# zero_pp_rank_3_mp_rank_00_model_states.pt
_MODEL = re.compile(r"^(?:zero_pp_rank_(\d+)_)?mp_rank_(\d+)_model_states\.pt$", re.ASCII)
# [bf16_]zero_pp_rank_<dp>_mp_rank_<mp>_optim_states.pt
_OPTIM = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$", re.ASCII)
# Where DeepSpeed records the data-parallel size in every model states file (its engine's
# `_common_checkpoint_state`); one optimizer shard per rank of it under ZeRO.
DP_KEY = "dp_world_size"
MAX_RANKS = common.MAX_RANKS  # a recorded size beyond this is not a real job's: not trusted

# What DeepSpeed 0.19.8's ZeRO optimizer states pickle besides tensors, found by scanning files
# the library wrote (ZeRO-2, fp32/bf16/fp16, tests/frameworks/test_deepspeed.py). Each is
# rebuilt from plain data only: NEWOBJ (`cls.__new__`, object's own) then BUILD with a dict of
# numbers (no `__setstate__`, `__new__` or `__reduce__` of their own), or, for the enum, a
# lookup by value. None imports anything or runs code when loaded. ckptd never loads them; it
# only lets its pickle check accept these names in DeepSpeed checkpoints.
TRUSTED_GLOBALS = frozenset({
    # The static loss scaler (fp32/bf16): {"cur_scale": 1.0, "dynamic": False}.
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    # The fp16 loss scaler: its scale, window and hysteresis counters, and `dtype` (a torch
    # dtype, itself on torch's weights-only list).
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    # `zero_stage`: an int Enum, rebuilt as ZeroStageEnum(2).
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    # `param_slice_mappings`: a dataclass of two ints, {"numel": ..., "start": ...}.
    "deepspeed.utils.tensor_fragment.fragment_address",
})

Cell = tuple[int, int]  # (data-parallel rank, model-parallel rank)
_Namer = Callable[[int, int], str]  # a cell's file name


def step_of_dir(name: str) -> int | None:
    m = _DIR.match(name)
    return int(m.group(1)) if m else None


def step_of_tag(tag: str) -> int | None:
    return step_of_dir(tag) if step_of_dir(tag) is not None else common.dir_step(tag)


class DeepSpeedLayout:
    name = NAME
    trusted_globals = TRUSTED_GLOBALS

    def wants_content(self, rel: str) -> bool:
        return common.name_of(rel) == LATEST and not common.is_temp_path(rel)

    def wants_torch_fields(self, rel: str) -> bool:
        """Model states that record `dp_world_size`: mp ranks' files, ZeRO-3's rank 0's."""
        m = _MODEL.match(common.name_of(rel))
        return (m is not None and m.group(1) in (None, "0") and not common.is_temp_path(rel)
                and step_of_dir(common.name_of(common.parent_of(rel))) is not None)

    def pointer_files(self, files: tuple[str, ...]) -> dict[str, bytes]:
        """`latest` naming the checkpoint's tag, beside its tag directory, as rank 0 writes it."""
        for rel in files:
            directory = common.parent_of(rel)
            if (_MODEL.match(common.name_of(rel))
                    and step_of_dir(common.name_of(directory)) is not None):
                tag = common.name_of(directory)
                return {common.join(common.parent_of(directory), LATEST): tag.encode()}
        return {}

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
            if opts.multi_node:
                out.append(_node_share(snap, opts, now, directory, step, files, under, top))
                continue
            ranks = _Ranks(directory, top, common.parent_of(directory) in zero_dirs,
                           _recorded_dp(snap, directory, top))
            if bad := ranks.too_many(opts.world_size):
                out.append(common.make(NAME, step, directory, files, [],
                                       invalid_reason=str(Reason.BAD_METADATA),
                                       invalid_message=bad))
                continue
            problems = [
                common.unfinished_problem(snap, directory, under),
                _latest_problem(snap, directory, step),
                *ranks.problems(opts.world_size),
                common.settle_problem(snap, under, opts, now),
            ]
            out.append(common.make(NAME, step, directory, files, problems,
                                   rank_files=ranks.rank_files()))
        return out


def _node_share(snap: Snapshot, opts: RootOptions, now: float, directory: str, step: int,
                files: list[str], under: list[str], top: list[str]) -> Candidate:
    """A multi-node root (docs/MULTINODE.md): this node's files of the tag, once settled; the
    coordinator's (it holds the model states) also once `latest` names the tag. The other
    ranks' optimizer states are on other nodes: the commit, not this node, requires them."""
    problems = [common.unfinished_problem(snap, directory, under),
                common.settle_problem(snap, under, opts, now)]
    if any((m := _MODEL.match(n)) and m.group(1) in (None, "0") for n in top):
        # The coordinator: mp ranks' model states, or ZeRO-3's data-parallel rank 0's.
        problems.append(_latest_problem(snap, directory, step))
    cand = common.make(NAME, step, directory, files, problems)
    return dataclasses.replace(cand, node_share=True)


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


def _recorded_dp(snap: Snapshot, directory: str, names: list[str]) -> int | None:
    """`dp_world_size` as the model states record it, when the scanner could read it."""
    found = []
    for n in names:
        value = snap.torch_fields.get(common.join(directory, n), {}).get(DP_KEY)
        if type(value) is int and 0 < value <= MAX_RANKS:
            found.append(value)
    return max(found, default=None)


class _Ranks:
    """The per-rank files of one tag: which (dp, mp) cells are there, which are expected."""

    def __init__(self, directory: str, names: list[str], sibling_zero: bool,
                 recorded_dp: int | None) -> None:
        self.directory = directory
        self.optim = _cells(_OPTIM, names)
        self.zero3 = _cells(_MODEL, names, zero3=True)
        self.plain_mp = {int(m.group(2)) for n in names
                         if (m := _MODEL.match(n)) and m.group(1) is None}
        self.mp_size = 1 + max([mp for _, mp in self.optim | self.zero3] + list(self.plain_mp),
                               default=0)
        # Rank 0 writes its own optimizer file before `latest`, so a tag with no optimizer
        # file at all is a ZeRO-0 save (optimizer inside the model states) unless its sibling
        # tags have them.
        self.expect_optim = bool(self.optim) or sibling_zero
        self.recorded_dp = recorded_dp
        self.bf16 = any(n.startswith("bf16_") and _OPTIM.match(n) for n in names)

    def too_many(self, world_size: int) -> str:
        """A rank in a file name, or the ranks expected, past MAX_RANKS ("" when none): no
        real job's, and never expanded into a per-rank list."""
        cells = self.optim | self.zero3
        return (common.rank_problem([mp for _, mp in cells] + list(self.plain_mp),
                                    f"{self.directory}: mp rank")
                or common.rank_problem([dp for dp, _ in cells], f"{self.directory}: dp rank")
                or common.rank_problem([world_size], f"{self.directory}: world_size"))

    def problems(self, world_size: int) -> list[str]:
        """Every (dp, mp) cell must have its optimizer states (and, for ZeRO-3, model states)."""
        problems = (_missing("model states for mp rank", self.plain_mp, self.mp_size)
                    if self.plain_mp else [])
        if not self.plain_mp and not self.zero3:
            problems.append("mp_rank_00_model_states.pt")
        dp_size = self.dp_size(world_size)
        if dp_size is None:
            return [*problems, f"world_size {world_size} to be a multiple of {self.mp_size} mp"
                               " ranks"]
        if self.expect_optim:
            problems += self._missing_cells("optimizer states", self.optim, dp_size,
                                            self._optim_name)
        if self.zero3:
            problems += self._missing_cells("ZeRO-3 model states", self.zero3, dp_size,
                                            _zero3_model_name)
        return problems

    def dp_size(self, world_size: int) -> int | None:
        """Data-parallel ranks expected: as recorded in the model states, else world_size / mp
        ranks when the root sets it, else the highest seen."""
        if self.recorded_dp is not None:
            return self.recorded_dp
        if world_size > 0:
            return world_size // self.mp_size if world_size % self.mp_size == 0 else None
        return 1 + max((dp for dp, _ in self.optim | self.zero3), default=0)

    def rank_files(self) -> tuple[RankFiles, ...]:
        """What validation checks against `dp_world_size` read from the whole file."""
        d, out = self.directory, []
        if self.expect_optim:
            for mp in sorted(self.plain_mp):
                out.append(RankFiles(common.join(d, f"mp_rank_{mp:02d}_model_states.pt"),
                                     DP_KEY, common.join(d, self._optim_prefix()),
                                     _optim_suffix(mp)))
        for mp in sorted({mp for _, mp in self.zero3}):
            source = common.join(d, _zero3_model_name(0, mp))
            prefix = common.join(d, "zero_pp_rank_")
            out.append(RankFiles(source, DP_KEY, prefix, f"_mp_rank_{mp:02d}_model_states.pt"))
            if self.expect_optim:
                out.append(RankFiles(source, DP_KEY, common.join(d, self._optim_prefix()),
                                     _optim_suffix(mp)))
        return tuple(out)

    def _optim_prefix(self) -> str:
        return ("bf16_" if self.bf16 else "") + "zero_pp_rank_"

    def _optim_name(self, dp: int, mp: int) -> str:
        return f"{self._optim_prefix()}{dp}{_optim_suffix(mp)}"

    def _missing_cells(self, what: str, have: set[Cell], dp_size: int,
                       name: _Namer) -> list[str]:
        # Counted, not listed: dp_size * mp_size may be large, the files present are few.
        present = sum(1 for dp, mp in have if dp < dp_size and mp < self.mp_size)
        count = dp_size * self.mp_size - present
        if count <= 0:
            return []
        cells = ((dp, mp) for mp in range(self.mp_size) for dp in range(dp_size))
        gone = list(itertools.islice(((dp, mp) for dp, mp in cells if (dp, mp) not in have), 8))
        shown = ", ".join(f"dp {dp}/mp {mp} ({name(dp, mp)})" for dp, mp in gone)
        more = f" and {count - len(gone)} more" if count > len(gone) else ""
        return [f"{what} for {shown}{more}"]


def _optim_suffix(mp: int) -> str:
    return f"_mp_rank_{mp:02d}_optim_states.pt"


def _zero3_model_name(dp: int, mp: int) -> str:
    return f"zero_pp_rank_{dp}_mp_rank_{mp:02d}_model_states.pt"


def _cells(pattern: re.Pattern[str], names: list[str], zero3: bool = False) -> set[Cell]:
    out: set[Cell] = set()
    for n in names:
        m = pattern.match(n)
        if m and (not zero3 or m.group(1) is not None):
            out.add((int(m.group(1)), int(m.group(2))))
    return out


def _missing(what: str, have: set[int], size: int) -> list[str]:
    gone = common.missing_ranks(have, size)
    more = size - sum(1 for r in have if r < size) - len(gone)
    return [f"{what} {', '.join(map(str, gone))}" + (f" and {more} more" if more > 0 else "")
            ] if gone else []


LAYOUT = DeepSpeedLayout()
