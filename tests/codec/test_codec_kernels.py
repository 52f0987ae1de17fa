"""The compiled plane kernels (ckptd/codec/_planes.c) against the numpy reference: the same
bytes for every width, rotation, nibble plane, odd and empty length and unaligned start; the
golden objects and whole encodes through both paths; hostile arguments raise, never overrun."""

from __future__ import annotations

import io
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xxhash

from ckptd.codec import decode_stream, kernels, make_encoder, nibbles, planes

native = pytest.importorskip("ckptd.codec._planes", reason="the compiled kernels are not built")

GOLDEN = Path(__file__).parents[1] / "golden" / "codec"
LENGTHS = (0, 1, 2, 3, 7, 16, 4095, 4096, 4097, 8193, 1 << 17, (1 << 17) + 3, 300_001)


@pytest.fixture
def both(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[Callable[[], Any]], Any]]:
    """Run a function under the numpy path and the compiled path; return both results."""

    def run(fn: Callable[[], Any]) -> tuple[Any, Any]:
        got = []
        for mode in ("numpy", "c"):
            monkeypatch.setenv(kernels.ENV, mode)
            kernels.reset()
            assert kernels.name() == mode
            got.append(fn())
        return got[0], got[1]

    yield run
    monkeypatch.delenv(kernels.ENV, raising=False)
    kernels.reset()


def weights(n: int, width: int, seed: int = 0, spread: float = 0.05) -> bytes:
    """`n` bytes of float-like elements (most exponents within a window) at `width`."""
    rng = np.random.default_rng(seed)
    if width == 2:
        vals = rng.normal(0, spread, n // 2 + 1).astype(np.float32).view(np.uint32) >> 16
        data = vals.astype(np.uint16).tobytes()
    elif width == 4:
        data = rng.normal(0, spread, n // 4 + 1).astype(np.float32).tobytes()
    else:
        data = rng.normal(0, spread, n // 8 + 1).astype(np.float64).tobytes()
    return data[:n]


def inputs(width: int) -> Iterator[memoryview]:
    for n in LENGTHS:
        raw = bytearray(b"\x00" + weights(n * width + width - 1, width, seed=n))
        yield memoryview(raw)[1 : 1 + n * width]  # unaligned start
        yield memoryview(raw)[1 : 1 + n * width + width - 1]  # a tail shorter than an element
    rng = np.random.default_rng(9)
    yield memoryview(rng.integers(0, 256, 4097 * width, dtype=np.uint8).tobytes())


def copies(arrays: list[Any]) -> list[bytes]:
    return [bytes(np.asarray(a)) for a in arrays]


@pytest.mark.parametrize("width", [2, 4, 8])
@pytest.mark.parametrize("rotate", [True, False])
def test_split_and_merge_are_the_same_bytes(both: Any, width: int, rotate: bool) -> None:
    for data in inputs(width):
        _split_and_merge(both, data, width, rotate)


def _split_and_merge(both: Any, data: memoryview, width: int, rotate: bool) -> None:
    count = len(data) // width
    a, b = both(lambda: copies(planes.split(data, width, rotate, planes.Workspace())))
    assert a == b, f"split differs at {len(data)} bytes"
    parts = [np.frombuffer(p, dtype=np.uint8) for p in a]

    def merged() -> bytes:
        out = bytearray(count * width)
        planes.merge(parts, width, rotate, memoryview(out), planes.Workspace())
        return bytes(out)

    m1, m2 = both(merged)
    assert m1 == m2 == bytes(data[: count * width])


@pytest.mark.parametrize("width", [2, 4, 8])
def test_nibble_pack_split_and_merge_are_the_same_bytes(both: Any, width: int) -> None:
    for data in inputs(width):
        _nibbles(both, data, width)


def _nibbles(both: Any, data: memoryview, width: int) -> None:
    count = len(data) // width
    top = np.array(planes.split(data, width, True, planes.Workspace())[-1])
    base, _ = nibbles.nibble_base(top) if count else (0, 0.0)

    def pack() -> list[bytes]:
        return copies(list(nibbles.pack_nibbles(top, base, planes.Workspace())))

    def packed() -> list[bytes]:
        lower, pairs, escapes = nibbles.split_packed(data, width, base, planes.Workspace())
        return [*copies(lower), *copies([pairs, escapes])]

    p1, p2 = both(pack)
    assert p1 == p2
    s1, s2 = both(packed)
    assert s1 == s2 and s1[-2:] == p1
    lower = [np.frombuffer(p, dtype=np.uint8) for p in s1[:-2]]
    pairs, escapes = (np.frombuffer(p, dtype=np.uint8) for p in s1[-2:])

    def merged() -> tuple[bytes, int]:
        out = bytearray(count * width)
        top_plane = nibbles.NibblePlane(pairs, base, count, escapes)
        parts = [*lower, top_plane]
        nibbles.merge(parts, width, True, memoryview(out), planes.Workspace())
        return bytes(out), top_plane.marks

    m1, m2 = both(merged)
    assert m1 == m2 == (bytes(data[: count * width]), len(escapes))


def test_nibble_escapes_that_do_not_match_are_counted_alike(both: Any) -> None:
    wide = 10.0 ** np.random.default_rng(1).uniform(-6, 6, 10_000)  # many escapes
    data = (wide.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16).tobytes()
    top = np.array(planes.split(data, 2, True, planes.Workspace())[-1])
    lower = [np.array(planes.split(data, 2, True, planes.Workspace())[0])]
    pairs, escapes = nibbles.pack_nibbles(top, nibbles.nibble_base(top)[0], planes.Workspace())
    pairs, escapes = np.array(pairs), np.array(escapes)
    assert len(escapes) > 10
    for kept in (escapes[:-3], np.concatenate([escapes, escapes[:5]])):

        def marks(kept: Any = kept) -> int:
            top_plane = nibbles.NibblePlane(pairs, nibbles.nibble_base(top)[0], len(top), kept)
            out = memoryview(bytearray(len(data)))
            nibbles.merge([*lower, top_plane], 2, True, out, planes.Workspace())
            return top_plane.marks

        assert both(marks) == (len(escapes), len(escapes))


def test_golden_objects_decode_through_both_paths(both: Any) -> None:
    expected = json.loads((GOLDEN / "golden.json").read_text())
    for name, want in sorted(expected.items()):

        def decoded(name: str = name, codec: str = want["codec"]) -> str:
            dst = io.BytesIO()
            with open(GOLDEN / name, "rb") as src:
                decode_stream(codec, src, dst)
            return xxhash.xxh3_128_hexdigest(dst.getvalue())

        assert both(decoded) == (want["xxh3_128"], want["xxh3_128"]), name


@pytest.mark.parametrize("width", [2, 4, None])
def test_encodes_are_the_same_bytes(both: Any, width: int | None) -> None:
    data = b"header" + weights(3 * (1 << 16) + 5, width or 4, seed=3) + bytes(range(256)) * 8

    def encoded() -> bytes:
        out = io.BytesIO()
        with make_encoder("zstd-bytegroup", out, width_hint=width, block_size=1 << 16) as enc:
            enc.update(0, memoryview(data))
            enc.finish(len(data))
        return out.getvalue()

    a, b = both(encoded)
    assert a == b
    dst = io.BytesIO()
    decode_stream("zstd-bytegroup", io.BytesIO(a), dst)
    assert dst.getvalue() == data


def test_hostile_arguments_raise() -> None:
    n = 64
    src = bytes(4 * n)
    good = [bytearray(n) for _ in range(4)]
    out = bytearray(4 * n)
    with pytest.raises(ValueError, match="width"):
        native.split(src, 3, True, good[:3])
    with pytest.raises(ValueError, match="planes"):
        native.split(src, 4, True, good[:3])
    with pytest.raises(ValueError, match="holds"):
        native.split(src, 4, True, [*good[:3], bytearray(n - 1)])
    with pytest.raises(ValueError, match="holds"):
        native.merge([*good[:3], bytearray(n + 1)], 4, True, out)
    with pytest.raises(ValueError, match="output"):
        native.merge(good, 4, True, bytearray(4 * n + 1))
    with pytest.raises(BufferError):
        native.merge(good, 4, True, bytes(4 * n))  # read-only output
    with pytest.raises(BufferError):
        native.merge(good, 4, True, memoryview(out)[::2])  # not contiguous
    with pytest.raises(TypeError):
        native.merge([*good[:3], 7], 4, True, out)
    shared = bytearray(5 * n)
    view = memoryview(shared)
    with pytest.raises(ValueError, match="overlap"):
        native.merge([view[:n], *good[1:]], 4, True, view[n // 2 : n // 2 + 4 * n])
    with pytest.raises(ValueError, match="overlap"):
        native.split(view[: 4 * n], 4, True, [view[4 * n - 1 : 5 * n - 1], *good[1:]])
    with pytest.raises(ValueError, match="overlap"):
        native.split(src, 4, True, [view[:n], view[n - 1 : 2 * n - 1], *good[2:]])
    pairs, esc = bytearray(n // 2), bytearray(n)
    with pytest.raises(ValueError, match="wrong size"):
        native.pack_nibbles(bytes(n), 100, bytearray(n // 2 - 1), esc)
    with pytest.raises(ValueError, match="wrong size"):
        native.pack_nibbles(bytes(n), 100, pairs, bytearray(n - 1))
    with pytest.raises(ValueError, match="wrong size"):
        native.pack_nibbles(bytes(n), 256, pairs, esc)
    with pytest.raises(ValueError, match="overlap"):
        native.pack_nibbles(bytes(n), 100, view[:32], view[16 : 16 + n])
    with pytest.raises(ValueError, match="wrong size"):
        native.split_packed(src, 4, 100, good[:3], bytearray(n // 2 + 1), esc)
    with pytest.raises(ValueError, match="wrong size"):
        native.merge_nibbles(good[:3], bytearray(n // 2 - 1), 100, b"", 4, True, out)
    with pytest.raises(ValueError, match="wrong size"):
        native.merge_nibbles(good[:3], pairs, -1, b"", 4, True, out)
    with pytest.raises(ValueError, match="overlap"):
        native.merge_nibbles(good[:3], view[:32], 100, b"", 4, True, view[8 : 8 + 4 * n])
    assert native.merge_nibbles(good[:3], pairs, 100, b"", 4, True, out) == 0


def test_the_environment_forces_the_numpy_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(kernels.ENV, "numpy")
    kernels.reset()
    assert kernels.native() is None and kernels.name() == "numpy"
    monkeypatch.setenv(kernels.ENV, "bogus")
    kernels.reset()
    with pytest.raises(ValueError, match=kernels.ENV):
        kernels.native()
    monkeypatch.delenv(kernels.ENV)
    kernels.reset()
    assert kernels.name() == "c"


def test_describe_says_which_kernels_and_why(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(kernels.ENV, "c")
    kernels.reset()
    assert kernels.describe() in ("c (AVX2)", "c (baseline)")
    monkeypatch.setenv(kernels.ENV, "numpy")
    kernels.reset()
    assert kernels.describe() == f"numpy (no compiled kernels: {kernels.ENV}=numpy)"
    monkeypatch.delenv(kernels.ENV)
    kernels.reset()
