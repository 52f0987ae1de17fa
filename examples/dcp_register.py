"""Save with torch.distributed.checkpoint (DCP) into `step-<N>/`, then tell ckptd about it.

    python examples/dcp_register.py --root /tmp/ckpt/dcp --steps 3

DCP commits a save by writing `.metadata` last; ckptd's `dcp` layout recognises that on its own,
and the registration only wakes the daemon (and names the files, root-relative) right away.
Works in one process as here, and unchanged under torchrun with a process group.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from ckptd.client import Client


def build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", required=True, help="checkpoint root directory")
    parser.add_argument("--root-name", default=None, help="the root's name in ckptd's config")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args(argv)
    root = Path(args.root)

    model, optimizer = build()
    for _ in range(args.steps):
        optimizer.zero_grad()
        loss = model(torch.randn(4, 8)).pow(2).mean()
        loss.backward()
        optimizer.step()

    step_dir = root / f"step-{args.steps}"
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=step_dir)  # type: ignore[attr-defined]
    files = sorted(p.relative_to(root).as_posix() for p in step_dir.iterdir())
    registered = False
    if not dist.is_initialized() or dist.get_rank() == 0:  # dcp.save returned on every rank
        registered = Client(timeout=1.0).register(
            args.root_name or root.resolve().name, args.steps, paths=[step_dir.name],
            metrics={"loss": loss.item()})

    # Resume: DCP loads in place into state dicts shaped like the live ones.
    fresh_model, fresh_optimizer = build()
    model_sd, optim_sd = get_state_dict(fresh_model, fresh_optimizer)
    state: dict[str, Any] = {"model": model_sd, "optimizer": optim_sd}
    dcp.load(state, checkpoint_id=step_dir)  # type: ignore[attr-defined]
    set_state_dict(fresh_model, fresh_optimizer,
                   model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    same = all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh_model.parameters(),
                                                 strict=True))
    print(json.dumps({"step": args.steps, "path": str(step_dir), "files": files,
                      "registered": registered, "restored": same}), flush=True)


if __name__ == "__main__":
    main()
