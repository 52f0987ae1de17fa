"""Small real checkpoints for daemon tests: torch.save of a tiny model with Adam state, and
byte-level damage. (tests/writers.py and tests/layout_writers.py hold the per-format writers.)"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch


def tiny_state(seed: int = 0, n: int = 64) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = torch.nn.Linear(n, n)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(4, n)).sum().backward()
    opt.step()
    return {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": seed}


def save_single(root: Path, step: int, n: int = 64) -> Path:
    path = root / f"model_step_{step}.pt"
    torch.save(tiny_state(step, n), path)
    return path


def flip_byte(path: Path, where: float = 0.5) -> None:
    with open(path, "r+b") as f:
        f.seek(int(os.path.getsize(path) * where))
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0x55]))
