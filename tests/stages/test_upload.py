"""The upload stage and the remote keys, against a directory and a real SeaweedFS server.

Faults go through the real TCP proxy (tests/faultproxy.py) or a wrapper implementing the
Backend protocol around a real backend; kill -9 hits a real uploading process.
Run alone with `python -m pytest tests/stages/test_upload.py` (S3 cases need the `weed` binary).
"""

from __future__ import annotations

import io
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import xxhash
from structlog.testing import capture_logs
from support.uploads import (
    PART,
    ROOT,
    MiB,
    Recording,
    default_files,
    fail_on,
    keys_of,
    make_step,
    random_bytes,
    s3_backend,
)
from support.wait import wait_until

from ckptd.backends import Backend, LocalBackend, ObjectMeta, ObstoreBackend, wrap_backend
from ckptd.codec import decode_stream
from ckptd.errors import (
    CorruptData,
    ObjectNotFound,
    PermanentError,
    TransientError,
)
from ckptd.remote.keys import (
    list_steps,
    listed_committed,
    manifest_exists,
    read_latest,
    read_manifest,
    step_objects,
)
from ckptd.remote.manifest import MANIFEST_NAME, Manifest, StoredFile
from ckptd.stages.sending.ledger import LEDGER_NAME
from ckptd.stages.upload import delete_step, upload_step, verify_step

if TYPE_CHECKING:
    from faultproxy import FaultProxy
    from s3server import S3Server

pytest_plugins = ["s3server"]  # fixtures: s3_server, s3_url, fault_proxy

REPO = Path(__file__).resolve().parents[2]


# -- building a step's objects the way the compress stage leaves them ------------------------


def restored(backend: Backend, manifest: Manifest, f: StoredFile) -> bytes:
    stored = io.BytesIO()
    backend.get(f"{ROOT}/step-{manifest.step}/{f.key}", stored)
    stored.seek(0)
    out = io.BytesIO()
    decode_stream(f.codec, stored, out)
    return out.getvalue()


# -- backends ---------------------------------------------------------------------------------


def retrying(inner: Backend) -> Backend:
    return wrap_backend(inner, attempts=4, base_delay=0.01, max_delay=0.05)


@pytest.fixture(params=["local", "s3"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Backend:
    if request.param == "local":
        return LocalBackend(tmp_path / "remote", part_size=PART)
    server = request.getfixturevalue("s3_server")
    return s3_backend(server, request.getfixturevalue("s3_url"))


# -- the round trip ---------------------------------------------------------------------------


def test_upload_then_list_read_and_restore(backend: Backend, tmp_path: Path) -> None:
    objects, manifest = make_step(tmp_path, 7)
    done: list[int] = []
    result = upload_step(backend, ROOT, objects, manifest, progress=done.append)
    assert (result.uploaded_objects, result.skipped_objects) == (4, 0)
    assert result.sent_bytes == manifest.stored_size + len(manifest.to_bytes())
    assert sum(done) == manifest.stored_size
    assert result.latest_updated and read_latest(backend, ROOT) == 7
    assert list_steps(backend, ROOT) == [7]
    assert read_manifest(backend, ROOT, 7).as_json() == manifest.as_json()
    verify_step(backend, ROOT, manifest)  # whole: no TransientError
    assert keys_of(backend, 7) == {f.key for f in manifest.files} | {MANIFEST_NAME}
    for f, data in zip(manifest.files, default_files().values(), strict=True):
        assert f.codec == "zstd" and f.key == f.path + ".zst"
        out = restored(backend, manifest, f)
        assert out == data and xxhash.xxh3_128_hexdigest(out) == f.hash


def test_s3_uploads_are_checked_against_their_etags(s3_server: S3Server, s3_url: str,
                                                    tmp_path: Path) -> None:
    objects, manifest = make_step(tmp_path, 1)
    with capture_logs() as logs:
        result = upload_step(s3_backend(s3_server, s3_url), ROOT, objects, manifest)
    # single-part and multipart etags both equal the MD5s computed while sending
    assert result.checksum_verified == 4
    assert not [e for e in logs if e["event"] == "upload_etag_mismatch"]


@pytest.mark.skipif(shutil.which("zstd") is None, reason="zstd CLI not installed")
def test_zstd_objects_decompress_with_the_stock_cli(backend: Backend, tmp_path: Path) -> None:
    objects, manifest = make_step(tmp_path, 3)
    upload_step(backend, ROOT, objects, manifest)
    for f, data in zip(manifest.files, default_files().values(), strict=True):
        fetched = tmp_path / "fetched.zst"
        with open(fetched, "wb") as out:
            backend.get(f"{ROOT}/step-3/{f.key}", out)
        plain = subprocess.run(["zstd", "-d", "-c", "-q", str(fetched)], check=True,
                               capture_output=True).stdout
        assert plain == data


def test_a_rerun_sends_nothing(backend: Backend, tmp_path: Path) -> None:
    objects, manifest = make_step(tmp_path, 4)
    upload_step(backend, ROOT, objects, manifest)
    rec = Recording(backend)
    done: list[int] = []
    again = upload_step(rec, ROOT, objects, manifest, progress=done.append)
    assert (again.uploaded_objects, again.skipped_objects, again.sent_bytes) == (0, 4, 0)
    assert rec.puts() == []  # LATEST already names this step: not even rewritten
    assert sum(done) == manifest.stored_size


def test_the_same_files_with_a_new_timestamp_are_the_same_commit(
    backend: Backend, tmp_path: Path
) -> None:
    objects, manifest = make_step(tmp_path, 5)
    upload_step(backend, ROOT, objects, manifest)
    # Built again later: another timestamp, no metrics yet, the same files under another name
    # for the layout. The bytes are the same, so this is the same commit.
    rebuilt = Manifest(ROOT, 5, "registered", manifest.files, created="2001-01-01T00:00:00Z")
    assert upload_step(backend, ROOT, objects, rebuilt).uploaded_objects == 0
    assert read_manifest(backend, ROOT, 5).created == manifest.created


# -- interrupted uploads ----------------------------------------------------------------------


def test_an_interrupted_upload_has_no_manifest_and_resumes(
    backend: Backend, tmp_path: Path
) -> None:
    objects, manifest = make_step(tmp_path, 6)
    broken = Recording(backend, fail_on("meta.json.zst"))  # the smallest non-empty: sent last
    with pytest.raises(TransientError):
        upload_step(broken, ROOT, objects, manifest, concurrency=1)
    assert list_steps(backend, ROOT) == []
    assert MANIFEST_NAME not in keys_of(backend, 6)
    assert read_latest(backend, ROOT) is None
    there = keys_of(backend, 6)
    assert {"optim/rank0.pt.zst", "model.pt.zst"} <= there  # the biggest went first
    rec = Recording(backend)
    result = upload_step(rec, ROOT, objects, manifest)
    assert not {f"{ROOT}/step-6/{k}" for k in there} & set(rec.puts())
    assert result.skipped_objects == len(there)
    assert list_steps(backend, ROOT) == [6]


def test_objects_put_by_someone_else_are_resent_unless_their_etag_proves_them(
    backend: Backend, tmp_path: Path
) -> None:
    """No ledger entry: an object of the right size is skipped only when its S3 etag equals
    the local file's (single-part and multipart alike); file:// has no etag: re-sent."""
    objects, manifest = make_step(tmp_path, 8)
    for f in manifest.files:
        with open(objects / f.key, "rb") as src:
            backend.put(f"{ROOT}/step-8/{f.key}", src)
    rec = Recording(backend)
    result = upload_step(rec, ROOT, objects, manifest)
    is_s3 = isinstance(backend, ObstoreBackend)
    assert result.uploaded_objects == (0 if is_s3 else 4)
    assert (objects / LEDGER_NAME).exists()
    assert upload_step(Recording(backend), ROOT, objects, manifest).uploaded_objects == 0


def test_a_same_size_object_with_other_bytes_is_replaced(
    s3_server: S3Server, s3_url: str, tmp_path: Path
) -> None:
    """A re-save of a step whose raw objects have the same sizes as an earlier, uncommitted
    upload's: the etag tells them apart, so the stale bytes are never committed."""
    backend = s3_backend(s3_server, s3_url)
    files = {"a.bin": random_bytes(MiB, 1), "b.bin": random_bytes(7 * MiB, 2)}
    _, old = make_step(tmp_path / "old", 9, files, codec="none")
    for f in old.files:
        stale = (tmp_path / "old/objects/step-9" / f.key).read_bytes()
        backend.put(f"{ROOT}/step-9/{f.key}", stale)
    new_files = {"a.bin": random_bytes(MiB, 3), "b.bin": random_bytes(7 * MiB, 4)}
    objects, manifest = make_step(tmp_path / "new", 9, new_files, codec="none")
    assert upload_step(backend, ROOT, objects, manifest).uploaded_objects == 2
    for f, data in zip(manifest.files, new_files.values(), strict=True):
        assert restored(backend, manifest, f) == data


def test_a_dropped_connection_never_leaves_a_manifest(
    s3_server: S3Server, s3_url: str, fault_proxy: FaultProxy, tmp_path: Path
) -> None:
    objects, manifest = make_step(tmp_path, 10)
    bare = s3_backend(s3_server, s3_url, fault_proxy.endpoint)
    fault_proxy.set("drop", count=100, after_bytes=256 * 1024)
    with pytest.raises(TransientError):
        upload_step(bare, ROOT, objects, manifest)
    fault_proxy.set("pass")
    assert list_steps(bare, ROOT) == []
    assert MANIFEST_NAME not in keys_of(bare, 10)
    # The same drop, now under the standard retry wrapper: the upload goes through.
    faults = fault_proxy.stats()["faults"]
    fault_proxy.set("drop", count=1, after_bytes=MiB)
    with capture_logs() as logs:
        result = upload_step(retrying(bare), ROOT, objects, manifest)
    assert [e["op"] for e in logs if e["event"] == "storage_retry"] == ["put"]
    assert fault_proxy.stats()["faults"] == faults + 1
    assert list_steps(bare, ROOT) == [10] and result.skipped_objects + result.uploaded_objects == 4
    verify_step(bare, ROOT, manifest)  # whole: no TransientError


@pytest.mark.parametrize("status", [500, 503])
def test_server_errors_are_retried_to_completion(
    s3_server: S3Server, s3_url: str, fault_proxy: FaultProxy, tmp_path: Path, status: int
) -> None:
    objects, manifest = make_step(tmp_path, 11)
    backend = retrying(s3_backend(s3_server, s3_url, fault_proxy.endpoint))
    fault_proxy.set("status", count=3, status=status)
    with capture_logs() as logs:
        result = upload_step(backend, ROOT, objects, manifest)
    assert len([e for e in logs if e["event"] == "storage_retry"]) == 3
    assert fault_proxy.stats()["faults"] == 3
    assert result.uploaded_objects == 4 and list_steps(backend, ROOT) == [11]


def test_wrong_credentials_fail_at_once_without_a_retry_storm(
    s3_server: S3Server, s3_url: str, fault_proxy: FaultProxy, tmp_path: Path
) -> None:
    objects, manifest = make_step(tmp_path, 12)
    bad = retrying(s3_backend(s3_server, s3_url, fault_proxy.endpoint,
                              secret_access_key="not-the-secret", request_retries=2))
    started = time.monotonic()
    with capture_logs() as logs, pytest.raises(PermanentError, match="access denied"):
        upload_step(bad, ROOT, objects, manifest)
    assert time.monotonic() - started < 5
    assert fault_proxy.stats()["requests"] == 1  # the listing; nothing was sent
    assert not [e for e in logs if e["event"] == "storage_retry"]


# -- the commit, LATEST, deletes --------------------------------------------------------------


def test_a_step_committed_with_other_content_is_never_touched(
    backend: Backend, tmp_path: Path
) -> None:
    objects, manifest = make_step(tmp_path / "first", 13)
    upload_step(backend, ROOT, objects, manifest)
    other_files = dict(default_files(), **{"meta.json": b'{"step": 13, "other": true}'})
    objects2, other = make_step(tmp_path / "second", 13, other_files)
    rec = Recording(backend)
    with pytest.raises(PermanentError, match="already committed remotely with different"):
        upload_step(rec, ROOT, objects2, other)
    assert rec.puts() == []
    assert read_manifest(backend, ROOT, 13).as_json() == manifest.as_json()
    verify_step(backend, ROOT, manifest)  # whole: no TransientError


def racing(backend: Backend, manifest_body: bytes) -> Recording:
    """Someone else commits `manifest_body` just before our create-only put."""

    def fail(op: str, key: str) -> Exception | None:
        if op == "put" and key.endswith(MANIFEST_NAME) and not rec.puts().count(key) > 1:
            backend.put(key, manifest_body, create_only=True)
        return None

    rec = Recording(backend, fail)
    return rec


def test_the_create_only_commit_detects_a_concurrent_commit(
    backend: Backend, tmp_path: Path
) -> None:
    objects, manifest = make_step(tmp_path / "a", 14)
    other = Manifest(ROOT, 14, "native", manifest.files[:1])
    with pytest.raises(PermanentError, match="different content"):
        upload_step(racing(backend, other.to_bytes()), ROOT, objects, manifest)
    assert read_manifest(backend, ROOT, 14).as_json() == other.as_json()
    objects, manifest = make_step(tmp_path / "b", 15)
    same = Manifest(ROOT, 15, "native", manifest.files, created="2001-01-01T00:00:00Z")
    upload_step(racing(backend, same.to_bytes()), ROOT, objects, manifest)  # idempotent
    assert list_steps(backend, ROOT) == [14, 15]


def test_latest_only_moves_forward(backend: Backend, tmp_path: Path) -> None:
    small = {"model.pt": b"weights"}
    for step in (20, 10):
        objects, manifest = make_step(tmp_path / str(step), step, small)
        result = upload_step(backend, ROOT, objects, manifest)
        assert result.latest_updated == (step == 20)
    assert read_latest(backend, ROOT) == 20 and list_steps(backend, ROOT) == [10, 20]
    backend.put(f"{ROOT}/LATEST", b"garbage")
    with pytest.raises(CorruptData):
        read_latest(backend, ROOT)
    objects, manifest = make_step(tmp_path / "30", 30, small)
    upload_step(backend, ROOT, objects, manifest)
    assert read_latest(backend, ROOT) == 30


def test_a_failed_latest_update_is_logged_not_raised(backend: Backend, tmp_path: Path) -> None:
    def fail(op: str, key: str) -> Exception | None:
        return TransientError("injected") if key.endswith("LATEST") else None

    objects, manifest = make_step(tmp_path, 21, {"model.pt": b"weights"})
    with capture_logs() as logs:
        result = upload_step(Recording(backend, fail), ROOT, objects, manifest)
    assert not result.latest_updated and list_steps(backend, ROOT) == [21]
    assert [e["event"] for e in logs if e["log_level"] == "warning"] == ["latest_update_failed"]


def test_delete_removes_the_manifest_first_and_fixes_latest(
    backend: Backend, tmp_path: Path
) -> None:
    files = {"m.pt": b"w" * 100, "o.pt": b"o"}
    for step in (1, 2, 3):
        objects, manifest = make_step(tmp_path / str(step), step, files)
        upload_step(backend, ROOT, objects, manifest)
    backend.put(f"{ROOT}/step-3/stray-from-an-old-upload.zst", b"x")
    rec = Recording(backend)
    assert delete_step(rec, ROOT, 3) == 3
    deletes = [k for op, k in rec.calls if op == "delete"]
    assert deletes[0] == f"{ROOT}/step-3/{MANIFEST_NAME}"
    assert rec.calls.index(("delete", deletes[0])) < rec.calls.index(("list", f"{ROOT}/step-3"))
    assert keys_of(backend, 3) == set()
    assert list_steps(backend, ROOT) == [1, 2] and read_latest(backend, ROOT) == 2
    delete_step(backend, ROOT, 1)
    assert read_latest(backend, ROOT) == 2  # named another step: untouched
    delete_step(backend, ROOT, 2)
    assert read_latest(backend, ROOT) is None and list_steps(backend, ROOT) == []
    delete_step(backend, ROOT, 2)  # idempotent


def test_a_delete_cut_short_leaves_no_half_step_listed(backend: Backend, tmp_path: Path) -> None:
    objects, manifest = make_step(tmp_path, 4)
    upload_step(backend, ROOT, objects, manifest)

    def fail(op: str, key: str) -> Exception | None:
        return TransientError("injected") if op == "delete" and "optim" in key else None

    with pytest.raises(TransientError):
        delete_step(Recording(backend, fail), ROOT, 4)
    assert list_steps(backend, ROOT) == []  # data objects remain; the step does not exist
    assert keys_of(backend, 4)
    delete_step(backend, ROOT, 4)
    assert keys_of(backend, 4) == set() and read_latest(backend, ROOT) is None


# -- bounds and local problems ------------------------------------------------------------------


def test_requests_in_flight_stay_within_concurrency(tmp_path: Path) -> None:
    files = {f"shard{i}.bin": random_bytes(256 * 1024, i) for i in range(8)}
    files["big.bin"] = random_bytes(11 * MiB, 99)  # 3 parts: takes both slots, runs alone
    objects, manifest = make_step(tmp_path, 1, files, codec="none")
    def pause(op: str, key: str) -> None:
        time.sleep(0.02)  # inside the put: overlapping puts show up as in flight together

    slow = Recording(LocalBackend(tmp_path / "remote", part_size=PART), pause)
    upload_step(slow, ROOT, objects, manifest, concurrency=2)
    assert slow.peak_in_flight == 2
    assert slow.puts()[0].endswith("big.bin")  # biggest first, alone


def test_local_problems_are_permanent(tmp_path: Path) -> None:
    backend = LocalBackend(tmp_path / "remote", part_size=PART)
    objects, manifest = make_step(tmp_path, 2, {"a.pt": b"aaaa", "b.pt": b"bbbb"}, codec="none")
    (objects / "a.pt").write_bytes(b"longer than the manifest says")
    with pytest.raises(PermanentError, match="bytes on disk"):
        upload_step(backend, ROOT, objects, manifest)
    (objects / "a.pt").unlink()
    with pytest.raises(PermanentError, match="missing on local disk"):
        upload_step(backend, ROOT, objects, manifest)
    with pytest.raises(PermanentError, match="not 'other'"):
        upload_step(backend, "other", objects, manifest)
    assert list_steps(backend, ROOT) == []


# -- reading the remote keys ----------------------------------------------------------------------


def test_list_steps_counts_only_committed_canonical_steps(backend: Backend, tmp_path: Path) -> None:
    objects, manifest = make_step(tmp_path, 40, {"m.pt": b"m"})
    upload_step(backend, ROOT, objects, manifest)
    backend.put(f"{ROOT}/step-41/m.pt.zst", b"uncommitted")
    backend.put(f"{ROOT}/step-042/{MANIFEST_NAME}", b"{}")
    backend.put(f"{ROOT}/step-x/{MANIFEST_NAME}", b"{}")
    backend.put(f"{ROOT}/step-43/deeper/{MANIFEST_NAME}", b"{}")
    backend.put(f"{ROOT}2/step-44/{MANIFEST_NAME}", b"{}")
    assert list_steps(backend, ROOT) == [40]
    # One rule for "committed", by HEAD, by a step's listing, by the root's listing.
    assert [manifest_exists(backend, ROOT, s) for s in (40, 41, 42, 43)] == [
        True, False, False, False]
    assert [listed_committed(step_objects(backend, ROOT, s)) for s in (40, 41)] == [True, False]
    with pytest.raises(ObjectNotFound):
        read_manifest(backend, ROOT, 41)
    backend.put(f"{ROOT}/step-45/{MANIFEST_NAME}", b"{not json")
    with pytest.raises(CorruptData):
        read_manifest(backend, ROOT, 45)
    backend.put(f"{ROOT}/step-46/{MANIFEST_NAME}", manifest.to_bytes())  # says step 40
    with pytest.raises(CorruptData, match="step 40"):
        read_manifest(backend, ROOT, 46)


def test_verify_step_names_missing_and_wrong_sized_objects(
    backend: Backend, tmp_path: Path
) -> None:
    objects, manifest = make_step(tmp_path, 50)
    upload_step(backend, ROOT, objects, manifest)
    model, optim = manifest.files[0], manifest.files[1]
    backend.delete(f"{ROOT}/step-50/{model.key}")
    backend.put(f"{ROOT}/step-50/{optim.key}", b"short")
    with pytest.raises(TransientError) as caught:
        verify_step(backend, ROOT, manifest)
    assert str(caught.value) == (
        f"step 50 at {backend.url}: verification failed: {model.key} missing; "
        f"{optim.key} has 5 bytes, expected {optim.stored_size}")
    # An object replaced after its put (same size, another etag or mtime): not the one sent.
    third = manifest.files[2]
    meta = backend.stat(f"{ROOT}/step-50/{third.key}")
    other = ObjectMeta(meta.key, meta.size, meta.mtime - 1, "0" * 32 if meta.etag else None)
    with pytest.raises(TransientError, match=f"{third.key} changed after it was uploaded"):
        verify_step(backend, ROOT, manifest, {third.key: other})
    with pytest.raises(TransientError) as caught:  # untouched ones stay quiet
        verify_step(backend, ROOT, manifest, {third.key: meta})
    assert "changed" not in str(caught.value)


def test_verification_before_the_commit_catches_a_vanished_object(
    backend: Backend, tmp_path: Path
) -> None:
    """An object deleted between its put and the commit: no manifest, TransientError."""
    objects, manifest = make_step(tmp_path, 51)

    def fail(op: str, key: str) -> Exception | None:
        if op == "put" and key.endswith(MANIFEST_NAME):
            raise AssertionError("committed without verification")
        if op == "list" and key == f"{ROOT}/step-51" and rec.puts():
            backend.delete(f"{ROOT}/step-51/{manifest.files[0].key}")
        return None

    rec = Recording(backend, fail)
    with pytest.raises(TransientError, match="verification failed"):
        upload_step(rec, ROOT, objects, manifest)
    assert list_steps(backend, ROOT) == []


# -- kill -9 mid-upload ------------------------------------------------------------------------

_UPLOADER = """
import json, sys
from pathlib import Path
from ckptd.backends import make_backend
from ckptd.remote.manifest import parse_manifest
from ckptd.stages.upload import upload_step
cfg = json.loads(sys.argv[1])
backend = make_backend(cfg["url"], endpoint=cfg["endpoint"], region=cfg["region"],
                       access_key_id=cfg["key"], secret_access_key=cfg["secret"],
                       part_size=5 * 1024 * 1024, concurrency=1, request_retries=0)
objects = Path(cfg["objects"])
manifest = parse_manifest((objects / "MANIFEST.json").read_bytes())
upload_step(backend, manifest.root, objects, manifest, concurrency=1)
"""


def test_kill_9_mid_upload_then_rerun_resends_nothing_complete(
    s3_server: S3Server, s3_url: str, fault_proxy: FaultProxy, tmp_path: Path
) -> None:
    files = {f"shard{i}.bin": random_bytes(MiB, i) for i in range(6)}
    objects, manifest = make_step(tmp_path, 60, files, codec="none")
    direct = s3_backend(s3_server, s3_url)
    fault_proxy.set("slow", count=100, bytes_per_s=4 * MiB)  # ~0.25 s per object
    cfg = {"url": s3_url, "endpoint": fault_proxy.endpoint, "region": s3_server.region,
           "key": s3_server.access_key, "secret": s3_server.secret_key, "objects": str(objects)}
    env = dict(os.environ, AWS_EC2_METADATA_DISABLED="true")
    proc = subprocess.Popen([sys.executable, "-c", _UPLOADER, json.dumps(cfg)], env=env,
                            cwd=REPO, stderr=subprocess.PIPE)
    try:
        def two_objects_up() -> bool:
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            return len(keys_of(direct, 60)) >= 2

        wait_until(two_objects_up, 30, "the uploader to send two objects", interval=0.02)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    there = keys_of(direct, 60)
    assert MANIFEST_NAME not in there and 2 <= len(there) < 6
    assert list_steps(direct, ROOT) == []
    fault_proxy.set("pass")
    seen = len(fault_proxy.stats()["log"])
    via_proxy = s3_backend(s3_server, s3_url, fault_proxy.endpoint)
    result = upload_step(via_proxy, ROOT, objects, manifest)
    puts = [line for line in fault_proxy.stats()["log"][seen:] if line.startswith("PUT ")]
    assert not [p for p in puts for key in there if f"/step-60/{key} " in p]
    assert result.skipped_objects == len(there)
    assert len(puts) == 6 - len(there) + 2  # the rest, MANIFEST.json, LATEST
    assert list_steps(direct, ROOT) == [60]
    for f, data in zip(manifest.files, files.values(), strict=True):
        assert restored(direct, manifest, f) == data
