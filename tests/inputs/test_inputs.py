"""The one bounded reader (ckptd.inputs): regular files only, never blocking, never through a
link, capped per kind; strict JSON with bounded numbers. Real files, FIFOs, links and memfds."""

from __future__ import annotations

import math
import os
import threading
import time

import pytest

from ckptd import inputs
from ckptd.errors import BadInput, CorruptData

SMALL = inputs.Kind("small", 16)


def test_reads_a_regular_file(tmp_path):
    p = tmp_path / "LATEST"
    p.write_bytes(b'{"step": 7}\n')
    assert inputs.read_json(p, inputs.LATEST) == {"step": 7}


def test_a_bad_input_is_corrupt_data_naming_the_item(tmp_path):
    p = tmp_path / "meta.json"
    p.write_bytes(b"{")
    with pytest.raises(CorruptData, match="meta.json"):
        inputs.read_json(p, inputs.ROOT_META)


def test_a_fifo_is_refused_at_once_without_a_writer(tmp_path):
    p = tmp_path / "LATEST"
    os.mkfifo(p)
    done = threading.Event()
    errors: list[BaseException] = []

    def read() -> None:
        try:
            inputs.read_file(p, inputs.LATEST)
        except BaseException as exc:  # noqa: BLE001 - the test inspects it
            errors.append(exc)
        done.set()

    threading.Thread(target=read, daemon=True).start()
    if not done.wait(10):
        with open(p, "wb"):  # release the reader so the thread ends, then fail
            pass
        pytest.fail("reading a FIFO blocked")
    assert isinstance(errors[0], BadInput)
    assert "not a regular file" in str(errors[0])


def test_a_symlink_is_refused_even_to_a_good_file(tmp_path):
    good = tmp_path / "good.json"
    good.write_bytes(b"{}")
    link = tmp_path / "lease.json"
    link.symlink_to(good)
    with pytest.raises(BadInput, match="symlink"):
        inputs.read_file(link, inputs.LEASE)


def test_a_directory_and_a_device_are_refused(tmp_path):
    (tmp_path / "d").mkdir()
    with pytest.raises(BadInput, match="not a regular file"):
        inputs.read_file(tmp_path / "d", inputs.LEASE)
    with pytest.raises(BadInput, match="not a regular file"):
        inputs.read_file("/dev/zero", inputs.LEASE)


def test_relative_to_a_directory_descriptor(tmp_path):
    (tmp_path / "pins.json").write_bytes(b"[1]")
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert inputs.read_json("pins.json", inputs.PINS, dir_fd=fd) == [1]
    finally:
        os.close(fd)


def test_missing_is_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError):
        inputs.read_file(tmp_path / "nope", inputs.LATEST)


def test_over_the_cap_is_refused_by_size_before_reading(tmp_path):
    p = tmp_path / "big"
    with open(p, "wb") as f:
        f.truncate(1 << 40)  # a sparse terabyte: refused by fstat, nothing read
    t0 = time.monotonic()
    with pytest.raises(BadInput, match="over the LATEST cap"):
        inputs.read_file(p, inputs.LATEST)
    assert time.monotonic() - t0 < 5


def test_exactly_the_cap_is_read(tmp_path):
    p = tmp_path / "f"
    p.write_bytes(b"x" * SMALL.cap)
    assert inputs.read_file(p, SMALL) == b"x" * SMALL.cap


def test_a_memfd_is_read_from_its_start_and_capped():
    fd = os.memfd_create("hdr")
    try:
        os.write(fd, b'{"a": 1}')
        assert inputs.loads(inputs.read_fd(fd, inputs.ARENA_HEADER, "arena"), "arena") == {"a": 1}
        os.write(fd, b"y" * 32)
        with pytest.raises(BadInput, match="arena"):
            inputs.read_fd(fd, SMALL, "arena")
    finally:
        os.close(fd)


def test_check_size():
    assert inputs.check_size(b"abc", SMALL, "k") == b"abc"
    with pytest.raises(BadInput, match="k: 17 bytes"):
        inputs.check_size(b"z" * 17, SMALL, "k")


@pytest.mark.parametrize(
    "text, why",
    [
        ('{"step": NaN}', "NaN"),
        ('{"step": Infinity}', "Infinity"),
        ('{"step": -Infinity}', "Infinity"),
        ('{"step": 1e400}', "not finite"),
        ('{"step": ' + "9" * 400 + "}", "digits"),
        ('{"step": 9223372036854775808}', "out of range"),
        ('{"step": 1, "step": 2}', "twice"),
        ("[" * 100 + "]" * 100, "nested"),
        ("[" * 100000, "nested"),
        ('{"a": 1', "not JSON"),
        ("", "not JSON"),
    ],
)
def test_strict_json_refuses(text, why):
    with pytest.raises(BadInput, match=why) as info:
        inputs.loads(text.encode(), "s3://b/r/LATEST")
    assert str(info.value).startswith("s3://b/r/LATEST: ")


def test_strict_json_refuses_bad_utf8():
    with pytest.raises(BadInput, match="not JSON"):
        inputs.loads(b'{"a": "\xff"}', "x")


def test_strict_json_accepts_the_edges():
    doc = inputs.loads(b'{"a": 9223372036854775807, "b": -9223372036854775807, "c": 1.5e300}',
                       "x")
    assert doc == {"a": 2**63 - 1, "b": -(2**63 - 1), "c": 1.5e300}
    assert inputs.loads(b"[" * 63 + b"]" * 63, "x") is not None


@pytest.mark.parametrize("value", [True, -1, 2**63, 1.0, "3", None])
def test_check_int_refuses(value):
    with pytest.raises(BadInput, match="world_size"):
        inputs.check_int(value, "world_size", 0, 2**63 - 1)


def test_check_int_and_float_accept():
    assert inputs.check_int(5, "n", 0, 10) == 5
    assert inputs.check_float(2, "m") == 2.0
    assert inputs.check_float(0.5, "m", 0, 1) == 0.5


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, 10**400, True, "1", None])
def test_check_float_refuses(value):
    with pytest.raises(BadInput, match="val_loss"):
        inputs.check_float(value, "val_loss")
