"""Bounded property tests of the one bounded reader (`ckptd.inputs`): every kind of file
(regular files, FIFOs, links, directories, devices, sizes around each cap) and strict JSON
from any bytes and from hostile JSON end in a value or BadInput, never another exception, in
bounded time. A few hundred cases a run (`CKPTD_FUZZ_EXAMPLES` for more)."""

from __future__ import annotations

import math
import os
import stat
import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from support.fuzzing import (
    _splice,
    bounded,
    fuzz,
    hostile_literals,
    json_values,
)

from ckptd import inputs
from ckptd.errors import BadInput

KINDS = sorted((v for v in vars(inputs).values() if isinstance(v, inputs.Kind)),
               key=lambda k: k.name)


# -- hostile JSON ------------------------------------------------------------------------------


def _depth(doc: Any) -> int:
    if isinstance(doc, dict):
        return 1 + max((_depth(v) for v in doc.values()), default=0)
    if isinstance(doc, list):
        return 1 + max((_depth(v) for v in doc), default=0)
    return 1


def _strict(doc: Any) -> None:
    """What `loads` promises of every document it returns."""
    todo = [doc]
    while todo:
        node = todo.pop()
        if isinstance(node, bool) or node is None or isinstance(node, str):
            continue
        if isinstance(node, int):
            assert -inputs.INT_LIMIT < node < inputs.INT_LIMIT
        elif isinstance(node, float):
            assert math.isfinite(node)
        elif isinstance(node, dict):
            todo.extend(node.values())
        else:
            assert isinstance(node, list)
            todo.extend(node)
    assert _depth(doc) <= inputs.MAX_DEPTH


# -- the bounded reader: loads -----------------------------------------------------------------


@fuzz()
@given(st.binary(max_size=300) | st.text(max_size=300).map(str.encode))
def test_loads_of_any_bytes_is_strict_json_or_bad_input(data: bytes) -> None:
    with bounded("loads"):
        try:
            doc = inputs.loads(data, "item")
        except BadInput as exc:
            assert "item" in str(exc)
            return
    _strict(doc)


@fuzz()
@given(json_values, st.lists(st.integers(0, 50), max_size=5), hostile_literals)
def test_loads_of_hostile_json_is_strict_json_or_bad_input(doc: Any, path: list[int],
                                                           literal: str) -> None:
    data = _splice(doc, path, literal)
    with bounded("loads"):
        try:
            got = inputs.loads(data, "item")
        except BadInput as exc:
            assert "item" in str(exc)
            return
    _strict(got)


@pytest.mark.parametrize("text", [
    "NaN", "[Infinity]", '{"x": -Infinity}', "1e999", "9" * 400, "[" * 1_000_000,
    '{"a": 1, "a": 1}', "[" * (inputs.MAX_DEPTH + 1) + "]" * (inputs.MAX_DEPTH + 1),
    "1" * 100_000, "0." + "1" * 100_000, b"\xff\xfe{}".decode("latin-1"),
])
def test_loads_refuses_what_strict_json_is_not(text: str) -> None:
    with bounded("loads"), pytest.raises(BadInput, match="item"):
        inputs.loads(text.encode("latin-1"), "item")


@fuzz()
@given(st.one_of(st.integers(), st.floats(), st.booleans(), st.none(), st.text(max_size=5),
                 st.integers(min_value=10**300, max_value=10**400)),
       st.integers(-10, 10), st.integers(-10, 10))
def test_check_int_and_float_are_a_value_or_bad_input(value: Any, lo: int, hi: int) -> None:
    try:
        got = inputs.check_int(value, "n", lo, hi)
        assert lo <= got <= hi and type(got) is int
    except BadInput:
        pass
    try:
        f = inputs.check_float(value, "x", lo, hi)
        assert math.isfinite(f) and lo <= f <= hi
    except BadInput:
        pass


# -- the bounded reader: read_file over every kind of file --------------------------------------


def _make(where: Path, shape: str, size: int) -> Path:
    """A file of `shape` at `where`: a regular file of `size` bytes (sparse: cheap at any
    size), a FIFO with no writer, a link to a regular file or to nothing, a directory."""
    target = where.parent / (where.name + ".target")
    if shape == "regular":
        with open(where, "wb") as f:
            f.truncate(size)
            f.write(b"{}"[: min(size, 2)])
    elif shape == "fifo":
        os.mkfifo(where)
    elif shape == "link":
        target.write_bytes(b"{}")
        where.symlink_to(target)
    elif shape == "dangling":
        where.symlink_to(target)
    elif shape == "dir":
        where.mkdir()
    elif shape == "dev_link":
        where.symlink_to("/dev/zero")
    return where


@fuzz(150)
@given(st.sampled_from(KINDS), st.sampled_from(["regular", "fifo", "link", "dangling", "dir",
                                                "dev_link"]),
       st.sampled_from([-1, 0, 1]), st.integers(0, 64), st.booleans())
def test_read_file_is_bytes_within_the_cap_or_bad_input(kind: inputs.Kind, shape: str,
                                                        near: int, small: int,
                                                        at_cap: bool) -> None:
    size = kind.cap + near if at_cap else small
    with tempfile.TemporaryDirectory() as tmp:
        path = _make(Path(tmp) / "item", shape, size)
        dir_fd = os.open(tmp, os.O_RDONLY | os.O_DIRECTORY)
        try:
            for how in ("path", "dir_fd"):
                with bounded(f"read_file of a {shape}"):
                    try:
                        data = (inputs.read_file(path, kind) if how == "path"
                                else inputs.read_file("item", kind, dir_fd=dir_fd))
                    except BadInput as exc:
                        assert shape != "regular" or size > kind.cap, exc
                        assert kind.name in str(exc) and "item" in str(exc)
                        continue
                assert shape == "regular" and size <= kind.cap
                assert len(data) == size
        finally:
            os.close(dir_fd)


def test_read_file_of_a_device_and_a_missing_file() -> None:
    with pytest.raises(BadInput, match="not a regular file"):
        inputs.read_file("/dev/zero", inputs.LATEST)
    with pytest.raises(FileNotFoundError):
        inputs.read_file("/nonexistent/ckptd/item", inputs.LATEST)


def test_read_fd_stops_at_the_cap_whatever_the_file_grows_to(tmp_path: Path) -> None:
    """A regular file that grows past the cap between fstat and read is refused after reading
    at most cap + 1 bytes (a memfd, as the async-save door hands over, is one too)."""
    fd = os.memfd_create("item")
    try:
        os.write(fd, b"x" * (inputs.LATEST.cap + 5000))
        with pytest.raises(BadInput, match="cap"):
            inputs.read_fd(fd, inputs.LATEST, "item")
        os.ftruncate(fd, 10)
        assert inputs.read_fd(fd, inputs.LATEST, "item") == b"x" * 10
    finally:
        os.close(fd)


def test_the_fuzzed_files_are_what_the_readers_expect(tmp_path: Path) -> None:
    """The shapes the read_file property builds are what their names say."""
    for shape, want in (("regular", stat.S_ISREG), ("fifo", stat.S_ISFIFO),
                        ("link", stat.S_ISLNK), ("dir", stat.S_ISDIR)):
        p = _make(tmp_path / shape, shape, 3)
        assert want(os.lstat(p).st_mode), shape
