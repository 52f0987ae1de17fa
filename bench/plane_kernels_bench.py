"""The codec's numpy path against its compiled plane kernels, side by side in one process on
the same blocks: whole decode, the merge alone, whole encode and the split alone, per core.

Each input file is coded with `zstd-bytegroup` once; then every step runs under each path in
turn (CKPTD_CODEC_KERNELS, rounds interleaved so load on the machine hits both alike), timed
in thread CPU time on one thread. Figures are raw bytes per CPU second, medians of the rounds,
and the compiled path's ratio to numpy. Both paths' outputs are checked equal.
With `--threads N`, the whole decode also runs on N threads (compiled path, wall time): one
object's blocks decoded in parallel, as `decode_stream(..., threads=N)` does.
Usage: python bench/plane_kernels_bench.py [--rounds 5] [--threads N] [FILE ...]
"""

from __future__ import annotations

import argparse
import io
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

from decode_merge_bench import DEFAULT, blocks

from ckptd.codec import decode_stream, kernels, make_encoder, nibbles, planes

PATHS = ("numpy", "c")


class Sink(io.RawIOBase):
    """Discards what the decoder writes (the copy into a file is not what is measured)."""

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        return len(memoryview(data))


def use(path: str) -> None:
    os.environ[kernels.ENV] = path
    kernels.reset()
    assert kernels.name() == path, f"{path} kernels unavailable"


def encode(data: bytes) -> bytes:
    out = io.BytesIO()
    with make_encoder("zstd-bytegroup", out) as enc:
        enc.update(0, memoryview(data))
        enc.finish(len(data))
    return out.getvalue()


def steps(data: bytes, coded: bytes, path: str) -> dict[str, Callable[[], object]]:
    _, found = blocks(path)
    ws = planes.Workspace()
    outs = [bytearray(len(b[1]) * b[2]) for b in found]
    width = found[0][2]

    def merge() -> object:
        for b, out in zip(found, outs, strict=True):
            lower, top, w, _ = b
            nibbles.merge([*lower, top], w, True, memoryview(out), ws)
        return outs  # compared after the clock stops

    view, size = memoryview(data), 4 << 20
    pieces = [view[at : at + size] for at in range(0, len(data) - size + 1, size)]
    bases = [nibbles.nibble_base(planes.split(p, width, True, ws)[-1])[0] for p in pieces]

    def split() -> object:
        for piece, base in zip(pieces, bases, strict=True):
            nibbles.split_packed(piece, width, base, ws)
        return None  # the same bytes: tests/codec/test_codec_kernels.py

    return {
        "decode (whole)": lambda: decode_stream("zstd-bytegroup", io.BytesIO(coded), Sink()),
        "merge + nibble unpack": merge,
        "encode (whole)": lambda: encode(data),
        "split + nibble pack (own base)": split,
    }


def sizes(data: bytes, path: str) -> dict[str, int]:
    _, found = blocks(path)
    merged = sum(len(b[1]) * b[2] for b in found)
    split = len(data) // (4 << 20) * (4 << 20)
    return {"decode (whole)": len(data), "merge + nibble unpack": merged,
            "encode (whole)": len(data), "split + nibble pack (own base)": split}


def threads_row(path: str, rounds: int, threads: int) -> None:
    data = open(path, "rb").read()
    coded = encode(data)
    use("c")
    walls: dict[int, list[float]] = {1: [], threads: []}
    for _ in range(rounds):
        for n in walls:
            t = time.perf_counter()
            decode_stream("zstd-bytegroup", io.BytesIO(coded), Sink(), threads=n)
            walls[n].append(time.perf_counter() - t)
    use("numpy")
    rate = {n: statistics.median(len(data) / w / 1e9 for w in ws) for n, ws in walls.items()}
    print(f"| decode, wall, 1 thread / {threads} threads (compiled) | {rate[1]:.2f} | "
          f"{rate[threads]:.2f} | {rate[threads] / rate[1]:.2f}x |")


def run(path: str, rounds: int) -> None:
    data = open(path, "rb").read()
    coded = encode(data)
    nbytes = sizes(data, path)
    fns = {p: (use(p), steps(data, coded, path))[1] for p in PATHS}
    times: dict[tuple[str, str], list[float]] = {}
    for _ in range(rounds):
        for name in fns["numpy"]:
            results = []
            for p in PATHS:
                use(p)
                t = time.thread_time()
                results.append(fns[p][name]())
                times.setdefault((name, p), []).append(time.thread_time() - t)
            assert results[0] == results[1], f"{name}: the two paths differ"
    use("numpy")
    print(f"\n{path} ({len(data) / 1e6:.1f} MB, {len(coded) / len(data):.3f} stored/raw): "
          f"GB/s per core, median of {rounds} (min-max)")
    print("| step | numpy | compiled | compiled / numpy |")
    print("|---|---|---|---|")
    for name in fns["numpy"]:
        rate = {p: [nbytes[name] / t / 1e9 for t in times[(name, p)]] for p in PATHS}
        med = {p: statistics.median(rate[p]) for p in PATHS}
        cells = [f"{med[p]:.2f} ({min(rate[p]):.2f}-{max(rate[p]):.2f})" for p in PATHS]
        print(f"| {name} | {cells[0]} | {cells[1]} | {med['c'] / med['numpy']:.2f}x |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("files", nargs="*", default=DEFAULT)
    args = ap.parse_args()
    for path in args.files:
        if os.path.exists(path):
            run(path, args.rounds)
            if args.threads > 1:
                threads_row(path, args.rounds, args.threads)
        else:
            print(f"\n{path}: missing (bench/bench_inputs.py writes it)")


if __name__ == "__main__":
    main()
