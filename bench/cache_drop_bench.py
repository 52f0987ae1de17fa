"""Validation of a checkpoint the trainer has just written (its pages dirty in the page cache):
ckptd as it is (drops the pages once the file is fsynced) beside the same validation without
that drop, alternating, in one run. Prints wall time and how much of the file stays cached.

    .venv/bin/python bench/cache_drop_bench.py --mb 512 --repeat 3
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from ckptd import fileio
from ckptd.model import Candidate
from ckptd.stages import validate as validate_stage


def resident(path: Path) -> int:
    out = subprocess.run(["fincore", "-b", "-n", "-o", "RES", str(path)], check=True,
                         capture_output=True, text=True).stdout
    return int(out.split()[0])


def one(root: Path, mb: int, drop: bool) -> tuple[float, float]:
    path = root / "step_1.pt"
    path.unlink(missing_ok=True)
    torch.save({"w": torch.randn(mb * 1024 * 1024 // 4)}, path)  # dirty in the page cache
    real = fileio.fsync_file
    if not drop:
        validate_stage.fileio.fsync_file = lambda p, drop=False: real(p)  # type: ignore[assignment]
    try:
        t0 = time.perf_counter()
        res = validate_stage.validate(root, Candidate("single", 1, "step_1.pt", ("step_1.pt",),
                                                      complete=True))
        wall = time.perf_counter() - t0
    finally:
        validate_stage.fileio.fsync_file = real  # type: ignore[assignment]
    assert res.valid, res
    return wall, resident(path) / path.stat().st_size


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=512)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    runs: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
    with tempfile.TemporaryDirectory(dir=Path.cwd()) as d:
        for i in range(args.repeat):
            for drop in ((True, False) if i % 2 == 0 else (False, True)):
                runs[drop].append(one(Path(d), args.mb, drop))
    for drop, label in ((False, "without the drop"), (True, "ckptd (drop after fsync)")):
        walls = [w for w, _ in runs[drop]]
        cached = [c for _, c in runs[drop]]
        print(f"{label:<26} wall median {statistics.median(walls):6.2f} s"
              f" ({', '.join(f'{w:.2f}' for w in walls)}); left cached median"
              f" {statistics.median(cached) * 100:5.1f}%")


if __name__ == "__main__":
    main()
