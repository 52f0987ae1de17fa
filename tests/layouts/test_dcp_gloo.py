"""Real 2-rank torch.distributed.checkpoint saves (gloo, one process per rank, a DTensor sharded
across the ranks plus replicated state) into a root that a daemon in the test process watches:
a whole save is valid and latest; a save missing a rank's data file, or whose rank 1 died before
the commit, is never latest; `ckptd verify` tells a whole save from one with a flipped byte, and
`ckptd restore` gives the whole save back byte for byte, and ckptd takes the restored copy as
whole.

Run as a script, this file is one rank of such a save (see `_rank_main`)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from support.config import SETTLE_S
from support.ports import rendezvous_port
from support.published import published_step
from support.wait import wait_scans

# DCP warns when it reads or writes without a process group, which is what these tests mean.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
WORLD = 2
ROWS, COLS = 512, 256  # the sharded weight: 512 KiB, 256 KiB per rank


def dcp_save(ckpt_dir: Path, seed: int, die_rank: int = -1, timeout: float = 60.0
             ) -> list[int]:
    """Run a 2-rank gloo DCP save of seed's state into `ckpt_dir`; the ranks' exit codes.
    With `die_rank`, that rank exits hard after writing its data, before the commit."""
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(rendezvous_port()),
           "WORLD_SIZE": str(WORLD), "OMP_NUM_THREADS": "1",
           # each rank runs this file, whose imports need tests/ (support) on its path
           "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[1]),
                                                       os.environ.get("PYTHONPATH")]))}
    env.pop("CKPTD_SOCKET", None)
    procs = [subprocess.Popen([sys.executable, __file__, str(ckpt_dir), str(seed), str(die_rank)],
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for r in range(WORLD)]
    codes, outs = [], []
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            out, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            out, _ = p.communicate()
        codes.append(p.returncode)
        outs.append(out.decode(errors="replace"))
    if die_rank < 0:
        assert codes == [0] * WORLD, "\n".join(outs)
    return codes


def full_state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(ROWS, COLS, generator=g), "b": torch.randn(COLS, generator=g)}


def _rank_main(ckpt_dir: str, seed: int, die_rank: int) -> None:
    from datetime import timedelta

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    rank = int(os.environ["RANK"])

    class Writer(FileSystemWriter):
        def write_data(self, plan: Any, planner: Any) -> Any:
            fut = super().write_data(plan, planner)
            if rank == die_rank:
                fut.wait()  # this rank's data file is on disk; the commit never comes
                os._exit(9)
            return fut

    dist.init_process_group("gloo", timeout=timedelta(seconds=20))
    mesh = init_device_mesh("cpu", (WORLD,))
    full = full_state(seed)
    state = {
        "model": {"w": distribute_tensor(full["w"], mesh, [Shard(0)]),
                  "b": distribute_tensor(full["b"], mesh, [Replicate()])},
        "optim": {"lr": 0.01, "rank_local_steps": torch.tensor([seed])},
        "step": seed,
    }
    dcp.save(state, storage_writer=Writer(ckpt_dir, thread_count=1))
    dist.barrier()
    dist.destroy_process_group()


def rot_byte_mid(path: Path) -> None:
    """Flip a byte in the middle of the file the way bit rot does: the mtime stays."""
    st = path.stat()
    with open(path, "r+b") as f:
        f.seek(st.st_size // 2)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0x55]))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def verify(path: Path) -> tuple[int, dict[str, Any]]:
    env = {k: v for k, v in os.environ.items() if k not in ("CKPTD_SOCKET", "CKPTD_CONFIG")}
    r = subprocess.run([sys.executable, "-m", "ckptd", "verify", str(path), "--json"],
                       capture_output=True, text=True, timeout=60, env=env)
    assert r.stdout, r.stderr
    return r.returncode, json.loads(r.stdout)


def test_whole_save_is_valid_latest_and_verifies(inproc_daemon: Any, tmp_path: Path) -> None:
    d = inproc_daemon(roots=[{"name": "r1", "upload": {"url": f"file://{tmp_path}/remote"}}])
    root = d.roots["r1"]
    good = root / "step-100"
    dcp_save(good, seed=100)
    assert sorted(p.name for p in good.iterdir()) == [".metadata", "__0_0.distcp",
                                                      "__1_0.distcp"]
    rec = d.wait_for("r1", 100)
    assert (rec["state"], rec["layout"], rec["path"]) == ("valid", "dcp", "step-100")
    assert d.client.latest("r1")["step"] == 100  # type: ignore[index]
    assert published_step(root) == 100

    # What the daemon vouched for reads back whole with DCP itself (one reader, no group).
    import torch.distributed.checkpoint as dcp

    back = {"model": {"w": torch.empty(ROWS, COLS), "b": torch.empty(COLS)}}
    dcp.load(back, checkpoint_id=str(good), no_dist=True)
    assert torch.equal(back["model"]["w"], full_state(100)["w"])

    code, doc = verify(good)
    assert code == 0, doc
    assert (doc["valid"], doc["layout"], doc["step"]) == (True, "dcp", 100)
    assert {f["path"].rsplit("/", 1)[-1] for f in doc["files"]} == {
        ".metadata", "__0_0.distcp", "__1_0.distcp"}

    bad = tmp_path / "copies" / "step-100"
    shutil.copytree(good, bad)  # copy2: mtimes kept, as a faithful copy would
    rot_byte_mid(bad / "__1_0.distcp")  # inside rank 1's shard of "w"
    code, doc = verify(bad)
    assert code == 1, doc
    assert (doc["valid"], doc["reason"]) == (False, "crc_mismatch"), doc

    # The same save with its rank-1 data file lost, put together aside and moved in whole,
    # so the daemon never sees it with the file.
    lost = tmp_path / "staging" / "step-200"
    shutil.copytree(good, lost)
    (lost / "__1_0.distcp").unlink()
    lost.rename(root / "step-200")

    assert d.client.wait("r1", 100, until="uploaded", timeout=60), d.log_text()[-3000:]
    out = tmp_path / "restored"
    r = subprocess.run([sys.executable, "-m", "ckptd", "restore", "r1", "100", "--to", str(out),
                        "--config", str(d.config)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    for name in (".metadata", "__0_0.distcp", "__1_0.distcp"):
        assert (out / "step-100" / name).read_bytes() == (good / name).read_bytes()

    wait_scans(d.client, settle=SETTLE_S, wake=d.wake_scan)
    assert_never_latest(d, 200, latest=100)


def test_rank_dying_before_the_commit_is_never_latest(inproc_daemon: Any) -> None:
    import torch.distributed.checkpoint as dcp

    d = inproc_daemon()
    root = d.roots["r1"]
    dcp.save({"model": full_state(100)}, checkpoint_id=str(root / "step-100"), no_dist=True)
    assert d.wait_for("r1", 100)["state"] == "valid"
    # Rank 1 dies after writing its data, before rank 0 can commit .metadata.
    died = root / "step-300"
    codes = dcp_save(died, seed=300, die_rank=1)
    assert codes[1] == 9 and codes[0] != 0, codes
    assert not (died / ".metadata").exists()
    assert (died / "__0_0.distcp").exists() or (died / "__1_0.distcp").exists()
    wait_scans(d.client, settle=SETTLE_S, wake=d.wake_scan)
    assert_never_latest(d, 300, latest=100)


def assert_never_latest(d: Any, step: int, latest: int) -> None:
    rec = d.client.checkpoint("r1", step)
    assert rec is None or rec["state"] in ("pending", "invalid"), rec
    if rec is not None and rec["state"] == "invalid":
        assert rec["reason"]
    assert d.client.latest("r1")["step"] == latest  # type: ignore[index]
    assert published_step(d.roots["r1"]) == latest
    code, doc = verify(d.roots["r1"] / f"step-{step}")
    assert code == 1 and doc["valid"] is False and doc["reason"], doc


def test_restored_dcp_save_is_whole_for_ckptd(inproc_daemon: Any, tmp_path: Path) -> None:
    """A fresh node restoring a DCP step to resume from it: the restored files must be a whole
    checkpoint for `ckptd verify` and for a daemon watching where they land (restore gives
    every file one mtime, else .metadata, restored first, would look older than its data)."""
    import torch.distributed.checkpoint as dcp

    d = inproc_daemon(roots=[{"name": "r1", "upload": {"url": f"file://{tmp_path}/remote"}},
                              {"name": "r2"}])
    src = d.roots["r1"] / "step-7"
    g = torch.Generator().manual_seed(7)
    state = {"w": torch.randn(1024, 1024, generator=g), "b": torch.randn(1024, generator=g)}
    dcp.save(state, checkpoint_id=str(src), no_dist=True)  # one writer: __0_0.distcp, 4 MiB
    assert d.wait_for("r1", 7)["state"] == "valid"
    assert d.client.wait("r1", 7, until="uploaded", timeout=60), d.log_text()[-3000:]
    dest = d.roots["r2"]
    r = subprocess.run([sys.executable, "-m", "ckptd", "restore", "r1", "7", "--to", str(dest),
                        "--config", str(d.config)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    for name in (".metadata", "__0_0.distcp"):
        assert (dest / "step-7" / name).read_bytes() == (src / name).read_bytes()
    code, doc = verify(dest / "step-7")
    assert code == 0 and doc["valid"] is True, doc
    assert d.wait_for("r2", 7, timeout=15)["state"] == "valid"


if __name__ == "__main__":
    _rank_main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
