"""`Backend.get_range` on every backend (a directory, a real SeaweedFS and a real Azurite) and
through every wrapper: exact bytes, the version pin, the errors, a stall and a retried fault.

Faults go through the real TCP proxy process (tests/faultproxy.py), never through fake backends.
"""

from __future__ import annotations

import hashlib
import io
import os
import threading
import time
from collections.abc import Callable, MutableMapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from structlog.testing import capture_logs
from support.uploads import s3_backend

from ckptd.backends import (
    Backend,
    LimitedBackend,
    LocalBackend,
    RetryingBackend,
    ThrottledBackend,
    wrap_backend,
)
from ckptd.backends.base import MAX_RANGE
from ckptd.errors import (
    CorruptData,
    ObjectNotFound,
    PermanentError,
    PreconditionFailed,
    TransientError,
)

if TYPE_CHECKING:
    from faultproxy import FaultProxy
    from s3server import S3Server

pytest_plugins = ["s3server", "azurite"]  # fixtures: s3_server, s3_url, fault_proxy; az_url

MiB = 1024 * 1024
PART = 5 * MiB
SIZE = 3 * MiB + 17  # not a multiple of anything the client might split by


def payload(n: int, seed: int = 0) -> bytes:
    """Deterministic bytes where every 32-byte stretch differs from its neighbours."""
    out = bytearray()
    counter = 0
    while len(out) < n:
        out += hashlib.sha256(f"{seed}:{counter}".encode()).digest()
        counter += 1
    return bytes(out[:n])


def retry_events(logs: list[MutableMapping[str, Any]]) -> list[MutableMapping[str, Any]]:
    return [e for e in logs if e["event"] == "storage_retry"]


@pytest.fixture(params=["local", "s3", "azure"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Backend:
    """Each implementation of the contract, empty, under a fresh base prefix."""
    if request.param == "local":
        return LocalBackend(tmp_path / "remote", part_size=PART)
    if request.param == "azure":
        return request.getfixturevalue("azurite").backend(request.getfixturevalue("az_url"))
    server = request.getfixturevalue("s3_server")
    return s3_backend(server, request.getfixturevalue("s3_url"))


DATA = payload(SIZE, seed=1)
SPANS = {
    "start": (0, 4096),
    "middle": (MiB + 3, 2 * MiB + 5),
    "end": (SIZE - 1000, SIZE),
    "first-byte": (0, 1),
    "one-byte-inside": (12345, 12346),
    "last-byte": (SIZE - 1, SIZE),
    "whole": (0, SIZE),
}


def test_ranges_are_exact(backend: Backend) -> None:
    backend.put("step-1/shard", DATA)
    for name, (start, end) in SPANS.items():
        got = backend.get_range("step-1/shard", start, end)
        assert len(got) == end - start, name
        assert bytes(got) == DATA[start:end], name


def test_a_range_is_safe_to_keep_after_more_reads(backend: Backend) -> None:
    backend.put("k", DATA)
    first = backend.get_range("k", 0, MiB)
    for i in range(3):
        backend.get_range("k", MiB, 2 * MiB)
        backend.put(f"other-{i}", payload(MiB, seed=i + 10))
    assert bytes(first) == DATA[:MiB]
    with pytest.raises(TypeError):
        memoryview(first)[0] = 0  # read-only, whatever the backend answers


def test_ranges_across_the_parts_of_a_multipart_object(backend: Backend) -> None:
    data = payload(2 * PART + 7, seed=2)
    backend.put("big", data)
    for start, end in ((PART - 10, PART + 10), (0, 2 * PART + 7), (2 * PART, 2 * PART + 7)):
        assert bytes(backend.get_range("big", start, end)) == data[start:end]


def test_the_version_tag_pins_the_range(backend: Backend) -> None:
    backend.put("LATEST", b"old version of the object")
    _, old = backend.get_versioned("LATEST")
    assert bytes(backend.get_range("LATEST", 4, 11, etag=old)) == b"version"
    backend.put("LATEST", b"new version, another length")
    with pytest.raises(PreconditionFailed) as info:
        backend.get_range("LATEST", 4, 11, etag=old)
    assert "LATEST" in str(info.value)
    _, new = backend.get_versioned("LATEST")
    assert bytes(backend.get_range("LATEST", 0, 3, etag=new)) == b"new"
    assert bytes(backend.get_range("LATEST", 0, 3)) == b"new"  # no tag: whatever is there


def test_stat_gives_the_version_reads_are_pinned_to(backend: Backend) -> None:
    """Every backend's stat (and list) gives a version tag, file:// included (its device,
    inode, mtime and size): a range or a download pinned to it fails once the object is
    another, and a vanished one is not found."""
    backend.put("obj", DATA)
    meta = backend.stat("obj")
    assert meta.version, meta
    listed = [m.version for m in backend.list("") if m.key == "obj"]
    assert listed == [meta.version] if isinstance(backend, LocalBackend) else all(listed)
    assert bytes(backend.get_range("obj", 5, 50, etag=meta.version)) == DATA[5:50]
    got = io.BytesIO()
    assert backend.get("obj", got, etag=meta.version) == SIZE and got.getvalue() == DATA
    backend.put("obj", payload(SIZE, seed=9))  # the same size, other bytes: a re-upload
    assert backend.stat("obj").version != meta.version
    with pytest.raises(PreconditionFailed, match="obj"):
        backend.get_range("obj", 5, 50, etag=meta.version)
    with pytest.raises(PreconditionFailed, match="obj"):
        backend.get("obj", io.BytesIO(), etag=meta.version)
    backend.delete("obj")
    with pytest.raises(ObjectNotFound):
        backend.get("obj", io.BytesIO(), etag=meta.version)
    with pytest.raises(ObjectNotFound):
        backend.get_range("obj", 5, 50, etag=meta.version)


class _ReplacingSink(io.BytesIO):
    """A download's destination that has the object changed after its first bytes came."""

    def __init__(self, change: Callable[[], None]) -> None:
        super().__init__()
        self.change, self.writes = change, 0

    def write(self, data: Any) -> int:
        n = super().write(data)
        self.writes += 1
        if self.writes == 1:
            self.change()
        return n


BIG = payload(2 * 8 * MiB + 17, seed=3)  # three of the object store's 8 MiB download ranges


def test_a_download_replaced_midway_fails_instead_of_mixing(backend: Backend) -> None:
    """A get reads one version: an object replaced after the first bytes arrived is
    PreconditionFailed (not retried: retrying the pin cannot help), never a mix. On file://
    the file opened is read (a rename over the name does not reach it)."""
    backend.put("big", BIG)
    other = payload(len(BIG), seed=4)
    sink = _ReplacingSink(lambda: backend.put("big", other))
    if isinstance(backend, LocalBackend):
        assert backend.get("big", sink) == len(BIG) and sink.getvalue() == BIG
        return
    with pytest.raises(PreconditionFailed, match="big"):
        RetryingBackend(backend, attempts=3, base_delay=0.0).get("big", sink)
    assert other[-4096:] not in sink.getvalue()


def test_a_file_rewritten_in_place_midway_fails_a_download(tmp_path: Path) -> None:
    """file://: bytes rewritten where they are while a get reads them: PreconditionFailed,
    and no byte read after the rewrite reaches the destination."""
    backend = LocalBackend(tmp_path / "remote")
    backend.put("big", BIG)
    path = tmp_path / "remote" / "big"
    os.utime(path, (1, 1))  # written long ago: the rewrite's mtime is another, at any grain

    def rewrite() -> None:
        with open(path, "r+b") as f:
            f.seek(len(BIG) - 100)
            f.write(b"\xff" * 100)

    sink = _ReplacingSink(rewrite)
    with pytest.raises(PreconditionFailed, match="changed while it was read"):
        backend.get("big", sink)
    assert len(sink.getvalue()) < len(BIG) and BIG.startswith(sink.getvalue())


def test_missing_object(backend: Backend) -> None:
    with pytest.raises(ObjectNotFound) as info:
        backend.get_range("nope/x", 0, 10)
    assert "nope/x" in str(info.value)
    with pytest.raises(ObjectNotFound):
        backend.get_range("nope/x", 0, 10, etag='"0123"')


@pytest.mark.parametrize(
    "start,end",
    [(SIZE - 5, SIZE + 5), (SIZE, SIZE + 1), (SIZE + 100, SIZE + 200), (0, MAX_RANGE)],
    ids=["straddles-end", "at-end", "beyond-end", "max-range"],
)
def test_a_range_past_the_end_is_corrupt_data(backend: Backend, start: int, end: int) -> None:
    backend.put("short/object", DATA)
    with pytest.raises(CorruptData) as info:
        backend.get_range("short/object", start, end)
    message = str(info.value)
    assert "short/object" in message and f"[{start}, {end})" in message


@pytest.mark.parametrize(
    "start,end",
    [(5, 5), (6, 5), (-1, 5), (0, MAX_RANGE + 1), (MiB, MiB + MAX_RANGE + 1)],
    ids=["empty", "backwards", "negative", "over-max", "over-max-offset"],
)
def test_a_bad_span_is_a_value_error_before_any_request(
    backend: Backend, start: int, end: int
) -> None:
    backend.put("k", b"0123456789")
    with pytest.raises(ValueError, match=r"\[-?\d+, \d+\)"):
        backend.get_range("k", start, end)
    with pytest.raises(ValueError):
        backend.get_range("missing", start, end)  # refused before the store is asked


def test_invalid_keys_are_refused(backend: Backend) -> None:
    for key in ("", "/abs", "a/../b"):
        with pytest.raises(PermanentError):
            backend.get_range(key, 0, 1)


# -- file:// ------------------------------------------------------------------------------


def test_local_the_largest_range(tmp_path: Path) -> None:
    backend = LocalBackend(tmp_path)
    with open(tmp_path / "sparse", "wb") as f:
        f.truncate(MAX_RANGE + 10)  # sparse: no disk, and reads as zeros
        f.seek(MAX_RANGE + 9)
        f.write(b"\x07")
    got = backend.get_range("sparse", 10, MAX_RANGE + 10)
    assert len(got) == MAX_RANGE and got[-1] == 7 and got[0] == 0
    del got


def test_local_links_and_non_files_are_refused(tmp_path: Path) -> None:
    base = tmp_path / "remote"
    backend = LocalBackend(base)
    backend.put("real", DATA)
    outside = tmp_path / "outside"
    outside.write_bytes(b"secret bytes outside the base")
    (base / "link").symlink_to(base / "real")
    (base / "escape").symlink_to(outside)
    (base / "dirlink").symlink_to(tmp_path)
    backend.put("d/x", b"2")
    os.mkfifo(base / "fifo")
    for key in ("link", "escape", "d", "fifo"):
        with pytest.raises(ObjectNotFound):
            backend.get_range(key, 0, 5)
    with pytest.raises(PermanentError, match="outside"):
        backend.get_range("dirlink/outside", 0, 5)
    assert bytes(backend.get_range("real", 0, 5)) == DATA[:5]


def test_local_rewrite_in_place_fails_the_version(tmp_path: Path) -> None:
    """A file rewritten in place (same inode, another mtime) is another version too."""
    backend = LocalBackend(tmp_path)
    backend.put("obj", DATA)
    _, tag = backend.get_versioned("obj")
    path = tmp_path / "obj"
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    with pytest.raises(PreconditionFailed):
        backend.get_range("obj", 0, 10, etag=tag)


# -- wrappers -----------------------------------------------------------------------------


def test_every_wrapper_forwards_the_range(backend: Backend) -> None:
    backend.put("k", DATA)
    _, tag = backend.get_versioned("k", limit=SIZE)
    wrapped = wrap_backend(backend, max_bytes_per_s=1e10, max_transfers=2)
    assert bytes(wrapped.get_range("k", 5, 50, etag=tag)) == DATA[5:50]
    with pytest.raises(CorruptData):
        wrapped.get_range("k", SIZE, SIZE + 1)
    with pytest.raises(PreconditionFailed):
        wrapped.get_range("k", 0, 1, etag='"not-the-tag"' if tag.startswith('"') else "x.y")


def test_throttle_charges_the_range(tmp_path: Path) -> None:
    inner = LocalBackend(tmp_path)
    inner.put("k", DATA)
    throttled = ThrottledBackend(inner, 4 * MiB, burst_s=0.02)
    started = time.monotonic()
    for _ in range(2):
        throttled.get_range("k", 0, MiB)
    # 2 MiB at 4 MiB/s: 0.5 s, less the first burst. A functional check, not a benchmark.
    assert time.monotonic() - started >= 0.4


def test_limit_holds_a_slot_for_the_range(tmp_path: Path) -> None:
    """The range waits for a slot that a transfer in flight holds."""
    inner = LocalBackend(tmp_path)
    inner.put("k", DATA)
    limited = LimitedBackend(inner, concurrency=1)
    release = threading.Event()
    started = threading.Event()

    class Blocking:
        def read(self, _n: int = -1) -> bytes:
            started.set()
            release.wait(10)
            return b""

    putter = threading.Thread(target=limited.put, args=("slow", Blocking()))
    putter.start()
    assert started.wait(10)
    done = threading.Event()

    def read() -> None:
        limited.get_range("k", 0, 10)
        done.set()

    reader = threading.Thread(target=read)
    reader.start()
    assert not done.wait(0.3), "the range did not wait for the slot"
    release.set()
    putter.join(10)
    reader.join(10)
    assert done.is_set()


# -- faults on the real server --------------------------------------------------------------


@pytest.mark.parametrize("mode", ["cut_response", "status"])
def test_a_failed_range_is_retried(
    s3_server: S3Server, s3_url: str, fault_proxy: FaultProxy, mode: str
) -> None:
    s3_backend(s3_server, s3_url).put("k", DATA)
    bare = s3_backend(s3_server, s3_url, fault_proxy.endpoint)
    backend = RetryingBackend(bare, attempts=4, base_delay=0.05, max_delay=0.2)
    fault_proxy.set(mode, count=1, status=503)
    with pytest.raises(TransientError):
        bare.get_range("k", 100, 200)  # the bare backend does not retry
    fault_proxy.set(mode, count=1, status=503)
    with capture_logs() as logs:
        assert bytes(backend.get_range("k", MiB, 2 * MiB)) == DATA[MiB : 2 * MiB]
    events = retry_events(logs)
    assert [(e["op"], e["key"], e["attempt"]) for e in events] == [("get", "k", 1)]
    assert fault_proxy.stats()["faults"] == 2  # the proxy counts faults across settings


def test_a_stalled_range_honours_the_read_timeout(
    s3_server: S3Server, s3_url: str, fault_proxy: FaultProxy
) -> None:
    s3_backend(s3_server, s3_url).put("k", DATA)
    # A fresh client (no pooled connection), a long request timeout: only the read timeout
    # can end the wait before the proxy's 10 s stall does.
    reader = s3_backend(
        s3_server, s3_url, fault_proxy.endpoint, read_timeout_s=0.5, request_timeout_s=60.0
    )
    fault_proxy.set("stall", count=1, stall_s=10.0)
    started = time.monotonic()
    with pytest.raises(TransientError):
        reader.get_range("k", 0, 100)
    assert time.monotonic() - started < 5.0
    assert bytes(reader.get_range("k", 0, 100)) == DATA[:100]  # the stall was once
