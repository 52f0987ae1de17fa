"""Three real daemons, one per "node", each with its own root, state and socket, sharing only an
object store (file://): a real 3-rank gloo DCP save where each rank's FileSystemWriter points at
its own node's root (what node-local disks give), committed once through the store; a node whose
daemon is down during the save leaves the step uncommitted and never latest until it returns;
`ckptd restore --all` gives one directory that `dcp.load` reads. docs/MULTINODE.md.

Run as a script, this file is one rank of such a save (see `_rank_main`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from support.wait import wait_until

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
WORLD = 3
ROWS, COLS = 384, 64


def _free_port() -> int:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def full_state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(ROWS, COLS, generator=g), "b": torch.randn(COLS, generator=g)}


def dcp_save(dirs: list[Path], seed: int, timeout: float = 90.0) -> None:
    """A 3-rank gloo DCP save of seed's state; rank r writes into dirs[r] (its node's disk)."""
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()),
           "WORLD_SIZE": str(WORLD), "OMP_NUM_THREADS": "1"}
    env.pop("CKPTD_SOCKET", None)
    procs = [subprocess.Popen([sys.executable, __file__, str(dirs[r]), str(seed)],
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for r in range(WORLD)]
    outs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=timeout)
            outs.append(out.decode(errors="replace"))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert [p.returncode for p in procs] == [0] * WORLD, "\n".join(outs)


def _rank_main(ckpt_dir: str, seed: int) -> None:
    from datetime import timedelta

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    dist.init_process_group("gloo", timeout=timedelta(seconds=30))
    mesh = init_device_mesh("cpu", (WORLD,))
    full = full_state(seed)
    state = {"model": {"w": distribute_tensor(full["w"], mesh, [Shard(0)]),
                       "b": distribute_tensor(full["b"], mesh, [Replicate()])},
             "step": seed}
    dcp.save(state, storage_writer=FileSystemWriter(ckpt_dir, thread_count=1))
    dist.barrier()
    dist.destroy_process_group()


# -- the nodes -------------------------------------------------------------------------------


class Nodes:
    """Three `ckptd run` processes, node n0 .. n2, one root `job` each, one shared remote."""

    def __init__(self, tmp: Path, socks: Path, remote: str, commit_timeout: str = "10s"
                 ) -> None:
        from support.config import write_layout
        from support.proc import DaemonHandle

        self.remote = remote
        self.handles = []
        for n in range(WORLD):
            layout = write_layout(
                tmp / f"n{n}", socks / f"n{n}.sock",
                [{"name": "job", "nodes": WORLD, "commit_timeout": commit_timeout,
                  "upload": {"url": remote}}], node=f"n{n}")
            self.handles.append(DaemonHandle(layout, tmp / f"n{n}.log"))

    def start(self, *which: int) -> None:
        for n in which or range(WORLD):
            self.handles[n].start()

    def stop(self) -> None:
        for h in self.handles:
            h.stop()

    def root(self, n: int) -> Path:
        return self.handles[n].roots["job"]

    def dirs(self, step: int) -> list[Path]:
        return [self.root(n) / f"step-{step}" for n in range(WORLD)]

    def row(self, n: int, step: int) -> dict[str, Any] | None:
        rows = self.handles[n].client.checkpoints("job") or []
        return next((c for c in rows if c["step"] == step), None)

    def wait_committed(self, step: int, nodes: range | tuple[int, ...] = range(WORLD),
                       timeout: float = 60.0) -> None:
        for n in nodes:
            wait_until(lambda n=n: (self.row(n, step) or {}).get("remote") == "uploaded",
                       timeout, f"node n{n} to record step {step} committed",
                       detail=lambda n=n: self.handles[n].log_text()[-4000:])

    def latest_json(self, n: int) -> int | None:
        try:
            return int(json.loads((self.root(n) / ".ckptd" / "latest.json").read_text())["step"])
        except (OSError, ValueError, KeyError, TypeError):
            return None


@pytest.fixture
def nodes(tmp_path: Path, short_dir: Path) -> Any:
    made: list[Nodes] = []

    def make(**kw: Any) -> Nodes:
        n = Nodes(tmp_path, short_dir, f"file://{tmp_path}/remote", **kw)
        made.append(n)
        return n

    yield make
    for n in made:
        n.stop()


def _manifest(tmp_path: Path, step: int) -> dict[str, Any]:
    doc = json.loads((tmp_path / "remote" / "job" / f"step-{step}" / "MANIFEST.json").read_text())
    assert isinstance(doc, dict)
    return doc


def test_a_three_node_dcp_save_is_committed_once_and_restores_whole(
        nodes: Any, tmp_path: Path) -> None:
    cluster = nodes()
    cluster.start()
    dcp_save(cluster.dirs(10), seed=10)
    assert (cluster.root(0) / "step-10" / ".metadata").exists()
    assert not (cluster.root(1) / "step-10" / ".metadata").exists()
    started = time.monotonic()
    cluster.wait_committed(10)
    doc = _manifest(tmp_path, 10)
    assert sorted(n["node"] for n in doc["nodes"]) == ["n0", "n1", "n2"]
    assert [n.get("record") for n in doc["nodes"] if n["node"] == "n0"] == ["step-10/.metadata"]
    paths = sorted(f["path"] for f in doc["files"])
    assert paths == ["step-10/.metadata", *(f"step-10/__{r}_0.distcp" for r in range(WORLD))]
    attempts = {f'{n["node"]}.{n["attempt"]}/' for n in doc["nodes"]}
    for f in doc["files"]:  # each file under its node's attempt-unique prefix
        assert any(f["key"].startswith(a + f["path"]) for a in attempts), f
    for n in range(WORLD):
        assert wait_until(lambda n=n: cluster.latest_json(n) == 10, 15, "latest.json")
    committed = [e for h in cluster.handles for e in h.events("step_committed")]
    assert len(committed) == 1, committed
    print(f"commit after save: {time.monotonic() - started:.2f}s")

    out = tmp_path / "restored"
    r = subprocess.run([sys.executable, "-m", "ckptd", "restore", "job", "10", "--to", str(out),
                        "--all", "--config", str(cluster.handles[1].config)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    import torch.distributed.checkpoint as dcp

    want = full_state(10)
    got = {"model": {"w": torch.zeros(ROWS, COLS), "b": torch.zeros(COLS)}, "step": 0}
    dcp.load(got, checkpoint_id=str(out / "step-10"))
    assert torch.equal(got["model"]["w"], want["w"]) and torch.equal(got["model"]["b"], want["b"])
    assert got["step"] == 10


def test_a_node_down_during_the_save_holds_the_commit_until_it_returns(
        nodes: Any, tmp_path: Path) -> None:
    cluster = nodes()
    cluster.start()
    dcp_save(cluster.dirs(1), seed=1)
    cluster.wait_committed(1)
    cluster.handles[2].stop()
    dcp_save(cluster.dirs(2), seed=2)
    waiting = cluster.handles[0].client
    wait_until(lambda: next((u for r in waiting.status()["roots"]
                             for u in r["uncommitted"] or [] if u["step"] == 2), None),
               30, "status to list step 2 as uncommitted")
    status = waiting.status()["roots"][0]
    assert status["uncommitted"] == [{"step": 2, "missing_nodes": ["n2"]}]
    assert status["latest"] == 1
    for n in (0, 1):
        assert cluster.latest_json(n) == 1
        assert (cluster.row(n, 2) or {}).get("remote") != "uploaded"
    assert not (tmp_path / "remote" / "job" / "step-2" / "MANIFEST.json").exists()
    cluster.start(2)
    cluster.wait_committed(2)
    for n in range(WORLD):
        assert wait_until(lambda n=n: cluster.latest_json(n) == 2, 15, "latest.json")


if __name__ == "__main__":
    _rank_main(sys.argv[1], int(sys.argv[2]))
