"""Objects written by earlier encoder versions (tests/golden/codec) still decode, byte for byte."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import xxhash

from ckptd.codec import decode_stream
from ckptd.errors import CorruptData

GOLDEN = Path(__file__).parent.parent / "golden" / "codec"
EXPECTED: dict[str, dict[str, object]] = json.loads((GOLDEN / "golden.json").read_text())


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_golden_object_decodes(name: str) -> None:
    want = EXPECTED[name]
    dst = io.BytesIO()
    with open(GOLDEN / name, "rb") as src:
        total = decode_stream(str(want["codec"]), src, dst)
    assert total == want["size"] == len(dst.getvalue())
    assert xxhash.xxh3_128_hexdigest(dst.getvalue()) == want["xxh3_128"]


@pytest.mark.parametrize("name", sorted(n for n in EXPECTED if n.endswith(".zbg")))
def test_golden_object_corruption_is_detected(name: str) -> None:
    stored = bytearray((GOLDEN / name).read_bytes())
    stored[len(stored) // 2] ^= 0x10
    with pytest.raises(CorruptData, match="zstd-bytegroup: block"):
        decode_stream("zstd-bytegroup", io.BytesIO(bytes(stored)), io.BytesIO())
