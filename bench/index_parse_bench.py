"""Cost of reading a block index from an object's tail: a good large index, and forged ones.

Forged: an object of `--mib` MiB whose tail claims as many blocks as its bytes allow (a
container index or a zstd seek table), each entry well formed, the sums made to agree; once
with the raw size the entries add up to ("consistent", the manifest forged too) and once with
the raw size of a small file ("inconsistent"). Prints CPU seconds and tracemalloc peak per case.

    PYTHONPATH=. python bench/index_parse_bench.py --mib 64

The good objects: random bytes coded with 4 KiB blocks (container) and 1 KiB frames (zstd),
so their indexes are as long as the encoder's smallest block sizes make them.
"""

from __future__ import annotations

import argparse
import io
import struct
import time
import tracemalloc
from collections.abc import Callable

import numpy as np

from ckptd.codec import TAIL_PROBE, frame, make_encoder, read_index, seektable
from ckptd.errors import CorruptData

KIB = 1 << 10


def forged_container(size: int, claim: int | None = None) -> tuple[bytes, int]:
    """(object, raw size its index adds up to): blocks of 1 KiB raw, MIN_BLOCK_STORED stored;
    its end record says `claim` raw bytes when given (else what the index adds up to)."""
    per = frame.MIN_BLOCK_STORED + frame.ENTRY_SIZE
    fixed = frame.FILE_HEADER_SIZE + frame.END_SIZE + frame.FOOTER_SIZE
    blocks = (size - fixed) // per
    raw = blocks * KIB
    rows = np.empty((blocks, 2), dtype="<u4")
    rows[:, 0], rows[:, 1] = frame.MIN_BLOCK_STORED, KIB
    body = bytes(blocks * frame.MIN_BLOCK_STORED)
    obj = (
        frame.pack_file_header(KIB)
        + body
        + frame.pack_end(blocks, raw if claim is None else claim)
        + frame.pack_index(rows.tobytes(), KIB)
    )
    return obj, raw


def forged_seek_table(size: int) -> tuple[bytes, int]:
    """(object, raw size): frames of 1 KiB raw in MIN_FRAME stored bytes each."""
    per = seektable.MIN_FRAME + 12
    frames = (size - 17) // per
    rows = np.empty((frames, 3), dtype="<u4")
    rows[:, 0], rows[:, 1], rows[:, 2] = seektable.MIN_FRAME, KIB, 0
    return bytes(frames * seektable.MIN_FRAME) + seektable.pack_rows(rows.tobytes()), frames * KIB


def good(codec: str, mib: int) -> tuple[bytes, int]:
    data = np.random.default_rng(0).integers(0, 256, mib << 20, dtype=np.uint8).tobytes()
    out = io.BytesIO()
    enc = make_encoder(codec, out, level=-7, block_size=KIB if codec == "zstd" else 4 * KIB)
    enc.update(0, memoryview(data))
    enc.finish(len(data))
    return out.getvalue(), len(data)


def measure(name: str, codec: str, stored: bytes, raw: int, repeat: int = 1) -> None:
    def fetch(start: int, end: int) -> bytes:
        return stored[start:end]

    tail = stored[len(stored) - min(TAIL_PROBE, len(stored)) :]
    run: Callable[[], object] = lambda: read_index(codec, len(stored), raw, tail, fetch)  # noqa: E731
    cpu = float("inf")
    for _ in range(repeat):  # the best of `repeat` runs
        took = time.process_time()
        outcome = _outcome(run)
        cpu = min(cpu, time.process_time() - took)
    tracemalloc.start()  # a second run: tracemalloc slows allocation, so CPU is taken without
    _outcome(run)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    print(f"{name:42s} {len(stored) / 2**20:7.1f} MiB  cpu {cpu:7.3f} s  "
          f"peak {peak / 2**20:8.1f} MiB  {outcome}")


def _outcome(run: Callable[[], object]) -> str:
    try:
        found = run()
    except CorruptData as exc:
        return f"CorruptData: {str(exc)[:70]}"
    return f"{len(found.blocks)} blocks" if found is not None else "None"  # type: ignore[attr-defined]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mib", type=int, default=64)
    args = parser.parse_args()
    size = args.mib << 20
    for codec, forge in (("zstd-bytegroup", forged_container), ("zstd", forged_seek_table)):
        stored, raw = forge(size)
        measure(f"{codec} forged, consistent", codec, stored, raw)
        measure(f"{codec} forged, raw size 1 MiB", codec, stored, 1 << 20)
        if codec == "zstd-bytegroup":
            claimed, _ = forged_container(size, 1 << 20)
            measure(f"{codec} forged, end record 1 MiB", codec, claimed, 1 << 20)
        bad = bytearray(stored)
        struct.pack_into("<I", bad, len(bad) - 9 if codec == "zstd" else len(bad) - 20, 2**32 - 1)
        measure(f"{codec} forged, count 2**32-1", codec, bytes(bad), raw)
    for codec in ("zstd-bytegroup", "zstd"):
        stored, raw = good(codec, args.mib)
        measure(f"{codec} good, {args.mib} MiB", codec, stored, raw, repeat=5)


if __name__ == "__main__":
    main()
