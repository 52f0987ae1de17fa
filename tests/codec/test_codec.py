"""Round trips, corruption detection and memory bounds of ckptd.codec, on real tensors."""

from __future__ import annotations

import io
import json
import os
import random
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from support.codec_data import BLOCK, decode, encode, trained_weights

from ckptd.codec import CODECS, codec_suffix, decode_stream, frame, make_encoder
from ckptd.errors import CorruptData


@pytest.fixture(scope="module")
def bf16() -> bytes:
    return trained_weights(torch.bfloat16)


@pytest.fixture(scope="module")
def fp32() -> bytes:
    return trained_weights(torch.float32)


RANDOM = np.random.default_rng(7).integers(0, 256, 3 * BLOCK + 123, dtype=np.uint8).tobytes()


def _metadata_json(entries: int) -> bytes:
    """Text like a checkpoint's metadata: where plain zstd beats byte planes."""
    rnd = random.Random(1)
    rows = [
        {
            "step": i,
            "loss": rnd.random(),
            "name": f"layer.{i}.weight",
            "shape": [rnd.randint(1, 4096)],
        }
        for i in range(entries)
    ]
    return json.dumps({"state": rows}, indent=1).encode()


TEXT = _metadata_json(1500)
SIZES = [0, 1, 2, 3, 5, 7, 4099, BLOCK - 1, BLOCK, BLOCK + 1, 2 * BLOCK + 3]


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("size", SIZES)
def test_round_trip_sizes(codec: str, size: int, fp32: bytes) -> None:
    for data in (RANDOM[:size], (fp32 * 4)[:size], TEXT[:size]):
        enc, stored = encode(data, codec)
        assert decode(enc.codec, stored) == data
        assert (enc.raw_size, enc.stored_size) == (len(data), len(stored))


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("chunk", [1, 777, BLOCK, 3 * BLOCK + 5])
def test_round_trip_chunkings(codec: str, chunk: int, bf16: bytes) -> None:
    data = bf16[: 2 * BLOCK + 11] if chunk == 1 else bf16
    enc, stored = encode(data, codec, chunk=chunk)
    assert decode(enc.codec, stored) == data


@pytest.mark.parametrize("width", [1, 2, 4, 8])
def test_width_hint_round_trips(width: int, fp32: bytes) -> None:
    data = fp32[: 3 * BLOCK + 5]
    enc, stored = encode(data, "zstd-bytegroup", width_hint=width)
    assert decode(enc.codec, stored) == data


def test_bytegroup_beats_plain_zstd_on_real_weights(bf16: bytes, fp32: bytes) -> None:
    for data, bound in ((bf16, 0.75), (fp32, 0.90)):
        auto, stored = encode(data, "auto", chunk=BLOCK, block_size=BLOCK)
        plain, zstd1 = encode(data, "zstd", level=1)
        assert auto.codec == "zstd-bytegroup" and auto.suffix == ".zbg"
        assert len(stored) / len(data) < bound
        assert len(stored) < len(zstd1)
        assert decode(auto.codec, stored) == data


@pytest.mark.parametrize("shift", [1, 2, 3])
def test_unaligned_tensors_are_found(shift: int, fp32: bytes) -> None:
    # Tensors inside a DCP shard start at arbitrary offsets.
    data = RANDOM[:shift] + fp32
    enc, stored = encode(data, "zstd-bytegroup")
    aligned, _ = encode(fp32, "zstd-bytegroup")
    assert decode(enc.codec, stored) == data
    assert len(stored) < aligned.stored_size * 1.01
    phases = [_header(stored, start).phase for start, _, _ in _block_offsets(stored)]
    assert phases.count(shift) > len(phases) // 2


def test_random_data_is_stored_raw() -> None:
    enc, stored = encode(RANDOM, "auto")
    assert enc.codec == "zstd-bytegroup"
    blocks = -(-len(RANDOM) // BLOCK)
    index = frame.ENTRY_SIZE * blocks + frame.FOOTER_SIZE  # version 3's index, exactly
    assert len(stored) - index < len(RANDOM) * 1.001
    assert decode(enc.codec, stored) == RANDOM


@pytest.mark.parametrize(
    ("data", "codec"),
    [(b"", "none"), (RANDOM[:5000], "none"), (TEXT[:5000], "zstd")],
)
def test_auto_small_files_resolve_to_a_single_codec(data: bytes, codec: str) -> None:
    enc, stored = encode(data, "auto")
    assert (enc.codec, enc.suffix) == (codec, codec_suffix(codec))
    assert decode(codec, stored) == data


def test_threads_give_identical_output(fp32: bytes) -> None:
    data = fp32 + RANDOM + TEXT[:50_000]
    for codec in ("auto", "zstd", "zstd-bytegroup"):
        one, stored1 = encode(data, codec, chunk=50_000)
        two, stored2 = encode(data, codec, chunk=50_000, threads=2)
        assert stored1 == stored2
        assert decode(two.codec, stored2) == data


def _chunks(count: int, size: int) -> Iterator[bytes]:
    rng = np.random.default_rng(3)
    for i in range(count):
        noise = rng.standard_normal(size // 4).astype(np.float32) * (i + 1)
        yield noise.tobytes()


@pytest.mark.parametrize("threads", [1, 2])
def test_memory_stays_bounded(threads: int) -> None:
    out = io.BytesIO()
    enc = make_encoder("auto", out, threads=threads, block_size=BLOCK)
    offset = peak = 0
    for piece in _chunks(200, 24_000):
        enc.update(offset, memoryview(piece))
        offset += len(piece)
        peak = max(peak, enc.buffered_bytes)
    enc.finish(offset)
    assert peak <= enc.peak_buffered_bytes <= enc.max_buffered_bytes
    assert enc.max_buffered_bytes <= (threads + 3) * BLOCK
    assert enc.buffered_bytes == 0
    assert offset > 50 * BLOCK


@pytest.mark.skipif(shutil.which("zstd") is None, reason="no zstd command line tool")
@pytest.mark.parametrize("data", [b"", TEXT, RANDOM], ids=["empty", "text", "random"])
def test_stock_zstd_decodes_zstd_codec(data: bytes, tmp_path: Path) -> None:
    enc, stored = encode(data, "zstd")
    path = tmp_path / f"x{enc.suffix}"
    path.write_bytes(stored)
    got = subprocess.run(["zstd", "-q", "-d", "-c", str(path)], capture_output=True, check=True)
    assert got.stdout == data


@pytest.mark.skipif(shutil.which("zstd") is None, reason="no zstd command line tool")
def test_stock_zstd_decodes_auto_single_block(tmp_path: Path) -> None:
    enc, stored = encode(TEXT[:BLOCK], "auto")
    assert enc.codec == "zstd"
    path = tmp_path / "x.zst"
    path.write_bytes(stored)
    got = subprocess.run(["zstd", "-q", "-d", "-c", str(path)], capture_output=True, check=True)
    assert got.stdout == TEXT[:BLOCK]


def _block_offsets(stored: bytes) -> list[tuple[int, int, int]]:
    """(header start, payload start, payload end) of each container block."""
    pos = frame.FILE_HEADER_SIZE
    found: list[tuple[int, int, int]] = []
    while not frame.is_end(stored[pos : pos + 4]):
        fixed = stored[pos : pos + frame.BLOCK_FIXED_SIZE]
        size = frame.table_size(fixed)
        rest = stored[pos + len(fixed) : pos + len(fixed) + size]
        head = frame.parse_block_header(fixed, rest, len(found), frame.MAX_BLOCK)
        start = pos + len(fixed) + size
        found.append((pos, start, start + head.stored_len))
        pos = start + head.stored_len
    return found


def _header(stored: bytes, pos: int) -> frame.BlockHeader:
    fixed = stored[pos : pos + frame.BLOCK_FIXED_SIZE]
    rest = stored[pos + len(fixed) : pos + len(fixed) + frame.table_size(fixed)]
    return frame.parse_block_header(fixed, rest, 0, frame.MAX_BLOCK)


def _flip(data: bytes, at: int) -> bytes:
    out = bytearray(data)
    out[at] ^= 0x40
    return bytes(out)


@pytest.mark.parametrize("where", ["payload_start", "payload_mid", "payload_end", "header"])
def test_flipped_byte_names_the_block(where: str, bf16: bytes) -> None:
    data = bf16 + RANDOM[:BLOCK]
    enc, stored = encode(data, "zstd-bytegroup")
    blocks = _block_offsets(stored)
    assert len(blocks) >= 3
    head, start, end = blocks[2]
    at = {
        "payload_start": start,
        "payload_mid": (start + end) // 2,
        "payload_end": end - 1,
        "header": head + 2,
    }[where]
    with pytest.raises(CorruptData, match="block 2"):
        decode(enc.codec, _flip(stored, at))


def test_every_flipped_byte_in_a_container_is_detected(bf16: bytes) -> None:
    data = TEXT[:3000] + RANDOM[:3000] + bf16[:6000]
    enc, stored = encode(data, "zstd-bytegroup", block_size=frame.MIN_BLOCK * 2)
    for at in range(len(stored)):
        with pytest.raises(CorruptData):
            decode(enc.codec, _flip(stored, at))


def test_flipped_bytes_in_zstd_frames_never_decode_to_wrong_data() -> None:
    # Some zstd header bits do not affect the output; the manifest hash is the end-to-end check.
    data = TEXT[:3000] + RANDOM[:3000]
    enc, stored = encode(data, "zstd", block_size=frame.MIN_BLOCK * 2)
    caught = 0
    for at in range(len(stored)):
        try:
            assert decode(enc.codec, _flip(stored, at)) == data
        except CorruptData:
            caught += 1
    assert caught > 0.95 * len(stored)


def test_truncation_is_detected(fp32: bytes) -> None:
    data = fp32[: 2 * BLOCK + 100]
    for codec in ("zstd-bytegroup", "zstd"):
        enc, stored = encode(data, codec)
        cuts = {0, 1, 10, len(stored) // 2, len(stored) - 20, len(stored) - 1}
        if codec == "zstd-bytegroup":
            cuts |= {end for _, _, end in _block_offsets(stored)}
        for cut in sorted(cuts):
            with pytest.raises(CorruptData):
                decode(enc.codec, stored[:cut])


def test_trailing_bytes_are_rejected() -> None:
    enc, stored = encode(TEXT, "zstd-bytegroup")
    with pytest.raises(CorruptData, match="trailing"):
        decode(enc.codec, stored + b"x")


def test_zstd_frame_corruption_names_the_frame() -> None:
    enc, stored = encode(TEXT, "zstd")
    table = stored.rindex(b"\x5e\x2a\x4d\x18")  # the seek table's skippable frame
    with pytest.raises(CorruptData, match="frame"):
        decode(enc.codec, _flip(stored, table - 2))


def test_unknown_codec_on_decode_is_corrupt_data() -> None:
    with pytest.raises(CorruptData, match="unknown codec"):
        decode_stream("lz5", io.BytesIO(b""), io.BytesIO())


def test_size_change_during_encode_is_reported() -> None:
    enc = make_encoder("auto", io.BytesIO())
    enc.update(0, memoryview(b"abc"))
    with pytest.raises(CorruptData, match="changed"):
        enc.finish(4)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"codec": "lz4"},
        {"codec": "zstd", "threads": 0},
        {"codec": "auto", "min_saving": 1.5},
        {"codec": "auto", "width_hint": 3},
        {"codec": "zstd", "level": 40},
    ],
)
def test_bad_arguments_are_rejected(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        make_encoder(out=io.BytesIO(), **kwargs)  # type: ignore[arg-type]


def test_out_of_order_chunks_are_rejected() -> None:
    enc = make_encoder("zstd", io.BytesIO())
    enc.update(0, memoryview(b"abcd"))
    with pytest.raises(ValueError, match="offset"):
        enc.update(10, memoryview(b"efgh"))
    enc.close()


def test_suffixes() -> None:
    assert [codec_suffix(c) for c in ("none", "zstd", "zstd-bytegroup")] == ["", ".zst", ".zbg"]
    with pytest.raises(ValueError):
        codec_suffix("auto")


def test_decode_from_a_real_file(tmp_path: Path, fp32: bytes) -> None:
    path = tmp_path / "w.zbg"
    with open(path, "wb") as out:
        enc = make_encoder("auto", out, block_size=BLOCK)
        enc.update(0, memoryview(fp32))
        enc.finish(len(fp32))
    assert os.path.getsize(path) == enc.stored_size
    with open(path, "rb") as src, open(tmp_path / "w", "wb") as dst:
        assert decode_stream(enc.codec, src, dst) == len(fp32)
    assert (tmp_path / "w").read_bytes() == fp32
