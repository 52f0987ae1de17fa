"""What a fresh destination costs: writing a resume's bytes into new, untouched tensor memory
(as a trainer's `torch.empty` state is) in 4 MiB blocks, the way ckptd's readers decode into
it, with the kernel's first-touch page faults, against the same pages mapped ahead in one call.

Ways, each on a fresh `torch.empty(size, dtype=uint8)`, CPU seconds of this process:
  plain     every page faulted in by its first write
  populate  madvise(MADV_POPULATE_WRITE) over each block just before it is written (5.14+)
  huge      madvise(MADV_HUGEPAGE) over the buffer first (transparent huge pages on `madvise`)
Rounds interleave the ways; each is printed as it runs. Nothing here is a timed test.
Usage: python bench/prefault_bench.py [--size 1600MB] [--rounds 3] [--ways plain,populate,huge]
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import time

import numpy as np
import torch

from ckptd.units import parse_size

BLOCK = 4 << 20
PAGE, HUGE = 4096, 2 << 20
MADV_HUGEPAGE, MADV_POPULATE_WRITE = 14, 23

libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)


def advise(addr: int, n: int, advice: int, align: int) -> None:
    lo, hi = -(-addr // align) * align, (addr + n) // align * align
    if hi > lo and libc.madvise(lo, hi - lo, advice) != 0:
        raise OSError(ctypes.get_errno(), f"madvise({advice})")


def one(way: str, size: int, src: np.ndarray) -> float:
    t = torch.empty(size, dtype=torch.uint8)
    dst, addr = t.numpy(), t.data_ptr()
    cpu = time.process_time()
    if way == "huge":
        advise(addr, size, MADV_HUGEPAGE, HUGE)
    for at in range(0, size, BLOCK):
        n = min(BLOCK, size - at)
        if way == "populate":
            advise(addr + at, n, MADV_POPULATE_WRITE, PAGE)
        dst[at : at + n] = src[:n]
    return time.process_time() - cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", default="1600MB")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--ways", default="plain,populate,huge")
    args = ap.parse_args()
    size = parse_size(args.size)
    src = np.random.default_rng(0).integers(0, 256, BLOCK, dtype=np.uint8)
    ways = args.ways.split(",")
    print(f"{size:,} bytes in {BLOCK >> 20} MiB blocks into fresh torch.empty memory; "
          f"THP: {open('/sys/kernel/mm/transparent_hugepage/enabled').read().strip()}")
    got: dict[str, list[float]] = {w: [] for w in ways}
    for r in range(args.rounds):
        for way in ways if r % 2 == 0 else ways[::-1]:
            got[way].append(one(way, size, src))
            print(f"round {r + 1} {way}: {got[way][-1]:.3f} CPU s", flush=True)
    for way in ways:
        vals = sorted(got[way])
        print(f"{way}: median {vals[len(vals) // 2]:.3f} CPU s ({vals[0]:.3f}-{vals[-1]:.3f})")


if __name__ == "__main__":
    main()
