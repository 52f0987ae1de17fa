"""Where a zstd-bytegroup block's decode time goes, and a fused decode side by side with it.

Each input file is coded with `zstd-bytegroup` in memory; then, one thread, thread CPU time,
rounds interleaved, every block of the file:

- the parts of the current decode, each timed alone: the payload checksum, zstd of each plane
  (one-shot `decompress` into a fresh buffer, as the decoder does), the merge (compiled kernel,
  nibble unpack included), the output checksum, the copy out into a destination buffer;
- the same zstd calls with their buffers kept alive between blocks (what fresh allocation and
  first touch cost is the difference);
- the whole current decode (`_BlockCoder.decode_into`) against the fused one: the planes of a
  block decompressed in lockstep, `--chunk` elements at a time, by `stream_reader.readinto`
  into reused chunk buffers, each chunk merged into the destination at once (one row per
  chunk size in `--chunks`).

Every fused output is checked against the current decode (once, before the rounds). Nothing
here is a timed test.
Usage: python bench/decode_fused_bench.py [--rounds 5] [--chunks 65536,262144] [FILE ...]
"""

from __future__ import annotations

import argparse
import io
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import xxhash
import zstandard

from ckptd.codec import decoder, frame, kernels, make_encoder, planes
from ckptd.codec.frame import BlockHeader

DEFAULT = [
    "/tmp/ckptd-bench/minilm-bf16.safetensors",
    "/tmp/ckptd-bench/minilm-fp32.safetensors",
]
Block = tuple[BlockHeader, bytes]


def blocks(path: str) -> tuple[int, int, list[Block]]:
    data = open(path, "rb").read()
    coded = io.BytesIO()
    with make_encoder("zstd-bytegroup", coded) as enc:
        enc.update(0, memoryview(data))
        enc.finish(len(data))
    src = io.BytesIO(coded.getvalue())
    size, version = frame.parse_file_header(src.read(frame.FILE_HEADER_SIZE))
    found: list[Block] = []
    while not frame.is_end(marker := src.read(4)):
        fixed = marker + src.read(frame.BLOCK_FIXED_SIZE - 4)
        head = frame.parse_block_header(fixed, src.read(frame.table_size(fixed)), 0, size, version)
        found.append((head, src.read(head.stored_len)))
    return size, version, found


def zstd_frames(head: BlockHeader, payload: bytes) -> list[tuple[memoryview, int]]:
    """(frame, declared size) of every zstd frame in the block: planes, pairs, escapes."""
    out, pos = [], head.phase
    for entry in head.planes:
        stored = memoryview(payload)[pos : pos + entry.stored_len]
        pos += entry.stored_len
        if entry.method == frame.METHOD_ZSTD:
            out.append((stored, head.plane_len))
        elif entry.method == frame.METHOD_NIBBLES:
            nib = frame.parse_nibbles_head(stored, head.plane_len, "bench")
            pairs = stored[frame.NIBBLES_HEAD_SIZE : nib.escapes_at]
            out.append((pairs, (head.plane_len + 1) // 2))
            if nib.escape_method == frame.ESCAPES_ZSTD:
                out.append((stored[nib.escapes_at :], nib.escapes))
    return out


class Fused:
    """The fused decode: zstd planes read in lockstep a chunk at a time, merged at once."""

    def __init__(self, chunk: int) -> None:
        self.chunk = chunk
        self.dctxs = [zstandard.ZstdDecompressor() for _ in range(8)]
        self.bufs = [np.empty(chunk, np.uint8) for _ in range(8)]
        self.one = zstandard.ZstdDecompressor()

    def decode_into(
        self, head: BlockHeader, payload: memoryview, out: memoryview,
        clock: dict[str, float] | None = None,
    ) -> None:
        """With `clock`, the time in zstd and in the merges is added to it (an extra pass:
        the timer calls cost time of their own)."""
        if xxhash.xxh3_64_intdigest(payload) != head.stored_checksum:
            raise ValueError("payload checksum")
        n, w = head.plane_len, head.width
        start, end = head.phase, head.phase + n * w
        out[:start] = payload[:start]
        fills: list[Callable[[memoryview], int | None] | None] = []
        views: list[Any] = []
        pos = start
        nib = None
        escapes: Any = None
        for i, entry in enumerate(head.planes):
            stored = payload[pos : pos + entry.stored_len]
            pos += entry.stored_len
            if entry.method == frame.METHOD_RAW:
                views.append(np.frombuffer(stored, np.uint8))
                fills.append(None)
            elif entry.method == frame.METHOD_ZSTD:
                views.append(self.bufs[i])
                fills.append(self.dctxs[i].stream_reader(stored).readinto)
            else:
                nib = frame.parse_nibbles_head(stored, n, "bench")
                pairs = stored[frame.NIBBLES_HEAD_SIZE : nib.escapes_at]
                views.append(self.bufs[i])
                fills.append(self.dctxs[i].stream_reader(pairs).readinto)
                escapes = stored[nib.escapes_at :]
                if nib.escape_method == frame.ESCAPES_ZSTD:
                    escapes = self.one.decompress(escapes, max_output_size=nib.escapes)
        native = kernels.native()
        if native is None:
            raise SystemExit("the fused decode needs the compiled kernels (codec._planes)")
        rotate = head.transform == frame.TRANSFORM_SIGN_ROTATE
        marks = 0
        c = self.chunk
        tick = time.thread_time if clock is not None else _zero
        for at in range(0, n, c):
            m = min(c, n - at)
            t0 = tick()
            parts = []
            for i, fill in enumerate(fills):
                if fill is None:
                    parts.append(views[i][at : at + m])
                    continue
                size = (m + 1) // 2 if nib is not None and i == w - 1 else m
                buf = views[i][:size]
                if decoder._fill(fill, buf.data) != size:
                    raise ValueError("short plane")
                parts.append(buf)
            dst = out[start + at * w : start + (at + m) * w]
            t1 = tick()
            if nib is not None:
                marks += native.merge_nibbles(
                    parts[:-1], parts[-1], nib.base, escapes[marks:], w, rotate, dst
                )
            else:
                native.merge(parts, w, rotate, dst)
            if clock is not None:
                clock["fused: zstd chunk fills"] += t1 - t0
                clock["fused: chunk merges"] += tick() - t1
        out[end:] = payload[pos:]
        if xxhash.xxh3_64_intdigest(out) != head.checksum:
            raise ValueError("raw checksum")


def _zero() -> float:
    return 0.0


def run(path: str, rounds: int, chunks: list[int]) -> None:
    block_size, version, found = blocks(path)
    coder = decoder._BlockCoder(version, planes.Workspace())
    fused = {c: Fused(c) for c in chunks}
    out = memoryview(bytearray(block_size))
    check = bytearray(block_size)
    dest = bytearray(sum(h.raw_len for h, _ in found))
    frames = [zstd_frames(h, p) for h, p in found]
    kept = [[bytearray(size) for _, size in fs] for fs in frames]
    times: dict[str, list[float]] = {}

    def note(name: str, spent: float) -> None:
        times.setdefault(name, []).append(1e3 * spent / len(found))

    for head, payload in found:  # checked once, outside the clock: the check evicts the cache
        want = memoryview(check)[: head.raw_len]
        coder.decode_into(head, memoryview(payload), want, "bench")
        for c, f in fused.items():
            f.decode_into(head, memoryview(payload), out[: head.raw_len])
            assert out[: head.raw_len] == want, f"fused, chunks of {c}, differs"
    for _ in range(rounds):
        parts = dict.fromkeys(
            ("payload checksum", "zstd, fresh buffers", "zstd readinto, kept buffers",
             "output checksum", "copy out"), 0.0)
        at = 0
        for (head, payload), fs, keep in zip(found, frames, kept, strict=True):
            view = memoryview(payload)
            t = time.thread_time()
            xxhash.xxh3_64_intdigest(view)
            parts["payload checksum"] += time.thread_time() - t
            t = time.thread_time()
            for stored, size in fs:
                coder.dctx.decompress(stored, max_output_size=size)
            parts["zstd, fresh buffers"] += time.thread_time() - t
            t = time.thread_time()
            for (stored, _), buf in zip(fs, keep, strict=True):
                decoder._fill(coder.dctx.stream_reader(stored).readinto, memoryview(buf))
            parts["zstd readinto, kept buffers"] += time.thread_time() - t
            o = out[: head.raw_len]
            coder.decode_into(head, view, o, "bench")  # leaves the planes for the merge below
            t = time.thread_time()
            xxhash.xxh3_64_intdigest(o)
            parts["output checksum"] += time.thread_time() - t
            t = time.thread_time()
            dest[at : at + head.raw_len] = o
            parts["copy out"] += time.thread_time() - t
            at += head.raw_len
        for name, spent in parts.items():
            note(name, spent)
        note("merge (compiled)", _merge_time(coder, found))
        variants: list[tuple[str, Fused | None]] = [("whole decode, current", None)]
        variants += [(f"whole decode, fused, chunks of {c}", f) for c, f in fused.items()]
        for name, fn in variants:
            spent = 0.0
            for head, payload in found:
                o = out[: head.raw_len]
                t = time.thread_time()
                if fn is None:
                    coder.decode_into(head, memoryview(payload), o, "bench")
                else:
                    fn.decode_into(head, memoryview(payload), o)
                spent += time.thread_time() - t
            note(name, spent)
        for c, f in fused.items():
            clock = dict.fromkeys(("fused: zstd chunk fills", "fused: chunk merges"), 0.0)
            for head, payload in found:
                f.decode_into(head, memoryview(payload), out[: head.raw_len], clock)
            for part, spent in clock.items():
                note(f"{part}, chunks of {c}", spent)
    mb = sum(h.raw_len for h, _ in found) / len(found) / 1e6
    print(f"\n{path}: {len(found)} blocks, width {found[0][0].width}; "
          f"ms per block (median of {rounds}, min-max), MB/s per CPU second")
    print("| step | ms per block | MB/s/core |\n|---|---|---|")
    for name, ms in times.items():
        med = statistics.median(ms)
        print(f"| {name} | {med:.3f} ({min(ms):.3f}-{max(ms):.3f}) | {mb / med * 1e3:.0f} |")
    cur = statistics.median(times["whole decode, current"])
    for c in chunks:
        fus = statistics.median(times[f"whole decode, fused, chunks of {c}"])
        print(f"fused (chunks of {c}) / current, per CPU second: {cur / fus:.3f}x")


def _merge_time(coder: decoder._BlockCoder, found: list[Block]) -> float:
    """The merge alone: planes decoded first, outside the clock, then merged."""
    from ckptd.codec import nibbles

    spent = 0.0
    out = memoryview(bytearray(max(h.raw_len for h, _ in found)))
    for head, payload in found:
        parts, pos = [], head.phase
        for i, entry in enumerate(head.planes):
            stored = memoryview(payload)[pos : pos + entry.stored_len]
            pos += entry.stored_len
            parts.append(coder._plane(entry.method, stored, head.plane_len, "bench", i))
        o = out[head.phase : head.phase + head.plane_len * head.width]
        t = time.thread_time()
        nibbles.merge(parts, head.width, head.transform == 1, o, coder.ws)
        spent += time.thread_time() - t
    return spent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--chunks", default="65536,262144", help="elements per chunk, comma-separated")
    ap.add_argument("files", nargs="*", default=DEFAULT)
    args = ap.parse_args()
    for path in args.files:
        chunks = [int(c) for c in args.chunks.split(",")]
        if any(c <= 0 or c % 2 for c in chunks):
            ap.error("--chunks: even element counts (a chunk never splits a nibble pair)")
        run(path, args.rounds, chunks)


if __name__ == "__main__":
    main()
