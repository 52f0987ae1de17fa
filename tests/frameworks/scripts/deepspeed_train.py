"""One rank of a DeepSpeed ZeRO-2 run on CPU (gloo): a tiny model trained a few steps and saved
with `engine.save_checkpoint`, or resumed with `engine.load_checkpoint`.

    deepspeed_train.py save SAVE_DIR --steps 3[,5...] [--dump FILE] [--slow S] [--straggle S]
    deepspeed_train.py resume LOAD_DIR --dump FILE

`save` trains and, at each step listed, saves with DeepSpeed's own defaults (tag
`global_step<N>`, then `latest`). `--dump FILE` has rank 0 write the module's weights and the
engine's step to FILE (`{step}` in it is replaced; on resume, after loading), outside the
checkpoint, for the test to compare. `--slow S` pauses S seconds after each checkpoint file is
written (a save that can be caught half-way). `--straggle S`: rank 1 writes its optimizer shard
only S seconds after rank 0 has written `latest` (DeepSpeed does not wait for the other ranks
before `latest`). The bytes written are always DeepSpeed's own. `--precision` picks fp32 (the
default), bf16 or fp16. One process per rank with torchrun's variables (fw.start_ranks)."""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed  # noqa: E402
import torch  # noqa: E402

SEED = 1234
CONFIG: dict[str, Any] = {
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 1,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
    "zero_optimization": {"stage": 2},
    "steps_per_print": 1_000_000,
    "wall_clock_breakdown": False,
}


def model() -> torch.nn.Module:
    torch.manual_seed(SEED)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


def engine(precision: str) -> Any:
    deepspeed.init_distributed(dist_backend="gloo")
    net = model()
    config = {**CONFIG, **({precision: {"enabled": True}} if precision != "fp32" else {})}
    eng, _, _, _ = deepspeed.initialize(model=net, model_parameters=net.parameters(),
                                        config=config)
    return eng


def train(eng: Any, steps: int) -> None:
    g = torch.Generator().manual_seed(SEED + 100 * eng.global_steps + eng.global_rank)
    dtype = next(eng.module.parameters()).dtype
    for _ in range(steps):
        x = torch.randn(4, 16, generator=g).to(dtype)
        y = torch.randn(4, 4, generator=g)
        loss = torch.nn.functional.mse_loss(eng(x).float(), y)
        eng.backward(loss)
        eng.step()


def slow_writes(eng: Any, pause: float, straggle: float, save_dir: str) -> None:
    """Wrap the engine's checkpoint writer: a pause after each file, and rank 1 holding its
    optimizer shard back until `straggle` seconds after `latest` is on disk."""
    real = eng.checkpoint_engine.save
    latest = os.path.join(save_dir, "latest")

    def save(state_dict: Any, path: str) -> Any:
        if straggle and eng.global_rank == 1 and path.endswith("_optim_states.pt"):
            tag = os.path.basename(os.path.dirname(path))
            deadline = time.monotonic() + 120  # rank 0 died: do not hang the test
            while not _names(latest, tag) and time.monotonic() < deadline:
                time.sleep(0.01)
            time.sleep(straggle)
        out = real(state_dict=state_dict, path=path)
        time.sleep(pause)
        return out

    eng.checkpoint_engine.save = save


def _names(latest: str, tag: str) -> bool:
    try:
        with open(latest) as f:
            return f.read().strip() == tag
    except OSError:
        return False


def dump(eng: Any, pattern: str) -> None:
    if pattern and eng.global_rank == 0:
        weights = {k: v.detach().clone() for k, v in eng.module.state_dict().items()}
        torch.save({"global_steps": eng.global_steps, "weights": weights},
                   pattern.replace("{step}", str(eng.global_steps)))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["save", "resume"])
    p.add_argument("dir")
    p.add_argument("--steps", default="3")
    p.add_argument("--dump", default="")
    p.add_argument("--slow", type=float, default=0.0)
    p.add_argument("--straggle", type=float, default=0.0)
    p.add_argument("--precision", choices=["fp32", "bf16", "fp16"], default="fp32")
    a = p.parse_args()
    eng = engine(a.precision)
    if a.mode == "save":
        if a.slow or a.straggle:
            slow_writes(eng, a.slow, a.straggle, a.dir)
        for step in sorted(int(s) for s in a.steps.split(",")):
            train(eng, step - eng.global_steps)
            eng.save_checkpoint(a.dir)
            dump(eng, a.dump)
    else:
        path, _ = eng.load_checkpoint(a.dir)
        assert path is not None, f"load_checkpoint found nothing to load in {a.dir}"
        dump(eng, a.dump)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
