"""`ckptd.torch.save(..., node_local=True)` and the native layout on a multi-node root: how
ranks group by the directory they see, what each node's share looks like to the layout, and
the commit record rank 0's `meta.json` gives (docs/MULTINODE.md). The 3-node save through real
daemons is in test_multinode.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import xxhash
from support.layouts_real import snapshot

import ckptd.torch
from ckptd import layouts
from ckptd.errors import CkptdError, PermanentError, TransientError
from ckptd.model import RootOptions
from ckptd.remote.manifest import Manifest, StoredFile
from ckptd.stages.multinode import records
from ckptd.torch._nodelocal import groups_of

SETTLE = 5.0


def test_ranks_group_by_the_directory_they_see() -> None:
    assert groups_of([[0, 1], [0, 1], [2], [3, 4], [3, 4]]) == {
        0: (0, 1), 1: (0, 1), 2: (2,), 3: (3, 4), 4: (3, 4)}
    assert groups_of([[0]]) == {0: (0,)}


@pytest.mark.parametrize("views", [
    [[0, 1], [1]],        # rank 0 sees rank 1's probe, rank 1 does not see rank 0's
    [[1], [1]],           # rank 0 does not see its own probe
    [[0, 1, 2], [0, 1], [0, 1, 2]],
])
def test_views_that_are_not_a_partition_are_refused(views: list[list[int]]) -> None:
    with pytest.raises(CkptdError, match="disagree"):
        groups_of(views)


def test_node_local_needs_torch_distributed_and_blocking(tmp_path: Path) -> None:
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="torch.distributed"):
        ckptd.torch.save(tmp_path, 3, model=model, node_local=True, register=False)
    with pytest.raises(ValueError, match="blocking only"):
        ckptd.torch.save(tmp_path, 3, model=model, node_local=True,  # type: ignore[call-overload]
                         blocking=False, register=False)
    assert list(tmp_path.iterdir()) == []


def _write(root: Path, files: dict[str, bytes], meta: list[tuple[str, int]] | None) -> None:
    d = root / "step-7"
    d.mkdir(parents=True)
    for name, data in files.items():
        (d / name).write_bytes(data)
    if meta is not None:
        listing = [{"path": p, "size": s, "component": "x"} for p, s in meta]
        (d / "meta.json").write_text(json.dumps(
            {"format": "ckptd-native/1", "step": 7, "world_size": 3, "files": listing}))


def _detect(root: Path, multi_node: bool, after: float = SETTLE + 1) -> list[layouts.Candidate]:
    snap = snapshot(root)
    newest = max(f.mtime for f in snap.files.values())
    return layouts.detect(snap, RootOptions(settle=SETTLE, multi_node=multi_node),
                          newest + after)


def test_the_coordinators_share_holds_meta_and_its_own_files(tmp_path: Path) -> None:
    _write(tmp_path, {"model.pt": b"m" * 10, "optim.rank0.pt": b"o" * 4},
           [("model.pt", 10), ("optim.rank0.pt", 4), ("optim.rank1.pt", 9)])
    (cand,) = _detect(tmp_path, multi_node=True, after=0.0)
    assert (cand.layout, cand.complete, cand.node_share) == ("native", True, True)
    assert cand.expected_sizes == {"step-7/model.pt": 10, "step-7/optim.rank0.pt": 4}
    (single,) = _detect(tmp_path, multi_node=False)  # one node: rank 1's file is missing
    assert not single.complete and "step-7/optim.rank1.pt" in single.waiting_for


def test_a_size_meta_lists_is_still_held_on_the_coordinator(tmp_path: Path) -> None:
    _write(tmp_path, {"model.pt": b"m" * 8}, [("model.pt", 10), ("optim.rank1.pt", 9)])
    (cand,) = _detect(tmp_path, multi_node=True)
    assert not cand.complete and "to reach 10 bytes" in cand.waiting_for


def test_another_nodes_share_is_its_settled_rank_files(tmp_path: Path) -> None:
    _write(tmp_path, {"optim.rank1.pt": b"o" * 4, "rng.rank1.pt": b"r" * 4}, None)
    (fresh,) = _detect(tmp_path, multi_node=True, after=0.0)
    assert not fresh.complete  # not settled yet
    (cand,) = _detect(tmp_path, multi_node=True)
    assert (cand.complete, cand.node_share) == (True, True)
    (single,) = _detect(tmp_path, multi_node=False)
    assert not single.complete and "meta.json" in single.waiting_for


def test_a_step_dir_of_other_names_is_no_native_share(tmp_path: Path) -> None:
    _write(tmp_path, {"optim.rank1.pt": b"o" * 4, "notes.txt": b"x"}, None)
    cands = [c for c in _detect(tmp_path, multi_node=True) if c.layout == "native"]
    assert cands and not any(c.complete for c in cands)


def _manifest(root: Path, rels: list[str]) -> Manifest:
    files = []
    for rel in rels:
        data = (root / rel).read_bytes()
        files.append(StoredFile(rel, len(data), xxhash.xxh3_128_hexdigest(data), "xxh3-128",
                                "none", len(data), rel))
    return Manifest("job", 7, "native", tuple(files))


def test_the_record_is_every_file_meta_lists(tmp_path: Path) -> None:
    _write(tmp_path, {"model.pt": b"m" * 10},
           [("model.pt", 10), ("optim.rank0.pt", 4), ("optim.rank1.pt", 9)])
    manifest = _manifest(tmp_path, ["step-7/meta.json", "step-7/model.pt"])
    mtimes = {"step-7/meta.json": 50.0, "step-7/model.pt": 40.0}
    record = records.native_record(tmp_path, manifest, mtimes)
    assert record is not None
    assert (record.path, record.mtime, record.after, record.exact) == (
        "step-7/meta.json", 50.0, 0.0, True)
    assert dict(record.expected) == {"step-7/model.pt": 10, "step-7/optim.rank0.pt": 4,
                                     "step-7/optim.rank1.pt": 9}
    share = _manifest(tmp_path, ["step-7/model.pt"])  # no meta.json: another node's share
    assert records.native_record(tmp_path, share, mtimes) is None


def test_a_meta_changed_since_validation_or_unreadable_gives_no_record(tmp_path: Path) -> None:
    _write(tmp_path, {"model.pt": b"m"}, [("model.pt", 1)])
    manifest = _manifest(tmp_path, ["step-7/meta.json"])
    meta = tmp_path / "step-7" / "meta.json"
    meta.write_text(meta.read_text().replace('"size": 1', '"size": 2'))
    with pytest.raises(TransientError, match="changed since it was validated"):
        records.native_record(tmp_path, manifest, {"step-7/meta.json": 1.0})
    meta.write_text('{"files": [{"path": "model.pt"}]}')
    with pytest.raises(PermanentError, match="no file listing"):
        records.native_record(tmp_path, _manifest(tmp_path, ["step-7/meta.json"]),
                            {"step-7/meta.json": 1.0})


def test_an_exact_record_refuses_a_longer_file() -> None:
    """DCP's record names a least size (a byte range's end); native's meta.json an exact one."""
    from ckptd.cluster import commit as cc

    def coord(exact: bool) -> cc.Part:
        return cc.Part("0", "c", "native", (
            cc.PartFile("s/meta.json", 5, 100.0, "m", "x", "none", 5, "0.c/s/meta.json"),),
            cc.CommitRecord("s/meta.json", 100.0, {"s/optim.rank1.pt": 10}, exact=exact))

    longer = cc.Part("1", "a", "native", (cc.PartFile("s/optim.rank1.pt", 11, 99.0, "h", "x",
                                                      "none", 11, "1.a/s/optim.rank1.pt"),))
    seen = {"0.c": {"1.a"}}  # node 1 confirmed its part for the record's save
    assert cc.choose([coord(False), longer], confirmed=seen).covered
    plan = cc.choose([coord(True), longer], confirmed=seen)
    assert not plan.covered and "needs 10" in plan.problems[0]
    assert cc.parse_part(coord(True).to_bytes(), "p").record == coord(True).record


LINKED = """
import os, sys, torch, torch.distributed as dist
import ckptd.torch
from ckptd.errors import CkptdError
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + sys.argv[2], rank=0,
                        world_size=1)
root = sys.argv[1]
os.symlink(os.path.join(root, "..", "elsewhere"), os.path.join(root, "step-5.tmp"))
try:
    ckptd.torch.save(root, 5, model=torch.nn.Linear(2, 2), node_local=True, register=False)
except CkptdError as exc:
    print("REFUSED", exc)
ckptd.torch.save(root, 6, model=torch.nn.Linear(2, 2), node_local=True, register=False)
print(sorted(os.listdir(os.path.join(root, "step-6"))))
"""


def test_one_node_saves_whole_and_a_linked_tmp_dir_is_refused(tmp_path: Path) -> None:
    """World size 1 (one node): the save is an ordinary native checkpoint. A `step-N.tmp`
    that is a symlink is refused, and nothing where it points is touched."""
    import socket
    import subprocess
    import sys

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "keep.txt").write_text("mine")
    root = tmp_path / "root"
    root.mkdir()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    done = subprocess.run([sys.executable, "-c", LINKED, str(root), str(port)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "REFUSED" in done.stdout and "not a directory of this root" in done.stdout
    assert (elsewhere / "keep.txt").read_text() == "mine"
    assert sorted(p.name for p in elsewhere.iterdir()) == ["keep.txt"]
    assert "['meta.json', 'model.pt', 'rng.rank0.pt']" in done.stdout
    meta = json.loads((root / "step-6" / "meta.json").read_text())
    assert meta["nodes"] == 1 and [f["path"] for f in meta["files"]] == ["model.pt",
                                                                         "rng.rank0.pt"]
