"""ckptd.dcp.StorageReader in a real 2-rank gloo job: a DTensor sharded across the ranks is
saved by both, committed to a file:// remote as the daemon does it, and loaded back by both
ranks, each getting exactly its shard and fetching about its share of the stored bytes; the
same step loads resharded into one process; ranks whose "latest" differs fail the load.

Run as a script, this file is one rank of such a job (see `_rank_main`)."""

from __future__ import annotations

import fcntl
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
from support.ports import rendezvous_port

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
WORLD = 2
ROOT = "llm"
ROWS, COLS = 8192, 2048  # the sharded weight: 64 MiB, 32 MiB (8 blocks of 4 MiB) per rank
JOB_TIMEOUT_S = 120.0


def full_state(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(ROWS, COLS, generator=g), "b": torch.randn(COLS, generator=g)}


def run_job(base: Path) -> list[dict[str, Any]]:
    """Run both ranks of the job (see `_rank_main`) on `base` (the root under root/, the
    remote under remote/, what the ranks loaded and their reports under out/)."""
    out = base / "out"
    out.mkdir(parents=True)
    env = {k: v for k, v in os.environ.items() if k not in ("CKPTD_SOCKET", "CKPTD_CONFIG")}
    env.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(rendezvous_port()),
                "WORLD_SIZE": str(WORLD), "OMP_NUM_THREADS": "1",
                # each rank runs this file, whose imports need tests/ (support) on its path
                "PYTHONPATH": os.pathsep.join(filter(None, [
                    str(Path(__file__).resolve().parents[1]), env.get("PYTHONPATH")]))})
    procs = [subprocess.Popen([sys.executable, __file__, str(base)],
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for r in range(WORLD)]
    codes, outs = [], []
    deadline = time.monotonic() + JOB_TIMEOUT_S
    for p in procs:
        try:
            text, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            text, _ = p.communicate()
        codes.append(p.returncode)
        outs.append(text.decode(errors="replace")[-4000:])
    assert codes == [0] * WORLD, "\n".join(outs)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory, worker_id: str
        ) -> tuple[Path, list[dict[str, Any]]]:
    """The job, run once for the whole test run: under xdist the first worker to get here
    runs it in the workers' shared temp dir and the others wait for it (two ranks importing
    torch twice over would double the cost on a small machine)."""
    shared = tmp_path_factory.getbasetemp()
    if worker_id != "master":
        shared = shared.parent
    base = shared / "dcp-reader-ranks"
    with open(shared / "dcp-reader-ranks.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (base / "done").exists():
            shutil.rmtree(base, ignore_errors=True)
            run_job(base)
            (base / "done").touch()
    return base, [json.loads((base / "out" / f"rank{r}.json").read_text())
                  for r in range(WORLD)]


def step_files(url: str, step: int) -> dict[str, Any]:
    """path -> (stored size, the largest stored block) of each file of the step."""
    from ckptd.fetch.step import RemoteStep

    found = {}
    with RemoteStep.open(ROOT, step, remote=url) as opened:
        for f in opened.files():
            index = opened.reader(f.path).index()
            biggest = max((b.stored_len for b in index.blocks), default=0) if index else 0
            found[f.path.rpartition("/")[2]] = (f.stored_size, biggest)
    return found


def test_each_rank_loads_its_shard_fetching_its_share(job: Any) -> None:
    from ckptd.codec import TAIL_PROBE

    base, reports = job
    full = full_state(1)
    files = step_files(f"file://{base / 'remote'}", 1)
    total = sum(size for size, _ in files.values())
    for rank, rep in enumerate(reports):
        got = torch.load(base / "out" / f"rank{rank}.pt", weights_only=True)
        assert rep["step"] == 1
        assert torch.equal(got["w"], full["w"].chunk(WORLD)[rank]), rank
        assert torch.equal(got["b"], full["b"]), rank
        assert got["lr"] == 0.01 and got["step"] == 1
        # Its own data file whole (and its index), the metadata; of the other rank's file at
        # most its index and the two blocks with the replicated items (the first: the bytes
        # items; the last: the replicated tensor). Never the other rank's shard.
        own, meta = files[f"__{rank}_0.distcp"][0], files[".metadata"][0]
        other_block = files[f"__{1 - rank}_0.distcp"][1]
        fetched = rep["stats"]["stored_bytes"]
        most = own + meta + 2 * TAIL_PROBE + 2 * other_block
        assert own + meta <= fetched <= most, (rank, rep["stats"], files)
        ratio = fetched / total
        print(f"rank {rank}: {rep['stats']} of {total} stored bytes ({ratio:.3f})")
        assert ratio <= 0.6, (rank, rep["stats"], total)


def test_saved_by_two_ranks_loads_whole_into_one_process(job: Any) -> None:
    import torch.distributed.checkpoint as dcp

    from ckptd.codec import TAIL_PROBE
    from ckptd.dcp import StorageReader

    base, _reports = job
    url = f"file://{base / 'remote'}"
    full = full_state(1)
    whole: dict[str, Any] = {
        "model": {"w": torch.zeros(ROWS, COLS), "b": torch.zeros(COLS)},
        "optim": {"lr": 0.0}, "step": 0}
    reader = StorageReader(ROOT, 1, remote=url)
    dcp.load(whole, storage_reader=reader, no_dist=True)
    assert reader.step == 1
    assert torch.equal(whole["model"]["w"], full["w"])
    assert torch.equal(whole["model"]["b"], full["b"])
    assert whole["optim"]["lr"] == 0.01 and whole["step"] == 1
    total = sum(size for size, _ in step_files(url, 1).values())
    assert reader.stats.stored_bytes <= total + 2 * TAIL_PROBE, (reader.stats, total)


def test_ranks_that_resolve_different_latest_steps_fail_the_load(job: Any) -> None:
    """Rank 0 opened "latest" (step 1), step 2 was committed, rank 1 opened "latest" (step
    2): the load failed on both ranks, saying so, and filled nothing."""
    _base, reports = job
    assert [rep["race"]["step"] for rep in reports] == [1, 2]
    for rep in reports:
        error = rep["race"]["error"]
        assert error is not None, rep
        assert "ranks resolved different steps" in error, error[-2000:]
        assert "pass step= explicitly" in error
        assert rep["race"]["untouched"], "a failed plan left a destination written"


# -- one rank of the job ---------------------------------------------------------------------


def _rank_main(base: Path) -> None:
    """Save steps 1 and 2 (both ranks), commit step 1 (rank 0), load it back per rank; then
    the "latest" race: rank 0 opens "latest", step 2 is committed, rank 1 opens "latest", and
    both load. What each rank got goes to out/rank<r>.pt, its report to out/rank<r>.json."""
    from datetime import timedelta

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from support.published import publish
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from ckptd.backends import LocalBackend
    from ckptd.dcp import StorageReader

    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    mesh = init_device_mesh("cpu", (WORLD,))
    root, backend = base / "root", LocalBackend(str(base / "remote"))
    url = f"file://{base / 'remote'}"

    def state(seed: int) -> dict[str, Any]:
        full = full_state(seed)
        return {"model": {"w": distribute_tensor(full["w"], mesh, [Shard(0)]),
                          "b": distribute_tensor(full["b"], mesh, [Replicate()])},
                "optim": {"lr": 0.01}, "step": seed}

    def blank() -> dict[str, Any]:
        return {"model": {"w": distribute_tensor(torch.zeros(ROWS, COLS), mesh, [Shard(0)]),
                          "b": distribute_tensor(torch.zeros(COLS), mesh, [Replicate()])},
                "optim": {"lr": 0.0}, "step": 0}

    for n in (1, 2):
        dcp.save(state(n), checkpoint_id=root / f"step-{n}")
    dist.barrier()
    if rank == 0:
        publish(root, ROOT, 1, backend)
    dist.barrier()

    dest = blank()
    reader = StorageReader(ROOT, 1, remote=url)
    dcp.load(dest, storage_reader=reader)
    reader.close()
    torch.save({"w": dest["model"]["w"].to_local(), "b": dest["model"]["b"].to_local(),
                "lr": dest["optim"]["lr"], "step": dest["step"]}, base / "out" / f"rank{rank}.pt")
    st = reader.stats
    report: dict[str, Any] = {
        "rank": rank, "step": reader.step,
        "stats": {"stored_bytes": st.stored_bytes, "requests": st.requests, "blocks": st.blocks}}
    dist.barrier()

    race: dict[str, Any] = {"error": None}
    latest = StorageReader(ROOT, "latest", remote=url)
    if rank == 0:
        race["step"] = latest.step  # opens: resolves "latest" now
        publish(root, ROOT, 2, backend)
    dist.barrier()
    if rank == 1:
        race["step"] = latest.step
    dist.barrier()
    dest = blank()
    try:
        dcp.load(dest, storage_reader=latest)
    except CheckpointException as exc:
        race["error"] = str(exc)
    latest.close()
    race["untouched"] = bool((dest["model"]["w"].to_local() == 0).all())
    report["race"] = race
    (base / "out" / f"rank{rank}.json").write_text(json.dumps(report))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    _rank_main(Path(sys.argv[1]))
