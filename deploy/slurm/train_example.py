"""A stand-in for a training script run by train.sbatch: what a trainer does beside ckptd.

It resumes from the latest step ckptd names (`ckptd.torch.load`: the daemon at $CKPTD_SOCKET,
else `<root>/.ckptd/latest.json`, else the remote of the root in $CKPTD_CONFIG), saves every
`--save-every` steps with `ckptd.torch.save` (which registers the save with the daemon), and
on SIGUSR1 (train.sbatch forwards Slurm's `--signal=B:USR1@...` through srun) saves at the
next step boundary and exits 0. With several ranks, the ranks agree on stopping first: one
rank stopping alone would leave the others waiting in a collective.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from types import FrameType

import torch
import torch.distributed as dist

import ckptd.torch as ct
from ckptd.errors import NotFound

_stop = False


def _on_usr1(signum: int, frame: FrameType | None) -> None:
    global _stop
    _stop = True  # acted on at the next step boundary, never inside a step


def stop_agreed() -> bool:
    """Whether any rank was asked to stop (every rank gets the same answer)."""
    if not (dist.is_available() and dist.is_initialized()):
        return _stop
    flag = torch.tensor([int(_stop)])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", required=True, help="the checkpoint directory (a ckptd root)")
    ap.add_argument("--root-name", default="", help="its name in the ckptd config")
    ap.add_argument("--steps", type=int, default=1_000_000)
    ap.add_argument("--save-every", type=int, default=1000)
    ap.add_argument("--step-seconds", type=float, default=0.0, help="pretend each step is slow")
    args = ap.parse_args(argv)
    signal.signal(signal.SIGUSR1, _on_usr1)
    name = args.root_name or None

    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    try:
        step, _ = ct.load(args.root, "latest", model=model, optimizer=opt, root_name=name)
    except NotFound:
        step = 0
    print(f"training from step {step}", flush=True)
    while step < args.steps:
        step += 1
        loss = model(torch.randn(32, 64)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        time.sleep(args.step_seconds)
        stopping = stop_agreed()
        if stopping or step % args.save_every == 0 or step == args.steps:
            ct.save(args.root, step, model=model, optimizer=opt,
                    metrics={"loss": loss.item()}, root_name=name)
            print(f"saved step {step}", flush=True)
        if stopping:
            print(f"stopping after step {step} (SIGUSR1)", flush=True)
            return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
