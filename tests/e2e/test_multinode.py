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

pytest_plugins = ["s3server"]
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


def dcp_save(roots: list[Path], *steps: int, seed: int = 0, timeout: float = 120.0,
             crash: bool = False, pattern: str = "step-{step}") -> None:
    """One 3-rank gloo job saving `steps` in turn (the state of seed `seed or step`); rank r
    writes `roots[r]/step-<N>` (its node's disk). `crash`: every rank exits hard once its
    data file of the first step is written, before the commit."""
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()),
           "WORLD_SIZE": str(WORLD), "OMP_NUM_THREADS": "1",
           # each rank runs this file, whose imports need tests/ (support) on its path
           "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[1]),
                                                       os.environ.get("PYTHONPATH")]))}
    env.pop("CKPTD_SOCKET", None)
    arg = ",".join(f"{step}:{seed or step}" for step in steps)
    procs = [subprocess.Popen([sys.executable, __file__, str(roots[r]), arg, str(crash), pattern],
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
    want = [9] * WORLD if crash else [0] * WORLD
    assert [p.returncode for p in procs] == want, "\n".join(outs)


def _rank_main(root: str, steps: str, crash: bool, pattern: str) -> None:
    from datetime import timedelta

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    class Writer(FileSystemWriter):
        def write_data(self, plan: Any, planner: Any) -> Any:
            fut = super().write_data(plan, planner)
            if crash:
                fut.wait()  # this rank's data file is on disk; the commit never comes
                os._exit(9)
            return fut

    dist.init_process_group("gloo", timeout=timedelta(seconds=30))
    mesh = init_device_mesh("cpu", (WORLD,))
    for item in steps.split(","):
        step, seed = (int(x) for x in item.split(":"))
        full = full_state(seed)
        state = {"model": {"w": distribute_tensor(full["w"], mesh, [Shard(0)]),
                           "b": distribute_tensor(full["b"], mesh, [Replicate()])},
                 "step": seed}
        where = f"{root}/{pattern.format(step=step)}"
        dcp.save(state, storage_writer=Writer(where, thread_count=1))
        dist.barrier()
    dist.destroy_process_group()


# -- the nodes -------------------------------------------------------------------------------


class Nodes:
    """Three `ckptd run` processes, node n0 .. n2, one root `job` each, one shared remote."""

    def __init__(self, tmp: Path, socks: Path, upload: dict[str, Any],
                 commit_timeout: str = "10s", **root: Any) -> None:
        from support.config import write_layout
        from support.proc import DaemonHandle

        self.handles = []
        for n in range(WORLD):
            layout = write_layout(
                tmp / f"n{n}", socks / f"n{n}.sock",
                [{"name": "job", "nodes": WORLD, "commit_timeout": commit_timeout,
                  "upload": upload, **root}], node=f"n{n}")
            self.handles.append(DaemonHandle(layout, tmp / f"n{n}.log"))

    def start(self, *which: int) -> None:
        for n in which or range(WORLD):
            self.handles[n].start()

    def stop(self) -> None:
        for h in self.handles:
            h.stop()

    def root(self, n: int) -> Path:
        return self.handles[n].roots["job"]

    def roots(self) -> list[Path]:
        return [self.root(n) for n in range(WORLD)]

    def row(self, n: int, step: int) -> dict[str, Any] | None:
        rows = self.handles[n].client.checkpoints("job") or []
        return next((c for c in rows if c["step"] == step), None)

    def wait_committed(self, step: int, nodes: range | tuple[int, ...] = range(WORLD),
                       timeout: float = 60.0) -> None:
        for n in nodes:
            wait_until(lambda n=n: (self.row(n, step) or {}).get("remote") == "uploaded",
                       timeout, f"node n{n} to record step {step} committed",
                       detail=lambda n=n: self.handles[n].log_text()[-4000:])

    def restore(self, n: int, step: int, to: Path, *how: str) -> None:
        """`ckptd restore job STEP --to TO HOW...` with node n's config (no daemon needed)."""
        r = subprocess.run([sys.executable, "-m", "ckptd", "restore", "job", str(step), "--to",
                            str(to), *how, "--config", str(self.handles[n].config)],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stdout + r.stderr

    def latest_json(self, n: int) -> int | None:
        try:
            return int(json.loads((self.root(n) / ".ckptd" / "latest.json").read_text())["step"])
        except (OSError, ValueError, KeyError, TypeError):
            return None


@pytest.fixture
def nodes(tmp_path: Path, short_dir: Path) -> Any:
    made: list[Nodes] = []

    def make(upload: dict[str, Any] | None = None, **kw: Any) -> Nodes:
        n = Nodes(tmp_path, short_dir, upload or {"url": f"file://{tmp_path}/remote"}, **kw)
        made.append(n)
        return n

    yield make
    for n in made:
        n.stop()


def _s3_get(s3: Any, url: str, key: str) -> bytes:
    from ckptd.backends import make_backend

    backend = make_backend(url, endpoint=s3.endpoint, region=s3.region,
                           access_key_id=s3.access_key, secret_access_key=s3.secret_key)
    return backend.get_bytes(key)


def _manifest(tmp_path: Path, step: int) -> dict[str, Any]:
    doc = json.loads((tmp_path / "remote" / "job" / f"step-{step}" / "MANIFEST.json").read_text())
    assert isinstance(doc, dict)
    return doc


def test_a_three_node_dcp_save_is_committed_once_and_restores_whole(
        nodes: Any, s3_server: Any, s3_url: str, tmp_path: Path) -> None:
    """Through SeaweedFS, which enforces create-only puts: the probe passes, one commit."""
    cluster = nodes(upload={"url": s3_url, "endpoint": s3_server.endpoint,
                            "region": s3_server.region, "access_key_id": s3_server.access_key,
                            "secret_access_key": s3_server.secret_key})
    cluster.start()
    dcp_save(cluster.roots(), 10)
    assert (cluster.root(0) / "step-10" / ".metadata").exists()
    assert not (cluster.root(1) / "step-10" / ".metadata").exists()
    started = time.monotonic()
    cluster.wait_committed(10)
    doc = json.loads(_s3_get(s3_server, s3_url, "job/step-10/MANIFEST.json"))
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
    cluster.restore(1, 10, out, "--all")
    import torch.distributed.checkpoint as dcp

    want = full_state(10)
    got = {"model": {"w": torch.zeros(ROWS, COLS), "b": torch.zeros(COLS)}, "step": 0}
    dcp.load(got, checkpoint_id=str(out / "step-10"))
    assert torch.equal(got["model"]["w"], want["w"]) and torch.equal(got["model"]["b"], want["b"])
    assert got["step"] == 10
    # and straight from the bucket, no restore: the commit's files under their nodes' keys
    from ckptd.dcp import StorageReader

    direct = {"model": {"w": torch.zeros(ROWS, COLS), "b": torch.zeros(COLS)}, "step": 0}
    dcp.load(direct, storage_reader=StorageReader("job", config=cluster.handles[1].config),
             no_dist=True)
    assert torch.equal(direct["model"]["w"], want["w"]) and direct["step"] == 10

    one = tmp_path / "one-node"
    cluster.restore(0, 10, one, "--node", "n2")
    assert sorted(p.name for p in (one / "step-10").iterdir()) == [".metadata", "__2_0.distcp"]
    assert (one / "step-10" / "__2_0.distcp").read_bytes() == (
        cluster.root(2) / "step-10" / "__2_0.distcp").read_bytes()


def test_a_node_down_holds_the_commit_and_retention_keeps_the_uncommitted_steps(
        nodes: Any, tmp_path: Path) -> None:
    cluster = nodes(retention={"local": {"keep_last": 1, "keep_best": 0}})
    cluster.start()
    dcp_save(cluster.roots(), 1)
    cluster.wait_committed(1)
    cluster.handles[2].stop()
    dcp_save(cluster.roots(), 2, 3)  # n2 down: steps 2 and 3 wait for its parts
    waiting = cluster.handles[0].client
    want = [{"step": 2, "missing_nodes": ["n2"], "unseen_nodes": 0},
            {"step": 3, "missing_nodes": ["n2"], "unseen_nodes": 0}]
    wait_until(lambda: waiting.status()["roots"][0]["uncommitted"] == want, 30,
               "steps 2 and 3 listed as waiting for n2's parts",
               detail=lambda: str(waiting.status()["roots"][0]["uncommitted"]))
    cluster.handles[0].stop()  # a restart rebuilds the list from the store's parts
    cluster.start(0)
    wait_until(lambda: waiting.status()["roots"][0]["uncommitted"] == want, 30,
               "steps 2 and 3 listed again after a restart",
               detail=lambda: str(waiting.status()["roots"][0]["uncommitted"]))
    from ckptd.cli.render import render_status

    assert "job: step 2 waits for its commit: parts missing from n2" in render_status(
        waiting.status())
    status = waiting.status()["roots"][0]
    assert status["latest"] == 1
    assert (cluster.row(0, 2) or {})["nodes"] == {"n0": "uploaded", "n1": "uploaded",
                                                 "n2": "missing"}
    for n in (0, 1):  # retention runs on every transition; once more now, to be sure
        cluster.handles[n].client.request_json("POST", "/v1/roots/job/prune")
    for n in (0, 1):
        assert cluster.latest_json(n) == 1
        for step in (2, 3):  # keep_last = 1, yet neither uncommitted step goes
            assert (cluster.root(n) / f"step-{step}").is_dir()
            assert (cluster.row(n, step) or {}).get("remote") != "uploaded"
    assert not (tmp_path / "remote" / "job" / "step-2" / "MANIFEST.json").exists()
    cluster.start(2)
    cluster.wait_committed(3)
    for n in range(WORLD):
        assert wait_until(lambda n=n: cluster.latest_json(n) == 3, 15, "latest.json")
    wait_until(lambda: not (cluster.root(0) / "step-2").exists(), 30,
               "step 2 pruned once committed and older than keep_last")


def test_the_coordinator_killed_after_its_part_another_node_commits(
        nodes: Any, tmp_path: Path) -> None:
    cluster = nodes(commit_timeout="10s")
    cluster.start(0)
    dcp_save(cluster.roots(), 4)  # n1, n2 down: the coordinator's part waits alone
    parts = tmp_path / "remote" / "job" / "step-4" / "_parts"
    wait_until(lambda: any(p.name.startswith("n0.") for p in parts.glob("*.json")), 30,
               "the coordinator's part", detail=lambda: cluster.handles[0].log_text()[-3000:])
    cluster.handles[0].kill9()
    cluster.start(1, 2)
    cluster.wait_committed(4, nodes=(1, 2), timeout=60)
    doc = _manifest(tmp_path, 4)
    assert sorted(n["node"] for n in doc["nodes"]) == ["n0", "n1", "n2"]
    by = [e["by"] for h in cluster.handles[1:] for e in h.events("step_committed")]
    assert len(by) == 1 and by[0] in ("n1", "n2")
    cluster.start(0)  # back: finds the commit and records its own part in it
    cluster.wait_committed(4, nodes=(0,))


def test_a_crashed_first_attempt_is_never_mixed_into_the_re_save(
        nodes: Any, tmp_path: Path) -> None:
    cluster = nodes()
    dcp_save(cluster.roots(), 5, seed=50, crash=True)  # no .metadata anywhere
    old = time.time() - 3600  # the crash was an hour before the re-save
    for d in (r / "step-5" for r in cluster.roots()):
        for f in d.iterdir():
            os.utime(f, (old, old))
    cluster.start()
    parts = tmp_path / "remote" / "job" / "step-5" / "_parts"
    wait_until(lambda: len(list(parts.glob("*.json"))) == WORLD, 30,
               "every node's part of the crashed attempt")
    first = {p.name for p in parts.glob("*.json")}
    dcp_save(cluster.roots(), 5)
    cluster.wait_committed(5)
    doc = _manifest(tmp_path, 5)
    chosen = {f'{n["node"]}.{n["attempt"]}.json' for n in doc["nodes"]}
    assert not chosen & first, (chosen, first)
    for f in doc["files"]:  # the second attempt's bytes: the files on the nodes' disks now
        node = int(f["key"][1])
        import xxhash

        assert xxhash.xxh3_128_hexdigest((cluster.root(node) / f["path"]).read_bytes()) == (
            f["hash"])


def test_a_re_save_right_after_a_crash_commits_its_own_bytes_on_every_node(
        nodes: Any, tmp_path: Path) -> None:
    """The sequence a busy machine gave: step 5 saved on three nodes, the save killed before
    `.metadata` (no commit), every node's part of it written; the step re-saved in place
    seconds later with other bytes (every first-attempt file inside any window of mtimes),
    and the non-coordinators' daemons held (SIGSTOP: their uploads of the re-save come late)
    until the coordinator, with the record, has looked at the parts. Their first attempt's
    parts cover the record by path and size; only the nodes can tell they are not the
    re-save's. The commit holds the re-save's bytes of every node, whoever is slow."""
    import signal

    import torch.distributed.checkpoint as dcp
    import xxhash

    cluster = nodes()
    cluster.start()
    started = time.monotonic()
    dcp_save(cluster.roots(), 5, seed=50, crash=True)  # no .metadata anywhere
    parts = tmp_path / "remote" / "job" / "step-5" / "_parts"
    wait_until(lambda: len(list(parts.glob("*.json"))) == WORLD, 30,
               "every node's part of the crashed attempt")
    first = {p.name for p in parts.glob("*.json")}
    print(f"first attempt's parts: {time.monotonic() - started:.1f}s")
    manifest = tmp_path / "remote" / "job" / "step-5" / "MANIFEST.json"

    def coordinator_looked() -> bool:  # with the record: committed, or waiting on the others
        return manifest.exists() or any(
            e.get("step") == 5 and "in no part of the save" in str(e.get("error"))
            for e in cluster.handles[0].events("commit_waiting"))

    slow = cluster.handles[1:]
    for h in slow:
        h.signal(signal.SIGSTOP)
    try:
        dcp_save(cluster.roots(), 5, seed=51)  # the re-save, in place, at once
        wait_until(coordinator_looked, 60, "the coordinator's look at the parts with its record",
                   detail=lambda: cluster.handles[0].log_text()[-3000:])
    finally:
        for h in slow:
            h.signal(signal.SIGCONT)
    print(f"re-saved, coordinator looked: {time.monotonic() - started:.1f}s")
    wait_until(manifest.exists, 60, "the commit of step 5")
    doc = _manifest(tmp_path, 5)
    chosen = {f'{n["node"]}.{n["attempt"]}.json' for n in doc["nodes"]}
    assert not chosen & first, f"the commit holds first-attempt parts {sorted(chosen & first)}"
    print(f"committed: {time.monotonic() - started:.1f}s")
    cluster.wait_committed(5)
    for f in doc["files"]:  # the re-save's bytes: the files on the nodes' disks now
        node = int(f["key"][1])
        assert xxhash.xxh3_128_hexdigest((cluster.root(node) / f["path"]).read_bytes()) == (
            f["hash"]), f
    want = full_state(51)
    for n in range(WORLD):  # restored with every node's config: the re-save, whole
        out = tmp_path / f"restored-n{n}"
        cluster.restore(n, 5, out, "--all")
        for r in range(WORLD):
            name = f"step-5/__{r}_0.distcp"
            assert (out / name).read_bytes() == (cluster.root(r) / name).read_bytes(), (n, r)
        got: dict[str, Any] = {"model": {"w": torch.zeros(ROWS, COLS), "b": torch.zeros(COLS)},
                               "step": 0}
        dcp.load(got, checkpoint_id=str(out / "step-5"))
        assert torch.equal(got["model"]["w"], want["w"]), n
        assert torch.equal(got["model"]["b"], want["b"]) and got["step"] == 51, n
    print(f"restored from every node: {time.monotonic() - started:.1f}s")



def test_a_deepspeed_save_split_over_nodes_commits_and_restores_whole(
        nodes: Any, tmp_path: Path) -> None:
    """DeepSpeed ZeRO on node-local disks: rank 0's node holds the model states, its optimizer
    shard and `latest`; each other node only its rank's optimizer shard."""
    from layout_writers import write_deepspeed

    staged = write_deepspeed(tmp_path / "staging", 5, world_size=WORLD)
    cluster = nodes()
    cluster.start()
    homes = {"mp_rank_00_model_states.pt": 0,
             **{f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt": r for r in range(WORLD)}}
    for name, node in homes.items():
        (cluster.root(node) / "global_step5").mkdir(exist_ok=True)
        (staged / name).rename(cluster.root(node) / "global_step5" / name)
    (staged.parent / "latest").rename(cluster.root(0) / "latest")
    cluster.wait_committed(5)
    for n in range(WORLD):  # `ls`: every node's part state, as each node saw the commit
        assert (cluster.row(n, 5) or {})["nodes"] == dict.fromkeys(["n0", "n1", "n2"],
                                                                  "committed")
    doc = _manifest(tmp_path, 5)
    assert doc["layout"] == "deepspeed"
    assert [n.get("record") for n in doc["nodes"] if n["node"] == "n0"] == [
        "global_step5/mp_rank_00_model_states.pt"]
    assert sorted(f["path"] for f in doc["files"]) == sorted(
        f"global_step5/{name}" for name in homes)
    out = tmp_path / "restored"
    cluster.restore(2, 5, out, "--all")
    assert (out / "latest").read_text() == "global_step5"
    for name, node in homes.items():
        assert (out / "global_step5" / name).read_bytes() == (
            cluster.root(node) / "global_step5" / name).read_bytes()



def test_a_deepspeed_zero3_save_split_over_nodes_commits(nodes: Any, tmp_path: Path) -> None:
    """ZeRO-3: every data-parallel rank writes its own model states and optimizer states on
    its node; rank 0's model states record `dp_world_size`, and `latest` is on its node."""
    cluster = nodes()
    cluster.start()
    homes = {}
    for r in range(WORLD):
        d = cluster.root(r) / "global_step9"
        d.mkdir()
        common = {"dp_world_size": WORLD, "mp_world_size": 1, "ds_version": "0.16.4",
                  "global_steps": 9}
        torch.save({"module": {"w": torch.zeros(0)}, **common},
                   d / f"zero_pp_rank_{r}_mp_rank_00_model_states.pt")
        torch.save({"optimizer_state_dict": {"shard": torch.full((8,), float(r))}},
                   d / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt")
        homes.update({f"zero_pp_rank_{r}_mp_rank_00_{kind}_states.pt": r
                      for kind in ("model", "optim")})
    (cluster.root(0) / "latest").write_text("global_step9")
    cluster.wait_committed(9)
    doc = _manifest(tmp_path, 9)
    assert doc["layout"] == "deepspeed"
    assert [n.get("record") for n in doc["nodes"] if n["node"] == "n0"] == [
        "global_step9/zero_pp_rank_0_mp_rank_00_model_states.pt"]
    assert sorted(f["path"] for f in doc["files"]) == sorted(
        f"global_step9/{name}" for name in homes)


def test_a_ranked_save_split_over_nodes_commits_and_restores_whole(
        nodes: Any, tmp_path: Path) -> None:
    """The `ranked` layout on node-local disks: rank 0's node holds `model_<N>.pt`,
    `meta_<N>.json` (the record, naming world_size 3) and its optimizer shard; each other node
    only its rank's shard."""
    from layout_writers import write_ranked

    staged = tmp_path / "staging"
    write_ranked(staged, 5, world_size=WORLD)
    cluster = nodes()
    homes = {"model_5.pt": 0, "meta_5.json": 0,
             **{f"optim_5_rank{r}.pt": r for r in range(WORLD)}}
    for name, node in homes.items():
        (staged / name).rename(cluster.root(node) / name)
    cluster.start()
    cluster.wait_committed(5)
    for n in range(WORLD):  # `ls`: every node's part state, as each node saw the commit
        assert (cluster.row(n, 5) or {})["nodes"] == dict.fromkeys(["n0", "n1", "n2"],
                                                                  "committed")
    doc = _manifest(tmp_path, 5)
    assert doc["layout"] == "ranked"
    assert [n.get("record") for n in doc["nodes"] if n["node"] == "n0"] == ["meta_5.json"]
    assert sorted(f["path"] for f in doc["files"]) == sorted(homes)
    committed = [e for h in cluster.handles for e in h.events("step_committed")]
    assert len(committed) == 1, committed
    out = tmp_path / "restored"
    cluster.restore(1, 5, out, "--all")
    assert sorted(p.name for p in out.iterdir()) == sorted(homes)
    for name, node in homes.items():
        assert (out / name).read_bytes() == (cluster.root(node) / name).read_bytes()


def test_a_layout_without_a_record_is_refused_not_left_waiting(
        nodes: Any, tmp_path: Path) -> None:
    """A single-file checkpoint on a multi-node root: no node can ever commit it, so its upload
    fails for good with the reason, sends nothing, and the step is never latest."""
    cluster = nodes()
    cluster.start(0)
    torch.save({"w": torch.ones(4)}, cluster.root(0) / "model_step_9.pt")
    client = cluster.handles[0].client
    wait_until(lambda: "no commit record" in (client.status()["roots"][0]["last_error"] or ""),
               30, "the upload refused", detail=lambda: cluster.handles[0].log_text()[-3000:])
    assert "nodes = 1" in client.status()["roots"][0]["last_error"]
    assert (cluster.row(0, 9) or {})["state"] == "valid"
    assert client.status()["roots"][0]["latest"] is None
    assert not list((tmp_path / "remote").rglob("*model_step_9*"))
    from layout_writers import write_megatron  # the legacy format: the same, for its reason

    write_megatron(cluster.root(0), 100)
    wait_until(lambda: "Megatron's legacy format" in cluster.handles[0].log_text(), 30,
               "the legacy Megatron upload refused",
               detail=lambda: cluster.handles[0].log_text()[-3000:])
    assert (cluster.row(0, 100) or {})["state"] == "valid"
    assert not list((tmp_path / "remote").rglob("*model_optim_rng*"))


def test_a_megatron_torch_dist_save_split_over_nodes_commits(nodes: Any, tmp_path: Path) -> None:
    """megatron-core's torch_dist: `common.pt`, the DCP save of every rank into `iter_N/` on
    its own node, `metadata.json`, then the tracker, on rank 0's node only."""
    cluster = nodes()
    d = cluster.root(0) / "iter_0000100"
    d.mkdir()
    torch.save({"iteration": 100}, d / "common.pt")
    dcp_save(cluster.roots(), 100, pattern="iter_{step:07d}")
    (d / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')
    (cluster.root(0) / "latest_checkpointed_iteration.txt").write_text("100")
    cluster.start()
    cluster.wait_committed(100)
    doc = _manifest(tmp_path, 100)
    assert doc["layout"] == "megatron"
    assert sorted(f["path"] for f in doc["files"]) == sorted(
        ["iter_0000100/.metadata", "iter_0000100/common.pt", "iter_0000100/metadata.json",
         *(f"iter_0000100/__{r}_0.distcp" for r in range(WORLD))])
    out = tmp_path / "restored"
    cluster.restore(1, 100, out, "--all")
    assert (out / "latest_checkpointed_iteration.txt").read_text() == "100"
    import torch.distributed.checkpoint as dcp

    got = {"model": {"w": torch.zeros(ROWS, COLS), "b": torch.zeros(COLS)}, "step": 0}
    dcp.load(got, checkpoint_id=str(out / "iter_0000100"))
    assert torch.equal(got["model"]["w"], full_state(100)["w"])


def test_a_native_node_local_save_commits_and_loads_every_rank(
        nodes: Any, tmp_path: Path) -> None:
    """`ckptd.torch.save(..., node_local=True)` from 3 gloo ranks, each into its own node's
    root: rank 0's node holds model.pt, meta.json and its rank files; each other node only its
    rank's. Committed once; `restore --all` gives a checkpoint every rank's state loads from."""
    cluster = nodes()
    cluster.start()
    left = cluster.root(1) / "step-7.tmp"  # an interrupted save's leftovers on node n1
    left.mkdir()
    (left / "optim.rank1.pt").write_bytes(b"torn")
    (left / ".here.rank9").write_text('{"token": "old"}')
    dcp_save(cluster.roots(), 7, pattern="native")
    assert sorted(p.name for p in (cluster.root(0) / "step-7").iterdir()) == [
        "meta.json", "model.pt", "optim.rank0.pt", "rng.rank0.pt"]
    for n in (1, 2):
        assert sorted(p.name for p in (cluster.root(n) / "step-7").iterdir()) == [
            f"optim.rank{n}.pt", f"rng.rank{n}.pt"]
    cluster.wait_committed(7)
    for n in range(WORLD):
        assert (cluster.row(n, 7) or {})["nodes"] == dict.fromkeys(["n0", "n1", "n2"],
                                                                  "committed")
        assert wait_until(lambda n=n: cluster.latest_json(n) == 7, 15, "latest.json")
    doc = _manifest(tmp_path, 7)
    assert doc["layout"] == "native"
    assert [n.get("record") for n in doc["nodes"] if n["node"] == "n0"] == ["step-7/meta.json"]
    out = tmp_path / "restored"
    cluster.restore(1, 7, out, "--all")
    import ckptd.torch

    saved_model = _native_state(7, 0)[0]  # rank 0 writes the model
    for rank in range(WORLD):
        opt = _native_state(7, rank)[1]
        got_model, got_opt = _native_state(0, rank)
        ckptd.torch.load(out / "step-7", model=got_model, optimizer=got_opt, rank=rank,
                         restore_rng=False)
        assert torch.equal(got_model.weight, saved_model.weight)
        want, got = opt.state_dict()["state"][0], got_opt.state_dict()["state"][0]
        assert torch.equal(got["momentum_buffer"], want["momentum_buffer"])


def _native_state(seed: int, rank: int) -> tuple[torch.nn.Linear, torch.optim.SGD]:
    """A model (the same on every rank) and rank `rank`'s optimizer with one step taken."""
    torch.manual_seed(seed)
    model = torch.nn.Linear(COLS, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if seed:
        model(torch.full((2, COLS), float(rank + 1))).sum().backward()
        opt.step()
    return model, opt


def _native_main(root: str, steps: str) -> None:
    from datetime import timedelta

    import torch.distributed as dist

    import ckptd.torch

    dist.init_process_group("gloo", timeout=timedelta(seconds=30))
    for item in steps.split(","):
        step, seed = (int(x) for x in item.split(":"))
        model, opt = _native_state(seed, dist.get_rank())
        ckptd.torch.save(root, step, model=model, optimizer=opt, node_local=True,
                         register=False)
    dist.destroy_process_group()


if __name__ == "__main__":
    if sys.argv[4] == "native":
        _native_main(sys.argv[1], sys.argv[2])
    else:
        _rank_main(sys.argv[1], sys.argv[2], sys.argv[3] == "True", sys.argv[4])
