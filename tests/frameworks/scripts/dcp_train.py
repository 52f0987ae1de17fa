"""torch.distributed.checkpoint as its users call it, one process per rank over gloo:
argv: MODE DIR STEP [--load]. MODE is `sync` (dcp.save), `async-thread` (dcp.async_save),
`async-process` (dcp.async_save in a background process) or `fsdp2` (a model sharded with
fully_shard, saved with get_state_dict). With --load, load DIR into a fresh model and print
whether every tensor equals the saved one."""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp


def model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(),
                               torch.nn.Linear(512, 256))


def main() -> None:
    mode, path, step = sys.argv[1], sys.argv[2], int(sys.argv[3])
    load = "--load" in sys.argv
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    net = model(step)
    if mode == "fsdp2":
        from torch.distributed.checkpoint.state_dict import get_state_dict
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for layer in net:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(net, mesh=mesh)
        opt = torch.optim.Adam(net.parameters(), lr=1e-3)
        net(torch.randn(4, 256)).sum().backward()
        opt.step()
        msd, osd = get_state_dict(net, opt)
        state = {"model": msd, "optim": osd, "step": step}
    else:
        state = {"model": net.state_dict(), "step": step}
    if "--big" in sys.argv:  # 64 MiB more: a save that takes long enough to be killed in
        state["model"]["big"] = torch.randn(16 * 1024 * 1024)
    if load:
        want = {k: v.full_tensor() if hasattr(v, "full_tensor") else v.clone()
                for k, v in state["model"].items()}
        for v in state["model"].values():
            v.detach().zero_() if not hasattr(v, "to_local") else v.to_local().zero_()
        dcp.load(state, checkpoint_id=path)
        got = {k: v.full_tensor() if hasattr(v, "full_tensor") else v
               for k, v in state["model"].items()}
        same = all(torch.equal(got[k], want[k]) for k in want)
        if dist.get_rank() == 0:
            print(json.dumps({"same": same, "step": state["step"]}), flush=True)
    elif mode.startswith("async"):
        kind = None
        if mode == "async-process":
            from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

            kind = AsyncCheckpointerType.PROCESS
        fut = (dcp.async_save(state, checkpoint_id=path) if kind is None
               else dcp.async_save(state, checkpoint_id=path, async_checkpointer_type=kind))
        t0 = time.monotonic()
        fut.result()
        print(f"async save done in {time.monotonic() - t0:.2f}s", flush=True)
    else:
        dcp.save(state, checkpoint_id=path)
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # an async process checkpointer's helper would otherwise hold the exit


if __name__ == "__main__":
    main()
