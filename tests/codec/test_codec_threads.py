"""One object's blocks decoded on several threads: the same bytes, the same pieces in the same
order, and on corruption or truncation the same error, after the same blocks, as on one."""

from __future__ import annotations

import io
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import xxhash

from ckptd.codec import decode_stream, make_encoder
from ckptd.errors import CorruptData

GOLDEN = Path(__file__).parents[1] / "golden" / "codec"
BLOCK = 1 << 16


def _data() -> bytes:
    rng = np.random.default_rng(5)
    weights = rng.normal(0, 0.05, 40 * BLOCK // 4).astype(np.float32).tobytes()
    return weights + rng.integers(0, 256, 3 * BLOCK + 77, dtype=np.uint8).tobytes() + bytes(999)


def _stored(data: bytes) -> bytes:
    out = io.BytesIO()
    with make_encoder("zstd-bytegroup", out, block_size=BLOCK) as enc:
        enc.update(0, memoryview(data))
        enc.finish(len(data))
    return out.getvalue()


def _decode(stored: bytes, threads: int) -> tuple[bytes, list[int], str]:
    dst, pieces = io.BytesIO(), []
    try:
        decode_stream("zstd-bytegroup", io.BytesIO(stored), dst, pieces.append, threads)
    except CorruptData as err:
        return dst.getvalue(), pieces, str(err)
    return dst.getvalue(), pieces, ""


@pytest.fixture(scope="module")
def stored() -> tuple[bytes, bytes]:
    data = _data()
    return data, _stored(data)


@pytest.mark.parametrize("threads", [2, 3, 8])
def test_threads_decode_the_same_pieces(stored: tuple[bytes, bytes], threads: int) -> None:
    data, coded = stored
    got, pieces, err = _decode(coded, threads)
    assert err == "" and got == data
    assert (got, pieces, err) == _decode(coded, 1)


@pytest.mark.parametrize("threads", [2, 4])
def test_corruption_raises_the_same_error_after_the_same_blocks(
    stored: tuple[bytes, bytes], threads: int
) -> None:
    _, coded = stored
    rng = np.random.default_rng(threads)
    for at in [*rng.integers(16, len(coded) - 40, 12), len(coded) // 2]:
        bad = bytearray(coded)
        bad[int(at)] ^= 0x41
        one = _decode(bytes(bad), 1)
        assert one[2], f"flip at {at} not detected"
        assert _decode(bytes(bad), threads) == one
    for cut in (len(coded) - 1, len(coded) // 3, 20):
        one = _decode(coded[:cut], 1)
        assert one[2] and _decode(coded[:cut], threads) == one


def test_golden_objects_decode_on_threads() -> None:
    expected = json.loads((GOLDEN / "golden.json").read_text())
    for name, want in sorted(expected.items()):
        dst = io.BytesIO()
        with open(GOLDEN / name, "rb") as src:
            decode_stream(want["codec"], src, dst, threads=3)
        assert xxhash.xxh3_128_hexdigest(dst.getvalue()) == want["xxh3_128"], name


class _CountingPool(ThreadPoolExecutor):
    """A real pool that counts the tasks running on it (a task cancelled before it started
    never runs)."""

    def __init__(self, threads: int) -> None:
        super().__init__(threads, "test-decode")
        self.busy = 0
        self.lock = threading.Lock()

    def submit(self, fn, /, *args, **kwargs):  # type: ignore[no-untyped-def, override]
        def run():  # type: ignore[no-untyped-def]
            with self.lock:
                self.busy += 1
            try:
                time.sleep(0.002)  # so a caller not waiting would see its blocks still running
                return fn(*args, **kwargs)
            finally:
                with self.lock:
                    self.busy -= 1

        return super().submit(run)


def test_objects_sharing_one_pool_each_decode_whole(stored: tuple[bytes, bytes]) -> None:
    data, coded = stored
    other = bytes(reversed(data))
    other_coded = _stored(other)
    results: dict[int, bytes] = {}

    def one(i: int, blob: bytes) -> None:
        dst = io.BytesIO()
        decode_stream("zstd-bytegroup", io.BytesIO(blob), dst, threads=2, pool=pool)
        results[i] = dst.getvalue()

    with _CountingPool(2) as pool:
        workers = [threading.Thread(target=one, args=(i, coded if i % 2 else other_coded))
                   for i in range(4)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
    assert results == {0: other, 1: data, 2: other, 3: data}


class _FailingSink(io.BytesIO):
    def __init__(self, after: int) -> None:
        super().__init__()
        self.after = after

    def write(self, data) -> int:  # type: ignore[no-untyped-def, override]
        if self.tell() + len(data) > self.after:
            raise OSError(28, "No space left on device")
        return super().write(data)


def test_a_failed_write_leaves_no_block_decoding_on_a_shared_pool(
    stored: tuple[bytes, bytes]
) -> None:
    """The readers' buffers go back to the caller's when decode_stream returns: no block of it
    may still be decoding into them on a pool that outlives the call."""
    _, coded = stored
    with _CountingPool(2) as pool:
        with pytest.raises(OSError, match="No space"):
            decode_stream("zstd-bytegroup", io.BytesIO(coded), _FailingSink(5 * BLOCK),
                          threads=4, pool=pool)
        assert pool.busy == 0


def test_a_corrupt_object_on_a_shared_pool_fails_as_on_one_thread(
    stored: tuple[bytes, bytes]
) -> None:
    _, coded = stored
    bad = bytearray(coded)
    bad[len(coded) // 2] ^= 0x41
    one = _decode(bytes(bad), 1)
    dst, pieces = io.BytesIO(), []
    with _CountingPool(2) as pool:
        with pytest.raises(CorruptData) as err:
            decode_stream("zstd-bytegroup", io.BytesIO(bytes(bad)), dst, pieces.append, 3, pool)
        assert pool.busy == 0
    assert (dst.getvalue(), pieces, str(err.value)) == one
