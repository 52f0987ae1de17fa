"""Decoder kernels side by side: ways to rebuild a block whose top plane is exponent nibbles,
and ways to call zstd on its pairs frame, timed in one process on the same blocks.

Each input file is coded with `zstd-bytegroup`; every block with a nibble top plane is decoded
with the codec's own reader up to the merge, then each variant runs on it in turn (rounds
interleaved, thread CPU time, medians over rounds of the per-block mean). Every variant's
output is checked against the codec's. Nothing here is a timed test.
Usage: python bench/decode_merge_bench.py [--rounds 7] [FILE ...]
"""

from __future__ import annotations

import argparse
import io
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import zstandard

from ckptd.codec import decoder, frame, make_encoder, planes
from ckptd.codec.nibbles import NibblePlane

DEFAULT = [
    "/tmp/ckptd-bench/minilm-bf16.safetensors",
    "/tmp/ckptd-bench/tinylm300-bf16.safetensors",
    "/tmp/ckptd-bench/minilm-fp32.safetensors",
]
Block = tuple[list[Any], NibblePlane, int, bytes]  # lower planes, top, width, pairs frame


def blocks(path: str) -> tuple[decoder._BlockReader, list[Block]]:
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
        payload = src.read(head.stored_len)
        if head.planes[-1].method != frame.METHOD_NIBBLES or head.phase or head.plane_len % 16:
            continue  # the variants below skip the odd-length and unaligned cases
        reader = decoder._BlockReader(size, version)  # one per block: its planes stay valid
        parts, pos = [], 0
        for i, entry in enumerate(head.planes):
            stored = memoryview(payload)[pos : pos + entry.stored_len]
            parts.append(reader._plane(entry.method, stored, head.plane_len, "bench", i))
            pos += entry.stored_len
        nib = frame.parse_nibbles_head(stored, head.plane_len, "bench")
        pairs_frame = bytes(stored[frame.NIBBLES_HEAD_SIZE : nib.escapes_at])
        found.append(([np.array(p) for p in parts[:-1]], parts[-1], head.width, pairs_frame))
    return decoder._BlockReader(size, version), found


def current(b: Block, out: Any, ws: planes.Workspace) -> None:
    lower, top, width, _ = b
    top.marks = 0
    planes.merge([*lower, top], width, True, out, ws)


def spread(b: Block, out: Any, ws: planes.Workspace) -> None:
    """Each pair byte becomes both elements' exponent bits in one multiply, mask, add; the
    mantissa byte is rotated in place; escapes are found 16 nibbles per 64-bit word after."""
    lower, top, width, _ = b
    words = np.frombuffer(out, dtype=planes.UINT[width])
    for start in range(0, len(top), planes.MERGE_CHUNK):
        stop = min(start + planes.MERGE_CHUNK, len(top))
        n, w = stop - start, words[start:stop]
        t16 = w if width == 2 else ws.get("t16", np.uint16, n)
        carry = ws.get("c16", np.uint16, n)
        np.copyto(t16, lower[-1][start:stop])
        np.left_shift(t16, 15, out=carry)
        np.right_shift(t16, 1, out=t16)
        np.bitwise_or(t16, carry, out=t16)
        both = ws.get("s32", np.uint32, n // 2)
        pairs = top.pairs[start // 2 : stop // 2]
        np.multiply(pairs, np.uint32(0x80080), out=both, dtype=np.uint32)
        np.bitwise_and(both, np.uint32(0x07800780), out=both)
        np.add(both, np.uint32((top.base << 7) * 0x10001), out=both)
        np.bitwise_or(t16.view(np.uint32), both, out=t16.view(np.uint32))
        if width > 2:
            planes._merge_low([p[start:stop] for p in lower[:-1]], t16, w, ws)
    where = _escapes(top.pairs, ws)
    shift = 8 * width - 9
    keep = words.dtype.type(~(0xFF << shift) & ((1 << (8 * width)) - 1))
    words[where] = (words[where] & keep) | (top.escapes.astype(words.dtype) << shift)


def _escapes(pairs: Any, ws: planes.Workspace) -> Any:
    packed = pairs[: len(pairs) // 8 * 8].view(np.uint64)
    hit = ws.get("hit", np.uint64, len(packed))
    np.bitwise_and(packed, np.uint64(0x7777_7777_7777_7777), out=hit)
    np.add(hit, np.uint64(0x1111_1111_1111_1111), out=hit)
    np.bitwise_and(hit, packed, out=hit)
    np.bitwise_and(hit, np.uint64(0x8888_8888_8888_8888), out=hit)
    rows = np.flatnonzero(np.not_equal(hit, 0, out=ws.get("hitb", np.bool_, len(packed))))
    bits = np.unpackbits(hit[rows].view(np.uint8), bitorder="little").reshape(len(rows), 64)
    row, bit = np.nonzero(bits)
    return 16 * rows[row] + (bit >> 2)  # bench blocks hold a multiple of 16 elements


def lut(b: Block, out: Any, ws: planes.Workspace) -> None:
    """One np.take per plane: a 256-entry table turns a pair byte into both elements' exponent
    bits, another rotates the mantissa byte (width 2 only; escapes as in `spread`)."""
    lower, top, width, _ = b
    byte = np.arange(256, dtype=np.uint32)
    table = ((top.base + (byte & 15)) << 7) | ((top.base + (byte >> 4)) << 23)
    rot = ((byte >> 1) | ((byte & 1) << 15)).astype(np.uint16)
    words = np.frombuffer(out, dtype=np.uint16)
    for start in range(0, len(top), planes.MERGE_CHUNK):
        stop = min(start + planes.MERGE_CHUNK, len(top))
        w = words[start:stop]
        np.take(table, top.pairs[start // 2 : stop // 2], out=w.view(np.uint32), mode="wrap")
        m = ws.get("m16", np.uint16, stop - start)
        np.take(rot, lower[-1][start:stop], out=m, mode="wrap")
        np.bitwise_or(w, m, out=w)
    where = _escapes(top.pairs, ws)
    words[where] = (words[where] & np.uint16(0x807F)) | (top.escapes.astype(np.uint16) << 7)


def zstd_calls(frame_bytes: bytes, size: int) -> dict[str, Callable[[], object]]:
    dctx = zstandard.ZstdDecompressor()
    buf = memoryview(bytearray(size))

    def readinto() -> object:
        return decoder._fill(dctx.stream_reader(frame_bytes).readinto, buf)

    return {
        "zstd stream_reader.readinto, reused buffer": readinto,
        "zstd decompress()": lambda: dctx.decompress(frame_bytes),
        "zstd decompress(max_output_size), as decoded": lambda: dctx.decompress(frame_bytes, size),
        "zstd decompressobj().decompress": lambda: dctx.decompressobj().decompress(frame_bytes),
    }


def run(path: str, rounds: int) -> None:
    reader, found = blocks(path)
    width = found[0][2]
    merges = {"current (unpack, then merge)": current, "multiply-spread": spread}
    if width == 2:
        merges["lut (np.take)"] = lut
    ws = reader.ws
    outs = {k: bytearray(len(found[0][1]) * width) for k in merges}
    times: dict[str, list[float]] = {k: [] for k in merges}
    calls = {k: v for b in found[:1] for k, v in zstd_calls(b[3], len(b[1].pairs)).items()}
    times.update({k: [] for k in calls})
    for _ in range(rounds):
        for name, fn in merges.items():
            spent = 0.0
            for b in found:
                view = memoryview(outs[name])[: len(b[1]) * width]
                t = time.thread_time()
                fn(b, view, ws)
                spent += time.thread_time() - t
                if name != "current (unpack, then merge)":
                    view2 = memoryview(outs["current (unpack, then merge)"])[: len(view)]
                    current(b, view2, ws)
                    assert bytes(view) == bytes(view2), f"{name} differs"
            times[name].append(spent / len(found))
        for name, call in calls.items():
            t = time.thread_time()
            for _ in range(4):
                call()
            times[name].append((time.thread_time() - t) / 4)
    print(f"\n{path}: {len(found)} nibble blocks, width {width}; ms per block (median, min-max)")
    for name, ts in times.items():
        ms = [1e3 * t for t in ts]
        print(f"| {name} | {statistics.median(ms):.2f} ({min(ms):.2f}-{max(ms):.2f}) |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("files", nargs="*", default=DEFAULT)
    args = ap.parse_args()
    for path in args.files:
        run(path, args.rounds)


if __name__ == "__main__":
    main()
