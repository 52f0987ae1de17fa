"""Completion rules of every layout, as tables of in-memory snapshots -> expected candidates."""

from __future__ import annotations

import json
import pickle
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from ckptd import layouts
from ckptd.layouts import common
from ckptd.model import Candidate, FileInfo, RankFiles, RootOptions, Snapshot

NOW = 10_000.0
SETTLE = 5.0
DCP_META = object()  # placeholder for real `.metadata` bytes, filled in by a fixture


@dataclass(frozen=True)
class F:
    """A file in a test snapshot: size, seconds since it last changed, optional newer mtime."""

    size: int = 10
    age: float = 100.0
    mtime_age: float | None = None
    open: bool = False
    seen_age: float | None = None  # seconds since the scanner first saw it; None = `age`
    first_mtime_age: float | None = None  # its mtime's age when first seen; None = unknown


@dataclass(frozen=True)
class E:
    """An expected candidate; `complete=None` leaves completeness unchecked."""

    layout: str
    step: int
    complete: bool | None
    waiting: str = ""
    invalid: str = ""
    path: str | None = None


def build(files: Mapping[str, F | int], contents: Mapping[str, Any] | None = None,
          registrations: dict[int, tuple[str, ...]] | None = None) -> Snapshot:
    infos: dict[str, FileInfo] = {}
    for rel, spec in files.items():
        f = spec if isinstance(spec, F) else F(size=spec)
        mtime_age = f.age if f.mtime_age is None else f.mtime_age
        seen = None if f.seen_age is None else NOW - f.seen_age
        first = None if f.first_mtime_age is None else NOW - f.first_mtime_age
        infos[rel] = FileInfo(rel, f.size, NOW - mtime_age, NOW - f.age, f.open, seen,
                              first_mtime=first)
    dirs = {"/".join(rel.split("/")[:i]) for rel in files for i in range(1, rel.count("/") + 1)}
    return Snapshot(files=infos, dirs=frozenset(dirs), contents=_encode(contents or {}),
                    registrations=dict(registrations or {}))


def _encode(contents: Mapping[str, Any]) -> dict[str, bytes]:
    out: dict[str, bytes] = {}
    for rel, value in contents.items():
        if isinstance(value, bytes):
            out[rel] = value
        elif isinstance(value, str):
            out[rel] = value.encode()
        else:
            out[rel] = json.dumps(value).encode()
    return out


def native_meta(step: int, files: dict[str, int], **extra: Any) -> dict[str, Any]:
    return {"format": "ckptd-native/1", "step": step, "world_size": 1,
            "created": "2025-01-01T00:00:00Z", "metrics": {"val_loss": 1.5}, "config": {},
            "files": [{"path": p, "size": s, "component": p.split(".")[0]}
                      for p, s in files.items()], **extra}


NATIVE_FILES = {"step-5/model.pt": 10, "step-5/optim.rank0.pt": 20, "step-5/meta.json": 300}
NATIVE_META = native_meta(5, {"model.pt": 10, "optim.rank0.pt": 20})
HF = {f"checkpoint-500/{n}": 10 for n in (
    "config.json", "model.safetensors", "training_args.bin", "optimizer.pt", "scheduler.pt",
    "rng_state.pth", "trainer_state.json")}
HF_STATE = {"global_step": 500, "best_metric": 0.5, "log_history": [
    {"loss": 2.0, "step": 400}, {"eval_loss": 1.25, "eval_acc": 0.75, "step": 500},
    {"loss": 1.9, "step": 500}]}
DS = "global_step100/"
DS_RANKS2 = {DS + "mp_rank_00_model_states.pt": 10,
             DS + "zero_pp_rank_0_mp_rank_00_optim_states.pt": 10,
             DS + "zero_pp_rank_1_mp_rank_00_optim_states.pt": 10, "latest": 13}
MEG = {"iter_0000100/mp_rank_00/model_optim_rng.pt": 10, "latest_checkpointed_iteration.txt": 3}
ORBAX_META = {"item_handlers": {"default": "PyTreeCheckpointHandler"}, "metrics": {"loss": 0.25},
              "init_timestamp_nsecs": 1, "commit_timestamp_nsecs": 2, "custom": {}}
ORBAX_100 = {"100/_CHECKPOINT_METADATA": 10, "100/default/_METADATA": 10,
             "100/default/manifest.ocdbt": 10, "100/default/d/0123abcd": 10}
RECENT = F(age=1.0)
# megatron-core's torch_dist save before its last file, metadata.json; the tracker names it
MEG_DIST = {"iter_0000100/common.pt": 1, "iter_0000100/.metadata": 1,
            "iter_0000100/__0_0.distcp": 10_000, "latest_checkpointed_iteration.txt": 1}
MEG_DIST_CONTENT = {"latest_checkpointed_iteration.txt": "100",
                    "iter_0000100/.metadata": DCP_META}
W2 = RootOptions(settle=SETTLE, world_size=2)

Regs = dict[int, tuple[str, ...]]
Row = tuple[Mapping[str, F | int], Mapping[str, Any], Regs, RootOptions, list[E]]
CASES: dict[str, Row] = {
    # --- native -----------------------------------------------------------------------------
    "native complete": (NATIVE_FILES, {"step-5/meta.json": NATIVE_META}, {}, RootOptions(),
                        [E("native", 5, True, path="step-5")]),
    "native size short": ({**NATIVE_FILES, "step-5/model.pt": 9},
                          {"step-5/meta.json": NATIVE_META}, {}, RootOptions(),
                          [E("native", 5, False, "step-5/model.pt to reach 10 bytes")]),
    "native listed file missing": (
        {k: v for k, v in NATIVE_FILES.items() if "optim" not in k},
        {"step-5/meta.json": NATIVE_META}, {}, RootOptions(),
        [E("native", 5, False, "step-5/optim.rank0.pt")]),
    "native no meta.json": ({"step-5/model.pt": 10}, {}, {}, RootOptions(),
                            [E("native", 5, False, "meta.json")]),
    "native tmp dir is not a checkpoint yet": (
        {"step-5.tmp/model.pt": 10, "step-5.tmp/meta.json": 10}, {}, {}, RootOptions(), []),
    "native bad json": (NATIVE_FILES, {"step-5/meta.json": b"{not json"}, {}, RootOptions(),
                        [E("native", 5, True, invalid="bad_metadata")]),
    "native step mismatch": (NATIVE_FILES, {"step-5/meta.json": native_meta(6, {})}, {},
                             RootOptions(), [E("native", 5, True, invalid="bad_metadata")]),
    "native path escapes": (NATIVE_FILES, {"step-5/meta.json": native_meta(5, {"../x": 1})}, {},
                            RootOptions(), [E("native", 5, True, invalid="bad_metadata")]),
    "native open file": ({**NATIVE_FILES, "step-5/model.pt": F(size=10, open=True)},
                         {"step-5/meta.json": NATIVE_META}, {}, RootOptions(),
                         [E("native", 5, False, "step-5/model.pt to be closed")]),
    "native meta vanished": (NATIVE_FILES, {}, {}, RootOptions(),
                             [E("native", 5, False, "to be readable")]),
    # --- registered -------------------------------------------------------------------------
    "registered complete": (
        {"out/a.pt": 1, "out/b/x.bin": 1, "out/b/y.bin": 1}, {}, {7: ("out/a.pt", "./out/b/")},
        RootOptions(), [E("registered", 7, True, path="out/a.pt")]),
    "registered missing path": ({"out/a.pt": 1}, {}, {7: ("out/a.pt", "out/b")}, RootOptions(),
                                [E("registered", 7, False, "out/b")]),
    "registered unsettled": ({"out/a.pt": RECENT}, {}, {7: ("out/a.pt",)}, RootOptions(),
                             [E("registered", 7, False, "unchanged for 5s")]),
    "registered claims before single": (
        {"model_step_100.pt": 1}, {}, {100: ("model_step_100.pt",)}, RootOptions(),
        [E("registered", 100, True)]),
    "registered without paths leaves layouts alone": (
        {"model_step_100.pt": 1}, {}, {100: ()}, RootOptions(), [E("single", 100, True)]),
    "registered temp path": ({"x.pt.tmp": 1}, {}, {3: ("x.pt.tmp",)}, RootOptions(),
                             [E("registered", 3, False, "temporary name")]),
    # --- settling ---------------------------------------------------------------------------
    "settled exactly at settle": ({"model_step_1.pt": F(age=SETTLE)}, {}, {}, RootOptions(),
                                  [E("single", 1, True)]),
    "just short of settle": ({"model_step_1.pt": F(age=SETTLE - 0.001)}, {}, {}, RootOptions(),
                             [E("single", 1, False, "unchanged for 5s")]),
    "mtime newer than changed_at": ({"model_step_1.pt": F(age=100, mtime_age=1)}, {}, {},
                                    RootOptions(), [E("single", 1, False, "unchanged")]),
    "open for write": ({"model_step_1.pt": F(open=True)}, {}, {}, RootOptions(),
                       [E("single", 1, False, "model_step_1.pt to be closed")]),
    "settle zero": ({"model_step_1.pt": F(age=0.0)}, {}, {}, RootOptions(settle=0.0),
                    [E("single", 1, True)]),
    # --- single -----------------------------------------------------------------------------
    "single patterns": (
        {"a/model_step_100.pt": 1, "b/epoch=2-step=300.ckpt": 1, "c/iter_0000200.pth": 1,
         "d/weights_50.safetensors": 1, "e/model-step-7.bin": 1}, {}, {}, RootOptions(),
        [E("single", 7, True), E("single", 50, True), E("single", 100, True),
         E("single", 200, True), E("single", 300, True)]),
    "single without step": ({"model.pt": 1, "last.ckpt": 1}, {}, {}, RootOptions(), []),
    "single temp names": ({"model_step_1.pt.tmp": 1, "model_step_2.pt.partial": 1,
                           "x.tmp/model_step_3.pt": 1}, {}, {}, RootOptions(), []),
    "nemo unfinished marker": (
        {"run--step=100-last.ckpt": 1, "run--step=100-last-unfinished": 0}, {}, {},
        RootOptions(), [E("single", 100, False, "-unfinished to be removed")]),
    # --- split ------------------------------------------------------------------------------
    "split complete": (
        {"step_5_meta.pt": 1, "step_5_model.pt": 1, "step_5_optim.pt": 1, "step_5_ema.pt": 1},
        {}, {}, RootOptions(), [E("split", 5, True, path="step_5_model.pt")]),
    "split without ema": ({"step_5_meta.pt": 1, "step_5_model.pt": 1, "step_5_optim.pt": 1},
                          {}, {}, RootOptions(), [E("split", 5, True)]),
    "split missing optim": ({"step_5_meta.pt": 1, "step_5_model.pt": 1}, {}, {}, RootOptions(),
                            [E("split", 5, False, "step_5_optim.pt")]),
    "split model alone is split, not single": (
        {"step_5_model.pt": 1}, {}, {}, RootOptions(), [E("split", 5, False, "step_5_meta.pt")]),
    "split ema still changing": (
        {"step_5_meta.pt": 1, "step_5_model.pt": 1, "step_5_optim.pt": 1, "step_5_ema.pt": RECENT},
        {}, {}, RootOptions(), [E("split", 5, False, "unchanged")]),
    # --- ranked -----------------------------------------------------------------------------
    "ranked complete (world_size option)": (
        {"model_5.pt": 1, "meta_5.json": 1, "optim_5_rank0.pt": 1, "optim_5_rank1.pt": 1},
        {"meta_5.json": {"world_size": 9, "metrics": {"loss": 2}}}, {}, W2,
        [E("ranked", 5, True, path="model_5.pt")]),
    "ranked ranks missing for world_size": (
        {"model_5.pt": 1, "meta_5.json": 1, "optim_5_rank0.pt": 1, "optim_5_rank1.pt": 1},
        {"meta_5.json": {}}, {}, RootOptions(world_size=4),
        [E("ranked", 5, False, "ranks 2, 3")]),
    "ranked world from meta": (
        {"model_5.pt": 1, "meta_5.json": 1, "optim_5_rank0.pt": 1, "optim_5_rank1.pt": 1},
        {"meta_5.json": {"world_size": 3}}, {}, RootOptions(), [E("ranked", 5, False, "ranks 2")]),
    "ranked contiguous": (
        {"model_5.pt": 1, "meta_5.json": 1, "optim_5_rank0.pt": 1, "optim_5_rank1.pt": 1},
        {"meta_5.json": {}}, {}, RootOptions(), [E("ranked", 5, True)]),
    "ranked gap": ({"model_5.pt": 1, "meta_5.json": 1, "optim_5_rank0.pt": 1,
                    "optim_5_rank2.pt": 1}, {"meta_5.json": {}}, {}, RootOptions(),
                   [E("ranked", 5, False, "ranks 1")]),
    "ranked missing meta": ({"model_5.pt": 1, "optim_5_rank0.pt": 1}, {}, {}, RootOptions(),
                            [E("ranked", 5, False, "meta_5.json")]),
    "lone model_N.pt is single": ({"model_5.pt": 1}, {}, {}, RootOptions(),
                                  [E("single", 5, True)]),
    "model_N.pt in a ranked dir is ranked": (
        {"model_5.pt": 1, "meta_5.json": 1, "optim_5_rank0.pt": 1, "model_6.pt": 1},
        {"meta_5.json": {"world_size": 1}}, {}, RootOptions(),
        [E("ranked", 5, True), E("ranked", 6, False, "meta_6.json")]),
    "ranked bad meta": ({"model_5.pt": 1, "meta_5.json": 1, "optim_5_rank0.pt": 1},
                        {"meta_5.json": b"{"}, {}, RootOptions(world_size=1),
                        [E("ranked", 5, True, invalid="bad_metadata")]),
    # --- hf ---------------------------------------------------------------------------------
    "hf complete": (HF, {"checkpoint-500/trainer_state.json": HF_STATE}, {}, RootOptions(),
                    [E("hf", 500, True, path="checkpoint-500")]),
    "hf without trainer_state": (
        {k: v for k, v in HF.items() if "trainer_state" not in k}, {}, {}, RootOptions(),
        [E("hf", 500, False, "trainer_state.json")]),
    "hf not settled": ({**HF, "checkpoint-500/rng_state.pth": RECENT},
                       {"checkpoint-500/trainer_state.json": HF_STATE}, {}, RootOptions(),
                       [E("hf", 500, False, "unchanged")]),
    "hf tmp dir": ({"tmp-checkpoint-500/model.safetensors": 1,
                    "tmp-checkpoint-500/trainer_state.json": 1}, {}, {}, RootOptions(), []),
    "hf with deepspeed inside": (
        {**HF, "checkpoint-500/global_step500/mp_rank_00_model_states.pt": 1,
         "checkpoint-500/global_step500/zero_pp_rank_0_mp_rank_00_optim_states.pt": 1,
         "checkpoint-500/latest": 1},
        {"checkpoint-500/trainer_state.json": HF_STATE}, {}, RootOptions(), [E("hf", 500, True)]),
    "hf with fsdp dcp inside": (
        {**HF, "checkpoint-500/pytorch_model_fsdp_0/.metadata": 1,
         "checkpoint-500/pytorch_model_fsdp_0/__0_0.distcp": 1},
        {"checkpoint-500/trainer_state.json": HF_STATE}, {}, RootOptions(), [E("hf", 500, True)]),
    "dcp dir named checkpoint-N is dcp": (
        {"checkpoint-500/.metadata": 1, "checkpoint-500/__0_0.distcp": 1}, {}, {}, RootOptions(),
        [E("dcp", 500, None)]),
    # --- deepspeed --------------------------------------------------------------------------
    "deepspeed complete": (DS_RANKS2, {"latest": "global_step100"}, {}, W2,
                           [E("deepspeed", 100, True, path="global_step100")]),
    "deepspeed latest written before other ranks": (
        {k: v for k, v in DS_RANKS2.items() if "rank_1" not in k}, {"latest": "global_step100"},
        {}, W2, [E("deepspeed", 100, False, "optimizer states for dp 1/mp 0")]),
    "deepspeed no latest": ({k: v for k, v in DS_RANKS2.items() if k != "latest"}, {}, {}, W2,
                            [E("deepspeed", 100, False, "latest naming global_step100")]),
    "deepspeed latest older": (DS_RANKS2, {"latest": "global_step50\n"}, {}, W2,
                               [E("deepspeed", 100, False, "names 'global_step50'")]),
    "deepspeed latest newer": (DS_RANKS2, {"latest": "global_step200"}, {}, W2,
                               [E("deepspeed", 100, True)]),
    "deepspeed inferred bf16 ranks": (
        {DS + "mp_rank_00_model_states.pt": 1, "latest": 1,
         **{DS + f"bf16_zero_pp_rank_{r}_mp_rank_00_optim_states.pt": 1 for r in (0, 1, 2)}},
        {"latest": "global_step100"}, {}, RootOptions(), [E("deepspeed", 100, True)]),
    "deepspeed inferred gap": (
        {DS + "mp_rank_00_model_states.pt": 1, "latest": 1,
         **{DS + f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt": 1 for r in (0, 2)}},
        {"latest": "global_step100"}, {}, RootOptions(), [E("deepspeed", 100, False, "dp 1")]),
    "deepspeed zero-0": ({DS + "mp_rank_00_model_states.pt": 1, "latest": 1},
                         {"latest": "global_step100"}, {}, RootOptions(),
                         [E("deepspeed", 100, True)]),
    "deepspeed zero-3 model states per rank": (
        {"latest": 1, **{DS + f"zero_pp_rank_{r}_mp_rank_00_{k}_states.pt": 1
                         for r in (0, 1) for k in ("model", "optim")}},
        {"latest": "global_step100"}, {}, W2, [E("deepspeed", 100, True)]),
    "deepspeed optimizer expected from sibling tags": (
        {**DS_RANKS2, "global_step200/mp_rank_00_model_states.pt": 1},
        {"latest": "global_step200"}, {}, W2,
        [E("deepspeed", 100, True), E("deepspeed", 200, False, "optimizer states")]),
    "deepspeed rank still settling": (
        {**DS_RANKS2, DS + "zero_pp_rank_1_mp_rank_00_optim_states.pt": RECENT},
        {"latest": "global_step100"}, {}, W2, [E("deepspeed", 100, False, "unchanged")]),
    # --- megatron ---------------------------------------------------------------------------
    "megatron complete": (MEG, {"latest_checkpointed_iteration.txt": "100"}, {}, RootOptions(),
                          [E("megatron", 100, True, path="iter_0000100")]),
    "megatron tracker older": (MEG, {"latest_checkpointed_iteration.txt": "50\n"}, {},
                               RootOptions(), [E("megatron", 100, False, "names '50'")]),
    "megatron tracker newer": (MEG, {"latest_checkpointed_iteration.txt": "200"}, {},
                               RootOptions(), [E("megatron", 100, True)]),
    "megatron no tracker": ({"iter_0000100/mp_rank_00/model_optim_rng.pt": 1}, {}, {},
                            RootOptions(),
                            [E("megatron", 100, False, "latest_checkpointed_iteration.txt")]),
    "megatron not settled": ({**MEG, "iter_0000100/mp_rank_00/model_optim_rng.pt": RECENT},
                             {"latest_checkpointed_iteration.txt": "100"}, {}, RootOptions(),
                             [E("megatron", 100, False, "unchanged")]),
    "megatron torch_dist re-save": (
        {"iter_0000100/.metadata": F(age=200),
         "iter_0000100/__0_0.distcp": F(age=100, seen_age=300),
         "iter_0000100/common.pt": 1, "iter_0000100/metadata.json": 1,
         "latest_checkpointed_iteration.txt": 1},
        {"latest_checkpointed_iteration.txt": "100", "iter_0000100/.metadata": b"x"}, {},
        RootOptions(), [E("megatron", 100, False, "re-save in progress")]),
    "megatron torch_dist complete": (
        {**MEG_DIST, "iter_0000100/metadata.json": 1}, MEG_DIST_CONTENT, {}, RootOptions(),
        [E("megatron", 100, True, path="iter_0000100")]),
    # a torch_dist shard cut short, the tracker written: truncated once settled, as for dcp
    "megatron torch_dist shard short, settled": (
        {**MEG_DIST, "iter_0000100/metadata.json": 1, "iter_0000100/__0_0.distcp": 3},
        MEG_DIST_CONTENT, {}, RootOptions(),
        [E("megatron", 100, True, invalid="truncated")]),
    "megatron torch_dist shard short, changing": (
        {**MEG_DIST, "iter_0000100/metadata.json": 1, "iter_0000100/__0_0.distcp": F(3, age=1)},
        MEG_DIST_CONTENT, {}, RootOptions(), [E("megatron", 100, False, "to reach")]),
    "megatron torch_dist without metadata.json": (
        MEG_DIST, MEG_DIST_CONTENT, {}, RootOptions(),
        [E("megatron", 100, False, "iter_0000100/metadata.json")]),
    # killed after common.pt: nothing else was written, and the tracker moved on
    "megatron torch_dist only common.pt, tracker newer": (
        {"iter_0000100/common.pt": 1, "latest_checkpointed_iteration.txt": 1},
        {"latest_checkpointed_iteration.txt": "200"}, {}, RootOptions(),
        [E("megatron", 100, False, "metadata.json")]),
    "iter dir without megatron signs is dcp": (
        {"iter_0000100/.metadata": 1, "iter_0000100/__0_0.distcp": 1}, {}, {}, RootOptions(),
        [E("dcp", 100, None)]),
    # --- dcp --------------------------------------------------------------------------------
    "dcp without .metadata": ({"step-3/__0_0.distcp": 1, "step-3/__1_0.distcp": 1}, {}, {},
                              RootOptions(), [E("dcp", 3, False, "step-3/.metadata")]),
    "dcp only .metadata.tmp": ({"step-3/__0_0.distcp": 1, "step-3/.metadata.tmp": 1}, {}, {},
                               RootOptions(), [E("dcp", 3, False, "step-3/.metadata")]),
    "dcp data changed after the metadata was seen": (
        {"step_3/.metadata": F(age=200), "step_3/__0_0.distcp": F(age=100, seen_age=300)},
        {"step_3/.metadata": b"x"}, {}, RootOptions(), [E("dcp", 3, False, "re-save")]),
    # `cp -r`: new mtimes in copy order (data newer than .metadata), nothing changed after
    # ckptd saw the files: a copy, not a re-save
    "dcp copied with cp -r, seen at once": (
        {"step_3/.metadata": F(age=100, mtime_age=100),
         "step_3/__0_0.distcp": F(age=100, mtime_age=99)},
        {"step_3/.metadata": b"x"}, {}, RootOptions(), [E("dcp", 3, True, "", "bad_metadata")]),
    "dcp copied with cp -r, a shard first seen half copied": (
        {"step_3/.metadata": F(age=200, mtime_age=200),
         "step_3/__0_0.distcp": F(age=100, seen_age=200, first_mtime_age=199)},
        {"step_3/.metadata": b"x"}, {}, RootOptions(), [E("dcp", 3, True, "", "bad_metadata")]),
    "dcp re-save of a shard first seen older than the metadata": (
        {"step_3/.metadata": F(age=200, mtime_age=200),
         "step_3/__0_0.distcp": F(age=100, seen_age=200, first_mtime_age=250)},
        {"step_3/.metadata": b"x"}, {}, RootOptions(), [E("dcp", 3, False, "re-save")]),
    "dcp copied with cp -r, seen while copying": (
        {"step_3/.metadata": F(age=200), "step_3/__0_0.distcp": F(age=100, seen_age=150)},
        {"step_3/.metadata": b"x"}, {}, RootOptions(), [E("dcp", 3, True, "", "bad_metadata")]),
    "dcp dir names": (
        {f"{d}/.metadata": F(age=100, mtime_age=100) for d in (
            "step3", "global_step4", "7", "ckpt/iter_8", "checkpoint_9")},
        {}, {}, RootOptions(),
        [E("dcp", 3, None), E("dcp", 4, None), E("dcp", 7, None), E("dcp", 8, None),
         E("dcp", 9, None)]),
    "dcp dir without step": ({"ckpt/.metadata": 1, "ckpt/__0_0.distcp": 1}, {}, {},
                             RootOptions(), []),
    "dcp nemo unfinished": (
        {"run--step=100-last/weights/.metadata": 1, "run--step=100-last/weights/__0_0.distcp": 1,
         "run--step=100-last/context/io.json": 1, "run--step=100-last-unfinished": 0},
        {}, {}, RootOptions(), [E("dcp", 100, False, "run--step=100-last-unfinished")]),
    "dcp complete": ({"step-3/.metadata": 1, "step-3/__0_0.distcp": 10_000}, {
        "step-3/.metadata": DCP_META}, {}, RootOptions(), [E("dcp", 3, True, path="step-3")]),
    "dcp referenced file short": ({"step-3/.metadata": 1, "step-3/__0_0.distcp": F(3, age=1)}, {
        "step-3/.metadata": DCP_META}, {}, RootOptions(), [E("dcp", 3, False, "to reach")]),
    "dcp referenced file short, open": (
        {"step-3/.metadata": 1, "step-3/__0_0.distcp": F(3, open=True)},
        {"step-3/.metadata": DCP_META}, {}, RootOptions(), [E("dcp", 3, False, "to reach")]),
    # .metadata is written after every shard is whole: a settled short shard was cut short.
    "dcp referenced file short, settled": (
        {"step-3/.metadata": 1, "step-3/__0_0.distcp": 3}, {"step-3/.metadata": DCP_META}, {},
        RootOptions(), [E("dcp", 3, True, invalid="truncated")]),
    "dcp referenced file short, settled, multi-node": (
        {"step-3/.metadata": 1, "step-3/__0_0.distcp": 3}, {"step-3/.metadata": DCP_META}, {},
        RootOptions(multi_node=True), [E("dcp", 3, True, invalid="truncated")]),
    "dcp referenced file missing": ({"step-3/.metadata": 1}, {"step-3/.metadata": DCP_META}, {},
                                    RootOptions(), [E("dcp", 3, False, "step-3/__0_0.distcp")]),
    "dcp bad metadata": ({"step-3/.metadata": 1, "step-3/__0_0.distcp": 1},
                         {"step-3/.metadata": b"\x80\x04garbage"}, {}, RootOptions(),
                         [E("dcp", 3, True, invalid="bad_metadata")]),
    "dcp unsafe pickle": ({"step-3/.metadata": 1, "step-3/__0_0.distcp": 1},
                          {"step-3/.metadata": pickle.dumps(print)}, {}, RootOptions(),
                          [E("dcp", 3, True, invalid="unsafe_pickle")]),
    "dcp two dirs in one step dir": (
        {"s/step-3/model/.metadata": 1, "s/step-3/model/__0_0.distcp": 10_000,
         "s/step-3/optim/__0_0.distcp": 1}, {"s/step-3/model/.metadata": DCP_META}, {},
        RootOptions(), [E("dcp", 3, False, "s/step-3/optim/.metadata", path="s/step-3")]),
    # --- orbax ------------------------------------------------------------------------------
    "orbax renamed": (ORBAX_100, {"100/_CHECKPOINT_METADATA": ORBAX_META}, {}, RootOptions(),
                      [E("orbax", 100, True, path="100")]),
    "orbax tmp dir": ({"100.orbax-checkpoint-tmp-1700000000/_CHECKPOINT_METADATA": 1,
                       "100.orbax-checkpoint-tmp-1700000000/default/_METADATA": 1}, {}, {},
                      RootOptions(), [E("orbax", 100, False, "rename to 100")]),
    "orbax leftover tmp beside final": (
        {**ORBAX_100, "100.orbax-checkpoint-tmp/default/_METADATA": 1},
        {"100/_CHECKPOINT_METADATA": ORBAX_META}, {}, RootOptions(), [E("orbax", 100, True)]),
    "orbax commit file": (
        {**ORBAX_100, "100/commit_success.txt": 1, "200/_CHECKPOINT_METADATA": 1,
         "200/default/_METADATA": 1}, {"200/_CHECKPOINT_METADATA": ORBAX_META}, {},
        RootOptions(), [E("orbax", 100, True), E("orbax", 200, False, "commit_success.txt")]),
    "orbax in place, not committed": (
        ORBAX_100, {"100/_CHECKPOINT_METADATA": {**ORBAX_META, "commit_timestamp_nsecs": None}},
        {}, RootOptions(), [E("orbax", 100, False, "not committed")]),
    "bare number dir without orbax files": ({"100/notes.txt": 1}, {}, {}, RootOptions(), []),
    # --- same step twice, junk --------------------------------------------------------------
    "same step twice: earlier-written first": (
        {"ema_step_100.pt": F(age=100), "model_step_100.pt": F(age=300)}, {}, {}, RootOptions(),
        [E("single", 100, True, path="model_step_100.pt"),
         E("single", 100, True, path="ema_step_100.pt")]),
    "junk ignored": ({"notes.txt": 1, "events.out.tfevents.1.host": 1, ".DS_Store": 1,
                      "logs/train.log": 1, "data.bin": 1, "x/__pycache__/a.pyc": 1}, {}, {},
                     RootOptions(), []),
}


@pytest.fixture(scope="module")
def dcp_meta_bytes(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    """Real `.metadata` bytes of a one-tensor DCP save whose data file is `__0_0.distcp`."""
    import torch
    from torch.distributed.checkpoint.state_dict_saver import save

    out = tmp_path_factory.mktemp("dcp")
    save({"w": torch.arange(1000, dtype=torch.float32)}, checkpoint_id=out, no_dist=True)
    return Path(out, ".metadata").read_bytes()


def _check(got: list[Candidate], want: list[E]) -> None:
    assert [(c.layout, c.step) for c in got] == [(e.layout, e.step) for e in want], got
    for cand, exp in zip(got, want, strict=True):
        if exp.complete is not None:
            assert cand.complete is exp.complete, cand
        assert exp.waiting in cand.waiting_for, cand
        assert cand.complete == (cand.waiting_for == ""), cand
        # The typed cause a stalled save is given up by: a member short of its promised size.
        assert cand.truncated == ("to reach" in cand.waiting_for), cand
        assert cand.invalid_reason == exp.invalid, cand
        if exp.path is not None:
            assert cand.path == exp.path, cand


@pytest.mark.parametrize("case", list(CASES))
def test_detect(case: str, request: pytest.FixtureRequest) -> None:
    files, contents, regs, opts, want = CASES[case]
    if any(v is DCP_META for v in contents.values()):
        meta = request.getfixturevalue("dcp_meta_bytes")
        contents = {k: (meta if v is DCP_META else v) for k, v in contents.items()}
    _check(layouts.detect(build(files, contents, regs), opts, NOW), want)


def test_temp_files_never_members() -> None:
    files = {**HF, "checkpoint-500/model.safetensors.tmp": 1, "checkpoint-500/x-unfinished": 0}
    snap = build(files, {"checkpoint-500/trainer_state.json": HF_STATE})
    [cand] = layouts.detect(snap, RootOptions(), NOW)
    assert all(not common.is_temp_path(f) for f in cand.files)
    assert "x-unfinished to be removed" in cand.waiting_for  # a marker inside blocks too


def test_native_sizes_and_metrics() -> None:
    snap = build(NATIVE_FILES, {"step-5/meta.json": NATIVE_META})
    [cand] = layouts.detect(snap, RootOptions(), NOW)
    assert cand.expected_sizes == {"step-5/model.pt": 10, "step-5/optim.rank0.pt": 20}
    assert cand.metrics == {"val_loss": 1.5}
    assert cand.files == ("step-5/meta.json", "step-5/model.pt", "step-5/optim.rank0.pt")


def test_hf_metrics_from_trainer_state() -> None:
    snap = build(HF, {"checkpoint-500/trainer_state.json": HF_STATE})
    [cand] = layouts.detect(snap, RootOptions(), NOW)
    assert cand.metrics == {"best_metric": 0.5, "eval_loss": 1.25, "eval_acc": 0.75}


def test_orbax_and_ranked_metrics() -> None:
    snap = build(ORBAX_100, {"100/_CHECKPOINT_METADATA": ORBAX_META})
    assert layouts.detect(snap, RootOptions(), NOW)[0].metrics == {"loss": 0.25}
    ranked = CASES["ranked complete (world_size option)"]
    cand = layouts.detect(build(ranked[0], ranked[1]), W2, NOW)[0]
    assert cand.metrics == {"loss": 2.0}


def test_dcp_min_sizes(dcp_meta_bytes: bytes) -> None:
    snap = build({"step-3/.metadata": 1, "step-3/__0_0.distcp": 10_000},
                 {"step-3/.metadata": dcp_meta_bytes})
    [cand] = layouts.detect(snap, RootOptions(), NOW)
    assert set(cand.min_sizes) == {"step-3/__0_0.distcp"}
    assert 4000 <= cand.min_sizes["step-3/__0_0.distcp"] <= 10_000


def test_named_layout_runs_only_it_and_registered() -> None:
    snap = build({"step_5_model.pt": 1, "other_step_9.pt": 1},
                 registrations={9: ("other_step_9.pt",)})
    got = layouts.detect(snap, RootOptions(), NOW, layout="single")
    assert [(c.layout, c.step) for c in got] == [("single", 5), ("registered", 9)]
    only = layouts.detect(snap, RootOptions(), NOW, layout="registered")
    assert [(c.layout, c.step) for c in only] == [("registered", 9)]


def test_same_step_across_layouts_both_returned() -> None:
    files: dict[str, F | int] = {**NATIVE_FILES, "model_step_5.pt": F(age=50)}
    got = layouts.detect(build(files, {"step-5/meta.json": NATIVE_META}), RootOptions(), NOW)
    assert [(c.layout, c.step) for c in got] == [("native", 5), ("single", 5)]


def test_claims_are_exclusive() -> None:
    cases = [CASES[k] for k in ("hf with deepspeed inside", "split complete", "deepspeed complete")]
    for files, contents, regs, opts, _ in cases:
        got = layouts.detect(build(files, contents, regs), opts, NOW)
        seen = [f for c in got for f in c.files]
        assert len(seen) == len(set(seen))


@pytest.mark.parametrize(("rel", "layout", "wanted"), [
    ("step-5/meta.json", "auto", True),
    ("step-5.tmp/meta.json", "auto", False),
    ("x/.metadata", "auto", True),
    ("x/.metadata", "single", False),
    ("x/.metadata", "megatron", True),
    ("latest", "deepspeed", True),
    ("latest_checkpointed_iteration.txt", "auto", True),
    ("meta_12.json", "ranked", True),
    ("checkpoint-5/trainer_state.json", "hf", True),
    ("other/trainer_state.json", "hf", False),
    ("100/_CHECKPOINT_METADATA", "orbax", True),
    ("model.pt", "auto", False),
])
def test_wants_content(rel: str, layout: str, wanted: bool) -> None:
    assert layouts.wants_content(rel, layout) is wanted


def test_names_and_get() -> None:
    assert set(layouts.names()) == {"native", "registered", "dcp", "split", "ranked", "hf",
                                  "deepspeed", "megatron", "orbax", "single"}
    assert all(layouts.get(n).name == n for n in layouts.names())
    with pytest.raises(ValueError, match="unknown layout"):
        layouts.get("nope")


@pytest.mark.parametrize(("name", "temp"), [
    ("a.tmp", True), ("a.partial", True), ("100.orbax-checkpoint-tmp-17", True),
    ("run-last-unfinished", True), ("tmp-checkpoint-5", True), ("model.pt", False),
    ("tmpfile.pt", False),
])
def test_temp_names(name: str, temp: bool) -> None:
    assert common.is_temp_name(name) is temp


@pytest.mark.parametrize(("name", "step"), [
    ("step-5", 5), ("step_5", 5), ("step5", 5), ("iter_0000100", 100), ("checkpoint-7", 7),
    ("global_step9", 9), ("42", 42), ("run--epoch=1-step=300-last", 300), ("ckpt", None),
    ("steps", None),
])
def test_dir_step(name: str, step: int | None) -> None:
    assert common.dir_step(name) == step


# --- deepspeed: the data-parallel size the model states record -------------------------------

DS_MODEL = DS + "mp_rank_00_model_states.pt"


def _ds(files: Mapping[str, F | int], dp: int | None, opts: RootOptions | None = None
        ) -> Candidate:
    snap = build(files, {"latest": "global_step100"})
    if dp is not None:
        snap = Snapshot(snap.files, snap.dirs, snap.contents,
                        torch_fields={DS_MODEL: {"dp_world_size": dp, "ds_version": "0.19.8"}})
    [cand] = layouts.detect(snap, opts or RootOptions(), NOW)
    return cand


def test_deepspeed_waits_for_the_ranks_the_model_states_record() -> None:
    """Without `world_size`, a rank whose optimizer file has not appeared is waited for when
    the model states say how many ranks there are; the message names its file."""
    no_rank1 = {k: v for k, v in DS_RANKS2.items() if "rank_1" not in k}
    assert _ds(no_rank1, None).complete  # inferred: only settling guards the gap
    cand = _ds(no_rank1, 2)
    assert not cand.complete
    assert "dp 1/mp 0 (zero_pp_rank_1_mp_rank_00_optim_states.pt)" in cand.waiting_for
    assert _ds(DS_RANKS2, 2).complete
    # The recorded size wins over a root's (wrong) world_size, both ways.
    assert not _ds(no_rank1, 2, RootOptions(settle=SETTLE, world_size=1)).complete
    assert _ds(DS_RANKS2, 2, RootOptions(settle=SETTLE, world_size=4)).complete
    # A value that is no rank count is not used.
    for bad in (0, -1, True, "2", 1 << 40):
        snap = build(no_rank1, {"latest": "global_step100"})
        snap = Snapshot(snap.files, snap.dirs, snap.contents,
                        torch_fields={DS_MODEL: {"dp_world_size": bad}})
        assert layouts.detect(snap, RootOptions(), NOW)[0].complete, bad


def test_deepspeed_candidates_carry_the_rank_files_validation_checks() -> None:
    cand = _ds(DS_RANKS2, None)
    assert cand.rank_files == (RankFiles(DS_MODEL, "dp_world_size",
                                         DS + "zero_pp_rank_", "_mp_rank_00_optim_states.pt"),)
    assert cand.rank_files[0].member(1) == DS + "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    bf16 = {k.replace("zero_pp", "bf16_zero_pp"): v for k, v in DS_RANKS2.items()}
    assert _ds(bf16, None).rank_files[0].prefix == DS + "bf16_zero_pp_rank_"
    zero3 = {DS + f"zero_pp_rank_{r}_mp_rank_00_{kind}_states.pt": 1
             for r in (0, 1) for kind in ("model", "optim")} | {"latest": 1}
    z3 = _ds(zero3, None)
    assert {(r.source, r.suffix) for r in z3.rank_files} == {
        (DS + "zero_pp_rank_0_mp_rank_00_model_states.pt", "_mp_rank_00_model_states.pt"),
        (DS + "zero_pp_rank_0_mp_rank_00_model_states.pt", "_mp_rank_00_optim_states.pt")}
    zero0 = {DS_MODEL: 1, "latest": 1}
    assert _ds(zero0, 2).complete and _ds(zero0, 2).rank_files == ()


@pytest.mark.parametrize(("rel", "wanted"), [
    ("global_step100/mp_rank_00_model_states.pt", True),
    ("run/global_step100/mp_rank_01_model_states.pt", True),
    ("global_step100/zero_pp_rank_0_mp_rank_00_model_states.pt", True),
    ("global_step100/zero_pp_rank_1_mp_rank_00_model_states.pt", False),
    ("global_step100/zero_pp_rank_0_mp_rank_00_optim_states.pt", False),
    ("global_step100.tmp/mp_rank_00_model_states.pt", False),
    ("other/mp_rank_00_model_states.pt", False),
])
def test_deepspeed_wants_torch_fields(rel: str, wanted: bool) -> None:
    assert layouts.wants_torch_fields(rel) is wanted
    assert layouts.wants_torch_fields(rel, "single") is False


def test_deepspeed_trusted_globals() -> None:
    assert "deepspeed.runtime.zero.config.ZeroStageEnum" in layouts.trusted_globals("deepspeed")
    assert layouts.trusted_globals("hf") == layouts.trusted_globals("nope") == frozenset()


def test_deepspeed_pointer_files() -> None:
    files = (DS_MODEL, DS + "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    assert layouts.pointer_files("deepspeed", files) == {"latest": b"global_step100"}
    assert layouts.pointer_files("deepspeed", tuple("run/" + f for f in files)) == {
        "run/latest": b"global_step100"}
    assert layouts.pointer_files("dcp", files) == {}
    step0 = ("global_step0/mp_rank_00_model_states.pt",)
    assert layouts.pointer_files("deepspeed", step0) == {"latest": b"global_step0"}
