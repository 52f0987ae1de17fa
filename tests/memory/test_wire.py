"""A replica's body: round trips of real torch.save files through every codec, a flipped byte
or a cut anywhere refused, hostile heads and frames refused before anything is trusted, a
source changing while it is sent caught, and memory that stays bounded for a big file."""

from __future__ import annotations

import io
import json
import mmap
import random
import struct
import tracemalloc
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import xxhash
from hypothesis import given
from hypothesis import strategies as st
from support.codec_data import trained_weights
from support.fuzzing import _replace, _splice, bounded, fuzz, hostile_literals, json_values

from ckptd.errors import BadValue, CorruptData
from ckptd.memory import wire
from ckptd.memory.wire import ReplicaFile, ReplicaHead

CODECS = ["none", "zstd", "zstd-bytegroup", "auto"]


def _saved(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _weights(dtype: torch.dtype) -> torch.Tensor:
    return torch.frombuffer(bytearray(trained_weights(dtype)), dtype=dtype)


@pytest.fixture(scope="module")
def files() -> dict[str, bytes]:
    return {"model.pt": _saved({"w": _weights(torch.bfloat16)}),
            "optim.rank0.pt": _saved({"exp_avg": _weights(torch.float32)}),
            "extra.pt": b""}


def _head(data: dict[str, bytes], node: str = "n1", step: int = 7) -> ReplicaHead:
    comps = {"model.pt": "model", "optim.rank0.pt": "optimizer", "extra.pt": "extra",
             "scheduler.pt": "scheduler"}
    fs = tuple(ReplicaFile(p, comps[p], len(b), xxhash.xxh3_128_hexdigest(b))
               for p, b in data.items())
    meta = {"format": "ckptd-native/1", "step": step, "world_size": 2, "created": 1.5,
            "metrics": {"loss": 0.25}, "config": {"lr": 1e-3}}
    return ReplicaHead("llm", node, step, 0, 2, 3, fs, meta)


def _body(data: dict[str, bytes], codec: str, h: ReplicaHead | None = None) -> bytes:
    h = h or _head(data)
    pieces = list(wire.encode(h, lambda f: memoryview(data[f.path]), codec, 3, 0.03))
    assert all(pieces)  # an empty piece would end a chunked HTTP body early
    return b"".join(pieces)


def _decode(body: bytes, threads: int = 1) -> tuple[ReplicaHead, dict[str, bytes]]:
    stream = io.BytesIO(body)
    h = wire.read_head(stream)
    out = {f.path: bytearray(f.size) for f in h.files}
    wire.decode_files(stream, h, lambda f: memoryview(out[f.path]), threads=threads)
    return h, {p: bytes(b) for p, b in out.items()}


def _sections(body: bytes) -> Iterator[int]:
    """Every offset where a section of the body starts (parsed here on its own)."""
    def u32(at: int) -> int:
        value: int = struct.unpack_from("<I", body, at)[0]
        return value

    at = 4 + u32(0) + 8
    yield from (0, 4, at - 8, at)
    while at < len(body):
        at += 4 + u32(at)  # prelude
        yield at
        while (n := u32(at)) != 0:
            yield at + 4
            at += 4 + n
            yield at
        at += 4
        yield at
        at += 4 + u32(at)  # trailer
        yield at


@pytest.mark.parametrize("codec", CODECS)
def test_round_trip_of_real_files(files: dict[str, bytes], codec: str) -> None:
    body = _body(files, codec)
    h, out = _decode(body)
    assert h == _head(files)
    assert out == files
    model = torch.load(io.BytesIO(out["model.pt"]), weights_only=True)
    assert torch.equal(model["w"], _weights(torch.bfloat16))
    if codec != "none":
        assert len(body) < sum(map(len, files.values()))


@pytest.mark.parametrize("size", [1, 100, 5000, 2 * wire.BLOCK_SIZE + 1])
def test_incompressible_bytes_round_trip(size: int) -> None:
    data = {"model.pt": random.Random(size).randbytes(size)}
    for codec in CODECS:
        assert _decode(_body(data, codec))[1] == data
        assert _decode(_body(data, codec), threads=3)[1] == data


def test_weights_shrink(files: dict[str, bytes]) -> None:
    model = {"model.pt": files["model.pt"]}
    raw = len(files["model.pt"])
    assert len(_body(model, "zstd-bytegroup")) < 0.8 * raw
    assert len(_body(model, "auto")) < 0.8 * raw


def test_a_flipped_byte_anywhere_is_refused(files: dict[str, bytes]) -> None:
    rng = random.Random(5)
    for codec in ("none", "zstd", "zstd-bytegroup"):
        body = _body(files, codec)
        places = {p + d for p in _sections(body) for d in (-1, 0, 1) if 0 <= p + d < len(body)}
        places |= {rng.randrange(len(body)) for _ in range(150)}
        for at in sorted(places):
            bad = bytearray(body)
            bad[at] ^= 1 << rng.randrange(8)
            with pytest.raises(CorruptData):
                _decode(bytes(bad))


def test_a_cut_anywhere_is_refused(files: dict[str, bytes]) -> None:
    for codec in ("none", "auto"):
        body = _body(files, codec)
        cuts = {p + d for p in _sections(body) for d in (-1, 0, 1) if 0 <= p + d < len(body)}
        assert max(_sections(body)) == len(body)
        for cut in sorted(cuts):
            with pytest.raises(CorruptData):
                _decode(body[:cut])
        with pytest.raises(CorruptData, match="after the last file"):
            _decode(body + b"\0")


def _doc(files: dict[str, bytes]) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(wire.head_bytes(_head(files)))
    return doc


def _with(doc: dict[str, Any], **changes: Any) -> bytes:
    return json.dumps({**doc, **changes}).encode()


def test_hostile_heads_are_refused(files: dict[str, bytes]) -> None:
    doc = _doc(files)
    f0 = doc["files"][0]
    bad_files = [
        [{**f0, "size": 2**41}],
        [{**f0, "size": 2**40}, {**doc["files"][1], "size": 2**40}],
        [{**f0, "size": -1}],
        [{**f0, "size": True}],
        [{**f0, "hash": f0["hash"].upper()}],
        [{**f0, "hash": f0["hash"][:31]}],
        [{**f0, "path": "optim.rank1.pt", "component": "optimizer"}],
        [{**f0, "path": "../model.pt"}],
        [{**f0, "component": "optimizer"}],
        [{**f0, "extra": 1}],
        [f0, f0],
        [f0] * 17,
        [],
        "model.pt",
    ]
    bad = [_with(doc, files=fs) for fs in bad_files]
    bad += [_with(doc, root=r) for r in ("", "../x", "a/b", "x" * 129, ".hidden", 5, "é")]
    bad += [_with(doc, node=n) for n in ("", "n 1", "-n", None)]
    bad += [_with(doc, step=2**63), _with(doc, step=-1), _with(doc, rank=2),
            _with(doc, world_size=2**16 + 1), _with(doc, generation=0),
            _with(doc, format="ckptd-replica/2"), _with(doc, extra=1),
            _with(doc, head={**doc["head"], "step": 8}),
            _with(doc, head={**doc["head"], "step": 7.0}),
            _with(doc, head={**doc["head"], "format": "dcp"}),
            _with(doc, head={**doc["head"], "deep": json.loads("[" * 70 + "]" * 70)}),
            _with(doc, head={**doc["head"], "pad": "x" * (1 << 20)}),
            b"[" * 100_000, b'{"format": NaN}', b"\xff\xfe", b"", b"[]",
            _with(doc).replace(b'"step"', b'"step": 1, "step"', 1)]
    for data in bad:
        with bounded("parse_head"), pytest.raises(CorruptData):
            wire.parse_head(data)
    assert wire.parse_head(_with(doc)) == _head(files)


def test_a_head_that_would_be_refused_is_not_sent(files: dict[str, bytes]) -> None:
    h = _head(files, node="no/slash")
    with pytest.raises(BadValue, match="node"):
        next(wire.encode(h, lambda f: memoryview(files[f.path]), "zstd", 3, 0.03))
    with pytest.raises(BadValue, match="codec"):
        next(wire.encode(_head(files), lambda f: memoryview(files[f.path]), "lz4", 3, 0.03))


class _Reads(io.BytesIO):
    """A stream that records the sizes asked of it."""

    def __init__(self, data: bytes) -> None:
        super().__init__(data)
        self.asked: list[int] = []

    def read(self, size: int | None = -1) -> bytes:
        self.asked.append(-1 if size is None else size)
        return super().read(size)


def test_lengths_are_checked_before_reading(files: dict[str, bytes]) -> None:
    stream = _Reads(struct.pack("<I", 0xFFFFFFFF) + b"x" * 100)
    with pytest.raises(CorruptData, match="over"):
        wire.read_head(stream)
    assert max(stream.asked) == 4
    small = {"model.pt": b"0123456789"}
    head = _body(small, "none")[: _prefix_len(small)]
    for frames, error in [(struct.pack("<I", (16 << 20) + 1), "over"),
                          (struct.pack("<I", 11) + b"x" * 11, "more than its codec"),
                          (struct.pack("<I", 4) + b"0123" + struct.pack("<I", 0), "decoded 4")]:
        stream = _Reads(head + _small({"codec": "none"}) + frames)
        h = wire.read_head(stream)
        stream.asked.clear()
        with pytest.raises(CorruptData, match=f"model.pt: .*{error}"):
            wire.decode_files(stream, h, lambda f: memoryview(bytearray(f.size)))
        assert max(stream.asked) <= 17  # the prelude; never a length read from the stream


def test_an_unknown_codec_or_a_lying_trailer_is_refused() -> None:
    small = {"model.pt": b"0123456789"}
    head = _body(small, "none")[: _prefix_len(small)]
    frames = struct.pack("<I", 10) + b"0123456789" + struct.pack("<I", 0)
    cases = [(_small({"codec": "lz4"}) + frames, "unknown codec"),
             (_small({"codec": "auto"}) + frames, "unknown codec"),
             (_small({"codec": "none", "x": 1}) + frames, "prelude"),
             (_small({"codec": "none"}) + frames + _small({"codec": "none", "stored": 9}),
              "trailer"),
             (_small({"codec": "none"}) + frames + _small({"codec": "zstd", "stored": 10}),
              "trailer"),
             (_small({"codec": "none"}) + frames.replace(b"0123", b"0124")
              + _small({"codec": "none", "stored": 10}), "hash mismatch")]
    for rest, error in cases:
        with pytest.raises(CorruptData, match=f"model.pt: .*{error}"):
            _decode(head + rest)
    _decode(head + _small({"codec": "none"}) + frames + _small({"codec": "none", "stored": 10}))


def _small(doc: dict[str, Any]) -> bytes:
    data = json.dumps(doc).encode()
    return struct.pack("<I", len(data)) + data


def _prefix_len(data: dict[str, bytes]) -> int:
    return 4 + len(wire.head_bytes(_head(data))) + 8


def test_a_source_changed_while_sent_is_caught() -> None:
    size = 3 * wire.CHUNK + 5
    src = bytearray(size)
    data = {"model.pt": src}
    h = _head({"model.pt": bytes(src)})
    out = wire.encode(h, lambda f: memoryview(data[f.path]), "none", 3, 0.03)
    sent = [next(out), next(out), next(out)]  # the head, a prelude, the first chunk's frame
    src[0] = 1  # already copied: what goes out is what was read, whole and consistent
    sent.append(next(out))
    src[2 * wire.CHUNK + 1] = 7  # not yet read
    with pytest.raises(CorruptData, match="model.pt: changed while it was sent"):
        sent.extend(out)
    with pytest.raises(CorruptData, match="truncated"):  # the body is never whole
        _decode(b"".join(sent))
    src[:] = bytes(size)
    src[0] = 1
    with pytest.raises(CorruptData, match="changed while it was sent"):
        _body(data, "zstd", h)  # type: ignore[arg-type]


def test_a_source_of_the_wrong_size_is_refused(files: dict[str, bytes]) -> None:
    h = _head(files)
    with pytest.raises(CorruptData, match="model.pt: .* bytes to send"):
        b"".join(wire.encode(h, lambda f: memoryview(files[f.path] + b"x"), "zstd", 3, 0.03))


@pytest.mark.parametrize("codec", ["none", "auto"])
def test_memory_stays_bounded_for_a_big_file(codec: str) -> None:
    size = 256 << 20
    with mmap.mmap(-1, size) as zeros:
        src = memoryview(zeros)
        h = ReplicaHead("r", "n", 1, 0, 1, 1, (ReplicaFile("model.pt", "model", size,
                        xxhash.xxh3_128_hexdigest(src)),),
                        {"format": "ckptd-native/1", "step": 1, "world_size": 1})
        tracemalloc.start()
        try:
            biggest = total = 0
            body = io.BytesIO()
            for piece in wire.encode(h, lambda f: src, codec, 3, 0.03):
                assert piece  # an empty piece would end a chunked HTTP body early
                biggest = max(biggest, len(piece))
                total += len(piece)
                if codec != "none":
                    body.write(piece)
            encode_peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.reset_peak()
            if codec != "none":
                body.seek(0)
                got = wire.read_head(body)
                with mmap.mmap(-1, size) as dest:
                    wire.decode_files(body, got, lambda f: memoryview(dest))
                    assert dest[size - 10:] == bytes(10)
                decode_peak = tracemalloc.get_traced_memory()[1]
                assert decode_peak < 16 << 20, decode_peak
        finally:
            tracemalloc.stop()
            src.release()
        assert biggest <= wire.FRAME_OUT + 4
        assert encode_peak < 32 << 20, encode_peak  # the chunk, its copy out, a few blocks
        assert total > size if codec == "none" else total < size // 100


@fuzz()
@given(st.binary(max_size=300))
def test_any_bytes_are_a_head_or_refused(data: bytes) -> None:
    try:
        wire.parse_head(data)
    except CorruptData:
        pass


VALID = json.loads(wire.head_bytes(_head({"model.pt": b"abc", "extra.pt": b""})))


@fuzz()
@given(st.lists(st.integers(0, 50), max_size=5), json_values | hostile_literals.map(str))
def test_a_mutated_head_is_parsed_or_refused(path: list[int], value: Any) -> None:
    data = json.dumps(_replace(VALID, path, value)).encode()
    with bounded("parse_head"):
        try:
            h = wire.parse_head(data)
        except CorruptData:
            return
    assert wire.parse_head(wire.head_bytes(h)) == h


@fuzz()
@given(st.lists(st.integers(0, 50), max_size=5), hostile_literals)
def test_a_hostile_literal_in_a_head_is_refused_or_bounded(path: list[int], raw: str) -> None:
    with bounded("parse_head"):
        try:
            wire.parse_head(_splice(VALID, path, raw))
        except CorruptData:
            pass


def test_a_destination_of_the_wrong_shape_is_refused(files: dict[str, bytes]) -> None:
    body = _body(files, "zstd")
    for dest in (lambda f: memoryview(bytes(f.size)), lambda f: memoryview(bytearray(f.size + 1))):
        stream = io.BytesIO(body)
        h = wire.read_head(stream)
        with pytest.raises(BadValue, match="writable view"):
            wire.decode_files(stream, h, dest)


def test_frames_of_big_and_small_pieces() -> None:
    out = wire._Out()
    pieces = [b"a" * (300 << 10), b"b" * (300 << 10), b"c", b"d" * (9 << 20)]
    for p in pieces:
        out.write(memoryview(p))
    sent = list(out.frames())
    assert all(sent) and out.size == 0
    body, frames = b"".join(sent), []
    while body:
        n = struct.unpack_from("<I", body)[0]
        assert 0 < n <= wire.FRAME_OUT
        frames.append(body[4:4 + n])
        body = body[4 + n:]
    assert b"".join(frames) == b"".join(pieces)
