"""One timed compress or decompress run, in its own process, so its peak RSS is its own.

Prints one JSON line: CPU seconds and wall seconds of the timed section, plus what was written.
Never leaves its input modified (zipnn gets a private copy: it edits its input in place).
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from collections.abc import Callable
from typing import Any, BinaryIO

import xxhash
from bench_sys import read_pass

from ckptd.formats.zipcheck import crc32  # type: ignore[attr-defined]  # the zip check's CRC-32

CHUNK = 8 << 20


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


class CrcSink:
    """CRC-32 over the whole stream: the cost of checking every zip member's CRC-32."""

    def __init__(self) -> None:
        self.crc = 0

    def update(self, offset: int, view: memoryview) -> None:
        self.crc = crc32(view, self.crc)

    def finish(self, total: int) -> None:
        pass


class HashSink:
    def __init__(self) -> None:
        self.h = xxhash.xxh3_128()

    def update(self, offset: int, view: memoryview) -> None:
        self.h.update(view)

    def finish(self, total: int) -> None:
        pass


def _crc_sink(path: str, is_zip: bool) -> Any:
    """The project's zip CRC sink when it exists and the file is a zip, else a whole-file CRC."""
    if is_zip:
        try:
            from ckptd.formats.zipcheck import ZipCrcSink

            return ZipCrcSink.for_file(path)
        except ImportError:
            pass
    return CrcSink()


def compress(encoder: str, src: str, dst: str, dtype: str, is_zip: bool) -> dict[str, Any]:
    with open(dst, "wb") as out:
        if encoder.startswith("ckptd"):
            return _ckptd_compress(encoder, src, out, is_zip)
        if encoder.startswith("pyzstd"):
            return _timed(lambda: _pyzstd_compress(int(encoder[-1]), src, out))
        if encoder == "zipnn":
            return _zipnn_compress(src, out, dtype)
    raise SystemExit(f"unknown encoder {encoder}")


def _timed(work: Callable[[], object]) -> dict[str, Any]:
    cpu, wall = _cpu(), time.perf_counter()
    result = work()
    return {"cpu_s": _cpu() - cpu, "wall_s": time.perf_counter() - wall, "result": result}


def _ckptd_compress(encoder: str, src: str, out: BinaryIO, is_zip: bool) -> dict[str, Any]:
    from ckptd.codec import make_encoder

    codec = encoder.split("+")[0].removeprefix("ckptd-").replace("bytegroup", "zstd-bytegroup")
    enc = make_encoder(codec, out, level=3, threads=int(os.environ.get("BENCH_THREADS", "1")))
    sinks: list[Any] = [enc]
    if encoder.endswith("+hash+crc"):
        sinks = [HashSink(), _crc_sink(src, is_zip), enc]
    res = _timed(lambda: read_pass(src, sinks)[1])
    res.update(codec=enc.codec, reader=res.pop("result"))
    return res


def _pyzstd_compress(level: int, src: str, out: BinaryIO) -> None:
    import zstandard

    with open(src, "rb") as f:
        zstandard.ZstdCompressor(level=level).copy_stream(f, out, read_size=CHUNK)


def _zipnn_compress(src: str, out: BinaryIO, dtype: str) -> dict[str, Any]:
    import zipnn

    zp = zipnn.ZipNN(input_format="byte", bytearray_dtype=dtype, threads=1)

    def work() -> None:
        with open(src, "rb") as f:
            data = bytearray(f.read())  # a private copy: zipnn.compress edits its input
        out.write(zp.compress(data))

    return _timed(work)


class _HashingNull:
    """Where decoders write: nothing is kept, the xxh3 of the output proves the round trip."""

    def __init__(self) -> None:
        self.h = xxhash.xxh3_128()
        self.size = 0

    def write(self, data: bytes | memoryview) -> int:
        self.h.update(data)
        self.size += len(data)
        return len(data)


def decompress(encoder: str, stored: str, codec: str, dtype: str) -> dict[str, Any]:
    sink = _HashingNull()
    if encoder.startswith("ckptd"):
        res = _timed(lambda: _ckptd_decompress(codec, stored, sink))
    elif encoder.startswith("pyzstd"):
        res = _timed(lambda: _pyzstd_decompress(stored, sink))
    elif encoder == "zipnn":
        res = _zipnn_decompress(stored, sink, dtype)
    else:
        raise SystemExit(f"unknown encoder {encoder}")
    res.update(digest=sink.h.hexdigest(), size=sink.size)
    res.pop("result", None)
    return res


def _ckptd_decompress(codec: str, stored: str, sink: _HashingNull) -> None:
    from ckptd.codec import decode_stream

    with open(stored, "rb") as src:
        decode_stream(codec, src, sink)  # type: ignore[arg-type]


def _pyzstd_decompress(stored: str, sink: _HashingNull) -> None:
    import zstandard

    with open(stored, "rb") as src:
        zstandard.ZstdDecompressor().copy_stream(src, sink, read_size=CHUNK, write_size=CHUNK)  # type: ignore[arg-type]


def _zipnn_decompress(stored: str, sink: _HashingNull, dtype: str) -> dict[str, Any]:
    import zipnn

    zp = zipnn.ZipNN(input_format="byte", bytearray_dtype=dtype, threads=1)

    def work() -> None:
        with open(stored, "rb") as f:
            sink.write(bytes(zp.decompress(f.read())))

    return _timed(work)


def in_memory(encoder: str, src: str, dtype: str) -> dict[str, Any]:
    """Codec CPU cost alone: input already in memory, output kept in memory, no file I/O."""
    with open(src, "rb") as f:
        data = f.read()
    compress, decompress = _MEMORY_CODECS[encoder](dtype)
    cpu = _cpu()
    stored = compress(data)
    compress_s = _cpu() - cpu
    cpu = _cpu()
    restored = decompress(stored)
    decompress_s = _cpu() - cpu
    return {
        "cpu_s": compress_s,
        "decomp_cpu_s": decompress_s,
        "stored": len(stored),
        "ok": xxhash.xxh3_128_digest(restored) == xxhash.xxh3_128_digest(data),
    }


class _Into:
    def __init__(self, size: int) -> None:
        self.buf = bytearray(size)
        self.pos = 0

    def write(self, data: bytes | memoryview) -> int:
        self.buf[self.pos : self.pos + len(data)] = data
        self.pos += len(data)
        return len(data)


Codec = tuple[Callable[[bytes], bytes], Callable[[bytes], bytes | bytearray]]


def _ckptd_memory(dtype: str) -> Codec:
    import io

    from ckptd.codec import decode_stream, make_encoder

    resolved, size = [""], [0]

    def compress(data: bytes) -> bytes:
        size[0] = len(data)
        out, view = io.BytesIO(), memoryview(data)
        enc = make_encoder("auto", out)
        for off in range(0, len(data), CHUNK):
            enc.update(off, view[off : off + CHUNK])
        enc.finish(len(data))
        resolved[0] = enc.codec
        return out.getvalue()

    def decompress(stored: bytes) -> bytearray:
        out = _Into(size[0])  # preallocated, as zstd's one-shot decompress does
        decode_stream(resolved[0], io.BytesIO(stored), out)  # type: ignore[arg-type]
        return out.buf

    return compress, decompress


def _pyzstd_memory(dtype: str) -> Codec:
    import zstandard

    cctx, dctx = zstandard.ZstdCompressor(level=1), zstandard.ZstdDecompressor()
    return cctx.compress, dctx.decompress


def _zipnn_memory(dtype: str) -> Codec:
    import zipnn

    zp = zipnn.ZipNN(input_format="byte", bytearray_dtype=dtype, threads=1)

    def compress(data: bytes) -> bytes:
        return bytes(zp.compress(bytearray(data)))  # a copy: zipnn edits its input in place

    def decompress(stored: bytes) -> bytes:
        return bytes(zp.decompress(stored))

    return compress, decompress


_MEMORY_CODECS: dict[str, Callable[[str], Codec]] = {
    "ckptd-auto": _ckptd_memory,
    "pyzstd-1": _pyzstd_memory,
    "zipnn": _zipnn_memory,
}


def warm_up(encoder: str, dtype: str) -> None:
    """Code a small synthetic buffer first, so the timed run sees the steady state of a
    long-running process (contexts created, buffers faulted in), as a daemon would."""
    import tempfile

    import numpy as np

    data = np.random.default_rng(0).standard_normal(1 << 20, dtype=np.float32) * 0.02
    with tempfile.TemporaryDirectory() as tmp:
        src, dst = os.path.join(tmp, "w"), os.path.join(tmp, "w.out")
        data.tofile(src)
        res = compress(encoder, src, dst, dtype, False)
        decompress(encoder, dst, res.get("codec", ""), dtype)


def reset_peak_rss() -> bool:
    """Restart VmHWM from the current RSS (Linux >= 4.0), so the warm-up does not count."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def evict(path: str) -> None:
    from bench_sys import evict as drop

    drop(path)


def _keep_fastest(best: dict[str, Any], res: dict[str, Any]) -> dict[str, Any]:
    """Each timing is the fastest of the repeats: on a shared machine noise only adds time."""
    if not best:
        return res
    for key in ("cpu_s", "wall_s", "decomp_cpu_s"):
        if key in res:
            best[key] = min(best[key], res[key])
    return best


NUMPY_KERNELS = "@numpy"


def main(argv: list[str]) -> None:
    """`bench_worker.py compress|decompress|memory ENCODER SRC DST|CODEC DTYPE IS_ZIP REPEATS`"""
    mode, encoder, src, dst_or_codec, dtype, is_zip, repeats = argv
    if encoder.endswith(NUMPY_KERNELS):  # the codec as it ran before its compiled kernels
        os.environ["CKPTD_CODEC_KERNELS"] = "numpy"
        encoder = encoder.removesuffix(NUMPY_KERNELS)
    warm_up(encoder, dtype)
    reset = reset_peak_rss()
    best: dict[str, Any] = {}
    for _ in range(int(repeats)):
        evict(src)
        if mode == "compress":
            res = compress(encoder, src, dst_or_codec, dtype, is_zip == "1")
        elif mode == "memory":
            res = in_memory(encoder, src, dtype)
        else:
            res = decompress(encoder, src, dst_or_codec, dtype)
        best = _keep_fastest(best, res)
    best["peak_rss"] = peak_rss() if reset else 0
    print(json.dumps(best))


if __name__ == "__main__":
    main(sys.argv[1:])
