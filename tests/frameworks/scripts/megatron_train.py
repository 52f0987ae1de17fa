"""One rank of a Megatron job on CPU (gloo): megatron-core's `dist_checkpointing` writes the
checkpoints in the torch_dist format, with tensor parallelism across the ranks, and the
`iter_<N:07d>/` dirs and `latest_checkpointed_iteration.txt` are laid out the way Megatron-LM's
`training/checkpointing.py` lays them out (rank 0 makes the dir, every rank saves, barrier, rank
0 writes the tracker). The state is a tiny GPT (megatron-core's own GPTModel) with the common
entries Megatron-LM saves beside it (`args`, `iteration`, `checkpoint_version`, the RNG state as
a ShardedObject); its weights are a pure function of the iteration, so a loader can check them.

    megatron_train.py save SAVE_DIR ITER [ITER ...] [--no-tracker] [--hold-commit SECONDS]
    megatron_train.py load LOAD_DIR

`save` saves each iteration in turn. `--no-tracker` leaves the tracker as it was (a job killed
after its last save, before rank 0 wrote the tracker). `--hold-commit` stalls every rank after
its data files are written and before DCP's `.metadata` (a slow file system), so a test can
kill the ranks with the save begun and not committed.
`load` resumes as Megatron-LM does: the iteration from the tracker, then
`dist_checkpointing.load` of the same sharded state dict; it checks every tensor against the
state of that iteration and prints `LOADED <iteration> <tensors>`.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from argparse import Namespace
from datetime import timedelta
from typing import Any

import numpy as np
import torch

TRACKER = "latest_checkpointed_iteration.txt"
TP = 2
SEED = 1234


def _cpu_only() -> None:
    """megatron-core 0.16.1 asks CUDA for a device and a sync even when saving CPU tensors;
    on a CPU-only torch those are the CPU and nothing."""
    torch.cuda.synchronize = lambda *a, **k: None  # type: ignore[assignment]
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment,return-value]


def _init() -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state

    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=TP)


def build_model(iteration: int) -> Any:
    """The tiny GPT whose weights at `iteration` every process can rebuild exactly."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    cfg = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4,
                            use_cpu_initialization=True, pipeline_dtype=torch.float32,
                            tensor_model_parallel_size=TP)
    torch.manual_seed(SEED)
    model = GPTModel(cfg, get_gpt_layer_local_spec(), vocab_size=256, max_sequence_length=32)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.0 + iteration / 1000.0)
    return model


def megatron_args() -> Namespace:
    return Namespace(num_layers=2, hidden_size=64, num_attention_heads=4,
                     tensor_model_parallel_size=TP, pipeline_model_parallel_size=1,
                     ckpt_format="torch_dist", use_dist_ckpt=True, seq_length=32)


def sharded_state(model: Any, iteration: int) -> dict[str, Any]:
    """What Megatron-LM's `generate_state_dict` hands `dist_checkpointing.save` (no optimizer:
    megatron-core's optimizers need CUDA)."""
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    rng = {"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
           "torch_rng_state": torch.get_rng_state(), "rng_tracker_states": {}}
    return {
        "args": megatron_args(),
        "checkpoint_version": 3.0,
        "iteration": iteration,
        "model": model.sharded_state_dict(),
        "rng_state": ShardedObject(
            "rng_state", [rng], (ps.get_pipeline_model_parallel_world_size(),
                                 ps.get_tensor_model_parallel_world_size()),
            (ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank()),
            replica_id=ps.get_data_parallel_rank(with_context_parallel=True)),
        "num_floating_point_operations_so_far": float(iteration) * 1e9,
        "opt_param_scheduler": {"max_lr": 3e-4, "num_steps": iteration * 8},
    }


def _hold_commit(seconds: float) -> None:
    """Stall each rank after its data files are written, before the gather that leads to
    DCP's `.metadata`."""
    from megatron.core.dist_checkpointing.strategies.filesystem_async import (
        FileSystemWriterAsync,
    )

    results = FileSystemWriterAsync.retrieve_write_results

    def slow(self: Any) -> Any:
        print("HOLDING", flush=True)
        time.sleep(seconds)
        return results(self)

    FileSystemWriterAsync.retrieve_write_results = slow  # type: ignore[method-assign]


def save(save_dir: str, iterations: list[int], tracker: bool) -> None:
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    rank = dist.get_rank()
    for iteration in iterations:
        model = build_model(iteration)
        checkpoint_name = os.path.join(save_dir, f"iter_{iteration:07d}")
        if rank == 0:
            os.makedirs(checkpoint_name, exist_ok=True)
        dist_checkpointing.save(
            sharded_state(model, iteration), checkpoint_name,
            validate_access_integrity=True,
            content_metadata={"singleton_local_shards": False,
                              "chained_optim_avoid_prefix": True})
        dist.barrier()
        if rank == 0 and tracker:
            with open(os.path.join(save_dir, TRACKER), "w") as f:
                f.write(str(iteration))
        dist.barrier()
        print(f"SAVED {iteration}", flush=True)


def read_tracker(load_dir: str) -> int:
    """Megatron-LM's `read_metadata`: the stripped text is the iteration."""
    with open(os.path.join(load_dir, TRACKER)) as f:
        return int(f.read().strip())


def load(load_dir: str) -> None:
    from megatron.core import dist_checkpointing

    iteration = read_tracker(load_dir)
    checkpoint_name = os.path.join(load_dir, f"iter_{iteration:07d}")
    model = build_model(iteration + 500)  # other weights: only the load can make them right
    torch.serialization.add_safe_globals([Namespace])  # common.pt holds Megatron's `args`
    state = dist_checkpointing.load(sharded_state(model, -1), checkpoint_name)
    assert state["iteration"] == iteration, (state["iteration"], iteration)
    assert state["args"].tensor_model_parallel_size == TP
    model.load_state_dict(state["model"])
    want = build_model(iteration).state_dict()
    got = model.state_dict()
    compared = 0
    for key, tensor in want.items():
        if isinstance(tensor, torch.Tensor) and not key.endswith("_extra_state"):
            assert torch.equal(got[key], tensor), key
            compared += 1
    assert compared > 10, compared
    print(f"LOADED {iteration} {compared}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["save", "load"])
    parser.add_argument("dir")
    parser.add_argument("iterations", nargs="*", type=int)
    parser.add_argument("--no-tracker", action="store_true")
    parser.add_argument("--hold-commit", type=float, default=0.0)
    opts = parser.parse_args()
    _cpu_only()
    _init()
    if opts.hold_commit:
        _hold_commit(opts.hold_commit)
    if opts.mode == "save":
        save(opts.dir, opts.iterations, tracker=not opts.no_tracker)
    else:
        load(opts.dir)
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":  # spawned helpers (multiprocessing) import this file too
    sys.exit(main())
