"""detect() on checkpoints written the way each framework writes them, whole and cut short."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import layout_writers as w
import pytest
from support.layouts_real import CASES, SETTLE, detect, snapshot

from ckptd.model import Candidate, RootOptions
from ckptd.watch.scanner import RootScanner

# Cutting these short leaves a file that only settling (or validation's framing check) can
# tell apart: the single layout has no commit marker.
NO_MARKER = {"single"}
# A first ranked save cut after `model_<N>.pt` is, to "auto", a single-file checkpoint (see
# test_ranked_first_save_in_auto): these cases are checked with their layout named.
NAMED = {"ranked"}


def _write(name: str, root: Path, stop: str | None = None) -> None:
    writer, kwargs, *_ = CASES[name]
    writer(root, **kwargs, stop=stop)


@pytest.mark.parametrize("name", list(CASES))
def test_whole_checkpoint_is_complete(name: str, tmp_path: Path) -> None:
    _, _, world, layout, step, anchor = CASES[name]
    _write(name, tmp_path)
    [cand] = detect(tmp_path, world)
    assert (cand.layout, cand.step, cand.path, cand.complete) == (layout, step, anchor, True), cand
    assert cand.invalid_reason == ""
    everything = set(snapshot(tmp_path).files)
    pointers = {"latest", "latest_checkpointed_iteration.txt"}  # shared by all steps
    assert set(cand.files) == everything - pointers


@pytest.mark.parametrize(("name", "stop"), [
    (n, s) for n in CASES if n not in NO_MARKER for s in w.STAGES[n]
])
def test_cut_short_is_never_complete(name: str, stop: str, tmp_path: Path) -> None:
    _write(name, tmp_path, stop)
    _, _, world, layout, *_ = CASES[name]
    got = detect(tmp_path, world, layout=layout if name in NAMED else "auto")
    assert not [c for c in got if c.complete], got
    assert all(c.waiting_for for c in got)


def test_ranked_first_save_in_auto(tmp_path: Path) -> None:
    w.write_ranked(tmp_path / "a", 7, stop="meta")
    assert [(c.layout, c.complete) for c in detect(tmp_path)] == [("single", True)]
    # Once the dir holds a ranked save, a lone model file is a ranked save under way.
    w.write_ranked(tmp_path / "b", 7)
    w.write_ranked(tmp_path / "b", 8, stop="meta")
    got = [(c.path, c.layout, c.complete) for c in detect(tmp_path / "b")]
    assert got == [("model_7.pt", "ranked", True), ("model_8.pt", "ranked", False)]


@pytest.mark.parametrize("stop", ["dcp", "metadata_json"])
def test_megatron_torch_dist_cut_short_stays_pending_after_later_saves(tmp_path: Path,
                                                                      stop: str) -> None:
    """A save killed before megatron-core's last file, then a later save tracked: the
    tracker names a later iteration, and the cut-short one is still not whole."""
    w.write_megatron(tmp_path, 100, torch_dist=True, stop=stop)
    w.write_megatron(tmp_path, 200, torch_dist=True)
    got = {c.step: c for c in detect(tmp_path)}
    assert got[200].complete
    assert not got[100].complete and "iter_0000100/metadata.json" in got[100].waiting_for


def test_single_torn_write_waits_for_settle(tmp_path: Path) -> None:
    w.write_single(tmp_path, 9, stop="finish")
    [cand] = detect(tmp_path, after=1.0)
    assert not cand.complete and "unchanged" in cand.waiting_for


def test_native_sizes_and_metrics(tmp_path: Path) -> None:
    w.write_native(tmp_path, 5, world_size=2)
    [cand] = detect(tmp_path)
    assert cand.complete and cand.metrics == {"val_loss": 1.25}
    assert cand.expected_sizes == {
        f: (tmp_path / f).stat().st_size
        for f in ("step-5/model.pt", "step-5/optim.rank0.pt", "step-5/optim.rank1.pt")}


def test_native_tmp_dir_is_not_reported(tmp_path: Path) -> None:
    w.write_native(tmp_path, 5, stop="rename")
    assert detect(tmp_path) == []


def test_deepspeed_latest_before_other_ranks(tmp_path: Path) -> None:
    w.write_deepspeed(tmp_path, 100, world_size=2, stop="optim1")
    [cand] = detect(tmp_path, world_size=2)
    assert not cand.complete and "dp 1/mp 0" in cand.waiting_for
    # Without world_size the ranks are inferred; only settling then guards the gap.
    [inferred] = detect(tmp_path, world_size=0, after=1.0)
    assert not inferred.complete


def test_deepspeed_bf16_two_saves(tmp_path: Path) -> None:
    w.write_deepspeed(tmp_path, 100, world_size=3, bf16=True)
    w.write_deepspeed(tmp_path, 200, world_size=3, bf16=True, stop="optim2")
    got = detect(tmp_path)  # ranks inferred: step 200 has only 0 and 1 ... and settled
    assert [(c.step, c.complete) for c in got] == [(100, True), (200, True)]
    got = detect(tmp_path, world_size=3)
    assert [(c.step, c.complete) for c in got] == [(100, True), (200, False)]


class Scans:
    """One RootScanner over a root, as the daemon keeps it: it remembers what it saw."""

    def __init__(self, root: Path) -> None:
        self.scanner = RootScanner("r", root, "auto", RootOptions(settle=SETTLE))
        self.now = time.time()

    def detect(self) -> list[Candidate]:
        self.now += SETTLE + 1
        return [c for c, _ in self.scanner.scan(self.now)[1]]


def test_dcp_resave_in_progress(tmp_path: Path) -> None:
    """Shards rewritten under a `.metadata` ckptd already saw: a re-save, until the new
    `.metadata` lands."""
    d = w.write_dcp(tmp_path / "step-3")
    scans = Scans(tmp_path)
    [cand] = scans.detect()
    assert cand.complete and cand.min_sizes
    assert all((tmp_path / f).stat().st_size >= n for f, n in cand.min_sizes.items())
    w.write_dcp(d, 1, stop="metadata")  # new shards, the old .metadata still there
    [again] = scans.detect()
    assert not again.complete and "re-save" in again.waiting_for
    w.write_dcp(d, 1)  # the whole save again, its .metadata last
    [done] = scans.detect()
    assert done.complete


@pytest.mark.parametrize("seen_while_copying", [False, True, "half"])
def test_dcp_copied_with_cp_r_completes(tmp_path: Path, seen_while_copying: bool | str
                                        ) -> None:
    """`cp -r` gives each file a new mtime in copy order (`.metadata` first, so older than
    the shards): a copy, not a re-save; complete once every referenced byte is there."""
    src = w.write_dcp(tmp_path / "src" / "step-3")
    dst = tmp_path / "root" / "step-3"
    dst.mkdir(parents=True)
    scans = Scans(tmp_path / "root")
    names = sorted(p.name for p in src.iterdir())
    assert names[0] == ".metadata"
    for i, name in enumerate(names):
        time.sleep(0.01)
        if seen_while_copying == "half" and i == 1:  # a scan lands mid-file
            data = (src / name).read_bytes()
            (dst / name).write_bytes(data[: len(data) // 2])
            [early] = scans.detect()
            assert not early.complete and "to reach" in early.waiting_for
            time.sleep(0.01)
        shutil.copyfile(src / name, dst / name)  # new mtime, as cp -r without -p
        if seen_while_copying is True and i == 0:
            [early] = scans.detect()
            assert not early.complete  # shards not there yet
    assert (dst / ".metadata").stat().st_mtime < (dst / names[-1]).stat().st_mtime
    [cand] = scans.detect()
    assert cand.complete, cand.waiting_for


def test_dcp_torchtitan_step_dir_without_metadata(tmp_path: Path) -> None:
    w.write_dcp(tmp_path / "step-3", stop="metadata")
    [cand] = detect(tmp_path)
    assert (cand.layout, cand.complete) == ("dcp", False)
    assert "step-3/.metadata" in cand.waiting_for


def test_hf_metrics(tmp_path: Path) -> None:
    w.write_hf(tmp_path, 500)
    [cand] = detect(tmp_path)
    assert cand.metrics == {"best_metric": 0.42, "eval_loss": 0.42, "eval_runtime": 1.5}


def test_orbax_metrics_saved_as_their_own_item(tmp_path: Path) -> None:
    """CheckpointManager(..., metrics=...) (0.12) writes `<step>/metrics/metrics` as JSON and
    leaves `_CHECKPOINT_METADATA`'s metrics empty."""
    w.write_orbax(tmp_path, 300)
    (tmp_path / "300" / "metrics").mkdir()
    (tmp_path / "300" / "metrics" / "metrics").write_text('{"loss": 0.3, "acc": true}')
    [cand] = detect(tmp_path)
    assert cand.complete and cand.metrics == {"loss": 0.3}


def test_orbax_old_tmp_name_and_metrics(tmp_path: Path) -> None:
    w.write_orbax(tmp_path, 100, tmp_ts=1700000000, stop="rename")
    [pending] = detect(tmp_path)
    assert pending.path == "100.orbax-checkpoint-tmp-1700000000" and not pending.complete
    w.write_orbax(tmp_path, 200)
    got = detect(tmp_path)
    assert [(c.step, c.complete) for c in got] == [(100, False), (200, True)]
    assert got[1].metrics == {"loss": 0.125}


@pytest.mark.parametrize("stop", w.STAGES["orbax_commit_file"])
def test_orbax_commit_file(stop: str, tmp_path: Path) -> None:
    w.write_orbax(tmp_path, 100, commit_file=True)
    w.write_orbax(tmp_path, 200, commit_file=True, stop=stop)
    got = [(c.step, c.complete) for c in detect(tmp_path)]
    assert got[0] == (100, True)
    assert (200, True) not in got


def test_deepspeed_ranks_recorded_in_the_model_states(tmp_path: Path) -> None:
    """The real scanner reads `dp_world_size` from the model states' first bytes: ranks whose
    optimizer files have not appeared are waited for without `world_size`; validation checks
    the same count if a tag is ever handed to it without them."""
    from dataclasses import replace

    from ckptd.stages.validate import validate

    w.write_deepspeed(tmp_path, 100, world_size=3, stop="optim1")  # rank 0 and `latest` only
    scans = Scans(tmp_path)
    scans.detect()
    [cand] = scans.detect()  # settled
    assert not cand.complete
    assert "zero_pp_rank_1_mp_rank_00_optim_states.pt" in cand.waiting_for
    assert "zero_pp_rank_2_mp_rank_00_optim_states.pt" in cand.waiting_for
    res = validate(tmp_path, replace(cand, complete=True))
    assert (res.valid, res.reason) == (False, "missing_file")
    assert "ranks' files are missing: global_step100/zero_pp_rank_1_mp_rank_00_optim_states.pt,"\
           " global_step100/zero_pp_rank_2_mp_rank_00_optim_states.pt" in res.message
    w.write_deepspeed(tmp_path, 100, world_size=3)  # the stragglers land (all rewritten)
    scans.detect()
    [cand] = scans.detect()
    assert cand.complete, cand.waiting_for
    assert validate(tmp_path, cand).valid


def test_torch_fields_are_read_once_and_not_while_a_file_changes(tmp_path: Path) -> None:
    """A large model states file being written changes at every scan: its head is read once
    it stops changing (or at first sight), not at every scan it wakes."""
    model = "global_step100/mp_rank_00_model_states.pt"
    w.write_deepspeed(tmp_path, 100, world_size=2)
    scanner, now = RootScanner("r", tmp_path, "auto", RootOptions(settle=SETTLE)), time.time()
    assert scanner.scan(now)[0].torch_fields[model]["dp_world_size"] == 2
    w.write_deepspeed(tmp_path, 100, world_size=3)  # rewritten since the last scan
    assert model not in scanner.scan(now + 1)[0].torch_fields
    assert scanner.scan(now + 2)[0].torch_fields[model]["dp_world_size"] == 3


# --- ranked split over nodes (a multi-node root, docs/MULTINODE.md) ---------------------------

RANKED_HOMES = {"model_5.pt": 0, "meta_5.json": 0, "optim_5_rank0.pt": 0,
                "optim_5_rank1.pt": 1, "optim_5_rank2.pt": 2}


def _ranked_over_nodes(tmp: Path, homes: dict[str, int] = RANKED_HOMES) -> list[Path]:
    """A real 3-rank ranked save, each file moved to the disk of the node that wrote it."""
    staged = tmp / "staging"
    w.write_ranked(staged, 5, world_size=3)
    nodes = [tmp / f"n{n}" for n in range(3)]
    for n in nodes:
        n.mkdir()
    for name, node in homes.items():
        (staged / name).rename(nodes[node] / name)
    return nodes


def test_ranked_split_over_nodes_each_node_holds_a_share(tmp_path: Path) -> None:
    n0, n1, n2 = _ranked_over_nodes(tmp_path)
    [coord] = detect(n0, multi_node=True)
    assert (coord.layout, coord.step, coord.path, coord.complete, coord.node_share) == (
        "ranked", 5, "model_5.pt", True, True), coord
    assert coord.files == ("meta_5.json", "model_5.pt", "optim_5_rank0.pt")
    assert coord.metrics == {"loss": 2.5} and not coord.invalid_reason
    for node, rank in ((n1, 1), (n2, 2)):  # another node's ranks, with no model or meta
        [share] = detect(node, multi_node=True)
        assert (share.layout, share.path, share.complete, share.node_share) == (
            "ranked", f"optim_5_rank{rank}.pt", True, True), share
        assert share.files == (f"optim_5_rank{rank}.pt",)
    [alone] = detect(n1)  # the same files on a single-node root: other ranks missing
    assert not alone.complete and "model_5.pt" in alone.waiting_for
    [early] = detect(n1, after=1, multi_node=True)
    assert not early.complete and "unchanged" in early.waiting_for


def test_ranked_coordinator_share_holds_model_and_meta(tmp_path: Path) -> None:
    homes = {**RANKED_HOMES, "model_5.pt": 1}  # the model went elsewhere: not a ranked save's
    n0, n1, _ = _ranked_over_nodes(tmp_path, homes)
    [coord] = detect(n0, multi_node=True)
    assert not coord.complete and coord.waiting_for == "model_5.pt", coord
    [share] = detect(n1, multi_node=True)  # the model without its meta: the meta is waited for
    assert share.path == "model_5.pt" and not share.complete
    assert share.waiting_for == "meta_5.json", share
    w.write_ranked(tmp_path / "first", 7, stop="meta")  # a lone model_<N>.pt stays single
    [single] = detect(tmp_path / "first", multi_node=True)
    assert (single.layout, single.complete, single.node_share) == ("single", True, False)


@pytest.mark.parametrize("meta", [b"{", b"[1]", b'{"pad": "' + b"x" * (1 << 20) + b'"}'])
def test_ranked_coordinator_bad_meta_is_invalid(meta: bytes, tmp_path: Path) -> None:
    n0, _, _ = _ranked_over_nodes(tmp_path)
    (n0 / "meta_5.json").write_bytes(meta)
    [coord] = detect(n0, multi_node=True)
    assert (coord.complete, coord.invalid_reason) == (True, "bad_metadata"), coord
    assert coord.invalid_message.startswith("meta_5.json")
