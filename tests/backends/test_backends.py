"""The storage contract, checked against every backend (a directory, a real SeaweedFS and a
real Azurite).

Faults go through a real TCP proxy process (tests/faultproxy.py), never through fake backends.
Run alone with `python -m pytest tests/backends/test_backends.py` (needs the `weed` binary for
S3 cases and Azurite in .cache/azurite, which `make test` installs, for Azure cases).
"""

from __future__ import annotations

import hashlib
import io
import os
import re
import shutil
import subprocess
import sys
import textwrap
import threading
import time
import tracemalloc
from collections.abc import Iterator, MutableMapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, cast

import pytest
from structlog.testing import capture_logs
from support.uploads import s3_backend

from ckptd.backends import (
    Backend,
    LimitedBackend,
    LocalBackend,
    ObstoreBackend,
    RetryingBackend,
    ThrottledBackend,
    TokenBucket,
    make_backend,
    wrap_backend,
)
from ckptd.backends.base import SMALL_OBJECT_MAX
from ckptd.backends.localfiles import TMP_MARK
from ckptd.errors import (
    BadInput,
    ObjectExists,
    ObjectNotFound,
    PermanentError,
    PreconditionFailed,
    TransientError,
)
from ckptd.remote.keys import advance_latest, latest_key, read_latest, retreat_latest

if TYPE_CHECKING:
    from faultproxy import FaultProxy
    from s3server import S3Server

pytest_plugins = ["s3server", "azurite"]  # fixtures: s3_server, s3_url, fault_proxy; az_url

MiB = 1024 * 1024
PART = 5 * MiB  # S3's smallest part: multipart cases stay small and fast
REPO = Path(__file__).resolve().parents[2]


def retrying(inner: Backend, attempts: int = 4) -> RetryingBackend:
    return RetryingBackend(inner, attempts=attempts, base_delay=0.05, max_delay=0.2)


def payload(n: int, seed: int = 0) -> bytes:
    """Deterministic, incompressible-looking bytes."""
    block = hashlib.sha256(f"{seed}".encode()).digest() * 2048  # 64 KiB
    return (block * (n // len(block) + 1))[:n]


def get_all(backend: Backend, key: str) -> bytes:
    out = io.BytesIO()
    n = backend.get(key, out)
    assert n == len(out.getvalue())
    return out.getvalue()


class RecordingReader(io.RawIOBase):
    """A source file that remembers its largest single read (to show puts stream)."""

    def __init__(self, f: BinaryIO) -> None:
        self.f = f
        self.largest = 0
        self.total = 0

    def readable(self) -> bool:
        return True

    def read(self, n: int | None = -1) -> bytes:
        data = self.f.read(-1 if n is None else n)
        self.largest = max(self.largest, len(data))
        self.total += len(data)
        return data


@pytest.fixture(params=["local", "s3", "azure"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Backend:
    """Each implementation of the contract, empty, under a fresh base prefix."""
    if request.param == "local":
        return LocalBackend(tmp_path / "remote", part_size=PART)
    if request.param == "azure":
        return request.getfixturevalue("azurite").backend(request.getfixturevalue("az_url"))
    server = request.getfixturevalue("s3_server")
    return s3_backend(server, request.getfixturevalue("s3_url"))


# -- the conformance suite ----------------------------------------------------------------


def test_round_trip_small(backend: Backend) -> None:
    meta = backend.put("a.txt", b"hello")
    assert meta.key == "a.txt" and meta.size == 5
    assert get_all(backend, "a.txt") == b"hello"
    assert backend.get_bytes("a.txt") == b"hello"


def test_round_trip_empty(backend: Backend) -> None:
    assert backend.put("empty", b"").size == 0
    assert get_all(backend, "empty") == b""
    assert backend.stat("empty").size == 0


def test_multipart_round_trip(backend: Backend) -> None:
    data = payload(2 * PART + 123, seed=1)
    meta = backend.put("big.bin", io.BytesIO(data), size=len(data))
    assert meta.size == len(data)
    assert backend.stat("big.bin").size == len(data)
    assert get_all(backend, "big.bin") == data
    if backend.url.startswith("s3://"):
        assert (meta.etag or "").endswith('-3"'), "three parts expected"


def test_put_streams_from_file_object(backend: Backend, tmp_path: Path) -> None:
    data = payload(3 * PART // 2 + 7, seed=2)
    src = tmp_path / "shard.bin"
    src.write_bytes(b"HEADER" + data)
    with open(src, "rb") as f:
        f.seek(6)  # a put reads from the current position
        reader = RecordingReader(f)
        backend.put("step-1/shard.bin", cast(BinaryIO, reader), size=len(data))
    assert reader.total == len(data)
    assert reader.largest <= MiB, "the source is read in bounded pieces"
    dst = tmp_path / "back.bin"
    with open(dst, "wb") as out:
        assert backend.get("step-1/shard.bin", out) == len(data)
    assert dst.read_bytes() == data


def test_create_only(backend: Backend) -> None:
    backend.put("MANIFEST.json", b'{"step": 1}', create_only=True)
    with pytest.raises(ObjectExists):
        backend.put("MANIFEST.json", b'{"step": 2}', create_only=True)
    with pytest.raises(ObjectExists):
        backend.put("MANIFEST.json", io.BytesIO(b'{"step": 3}'), create_only=True)
    assert backend.get_bytes("MANIFEST.json") == b'{"step": 1}'


def test_conditional_put_swaps_only_the_version_it_read(backend: Backend) -> None:
    backend.put("LATEST", b'{"step": 1}', create_only=True)
    data, first = backend.get_versioned("LATEST")
    assert data == b'{"step": 1}'
    backend.put("LATEST", b'{"step": 2}', if_match=first)
    data, second = backend.get_versioned("LATEST")
    assert data == b'{"step": 2}' and second != first
    with pytest.raises(PreconditionFailed):  # stale version: nothing changes
        backend.put("LATEST", b'{"step": 0}', if_match=first)
    with pytest.raises(PreconditionFailed):  # through the retry wrapper too, not retried
        retrying(backend).put("LATEST", io.BytesIO(b'{"step": 0}'), if_match=first)
    assert backend.get_versioned("LATEST") == (b'{"step": 2}', second)
    with pytest.raises(PreconditionFailed):  # a version of nothing: still nothing
        backend.put("absent", b"x", if_match=second)
    with pytest.raises(ObjectNotFound):
        backend.get_versioned("absent")
    with pytest.raises(PermanentError):
        backend.put("LATEST", b"x", create_only=True, if_match=second)
    assert [m.key for m in backend.list()] == ["LATEST"]  # no lock or temp file shows
    backend.delete("LATEST")
    with pytest.raises(PreconditionFailed):
        backend.put("LATEST", b'{"step": 3}', if_match=second)
    assert list(backend.list()) == []


def test_conditional_puts_lose_no_update(backend: Backend) -> None:
    """Writers racing read-increment-swap on one counter: every success counts once."""
    backend.put("counter", b"0", create_only=True)
    writers, each = 4, 5
    start = threading.Barrier(writers)

    def increment_times(n: int) -> None:
        start.wait()
        done = 0
        while done < n:
            data, version = backend.get_versioned("counter")
            try:
                backend.put("counter", b"%d" % (int(data) + 1), if_match=version)
                done += 1
            except PreconditionFailed:
                continue

    threads = [threading.Thread(target=increment_times, args=(each,)) for _ in range(writers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert int(backend.get_bytes("counter")) == writers * each


def test_latest_racing_nodes_end_at_the_highest_step(backend: Backend) -> None:
    """Nodes committing different steps at once: LATEST ends at the highest, whatever order."""
    steps = list(range(1, 9))
    start = threading.Barrier(len(steps))
    results: dict[int, bool] = {}

    def commit(step: int) -> None:
        start.wait()
        results[step] = advance_latest(backend, "job", step)

    with capture_logs() as logs:
        threads = [threading.Thread(target=commit, args=(s,)) for s in steps]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    assert read_latest(backend, "job") == max(steps)
    assert results[max(steps)] is True
    assert not [e for e in logs if e["event"] == "latest_update_failed"]
    assert advance_latest(backend, "job", 3) is False  # never backwards
    assert read_latest(backend, "job") == max(steps)


class AnotherNodeMovesLatest:
    """Fault injection: right after the first versioned read of LATEST, another node's commit
    (step `theirs`, manifest first) moves LATEST before the reader can swap it."""

    def __init__(self, inner: Backend, theirs: int) -> None:
        self.inner, self.theirs, self.fired = inner, theirs, False

    def get_versioned(self, key: str, limit: int = SMALL_OBJECT_MAX) -> tuple[bytes, str]:
        got = self.inner.get_versioned(key, limit)
        if not self.fired:
            self.fired = True
            self.inner.put(f"job/step-{self.theirs}/MANIFEST.json", b"{}", create_only=True)
            self.inner.put(key, b'{"step": %d}\n' % self.theirs)
        return got

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_latest_swap_lost_to_another_node_is_read_again(backend: Backend) -> None:
    for step in (3, 5):
        backend.put(f"job/step-{step}/MANIFEST.json", b"{}", create_only=True)
    assert advance_latest(backend, "job", 5)
    # Moving forward to 7 while another node moves it to 9: 9 stays.
    racing = cast(Backend, AnotherNodeMovesLatest(backend, 9))
    assert advance_latest(racing, "job", 7) is False and racing.fired  # type: ignore[attr-defined]
    assert read_latest(backend, "job") == 9
    # Deleting step 9 (LATEST) while another node commits 11: LATEST names 11, not 5.
    backend.delete("job/step-9/MANIFEST.json")
    retreat_latest(cast(Backend, AnotherNodeMovesLatest(backend, 11)), "job", 9)
    assert read_latest(backend, "job") == 11
    # Without a race the delete path points LATEST at the highest remaining step, then away.
    backend.delete("job/step-11/MANIFEST.json")
    retreat_latest(backend, "job", 11)
    assert read_latest(backend, "job") == 5
    for step in (3, 5):
        backend.delete(f"job/step-{step}/MANIFEST.json")
    retreat_latest(backend, "job", 5)
    assert read_latest(backend, "job") is None


_ADVANCE = """
import sys
from ckptd.backends import LocalBackend
from ckptd.remote.keys import advance_latest
backend, steps = LocalBackend(sys.argv[1]), [int(s) for s in sys.argv[2:]]
print("ready", flush=True)
sys.stdin.readline()
for step in steps:
    advance_latest(backend, "job", step)
"""


def test_local_latest_racing_processes_end_at_the_highest_step(tmp_path: Path) -> None:
    """The file:// swap is atomic among processes (an flock), not only among threads."""
    base = tmp_path / "remote"
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _ADVANCE, str(base), *[str(s) for s in range(i, 41, 4)]],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env,
        )
        for i in range(1, 5)
    ]
    try:
        for p in procs:  # every interpreter imported and waiting: then all go at once
            assert p.stdout is not None and p.stdout.readline() == b"ready\n"
        for p in procs:
            assert p.stdin is not None
            p.stdin.write(b"go\n")
            p.stdin.flush()
        assert [p.wait(60) for p in procs] == [0] * len(procs)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    backend = LocalBackend(base)
    assert read_latest(backend, "job") == 40
    assert [m.key for m in backend.list()] == [latest_key("job")]


def test_small_reads_are_bounded(backend: Backend) -> None:
    """get_bytes/get_versioned refuse an object over their limit (BadInput naming the key),
    through every wrapper and without a retry; at the limit they return it whole."""
    data = payload(1000)
    backend.put("small/obj", data)
    stacked = wrap_backend(backend, attempts=3, base_delay=0.01, max_bytes_per_s=100 * MiB,
                           max_transfers=2)
    for b in (backend, stacked):
        assert b.get_bytes("small/obj", 1000) == data
        assert b.get_versioned("small/obj", 1000)[0] == data
        with capture_logs() as logs:
            for read in (b.get_bytes, b.get_versioned):
                with pytest.raises(BadInput, match="small/obj") as info:
                    read("small/obj", 999)
                assert "1000 bytes" in str(info.value)
        assert not [e for e in logs if e["event"] == "storage_retry"]
    assert backend.get_bytes("small/obj") == data  # the default limit is generous


def test_a_small_read_of_a_large_object_reads_no_body(backend: Backend, tmp_path: Path) -> None:
    """An object far over the limit is refused from its size alone: its body never becomes
    Python bytes (the peak of Python's allocations stays far below its size)."""
    big = tmp_path / "big"
    with open(big, "wb") as f:
        f.write(payload(24 * MiB))
    with open(big, "rb") as f:
        backend.put("big/obj", f, 24 * MiB)
    tracemalloc.start()
    try:
        for read in (backend.get_bytes, backend.get_versioned):
            with pytest.raises(BadInput, match="big/obj"):
                read("big/obj", 4096)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 2 * MiB, f"{peak} bytes allocated refusing a 24 MiB object"


def test_put_overwrites_and_is_idempotent(backend: Backend) -> None:
    backend.put("k", b"one")
    backend.put("k", b"one")
    assert backend.get_bytes("k") == b"one"
    backend.put("k", b"two!")
    assert backend.get_bytes("k") == b"two!"
    assert backend.stat("k").size == 4


def test_stat(backend: Backend) -> None:
    data = b"checkpoint bytes"
    backend.put("s/one", data)
    meta = backend.stat("s/one")
    assert (meta.key, meta.size) == ("s/one", len(data))
    assert abs(meta.mtime - time.time()) < 300
    if backend.url.startswith("s3://"):  # the MD5 of a single-part object
        assert (meta.etag or "").strip('"') == hashlib.md5(data).hexdigest()
    elif isinstance(backend, ObstoreBackend):  # Azure: an opaque version tag
        assert meta.etag


def test_list_by_prefix(backend: Backend) -> None:
    for key in ("a/1", "a/2", "a/b/3", "ab/4", "c"):
        backend.put(key, key.encode())
    assert sorted(m.key for m in backend.list("a")) == ["a/1", "a/2", "a/b/3"]
    assert sorted(m.key for m in backend.list("a/")) == ["a/1", "a/2", "a/b/3"]
    assert sorted(m.key for m in backend.list("")) == ["a/1", "a/2", "a/b/3", "ab/4", "c"]
    assert list(backend.list("zzz")) == []
    sizes = {m.key: m.size for m in backend.list("a/b")}
    assert sizes == {"a/b/3": 5}


def test_delete_is_idempotent(backend: Backend) -> None:
    backend.put("d/x", b"1")
    backend.delete("d/x")
    backend.delete("d/x")
    backend.delete("never/was")
    with pytest.raises(ObjectNotFound):
        backend.stat("d/x")
    assert list(backend.list("d")) == []


def test_missing_object(backend: Backend) -> None:
    with pytest.raises(ObjectNotFound):
        backend.get("nope/x", io.BytesIO())
    with pytest.raises(ObjectNotFound):
        backend.get_bytes("nope/x")
    with pytest.raises(ObjectNotFound) as info:
        backend.stat("nope/x")
    assert isinstance(info.value, PermanentError)
    assert "nope/x" in str(info.value)


def test_nested_keys(backend: Backend) -> None:
    key = "llm-7b/step-1200/model/layer.0/__0_0.distcp.zst"
    backend.put(key, b"x" * 10)
    assert backend.get_bytes(key) == b"x" * 10
    assert [m.key for m in backend.list("llm-7b/step-1200")] == [key]


def test_unusual_characters_in_keys(backend: Backend) -> None:
    key = "root/step-7/dir with space/ünï+cøde=%20&.bin"
    backend.put(key, b"odd")
    assert backend.get_bytes(key) == b"odd"
    assert backend.stat(key).size == 3
    assert [m.key for m in backend.list("root/step-7")] == [key]


@pytest.mark.parametrize("key", ["", "/abs", "a//b", "../up", "a/./b", "a/..", "trailing/"])
def test_invalid_keys_are_refused(backend: Backend, key: str) -> None:
    with pytest.raises(PermanentError, match="invalid storage key"):
        backend.put(key, b"x")


def test_size_mismatch_stores_nothing(backend: Backend) -> None:
    with pytest.raises(PermanentError, match="expected"):
        backend.put("short", b"abc", size=4)
    big = payload(PART + 10, seed=3)
    with pytest.raises(PermanentError, match="expected"):
        backend.put("short-multipart", io.BytesIO(big), size=len(big) + 1)
    assert list(backend.list("")) == []


def test_get_into_a_seeked_destination_rewinds_on_retry(backend: Backend) -> None:
    backend.put("r", b"payload")
    out = io.BytesIO(b"prefix:")
    out.seek(0, os.SEEK_END)
    assert retrying(backend).get("r", out) == 7
    assert out.getvalue() == b"prefix:payload"


def test_throttle_caps_put_and_get(backend: Backend) -> None:
    rate = 8 * MiB
    throttled = ThrottledBackend(backend, rate, burst_s=0.02)
    data = payload(4 * MiB, seed=4)
    started = time.monotonic()
    throttled.put("slow", io.BytesIO(data))
    put_s = time.monotonic() - started
    started = time.monotonic()
    assert get_all(throttled, "slow") == data
    get_s = time.monotonic() - started
    # Loose lower bounds (N/R = 0.5 s): a functional check, not a benchmark.
    assert put_s >= 0.4 and get_s >= 0.4, (put_s, get_s)


# -- wrappers, on the local backend -------------------------------------------------------


def test_throttle_is_shared_by_concurrent_transfers(tmp_path: Path) -> None:
    throttled = ThrottledBackend(LocalBackend(tmp_path), 8 * MiB, burst_s=0.02)
    data = payload(2 * MiB)
    threads = [
        threading.Thread(target=throttled.put, args=(f"t{i}", io.BytesIO(data))) for i in range(2)
    ]
    started = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert time.monotonic() - started >= 0.4  # 4 MiB in all at 8 MiB/s, not 2 MiB each


def test_token_bucket_queues_reservations() -> None:
    now = [0.0]
    slept: list[float] = []

    def sleep(s: float) -> None:
        slept.append(s)

    bucket = TokenBucket(100.0, burst_s=0.0, clock=lambda: now[0], sleep=sleep)
    bucket.take(50)
    bucket.take(50)  # the second waits for the first one's debt too
    assert slept == pytest.approx([0.5, 1.0])


def test_retry_delay_is_capped_exponential_with_full_jitter(tmp_path: Path) -> None:
    top = RetryingBackend(LocalBackend(tmp_path), base_delay=0.5, max_delay=3.0, rng=lambda: 1.0)
    assert [top.delay(n) for n in range(1, 6)] == [0.5, 1.0, 2.0, 3.0, 3.0]
    low = RetryingBackend(LocalBackend(tmp_path), base_delay=0.5, rng=lambda: 0.25)
    assert low.delay(3) == 0.5


class Gauge:
    """How many callers are inside a section at once, and the most seen."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.active = 0
        self.peak = 0

    def enter(self) -> None:
        with self.lock:
            self.active += 1
            self.peak = max(self.peak, self.active)

    def leave(self) -> None:
        with self.lock:
            self.active -= 1


class GateReader(io.RawIOBase):
    """A one-byte source whose read lingers, so overlapping puts show on the gauge."""

    def __init__(self, gauge: Gauge) -> None:
        self.gauge = gauge
        self.done = False

    def readable(self) -> bool:
        return True

    def read(self, n: int | None = -1) -> bytes:
        if self.done:
            return b""
        self.gauge.enter()
        time.sleep(0.1)
        self.gauge.leave()
        self.done = True
        return b"x"


def test_limited_backend_caps_concurrent_transfers(tmp_path: Path) -> None:
    limited = LimitedBackend(LocalBackend(tmp_path), concurrency=2)
    gauge = Gauge()
    threads = [
        threading.Thread(target=limited.put, args=(f"k{i}", cast(BinaryIO, GateReader(gauge))))
        for i in range(5)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert gauge.peak == 2
    assert len(list(limited.list())) == 5


def test_wrap_backend_stacks_the_layers(tmp_path: Path) -> None:
    wrapped = wrap_backend(LocalBackend(tmp_path), max_bytes_per_s=1e9, max_transfers=3)
    assert isinstance(wrapped, LimitedBackend)
    assert isinstance(wrapped.inner, RetryingBackend)
    assert isinstance(wrapped.inner.inner, ThrottledBackend)
    wrapped.put("x", b"1")
    assert wrapped.get_bytes("x") == b"1" and wrapped.url == f"file://{tmp_path.resolve()}"


def test_make_backend_file_url(tmp_path: Path) -> None:
    backend = make_backend(f"file://{tmp_path}/remote")
    assert isinstance(backend, LocalBackend)
    backend.put("a/b", b"1")
    assert (tmp_path / "remote" / "a" / "b").read_bytes() == b"1"
    with pytest.raises(PermanentError, match="unsupported"):
        make_backend("ftp://host/x")


# -- local backend specifics --------------------------------------------------------------


def test_local_put_leaves_no_temp_files(tmp_path: Path) -> None:
    backend = LocalBackend(tmp_path)
    backend.put("a/b", b"1")
    with pytest.raises(PermanentError):
        backend.put("a/c", b"1", size=2)
    with pytest.raises(ObjectExists):
        backend.put("a/b", b"2", create_only=True)
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["b"]


def test_local_list_skips_temp_files_and_cleanup_removes_stale_ones(tmp_path: Path) -> None:
    base, outside = tmp_path / "base", tmp_path / "outside"
    outside.mkdir()
    backend = LocalBackend(base)
    backend.put("s/x", b"1")
    stale = base / "s" / f".y{TMP_MARK}0123456789ab"
    stale.write_bytes(b"partial")
    fresh = base / "s" / f".z{TMP_MARK}0123456789ab"
    fresh.write_bytes(b"in flight")
    old = time.time() - 7200
    os.utime(stale, (old, old))
    # Not this backend's own temp names, a link named like one, and a linked directory.
    mine = outside / f".w{TMP_MARK}0123456789ab"
    mine.write_bytes(b"not the backend's")
    os.utime(mine, (old, old))
    others = [base / "s" / f"y{TMP_MARK}0123456789ab", base / "s" / f".y{TMP_MARK}abc"]
    for p in others:
        p.write_bytes(b"someone's")
        os.utime(p, (old, old))
    (base / "s" / f".l{TMP_MARK}0123456789ab").symlink_to(mine)
    os.utime(base / "s" / f".l{TMP_MARK}0123456789ab", (old, old), follow_symlinks=False)
    (base / "d").symlink_to(outside, target_is_directory=True)
    assert [m.key for m in backend.list("")] == ["s/x"]
    assert backend.remove_stale_temp(3600) == 1
    assert not stale.exists() and fresh.exists() and (base / "s" / "x").read_bytes() == b"1"
    assert mine.exists() and all(p.exists() for p in others)
    assert (base / "s" / f".l{TMP_MARK}0123456789ab").is_symlink()


def test_local_never_writes_outside_base(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    base = tmp_path / "base"
    base.mkdir()
    (base / "escape").symlink_to(outside)
    backend = LocalBackend(base)
    with pytest.raises(PermanentError, match="outside"):
        backend.put("escape/x", b"1")
    with pytest.raises(PermanentError, match="outside"):
        backend.put("escape/deeper/x", b"1")
    (outside / "victim").write_bytes(b"keep")
    with pytest.raises(PermanentError, match="outside"):
        backend.delete("escape/victim")
    assert sorted(p.name for p in outside.iterdir()) == ["victim"]


def test_local_symlinks_and_directories_are_not_objects(tmp_path: Path) -> None:
    backend = LocalBackend(tmp_path)
    backend.put("real", b"1")
    (tmp_path / "link").symlink_to(tmp_path / "real")
    backend.put("d/x", b"2")
    for key in ("link", "d"):
        with pytest.raises(ObjectNotFound):
            backend.get_bytes(key)
        with pytest.raises(ObjectNotFound):
            backend.stat(key)
    assert sorted(m.key for m in backend.list()) == ["d/x", "real"]


def test_local_fifo_is_no_object_and_never_blocks_a_read(tmp_path: Path) -> None:
    """A FIFO under a key: every read refuses it at once (an open() without O_NONBLOCK
    waited for a writer forever)."""
    backend = LocalBackend(tmp_path)
    os.mkfifo(tmp_path / "fifo")
    calls = {"get": lambda: backend.get("fifo", io.BytesIO()),
             "get_bytes": lambda: backend.get_bytes("fifo"),
             "get_versioned": lambda: backend.get_versioned("fifo", 16)}
    errors: dict[str, BaseException] = {}

    def run(name: str) -> None:
        try:
            calls[name]()
        except BaseException as exc:  # noqa: BLE001 - inspected below
            errors[name] = exc

    threads = [threading.Thread(target=run, args=(n,), daemon=True) for n in calls]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        assert not any(t.is_alive() for t in threads), "a read of a FIFO blocked"
        assert {n: type(e) for n, e in errors.items()} == dict.fromkeys(calls, ObjectNotFound)
        assert [m.key for m in backend.list()] == []
    finally:
        try:  # let a reader blocked in open() (the defect) go
            os.close(os.open(tmp_path / "fifo", os.O_WRONLY | os.O_NONBLOCK))
        except OSError:
            pass


def test_local_delete_prunes_empty_directories(tmp_path: Path) -> None:
    backend = LocalBackend(tmp_path / "r")
    backend.put("root/step-1/a", b"1")
    backend.put("root/step-2/a", b"1")
    backend.delete("root/step-1/a")
    assert sorted(p.name for p in (tmp_path / "r" / "root").iterdir()) == ["step-2"]


def test_local_key_under_a_file_is_permanent(tmp_path: Path) -> None:
    backend = LocalBackend(tmp_path)
    backend.put("a", b"1")
    with pytest.raises(PermanentError, match="a/b"):
        backend.put("a/b", b"2")  # a directory cannot share a file's name here


def test_local_read_only_directory_is_permanent(tmp_path: Path) -> None:
    if os.geteuid() == 0:
        pytest.skip("root ignores directory permissions")
    (tmp_path / "ro").mkdir()
    os.chmod(tmp_path / "ro", 0o500)
    try:
        with pytest.raises(PermanentError):
            LocalBackend(tmp_path / "ro").put("x", b"1")
    finally:
        os.chmod(tmp_path / "ro", 0o700)


# -- S3: errors, credentials ----------------------------------------------------------------


@pytest.mark.parametrize("request_retries", [0, 2])
def test_wrong_credentials_fail_once_with_a_clear_message(
    s3_server: S3Server, s3_url: str, fault_proxy: FaultProxy, request_retries: int
) -> None:
    inner = s3_backend(
        s3_server,
        s3_url,
        fault_proxy.endpoint,
        secret_access_key="wrong",
        request_retries=request_retries,
    )
    bad = retrying(inner, attempts=5)
    with capture_logs() as logs, pytest.raises(PermanentError) as info:
        bad.put("x", b"1")
    assert not isinstance(info.value, ObjectNotFound)
    assert "access denied" in str(info.value) and "secret_access_key" in str(info.value)
    assert "wrong" not in str(info.value)
    assert [e for e in logs if e["event"] == "storage_retry"] == []
    assert fault_proxy.stats()["requests"] == 1


def test_missing_bucket_is_permanent_not_not_found(s3_server: S3Server) -> None:
    backend = s3_backend(s3_server, "s3://no-such-bucket/p")
    for call in (
        lambda: backend.put("x", b"1"),
        lambda: backend.get_bytes("x"),
        lambda: list(backend.list("")),
        lambda: backend.delete("x"),
    ):
        with pytest.raises(PermanentError, match="bucket does not exist") as info:
            call()
        assert not isinstance(info.value, ObjectNotFound)


def test_unreachable_endpoint_is_transient(s3_server: S3Server, s3_url: str) -> None:
    dead = s3_backend(s3_server, s3_url, "http://127.0.0.1:9", connect_timeout_s=1.0)
    with pytest.raises(TransientError):
        dead.put("x", b"1")


def _clean_aws_env(monkeypatch: pytest.MonkeyPatch, home: Path) -> None:
    for name in list(os.environ):
        if name.startswith("AWS_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")


def test_no_credentials_is_permanent_before_any_request(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    _clean_aws_env(monkeypatch, tmp_path)
    with pytest.raises(PermanentError, match="no S3 credentials"):
        make_backend("s3://bucket/p", endpoint="http://127.0.0.1:9")
    with pytest.raises(PermanentError, match="both"):
        make_backend("s3://bucket/p", endpoint="http://127.0.0.1:9", access_key_id="only")


def test_credentials_from_environment(
    s3_server: S3Server, s3_url: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    _clean_aws_env(monkeypatch, tmp_path)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_server.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_server.secret_key)
    backend = make_backend(s3_url, endpoint=s3_server.endpoint, request_retries=0)
    backend.put("env", b"1")
    assert backend.get_bytes("env") == b"1"


def test_credentials_from_shared_file(
    s3_server: S3Server, s3_url: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    _clean_aws_env(monkeypatch, tmp_path)
    creds = tmp_path / "credentials"
    creds.write_text(
        f"[ckptd]\naws_access_key_id = {s3_server.access_key}\n"
        f"aws_secret_access_key = {s3_server.secret_key}\n"
    )
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(creds))
    monkeypatch.setenv("AWS_PROFILE", "ckptd")
    backend = make_backend(s3_url, endpoint=s3_server.endpoint, request_retries=0)
    backend.put("file", b"1")
    assert [m.key for m in backend.list("")] == ["file"]


def test_other_clouds_are_built_without_contacting_them() -> None:
    with pytest.raises(PermanentError, match="GOOGLE_APPLICATION_CREDENTIALS"):
        make_backend("gs://bucket/p", access_key_id="k", secret_access_key="s")
    azure = make_backend("az://container/p", access_key_id="account", secret_access_key="a2V5")
    assert azure.url == "az://container/p"


def test_small_part_size_is_refused_for_s3(s3_server: S3Server, s3_url: str) -> None:
    with pytest.raises(PermanentError, match="5 MiB"):
        s3_backend(s3_server, s3_url, part_size=MiB)


# -- S3: faults through the proxy -----------------------------------------------------------


def retry_events(logs: list[MutableMapping[str, Any]]) -> list[MutableMapping[str, Any]]:
    return [e for e in logs if e["event"] == "storage_retry"]


@pytest.mark.parametrize("status", [500, 503])
def test_server_errors_are_retried(
    s3_server: S3Server, s3_url: str, fault_proxy: FaultProxy, status: int
) -> None:
    backend = retrying(s3_backend(s3_server, s3_url, fault_proxy.endpoint))
    data = payload(PART + 1000, seed=5)
    fault_proxy.set("status", count=2, status=status)
    with capture_logs() as logs:
        backend.put("step-1/shard", io.BytesIO(data), size=len(data))
    events = retry_events(logs)
    assert [e["attempt"] for e in events] == [1, 2]
    assert str(status) in events[0]["error"]
    fault_proxy.set("status", count=1, status=status)
    assert get_all(backend, "step-1/shard") == data
    assert fault_proxy.stats()["faults"] == 3


def test_connection_dropped_mid_upload_is_retried(
    s3_server: S3Server, s3_url: str, fault_proxy: FaultProxy
) -> None:
    backend = retrying(s3_backend(s3_server, s3_url, fault_proxy.endpoint))
    data = payload(2 * PART + 5, seed=6)
    fault_proxy.set("drop", count=1, after_bytes=MiB)
    with capture_logs() as logs:
        meta = backend.put("step-2/shard", io.BytesIO(data), size=len(data))
    assert len(retry_events(logs)) == 1
    assert meta.size == len(data)
    assert get_all(backend, "step-2/shard") == data
    small = b"m" * 1000
    fault_proxy.set("drop", count=1, after_bytes=100)
    with capture_logs() as logs:
        backend.put("step-2/small", small)
    assert len(retry_events(logs)) == 1
    assert backend.get_bytes("step-2/small") == small


def test_a_dropped_upload_never_shows_a_partial_object(
    s3_server: S3Server, s3_url: str, fault_proxy: FaultProxy
) -> None:
    bare = s3_backend(s3_server, s3_url, fault_proxy.endpoint)
    data = payload(2 * PART + 5, seed=7)
    fault_proxy.set("drop", count=100, after_bytes=MiB)
    with pytest.raises(TransientError):
        bare.put("partial", io.BytesIO(data))
    fault_proxy.set("pass")
    with pytest.raises(ObjectNotFound):
        bare.stat("partial")


def test_stalled_connection_times_out_and_is_retried(
    s3_server: S3Server, s3_url: str, fault_proxy: FaultProxy
) -> None:
    inner = s3_backend(
        s3_server, s3_url, fault_proxy.endpoint, read_timeout_s=0.5, request_timeout_s=1.0
    )
    backend = retrying(inner)
    fault_proxy.set("stall", count=1, stall_s=10.0)
    started = time.monotonic()
    with capture_logs() as logs:
        backend.put("stalled", b"s" * 1000)
    assert time.monotonic() - started < 8.0, "gave up on the stall before it ended"
    assert len(retry_events(logs)) == 1
    # A fresh client: the first one would reuse its pooled connection and never see a stall.
    reader = retrying(
        s3_backend(
            s3_server, s3_url, fault_proxy.endpoint, read_timeout_s=0.5, request_timeout_s=1.0
        )
    )
    fault_proxy.set("stall", count=1, stall_s=10.0)
    with capture_logs() as logs:
        assert get_all(reader, "stalled") == b"s" * 1000
    assert len(retry_events(logs)) == 1


def test_a_slow_upload_is_not_taken_for_a_stall(
    s3_server: S3Server, s3_url: str, fault_proxy: FaultProxy
) -> None:
    backend = s3_backend(s3_server, s3_url, fault_proxy.endpoint, read_timeout_s=0.3)
    data = payload(MiB, seed=8)
    fault_proxy.set("slow", count=1, bytes_per_s=2 * MiB)  # 0.5 s of sending, nothing back
    backend.put("slow", data)
    assert backend.get_bytes("slow") == data
    assert fault_proxy.stats()["faults"] == 1


def test_create_only_whose_answer_was_lost_is_confirmed(
    s3_server: S3Server, s3_url: str, fault_proxy: FaultProxy
) -> None:
    backend = retrying(s3_backend(s3_server, s3_url, fault_proxy.endpoint))
    manifest = b'{"format": "ckptd-manifest/1", "step": 3}'
    fault_proxy.set("cut_response", count=1)
    with capture_logs() as logs:
        backend.put("step-3/MANIFEST.json", manifest, create_only=True)
    names = [e["event"] for e in logs]
    assert names == ["storage_retry", "storage_create_confirmed"]
    # A different manifest already there is a real conflict, retried or not.
    backend.put("step-4/MANIFEST.json", b"theirs", create_only=True)
    fault_proxy.set("cut_response", count=1)
    with capture_logs() as logs, pytest.raises(ObjectExists):
        backend.put("step-4/MANIFEST.json", b"mine", create_only=True)
    assert [e["event"] for e in logs] == ["storage_retry"]
    assert backend.get_bytes("step-4/MANIFEST.json") == b"theirs"


def test_retries_are_bounded(s3_server: S3Server, s3_url: str, fault_proxy: FaultProxy) -> None:
    backend = retrying(s3_backend(s3_server, s3_url, fault_proxy.endpoint), attempts=3)
    fault_proxy.set("status", count=100, status=503)
    with capture_logs() as logs, pytest.raises(TransientError, match="503"):
        backend.put("never", b"1")
    assert len(retry_events(logs)) == 2
    assert [e["event"] for e in logs][-1] == "storage_gave_up"
    assert fault_proxy.stats()["requests"] == 3


def test_a_non_seekable_source_is_not_retried(
    s3_server: S3Server, s3_url: str, fault_proxy: FaultProxy
) -> None:
    backend = retrying(s3_backend(s3_server, s3_url, fault_proxy.endpoint))
    read_end, write_end = os.pipe()
    os.write(write_end, b"streamed")
    os.close(write_end)
    fault_proxy.set("status", count=1, status=503)
    with open(read_end, "rb") as pipe, pytest.raises(TransientError):
        backend.put("pipe", pipe)
    assert fault_proxy.stats()["requests"] == 1


# -- only the configured endpoint is ever contacted ----------------------------------------

_CHILD = """
import io, os, sys
from ckptd.backends import make_backend
from ckptd.errors import PermanentError
url, endpoint, key, secret = sys.argv[1:5]
b = make_backend(url, endpoint=endpoint, access_key_id=key, secret_access_key=secret,
                 part_size=5 * 1024 * 1024)
b.put("x/one", b"1")
b.put("x/big", io.BytesIO(os.urandom(6 * 1024 * 1024)))
assert b.get_bytes("x/one") == b"1"
b.get("x/big", io.BytesIO())
b.stat("x/one")
assert sorted(m.key for m in b.list("x")) == ["x/big", "x/one"]
b.delete("x/one")
for name in [n for n in os.environ if n.startswith("AWS_")]:
    del os.environ[name]
os.environ["HOME"] = sys.argv[5]
os.environ["AWS_EC2_METADATA_DISABLED"] = "true"  # else the chain ends at instance metadata
try:
    make_backend(url, endpoint=endpoint).stat("x/big")
except PermanentError:
    print("no-credentials refused")
"""


def _inet_peers(trace: str) -> set[tuple[str, int]]:
    v4 = re.findall(r'sin_port=htons\((\d+)\), sin_addr=inet_addr\("([^"]+)"\)', trace)
    v6 = re.findall(r'sin6_port=htons\((\d+)\).*?inet_pton\(AF_INET6, "([^"]+)"', trace)
    return {(addr, int(port)) for port, addr in v4 + v6}


def test_only_the_configured_endpoint_is_contacted(
    s3_server: S3Server, s3_url: str, fault_proxy: FaultProxy, tmp_path: Path
) -> None:
    strace = shutil.which("strace")
    if strace is None:
        pytest.skip("strace not installed")
    script = tmp_path / "child.py"
    script.write_text(textwrap.dedent(_CHILD))
    trace = tmp_path / "trace.txt"
    env = {
        "PATH": os.environ.get("PATH", ""),
        "PYTHONPATH": str(REPO),
        "HOME": str(tmp_path),
        "AWS_EC2_METADATA_DISABLED": "true",
    }
    cmd = [strace, "-f", "-qq", "-e", "trace=connect,sendto,sendmsg", "-o", str(trace)]
    cmd += [sys.executable, str(script), s3_url, fault_proxy.endpoint]
    cmd += [s3_server.access_key, s3_server.secret_key, str(tmp_path)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    if done.returncode != 0 and "ptrace" in done.stderr:
        pytest.skip(f"strace cannot trace here: {done.stderr.strip()[:200]}")
    assert done.returncode == 0, done.stderr
    assert "no-credentials refused" in done.stdout
    assert _inet_peers(trace.read_text()) == {("127.0.0.1", fault_proxy.port)}
    stats = fault_proxy.stats()
    assert stats["connections"] >= 1 and stats["requests"] >= 6
    assert all(peer.startswith("127.0.0.1:") for peer in stats["peers"])


@pytest.fixture(autouse=True)
def _no_metadata_lookups(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    yield


# -- object files sent from a mapping of their pages ----------------------------------------


def _object_file(tmp_path: Path, n: int, seed: int) -> tuple[Path, bytes]:
    data = payload(n, seed=seed)
    path = tmp_path / f"obj-{seed}.bin"
    path.write_bytes(data)
    return path, data


@pytest.mark.parametrize("size", [2 * MiB + 5, 2 * PART + 123])
def test_an_object_file_is_sent_from_its_pages_and_hashed_as_read(
    s3_server: S3Server, s3_url: str, tmp_path: Path, size: int
) -> None:
    from ckptd.backends.base import bare
    from ckptd.backends.mapped import TRIMMER
    from ckptd.stages.sending.reader import Meter, ObjectReader

    path, data = _object_file(tmp_path, size, seed=size)
    backend = retrying(s3_backend(s3_server, s3_url))
    meter = Meter(None)
    with ObjectReader(path, meter, PART, md5=True) as src:
        meta = backend.put("obj", cast(BinaryIO, src), size=size)
        assert bare(meta.etag or "") == src.etag(), "the store got exactly the bytes hashed"
    assert meter.sent_bytes == size
    assert get_all(backend, "obj") == data
    assert not TRIMMER._bodies, "the mapping is given up when the put returns"


def test_an_object_file_shorter_than_announced_stores_nothing(
    s3_server: S3Server, s3_url: str, tmp_path: Path
) -> None:
    from ckptd.stages.sending.reader import Meter, ObjectReader

    backend = s3_backend(s3_server, s3_url)
    for n in (2 * MiB, PART + 10):
        path, _ = _object_file(tmp_path, n, seed=n)
        with ObjectReader(path, Meter(None), PART, md5=True) as src, \
                pytest.raises(PermanentError, match="expected"):
            backend.put(f"short-{n}", cast(BinaryIO, src), size=n + 1)
    assert list(backend.list("")) == []
