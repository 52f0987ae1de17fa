"""An example trainer for train.sbatch: what each task of the job does beside ckptd.

srun starts it once per task. With more than one task it joins torch.distributed from the
environment Slurm gives every task (`SLURM_PROCID`, `SLURM_NTASKS`, the rendezvous at
`MASTER_ADDR:MASTER_PORT`: where unset, the job's first node from
`scontrol show hostnames "$SLURM_JOB_NODELIST"` and a port from the job id), over gloo on the
CPU, and trains a DDP model. Every rank saves its own part with
`ckptd.torch.save(..., node_local=True)`: each node's ranks write into that node's root (the
same path on every node, a node-local disk), rank 0 also writes the model and `meta.json`, and
each node's ckptd uploads its node's part (a root with `nodes` = the job's node count; the
bucket commits the step once the parts cover it). `--shared-root` is for a root that every
rank sees (one shared file system, `nodes = 1`): the ranks meet in that directory instead.

It resumes from the latest step: rank 0 picks it (`ckptd.torch.load`: the daemon at
$CKPTD_SOCKET, else `<root>/.ckptd/latest.json`, else the remote of the root in $CKPTD_CONFIG)
and every other rank loads that same step with its own optimizer state (on another node, from
the remote). It saves every `--save-every` steps, and on SIGUSR1 (train.sbatch forwards Slurm's
`--signal=B:USR1@...` through srun) saves at the next step boundary and exits 0. The ranks agree
on stopping with an all-reduce first: one rank stopping alone would leave the others waiting in
a collective.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from types import FrameType

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import ckptd.torch as ct
from ckptd.errors import NotFound

_stop = False


def _on_usr1(signum: int, frame: FrameType | None) -> None:
    global _stop
    _stop = True  # acted on at the next step boundary, never inside a step


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def stop_agreed() -> bool:
    """Whether any rank was asked to stop (every rank gets the same answer)."""
    if not _distributed():
        return _stop
    flag = torch.tensor([int(_stop)])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def all_ok(ok: bool) -> bool:
    """Whether every rank says ok (every rank gets the same answer)."""
    if not _distributed():
        return ok
    flag = torch.tensor([int(ok)])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def rendezvous() -> tuple[str, str]:
    """MASTER_ADDR and MASTER_PORT: the environment's, else the job's first node and a port
    derived from the job id (two jobs sharing a first node get different ports)."""
    addr = os.environ.get("MASTER_ADDR", "")
    if not addr:
        nodelist = os.environ.get("SLURM_JOB_NODELIST", "")
        if not nodelist:
            raise SystemExit("train_example.py: several tasks but neither MASTER_ADDR nor"
                             " SLURM_JOB_NODELIST is set")
        try:
            out = subprocess.run(["scontrol", "show", "hostnames", nodelist], check=True,
                                 capture_output=True, text=True, timeout=60).stdout
        except (OSError, subprocess.SubprocessError) as e:
            raise SystemExit(f"train_example.py: scontrol show hostnames {nodelist}: {e};"
                             " set MASTER_ADDR to the first node's address") from None
        if not out.split():
            raise SystemExit(f"train_example.py: scontrol show hostnames {nodelist}: no host")
        addr = out.split()[0]
    port = os.environ.get("MASTER_PORT", "")
    if not port:
        port = str(20000 + int(os.environ.get("SLURM_JOB_ID", "0")) % 10000)
    return addr, port


def init_distributed() -> tuple[int, int]:
    """(rank, world size) from Slurm's environment; torch.distributed (gloo) when there are
    several tasks."""
    world = int(os.environ.get("SLURM_NTASKS", "1"))
    rank = int(os.environ.get("SLURM_PROCID", "0"))
    if world > 1:
        addr, port = rendezvous()
        dist.init_process_group("gloo", init_method=f"tcp://{addr}:{port}", rank=rank,
                                world_size=world, timeout=timedelta(minutes=10))
    return rank, world


def resume(root: str, name: str | None, model: torch.nn.Module,
           opt: torch.optim.Optimizer) -> int:
    """The step every rank resumed from (0: none). Rank 0 resolves "latest"; the others load
    that step, each its own optimizer state. A failure on any rank fails every rank."""
    if not _distributed():
        try:
            return ct.load(root, "latest", model=model, optimizer=opt, root_name=name)[0]
        except NotFound:
            return 0
    rank = dist.get_rank()
    picked: list[int | str] = [0]
    if rank == 0:
        try:
            picked[0] = ct.load(root, "latest", model=model, optimizer=opt, root_name=name)[0]
        except NotFound:
            picked[0] = 0
        except Exception as e:  # the other ranks must hear of it, not wait for a step
            picked[0] = f"{type(e).__name__}: {e}"
    dist.broadcast_object_list(picked, src=0)
    step = picked[0]
    if isinstance(step, str):
        raise SystemExit(f"rank {rank}: rank 0 could not load the latest step: {step}")
    error = ""
    if step and rank != 0:
        try:
            ct.load(root, step, model=model, optimizer=opt, root_name=name)
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
    if not all_ok(not error):
        raise SystemExit(f"rank {rank}: step {step} did not load on every rank"
                         + (f": {error}" if error else ""))
    return step


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", required=True,
                    help="the checkpoint directory (a ckptd root), the same path on every node")
    ap.add_argument("--root-name", default="", help="its name in the ckptd config")
    ap.add_argument("--shared-root", action="store_true",
                    help="the root is one directory every rank sees (a shared file system)")
    ap.add_argument("--steps", type=int, default=1_000_000)
    ap.add_argument("--save-every", type=int, default=1000)
    ap.add_argument("--step-seconds", type=float, default=0.0, help="pretend each step is slow")
    args = ap.parse_args(argv)
    signal.signal(signal.SIGUSR1, _on_usr1)
    name = args.root_name or None
    rank, world = init_distributed()
    node_local = world > 1 and not args.shared_root

    torch.manual_seed(0)  # every rank starts from the same weights
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = resume(args.root, name, model, opt)
    # DDP averages the ranks' gradients: the weights stay the same on every rank.
    trained = DistributedDataParallel(model) if world > 1 else model
    print(f"rank {rank}/{world}: training from step {step}", flush=True)
    batches = torch.Generator().manual_seed(1000 * step + rank)  # each rank its own batches
    while step < args.steps:
        step += 1
        loss = trained(torch.randn(32, 64, generator=batches)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        time.sleep(args.step_seconds)
        stopping = stop_agreed()
        if stopping or step % args.save_every == 0 or step == args.steps:
            # Every rank calls it: each writes its own optimizer and RNG state; rank 0 also the
            # model and meta.json, and registers the step with its node's daemon.
            ct.save(args.root, step, model=model, optimizer=opt,
                    metrics={"loss": loss.item()}, root_name=name, node_local=node_local)
            print(f"rank {rank}: saved step {step}", flush=True)
        if stopping:
            print(f"rank {rank}: stopping after step {step} (SIGUSR1)", flush=True)
            break
    if _distributed():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
