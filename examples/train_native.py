"""A plain PyTorch training loop that checkpoints with ckptd.torch and resumes from the latest.

    python examples/train_native.py --root /tmp/ckpt/demo --steps 20 --save-every 5
    python examples/train_native.py --root /tmp/ckpt/demo --steps 20 --save-every 5 --crash-at 10
    python examples/train_native.py --root /tmp/ckpt/demo --steps 20 --save-every 5   # resumes

Saves the whole training state (model, Adam, LR schedule, GradScaler, EMA, every RNG), so a
resumed run continues exactly where the saved one was. Prints one JSON object per line.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
from typing import Any

import numpy as np
import torch
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

import ckptd.torch as ckpt
from ckptd.errors import NotFound


def build() -> dict[str, Any]:
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Dropout(0.1), torch.nn.Linear(32, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    return {
        "model": model,
        "optimizer": optimizer,
        "scheduler": torch.optim.lr_scheduler.StepLR(optimizer, step_size=4, gamma=0.7),
        "scaler": torch.amp.GradScaler("cpu", growth_interval=3),
        "ema": AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9)),  # type: ignore[no-untyped-call]
    }


def train_step(state: dict[str, Any]) -> float:
    """One step on synthetic data drawn from all three RNGs, so resuming must restore each."""
    x = torch.randn(8, 16)
    noise = torch.from_numpy(np.random.standard_normal((8, 1)).astype(np.float32))
    y = x[:, :1] * random.uniform(0.5, 1.5) + 0.1 * noise
    loss = torch.nn.functional.mse_loss(state["model"](x), y)
    state["optimizer"].zero_grad()
    state["scaler"].scale(loss).backward()
    state["scaler"].step(state["optimizer"])
    state["scaler"].update()
    state["scheduler"].step()
    state["ema"].update_parameters(state["model"])
    return loss.item()


def resume(root: str, state: dict[str, Any]) -> int:
    """The step to continue after: the latest checkpoint's, or 0 for a fresh start."""
    try:
        step, _meta = ckpt.load(root, "latest", restore_rng=True, **state)
    except NotFound:
        return 0
    print(json.dumps({"event": "resumed", "step": step}), flush=True)
    return step


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", required=True, help="checkpoint root directory")
    parser.add_argument("--steps", type=int, default=20, help="train until this step")
    parser.add_argument("--save-every", type=int, default=5)
    parser.add_argument("--crash-at", type=int, default=0,
                        help="kill -9 this process right after the save at this step")
    args = parser.parse_args(argv)

    torch.set_num_threads(1)  # same arithmetic in every run, so curves compare bit for bit
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(0)  # a resumed run gets its RNG states back from the checkpoint
    np.random.seed(0)
    random.seed(0)
    state = build()
    start = resume(args.root, state)
    for step in range(start + 1, args.steps + 1):
        loss = train_step(state)
        print(json.dumps({"step": step, "loss": loss}), flush=True)
        if step % args.save_every == 0 or step == args.steps:
            path = ckpt.save(args.root, step, metrics={"loss": loss}, config=vars(args), **state)
            print(json.dumps({"event": "saved", "step": step, "path": str(path)}), flush=True)
        if step == args.crash_at:
            os.kill(os.getpid(), signal.SIGKILL)
    ema_sum = sum(float(p.double().sum()) for p in state["ema"].parameters())
    print(json.dumps({"event": "done", "ema_sum": ema_sum, "scale": state["scaler"].get_scale(),
                      "lr": state["scheduler"].get_last_lr()[0]}), flush=True)


if __name__ == "__main__":
    main()
