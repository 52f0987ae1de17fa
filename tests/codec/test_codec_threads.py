"""One object's blocks decoded on several threads: the same bytes, the same pieces in the same
order, and on corruption or truncation the same error, after the same blocks, as on one."""

from __future__ import annotations

import io
import json
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
