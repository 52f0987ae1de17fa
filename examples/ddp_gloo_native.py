"""Two gloo processes (DDP + ZeroRedundancyOptimizer) saving per-rank optimizer shards.

    python examples/ddp_gloo_native.py --root /tmp/ckpt/ddp --steps 4

Each rank holds only its shard of the Adam state (ZeRO-1), so each rank passes its local
optimizer to ckptd.torch.save and writes `optim.rank<R>.pt`; rank 0 writes the model and commits
`step-<N>/` after both ranks are done. Then both resume from the latest step and check it.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.multiprocessing.spawn import spawn
from torch.nn.parallel import DistributedDataParallel

import ckptd.torch as ckpt


def build() -> tuple[DistributedDataParallel, ZeroRedundancyOptimizer]:
    torch.manual_seed(0)  # every rank starts from the same weights
    model = DistributedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)))
    return model, ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, lr=1e-2)


def worker(rank: int, world: int, port: int, root: str, steps: int) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=world)
    model, zero = build()
    torch.manual_seed(100 + rank)  # each rank its own batches
    for _ in range(steps):
        zero.zero_grad()
        loss = model(torch.randn(4, 8)).pow(2).mean()
        loss.backward()
        zero.step()
    # ZeRO's own state_dict() gathers every shard on one rank; the local optimizer is this shard.
    path = ckpt.save(root, steps, model=model, optimizer=zero.optim,
                     metrics={"loss": loss.item()})

    # Resume as a restarted job would: the latest complete step, each rank its own shard.
    fresh_model, fresh_zero = build()
    step, meta = ckpt.load(root, "latest", model=fresh_model, optimizer=fresh_zero.optim)
    same = _same(zero.optim.state_dict(), fresh_zero.optim.state_dict())
    same &= all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh_model.parameters(),
                                                  strict=True))
    line = json.dumps({"rank": rank, "step": step, "world_size": meta["world_size"],
                       "path": str(path), "restored": same})
    sys.stdout.write(line + "\n")  # one write per line: the two ranks share stdout
    sys.stdout.flush()
    dist.destroy_process_group()


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", required=True)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    spawn(worker, args=(2, free_port(), args.root, args.steps), nprocs=2)  # type: ignore[no-untyped-call]


if __name__ == "__main__":
    main()
