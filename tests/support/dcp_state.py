"""A DCP state saved, compressed and committed as the daemon does it, and compared back after a
load. Holds no tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from ckptd.backends import Backend
from support.published import publish

ROOT = "llm"


def state(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    big = torch.randn(3_000_000, generator=g)  # 12 MB: several 4 MiB blocks
    return {
        "model": {
            "big": big,
            "w": torch.randn(300, 200, generator=g).t(),  # saved through a transposed view
            "bf": torch.randn(1000, 64, generator=g).to(torch.bfloat16),
            "ids": torch.arange(5000, dtype=torch.int64) * seed,
            "scalar": torch.tensor(3.5 + seed),
            "empty": torch.empty(0, 7),
        },
        "optim": {"exp_avg": big * 0.5, "exp_avg_sq": big.abs()},
        "step": 100 + seed,
        "extra": {"lrs": [0.1, 0.01], "name": "run-a"},
    }


def blank_like(src: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in src.items():
        if isinstance(v, dict):
            out[k] = blank_like(v)
        elif isinstance(v, torch.Tensor):
            out[k] = torch.zeros(v.shape, dtype=v.dtype)
        else:
            out[k] = None
    return out


def same(a: Any, b: Any) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    return bool(a == b)


def saved(tmp_path: Path, backend: Backend, *steps: int, codec: str = "auto") -> Path:
    root = tmp_path / "root"
    for n in steps:
        dcp.save(state(n), checkpoint_id=root / f"step-{n}", no_dist=True)
        publish(root, ROOT, n, backend, codec=codec)
    return root
