"""The compress stage run by hand on a candidate, and the leftovers a stage must not leave.
Holds no tests."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import layout_writers as w
import numpy as np
import torch

from ckptd import fileio
from ckptd.codec import BLOCK_SIZE
from ckptd.model import Candidate
from ckptd.remote.manifest import Manifest
from ckptd.retention import executor
from ckptd.stages.compress import Stager
from ckptd.stages.validate import validate
from support.nets import no_nets


def stager(root: Path, cand: Candidate, codec: str = "auto", threads: int = 1) -> Stager:
    """As the daemon builds it: the executor installs the copy (over a superseded one)."""
    return Stager(root, "r", cand.step, cand.layout, codec, 3, threads, 0.03,
                  install=partial(executor.install_copy, root, cand.step, nets=no_nets()))


def stage(root: Path, cand: Candidate, codec: str = "auto", threads: int = 1) -> Manifest:
    """What the pipeline does: validate with the stager's sinks, then commit."""
    st = stager(root, cand, codec, threads)
    result = validate(root, cand, extra_sinks=st.sinks_for)
    assert result.valid, result
    return st.commit(result.files, result.metrics)


def list_temps(top: Path) -> list[Path]:
    return [p for p in top.rglob("*") if p.name.startswith(fileio.TEMP_PREFIX)]


def odd_files(root: Path) -> Candidate:
    """Sizes that stress the framing: empty, 1 byte, not a multiple of the element width,
    several codec blocks and read chunks, incompressible and all-zero data."""
    g = torch.Generator().manual_seed(1)
    f32 = torch.randn(100_003, generator=g).numpy().tobytes()
    bf16 = torch.randn(50_001, generator=g).to(torch.bfloat16).view(torch.int16).numpy().tobytes()
    big = np.random.default_rng(2).standard_normal((2 * BLOCK_SIZE + 4096) // 4, np.float32)
    data = {
        "odd/empty.dat": b"",
        "odd/one.dat": b"\x07",
        "odd/f32_plus3.dat": f32 + b"xyz",
        "odd/bf16_plus1.dat": bf16 + b"!",
        "odd/multi_block.dat": big.tobytes() + b"12345",
        "odd/random.dat": np.random.default_rng(3).bytes((1 << 20) + 1),
        "odd/zeros.dat": bytes(3 << 20),
        "odd/model.safetensors": w.safetensors_bytes({"w": torch.randn(33, 7, generator=g)}),
    }
    for rel, content in data.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(content)
    return Candidate("registered", 3, "odd", tuple(data), complete=True)
