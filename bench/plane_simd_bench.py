"""The compiled plane kernels built two ways, side by side: the wheel's build (baseline code
plus AVX2 clones picked at load time, on x86-64 with glibc and gcc) and the baseline alone
(-DCKPTD_NO_CLONES), each loaded from its own shared object and run on the same 4 MiB blocks
of the bench inputs, one thread, rounds interleaved. Needs a C compiler and Python's headers.
Usage: python bench/plane_simd_bench.py [--rounds 5] [FILE ...]
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sysconfig
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import numpy as np
from decode_merge_bench import DEFAULT

from ckptd.codec import nibbles

SOURCE = Path(__file__).resolve().parents[1] / "ckptd" / "codec" / "_planes.c"
BUILDS = {"baseline only": ["-DCKPTD_NO_CLONES"], "with AVX2 clones": []}
WIDTH = {"bf16": 2, "fp32": 4}


def build(flags: list[str], out: Path) -> ModuleType:
    include = sysconfig.get_paths()["include"]
    cmd = ["cc", "-shared", "-fPIC", "-O3", *flags, f"-I{include}", str(SOURCE), "-o", str(out)]
    subprocess.run(cmd, check=True)
    spec = importlib.util.spec_from_file_location("ckptd.codec._planes", out)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def rate(fn: Callable[[], object], nbytes: int, reps: int = 20) -> float:
    fn()
    t = time.thread_time()
    for _ in range(reps):
        fn()
    return nbytes * reps / (time.thread_time() - t) / 1e9


def run(path: str, mods: dict[str, ModuleType], rounds: int) -> None:
    width = WIDTH["bf16" if "bf16" in path else "fp32"]
    data = open(path, "rb").read()[8 << 20 : 12 << 20]
    n = len(data) // width
    planes = [bytearray(n) for _ in range(width)]
    pairs, spill, out = bytearray((n + 1) // 2), bytearray(n), bytearray(n * width)
    anymod = next(iter(mods.values()))
    anymod.split(data, width, True, planes)
    base = nibbles.nibble_base(np.frombuffer(planes[-1], np.uint8))[0]
    escapes = bytes(spill[: anymod.split_packed(data, width, base, planes[:-1], pairs, spill)])
    steps: dict[str, Callable[[ModuleType], object]] = {
        "split": lambda m: m.split(data, width, True, planes),
        "merge": lambda m: m.merge(planes, width, True, out),
        "split + nibble pack": lambda m: m.split_packed(data, width, base, planes[:-1], pairs,
                                                         spill),
        "merge + nibble unpack": lambda m: m.merge_nibbles(planes[:-1], pairs, base, escapes,
                                                            width, True, out),
    }
    got: dict[tuple[str, str], list[float]] = {}
    for _ in range(rounds):
        for step, fn in steps.items():
            for name, m in mods.items():
                speed = rate(lambda fn=fn, m=m: fn(m), len(data))
                got.setdefault((step, name), []).append(speed)
    print(f"\n{path}, one 4 MiB block (width {width}, {len(escapes)} escapes): GB/s per core")
    print("| kernel | " + " | ".join(mods) + " | ratio |")
    print("|---|---|---|---|")
    for step in steps:
        med = [statistics.median(got[(step, name)]) for name in mods]
        print(f"| {step} | " + " | ".join(f"{m:.1f}" for m in med) + f" | {med[1] / med[0]:.2f}x |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("files", nargs="*", default=DEFAULT)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        mods = {k: build(v, Path(tmp) / f"planes{i}.so") for i, (k, v) in enumerate(BUILDS.items())}
        for path in args.files:
            if Path(path).exists():
                run(path, mods, args.rounds)


if __name__ == "__main__":
    main()
