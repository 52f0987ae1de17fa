"""An object file read while it is written (`ckptd.stages.sending.growing`): only bytes the
writer reported final are read, EOF comes only with the finished object, and a failed writer,
a cancel, no progress or a finished file other than what was read fail the read."""

from __future__ import annotations

import errno
import hashlib
import random
import threading
from pathlib import Path

import pytest

from ckptd.backends import mapped
from ckptd.stages.sending.growing import GrowingReader, Growth
from ckptd.stages.sending.reader import S3Etag

PART = 1 << 16


def _reader(path: Path, growth: Growth, cancel: threading.Event | None = None,
            stall_s: float = 30.0) -> GrowingReader:
    return GrowingReader(path, growth, PART, True, cancel or threading.Event(), stall_s)


def _etag(data: bytes) -> str:
    sink = S3Etag(len(data), PART)
    sink.update(0, memoryview(data))
    return sink.etag()


def test_reads_only_final_bytes_and_ends_with_the_finished_object(tmp_path: Path) -> None:
    path = tmp_path / "obj"
    data = bytes(range(256)) * 1024  # 4 parts
    out = open(path, "wb", buffering=0)  # noqa: SIM115 (written piece by piece below)
    growth = Growth("obj")
    src = _reader(path, growth)
    got = bytearray()

    def read_all() -> None:
        while chunk := src.read(10_000):
            got.extend(chunk)

    reader = threading.Thread(target=read_all)
    reader.start()
    for at in range(0, len(data), 30_000):
        out.write(data[at:at + 30_000])
        out.write(b"not final yet")  # written beyond what is reported: never read
        out.seek(-13, 1)
        out.truncate()
        growth.advance(min(len(data), at + 30_000))
    out.close()
    growth.done("obj", len(data))
    reader.join(10)
    assert not reader.is_alive()
    assert bytes(got) == data
    assert src.size == len(data) and src.etag() == _etag(data)
    assert src.fingerprint is not None and src.fingerprint[0] == len(data)
    src.close()


@pytest.mark.parametrize("how", ["writer", "cancel", "stall", "other key", "short file"])
def test_a_read_fails_instead_of_ending(tmp_path: Path, how: str) -> None:
    path = tmp_path / "obj"
    path.write_bytes(b"x" * 1000)
    growth, cancel = Growth("obj"), threading.Event()
    src = _reader(path, growth, cancel, stall_s=0.2 if how == "stall" else 30.0)
    growth.advance(1000)
    assert src.read(400) == b"x" * 400
    if how == "writer":
        growth.fail("the object was not finished")
    elif how == "cancel":
        cancel.set()
    elif how == "other key":
        growth.done("obj.zst", 1000)
    elif how == "short file":
        growth.done("obj", 1200)  # says 1200 bytes, the file holds 1000
    with pytest.raises(OSError) as err:
        while src.read(400):
            pass
    assert err.value.errno in (errno.EIO, errno.ECANCELED, errno.ETIMEDOUT)
    assert src.etag() is None
    src.close()


def test_a_cancel_wakes_a_read_waiting_for_bytes(tmp_path: Path) -> None:
    path = tmp_path / "obj"
    path.write_bytes(b"")
    growth, cancel = Growth("obj"), threading.Event()
    src = _reader(path, growth, cancel)
    failed: list[OSError] = []

    def read() -> None:
        try:
            src.read(100)
        except OSError as exc:
            failed.append(exc)

    reader = threading.Thread(target=read)
    reader.start()
    cancel.set()
    reader.join(10)  # the read waits in short steps: it sees the cancel, not the 30 s stall
    assert not reader.is_alive() and failed and failed[0].errno == errno.ECANCELED
    src.close()


def test_a_mapping_of_the_growing_file_is_extended_as_reads_pass_its_end(
        tmp_path: Path) -> None:
    """The backend sends a file's pages from a mapping: for a growing file it maps further as
    the reads pass the end mapped, and every view holds exactly the bytes read."""
    path = tmp_path / "obj"
    data = random.Random(3).randbytes(24 << 20)
    path.write_bytes(data[: 2 << 20])
    growth = Growth("obj")
    growth.advance(2 << 20)
    src = _reader(path, growth)
    body = mapped.open_body(src, None, 16 << 20, "test")
    assert body is not None
    got = hashlib.sha256()

    def send() -> None:
        for view in body.chunks():
            got.update(view)
            view.release()

    sender = threading.Thread(target=send)
    sender.start()
    with open(path, "ab", buffering=0) as out:
        for at in range(2 << 20, len(data), 3 << 20):
            out.write(data[at:at + (3 << 20)])
            growth.advance(min(len(data), at + (3 << 20)))
    growth.done("obj", len(data))
    sender.join(10)
    assert not sender.is_alive()
    assert got.digest() == hashlib.sha256(data).digest() and body.length == len(data)
    mapped.close_body(body)
    src.close()


def _resident(path: Path) -> int:
    """Bytes of `path`'s mappings resident in this process (/proc/self/smaps)."""
    total, ours = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()
        if head and "-" in head[0] and len(head) >= 5 and not head[0].endswith(":"):
            ours = line.endswith(" " + str(path))
        elif ours and line.startswith("Rss:"):
            total += int(head[1]) * 1024
    return total


def test_views_of_a_replaced_mapping_are_trimmed_too(tmp_path: Path) -> None:
    """A growing file's mapping is replaced as reads pass its end, while the client may still
    send views of the one before: the trimmer drops those pages too, so a streamed object
    costs no more resident memory than a finished one."""
    path = tmp_path / "obj"
    part = 8 << 20
    path.write_bytes(b"\1" * part)
    growth = Growth("obj")
    growth.advance(part)
    src = _reader(path, growth)
    body = mapped.MappedBody(src, 16 << 20, "test")  # not the shared trimmer's: trimmed below
    first = body.view(0, part)
    with open(path, "ab", buffering=0) as out:
        out.write(b"\2" * part)
    growth.advance(2 * part)
    second = body.view(part, part)  # past the mapped end: a new mapping replaces the first
    assert bytes(first) == b"\1" * part and bytes(second) == b"\2" * part  # every page touched
    assert _resident(path) >= part  # the first mapping's pages, held by its view
    body.trim()
    assert _resident(path) < 1 << 20
    first.release()
    second.release()
    body.close()
    src.close()
