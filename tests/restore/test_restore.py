"""Restore without the daemon: from a backend (file:// and a real S3 server), parallel and
hash-checked; choosing the step and its source from a config; the TTY progress bar."""

from __future__ import annotations

import filecmp
import io
import json
import os
import select
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

import layout_writers as w
import pytest
from support.compress import list_temps, odd_files, stage
from support.layouts_real import detect
from writers import flip_byte

from ckptd.backends import Backend, LocalBackend, ObjectMeta, ObstoreBackend, make_backend
from ckptd.backends.base import SMALL_OBJECT_MAX, Source
from ckptd.config import Config, parse_config
from ckptd.copies.store import objects_dir
from ckptd.errors import CorruptData, NotFound, TransientError
from ckptd.fetch.source import list_remote_steps, read_remote_manifest, resolve_step
from ckptd.remote.manifest import MANIFEST_NAME, Manifest, StoredFile, step_prefix
from ckptd.restore.files import all_or_nothing, restore, restore_remote, tty_progress

if TYPE_CHECKING:
    from s3server import S3Server

pytest_plugins = ["s3server"]  # fixtures: s3_server, s3_url


def restore_step(backend: Backend, root_name: str, step: int, to: Path, concurrency: int = 4,
                 progress: Callable[[int], None] | None = None) -> list[Path]:
    """A remote step restored as `restore` does it: its committed manifest, then its objects."""
    return restore_remote(backend, read_remote_manifest(backend, root_name, step), to,
                          concurrency, progress)


def upload(backend: Backend, root_dir: Path, manifest: Manifest, name: str = "r") -> None:
    """What the upload stage leaves: the objects, then MANIFEST.json last, create-only."""
    prefix = step_prefix(name, manifest.step)
    for f in manifest.files:
        with open(objects_dir(root_dir, manifest.step) / f.key, "rb") as src:
            backend.put(f"{prefix}/{f.key}", src)
    backend.put(f"{prefix}/{MANIFEST_NAME}", manifest.to_bytes(), create_only=True)


def assert_same(root: Path, to: Path, manifest: Manifest) -> None:
    for f in manifest.files:
        assert filecmp.cmp(root / f.path, to / f.path, shallow=False), f.path
    assert list_temps(to) == []


@pytest.fixture
def staged(tmp_path: Path) -> tuple[Path, Manifest]:
    """A root with odd-sized files (step 3) and its local compressed copy."""
    root = tmp_path / "root"
    return root, stage(root, odd_files(root), "auto")


class Counting:
    """A backend that counts gets in flight (the same protocol, passed through)."""

    def __init__(self, inner: Backend) -> None:
        self.inner = inner
        self.url, self.part_size, self.md5_etags = inner.url, inner.part_size, inner.md5_etags
        self.active = self.peak = 0
        self._lock = threading.Lock()

    def get(self, key: str, dst: BinaryIO, etag: str | None = None) -> int:
        with self._lock:
            self.active += 1
            self.peak = max(self.peak, self.active)
        try:
            time.sleep(0.05)
            return self.inner.get(key, dst, etag=etag)
        finally:
            with self._lock:
                self.active -= 1

    def put(self, key: str, src: Source, size: int | None = None, *,
            create_only: bool = False, if_match: str | None = None) -> ObjectMeta:
        return self.inner.put(key, src, size, create_only=create_only, if_match=if_match)

    def get_bytes(self, key: str, limit: int = SMALL_OBJECT_MAX) -> bytes:
        return self.inner.get_bytes(key, limit)

    def get_versioned(self, key: str, limit: int = SMALL_OBJECT_MAX) -> tuple[bytes, str]:
        return self.inner.get_versioned(key, limit)

    def stat(self, key: str) -> ObjectMeta:
        return self.inner.stat(key)

    def list(self, prefix: str = "") -> Iterator[ObjectMeta]:
        return self.inner.list(prefix)

    def delete(self, key: str) -> None:
        self.inner.delete(key)


# --- from a backend ------------------------------------------------------------------------


def test_restore_from_file_backend_in_parallel(staged: tuple[Path, Manifest],
                                               tmp_path: Path) -> None:
    root, manifest = staged
    backend = Counting(make_backend(f"file://{tmp_path}/remote"))
    upload(backend, root, manifest)
    done: list[int] = []
    paths = restore_step(backend, "r", 3, tmp_path / "out", concurrency=4,
                                 progress=done.append)
    assert sorted(paths) == sorted(tmp_path / "out" / f.path for f in manifest.files)
    assert_same(root, tmp_path / "out", manifest)
    assert sum(done) == manifest.size
    assert 1 < backend.peak <= 4


def test_dcp_shards_restore_from_a_backend(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    w.write_nemo(root, 100)  # DCP shards: tensors at unaligned offsets
    [cand] = detect(root)
    manifest = stage(root, cand, "zstd-bytegroup")
    backend = LocalBackend(tmp_path / "remote")
    upload(backend, root, manifest)
    restore_step(backend, "r", cand.step, tmp_path / "out", concurrency=2)
    assert_same(root, tmp_path / "out", manifest)


def test_hash_mismatch_from_the_manifest_is_detected(staged: tuple[Path, Manifest],
                                                     tmp_path: Path) -> None:
    root, manifest = staged
    bad = next(f for f in manifest.files if f.path == "odd/f32_plus3.dat")
    forged = StoredFile(bad.path, bad.size, "0" * 32, bad.hash_alg, bad.codec, bad.stored_size,
                        bad.key)
    lying = Manifest(manifest.root, manifest.step, manifest.layout,
                     tuple(forged if f is bad else f for f in manifest.files))
    backend = LocalBackend(tmp_path / "remote")
    upload(backend, root, lying)
    with pytest.raises(CorruptData, match=r"odd/f32_plus3\.dat: content hash mismatch"):
        restore_step(backend, "r", 3, tmp_path / "out", concurrency=3)
    assert not (tmp_path / "out" / bad.path).exists()
    assert list_temps(tmp_path / "out") == []


def test_corrupt_and_missing_remote_objects(staged: tuple[Path, Manifest],
                                            tmp_path: Path) -> None:
    root, manifest = staged
    backend = LocalBackend(tmp_path / "remote")
    upload(backend, root, manifest)
    f = next(f for f in manifest.files if f.path == "odd/multi_block.dat")
    stored = tmp_path / "remote" / "r" / "step-3" / f.key
    flip_byte(stored, f.stored_size // 2)
    with pytest.raises(CorruptData, match=r"odd/multi_block\.dat: .*corrupt"):
        restore_step(backend, "r", 3, tmp_path / "out")
    assert not (tmp_path / "out" / f.path).exists() and list_temps(tmp_path / "out") == []
    stored.unlink()
    with pytest.raises(NotFound, match=r"odd/multi_block\.dat: object .* is missing"):
        restore_step(backend, "r", 3, tmp_path / "out2")


class FailsMidway(Counting):
    """A backend whose first get of `key` delivers half the object, then fails transiently."""

    def __init__(self, inner: Backend, key: str) -> None:
        super().__init__(inner)
        self.key, self.failed = key, False

    def get(self, key: str, dst: BinaryIO, etag: str | None = None) -> int:
        if key.endswith(self.key) and not self.failed:
            self.failed = True
            whole = io.BytesIO()
            self.inner.get(key, whole, etag=etag)
            dst.write(whole.getvalue()[: len(whole.getvalue()) // 2])
            raise TransientError(f"get {key}: connection reset")
        return self.inner.get(key, dst, etag=etag)


def test_a_download_failing_midway_starts_its_object_over(staged: tuple[Path, Manifest],
                                                         tmp_path: Path) -> None:
    root, manifest = staged
    f = next(f for f in manifest.files if f.path == "odd/multi_block.dat")
    backend = FailsMidway(LocalBackend(tmp_path / "remote"), f.key)
    upload(backend, root, manifest)
    seen: list[int] = []
    restore_step(backend, "r", 3, tmp_path / "out", progress=seen.append)
    assert backend.failed
    assert_same(root, tmp_path / "out", manifest)
    assert sum(seen) == manifest.size, "bytes decoded before the failure are counted once"


def test_an_object_longer_than_its_manifest_says_is_corrupt(staged: tuple[Path, Manifest],
                                                           tmp_path: Path) -> None:
    root, manifest = staged
    backend = LocalBackend(tmp_path / "remote")
    upload(backend, root, manifest)
    f = next(f for f in manifest.files if f.path == "odd/multi_block.dat")
    with open(tmp_path / "remote" / "r" / "step-3" / f.key, "ab") as stored:
        stored.write(b"trailing")
    with pytest.raises(CorruptData, match=r"odd/multi_block\.dat: .*bytes"):
        restore_step(backend, "r", 3, tmp_path / "out")
    assert not (tmp_path / "out" / f.path).exists() and list_temps(tmp_path / "out") == []


def test_a_step_without_manifest_does_not_exist(staged: tuple[Path, Manifest],
                                                tmp_path: Path) -> None:
    root, manifest = staged
    backend = LocalBackend(tmp_path / "remote")
    upload(backend, root, manifest)
    backend.delete(f"r/step-3/{MANIFEST_NAME}")
    with pytest.raises(NotFound, match="step 3 of 'r'"):
        restore_step(backend, "r", 3, tmp_path / "out")


def test_list_remote_steps(tmp_path: Path) -> None:
    backend = LocalBackend(tmp_path / "remote")
    for key in ["r/step-5/MANIFEST.json", "r/step-5/a.zst", "r/step-12/MANIFEST.json",
                "r/step-9/a.zst", "rr/step-7/MANIFEST.json", "r/LATEST",
                "r/step-05x/MANIFEST.json", "r/step-3/sub/MANIFEST.json"]:
        backend.put(key, b"{}")
    assert list_remote_steps(backend, "r") == [5, 12]
    assert list_remote_steps(backend, "nothing") == []


def test_restore_from_s3(staged: tuple[Path, Manifest], tmp_path: Path,
                         request: pytest.FixtureRequest) -> None:
    from s3server import weed_binary

    if weed_binary() is None:
        pytest.skip("SeaweedFS `weed` is not installed")
    server: S3Server = request.getfixturevalue("s3_server")
    url: str = request.getfixturevalue("s3_url")
    root, manifest = staged
    backend = ObstoreBackend(url, endpoint=server.endpoint, region=server.region,
                             access_key_id=server.access_key, secret_access_key=server.secret_key,
                             part_size=5 << 20, request_retries=0)
    upload(backend, root, manifest)
    restore_step(backend, "r", 3, tmp_path / "out", concurrency=4)
    assert_same(root, tmp_path / "out", manifest)
    assert list_remote_steps(backend, "r") == [3]


def test_a_stalled_server_fails_a_restore_within_its_timeouts(
        staged: tuple[Path, Manifest], tmp_path: Path, request: pytest.FixtureRequest) -> None:
    """A server that accepts connections and answers nothing: the restore fails within the
    backend's read timeout (per attempt), in one error, and places nothing in the target."""
    from s3server import weed_binary

    if weed_binary() is None:
        pytest.skip("SeaweedFS `weed` is not installed")
    server: S3Server = request.getfixturevalue("s3_server")
    url: str = request.getfixturevalue("s3_url")
    proxy = request.getfixturevalue("fault_proxy")
    root, manifest = staged
    direct = ObstoreBackend(url, endpoint=server.endpoint, region=server.region,
                            access_key_id=server.access_key,
                            secret_access_key=server.secret_key, part_size=5 << 20,
                            request_retries=0)
    upload(direct, root, manifest)
    proxy.set("stall", count=1000, stall_s=60.0)
    stalled = ObstoreBackend(url, endpoint=proxy.endpoint, region=server.region,
                             access_key_id=server.access_key,
                             secret_access_key=server.secret_key, part_size=5 << 20,
                             request_retries=0, connect_timeout_s=2.0, read_timeout_s=2.0,
                             request_timeout_s=4.0)
    target = tmp_path / "target"
    target.mkdir()
    (target / "keep").write_bytes(b"mine")
    started = time.monotonic()
    with pytest.raises(TransientError):
        all_or_nothing(target, lambda staging: restore_step(stalled, "r", 3, staging))
    assert time.monotonic() - started < 30
    assert sorted(p.name for p in target.iterdir()) == ["keep"]



def test_ckptd_restore_against_a_stalled_server_is_bounded_by_the_configured_timeouts(
        staged: tuple[Path, Manifest], tmp_path: Path, request: pytest.FixtureRequest) -> None:
    """`[roots.upload]` read_timeout/request_timeout/attempts bound what a stalled store costs
    `ckptd restore`: one line, a non-zero exit, nothing placed in the target."""
    from s3server import weed_binary
    from support.config import render_config
    from support.wire import cli

    if weed_binary() is None:
        pytest.skip("SeaweedFS `weed` is not installed")
    server: S3Server = request.getfixturevalue("s3_server")
    url: str = request.getfixturevalue("s3_url")
    proxy = request.getfixturevalue("fault_proxy")
    root, manifest = staged
    upload(ObstoreBackend(url, endpoint=server.endpoint, region=server.region,
                          access_key_id=server.access_key, secret_access_key=server.secret_key,
                          part_size=5 << 20, request_retries=0), root, manifest)
    proxy.set("stall", count=1000, stall_s=60.0)
    cfg = tmp_path / "ckptd.toml"
    cfg.write_text(render_config(
        {"state_dir": str(tmp_path / "state")},
        [{"name": "r", "path": str(tmp_path / "elsewhere"),
          "upload": {"url": url, "endpoint": proxy.endpoint, "region": server.region,
                     "access_key_id": server.access_key,
                     "secret_access_key": server.secret_key, "connect_timeout": "1s",
                     "read_timeout": "1s", "request_timeout": "2s", "attempts": 1}}]))
    target = tmp_path / "target"
    target.mkdir()
    (target / "keep").write_bytes(b"mine")
    started = time.monotonic()
    done = cli("restore", "r", "3", "--to", str(target), config=cfg)
    assert done.returncode != 0, done.stdout
    assert time.monotonic() - started < 45
    said = [line for line in done.stderr.splitlines() if not line.startswith("ckptd: config ")]
    assert len(said) == 1 and "r/step-3/" in said[0], done.stderr  # one line, naming the key
    assert sorted(p.name for p in target.iterdir()) == ["keep"]


# --- which step, from where ----------------------------------------------------------------


def config(tmp_path: Path, root: Path, remote: Path | None) -> Config:
    entry: dict[str, Any] = {"name": "r", "path": str(root)}
    if remote is not None:
        entry["upload"] = {"url": f"file://{remote}"}
    return parse_config({"daemon": {"state_dir": str(tmp_path / "state")}, "roots": [entry]},
                        tmp_path)


def write_latest(root: Path, step: int, path: Path) -> None:
    (root / ".ckptd" / "latest.json").write_text(json.dumps({"step": step, "path": str(path)}))


@pytest.fixture
def copies(tmp_path: Path) -> tuple[Path, Path]:
    """Root `r`: local copies of steps 5 and 7 (single files); remote: steps 7 and 9."""
    root, remote = tmp_path / "root", tmp_path / "remote"
    for step in (5, 7, 9):
        w.write_single(root, step)
        [cand] = [c for c in detect(root) if c.step == step]
        manifest = stage(root, cand, "zstd")
        if step in (7, 9):
            upload(LocalBackend(remote), root, manifest)
    os.rename(objects_dir(root, 9), tmp_path / "step-9-elsewhere")  # only remote now
    return root, remote


def test_explicit_step_prefers_the_local_copy(copies: tuple[Path, Path], tmp_path: Path) -> None:
    root, remote = copies
    cfg = config(tmp_path, root, remote)
    step, paths = restore(cfg, "r", 7, tmp_path / "out")
    assert step == 7 and [p.name for p in paths] == ["model_step_7.pt"]
    assert filecmp.cmp(root / "model_step_7.pt", paths[0], shallow=False)
    assert resolve_step(root, "r", 7, LocalBackend(remote)) == (7, "local")
    assert resolve_step(root, "r", 9, LocalBackend(remote)) == (9, "remote")
    step, paths = restore(cfg, "r", 9, tmp_path / "out9")
    assert step == 9 and filecmp.cmp(root / "model_step_9.pt", paths[0], shallow=False)


def test_a_local_copy_gone_under_the_read_is_restored_from_the_remote(
        copies: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A copy released (or damaged) while a restore reads it: the restore starts over from the
    remote, where the step is committed; with no remote, NotFound, and nothing left behind."""
    from ckptd import fileio
    from ckptd.restore import files

    root, remote = copies
    real = files.decode_object

    def released_first(src: Path, *args: Any) -> None:
        fileio.remove_tree(src.parent)  # the step's copy, as a release does it, before the open
        real(src, *args)

    monkeypatch.setattr(files, "decode_object", released_first)
    step, paths = restore(config(tmp_path, root, remote), "r", 7, tmp_path / "out")
    assert step == 7 and filecmp.cmp(root / "model_step_7.pt", paths[0], shallow=False)

    with pytest.raises(NotFound, match="local copy of step 5 of 'r' disappeared"):
        restore(config(tmp_path, root, None), "r", 5, tmp_path / "out5")
    assert not (tmp_path / "out5").exists()


def test_latest_follows_latest_json_then_the_highest_copy(copies: tuple[Path, Path],
                                                          tmp_path: Path) -> None:
    root, remote = copies
    backend = LocalBackend(remote)
    assert resolve_step(root, "r", "latest", backend) == (9, "remote")
    assert resolve_step(root, "r", "latest", None) == (7, "local")
    write_latest(root, 5, root / "model_step_5.pt")
    assert resolve_step(root, "r", "latest", backend) == (5, "local")
    step, _ = restore(config(tmp_path, root, remote), "r", "latest", tmp_path / "out")
    assert step == 5


def test_a_step_still_on_disk_has_nothing_to_restore(copies: tuple[Path, Path],
                                                     tmp_path: Path) -> None:
    root, remote = copies
    w.write_single(root, 11)
    write_latest(root, 11, root / "model_step_11.pt")
    with pytest.raises(NotFound, match="step 11 .* present locally at .*model_step_11.pt"):
        restore(config(tmp_path, root, remote), "r", "latest", tmp_path / "out")
    with pytest.raises(NotFound, match="present locally"):
        restore(config(tmp_path, root, None), "r", 11, tmp_path / "out")


def test_nothing_to_restore_says_where_it_looked(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    with pytest.raises(NotFound, match=r"no copy of step 4 of 'r'.*objects.*file://"):
        restore(config(tmp_path, root, tmp_path / "remote"), "r", 4, tmp_path / "out")
    with pytest.raises(NotFound, match="no step of 'r' .*no upload.url"):
        restore(config(tmp_path, root, None), "r", "latest", tmp_path / "out")
    with pytest.raises(NotFound, match="no root named 'x'"):
        restore(config(tmp_path, root, None), "x", "latest", tmp_path / "out")


def test_megatron_restore_writes_a_tracker_naming_the_restored_iteration(tmp_path: Path) -> None:
    """Megatron resumes from what `latest_checkpointed_iteration.txt` names, and the tracker
    belongs to no checkpoint: restoring iteration 100 while the root's tracker names 200 must
    still give a dir that resumes from 100, from the local copy or the remote alike."""
    root, remote = tmp_path / "root", tmp_path / "remote"
    for iteration in (100, 200):
        w.write_megatron(root, iteration)
    tracker = "latest_checkpointed_iteration.txt"
    assert (root / tracker).read_text() == "200"
    manifests = {c.step: stage(root, c, "zstd") for c in detect(root)}
    assert all(tracker not in {f.path for f in m.files} for m in manifests.values())
    upload(LocalBackend(remote), root, manifests[100])
    cfg = config(tmp_path, root, remote)

    out = tmp_path / "local"
    out.mkdir()
    (out / tracker).write_text("200")  # a later iteration named there already
    step, paths = restore(cfg, "r", 100, out)
    assert step == 100 and paths[-1] == out / tracker  # moved into place last
    assert (out / tracker).read_bytes() == b"100"  # Megatron-LM's own form: no newline
    assert_same(root, out, manifests[100])
    assert [(c.layout, c.step, c.complete) for c in detect(out)] == [("megatron", 100, True)]

    os.rename(objects_dir(root, 100), tmp_path / "elsewhere")  # only remote now
    step, paths = restore(cfg, "r", 100, tmp_path / "remote-out")
    assert (tmp_path / "remote-out" / tracker).read_bytes() == b"100"
    assert sorted(p.relative_to(tmp_path / "remote-out").as_posix() for p in paths) == sorted(
        [*(f.path for f in manifests[100].files), tracker])


def test_only_megatron_restores_a_pointer() -> None:
    from ckptd import layouts

    files = ("run/iter_0000100/mp_rank_00/model_optim_rng.pt", "run/iter_0000100/common.pt")
    assert layouts.pointer_files("megatron", files) == {
        "run/latest_checkpointed_iteration.txt": b"100"}
    assert layouts.pointer_files("megatron", ("iter_0000000/common.pt",)) == {
        "latest_checkpointed_iteration.txt": b"0"}
    assert layouts.pointer_files("megatron", ("notes/readme.txt",)) == {}
    assert layouts.pointer_files("dcp", ("iter_0000100/.metadata",)) == {}


def test_restore_reports_cumulative_progress(copies: tuple[Path, Path], tmp_path: Path) -> None:
    root, remote = copies
    seen: list[tuple[int, int]] = []
    restore(config(tmp_path, root, remote), "r", 9, tmp_path / "out",
            progress=lambda done, total: seen.append((done, total)))
    total = (root / "model_step_9.pt").stat().st_size
    assert seen[0] == (0, total) and seen[-1] == (total, total)


def test_deepspeed_restore_writes_latest_naming_the_restored_tag(tmp_path: Path) -> None:
    """DeepSpeed loads the tag its `latest` names; `latest` is shared by every step, so it is
    no member of any: restore writes it, naming the step restored even when the run's own
    `latest` had moved on, so `engine.load_checkpoint(DIR)` resumes there."""
    root = tmp_path / "root"
    w.write_deepspeed(root, 100, world_size=2)
    w.write_deepspeed(root, 200, world_size=2)  # `latest` now names global_step200
    [cand] = [c for c in detect(root) if c.step == 100]
    assert "latest" not in cand.files
    manifest = stage(root, cand, "zstd")
    out = tmp_path / "out"
    step, paths = restore(config(tmp_path, root, None), "r", 100, out)
    assert step == 100 and paths[-1] == out / "latest"
    assert (out / "latest").read_bytes() == b"global_step100"
    assert_same(root, out, manifest)
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()) == \
        sorted([*cand.files, "latest"])
    (out / "latest").write_text("global_step200")  # a restore replaces a stale one
    restore(config(tmp_path, root, None), "r", 100, out)
    assert (out / "latest").read_text() == "global_step100"


# --- progress bar --------------------------------------------------------------------------


def test_progress_bar_only_on_a_terminal() -> None:
    assert tty_progress(io.StringIO()) is None
    master, slave = os.openpty()
    try:
        with open(slave, "w", closefd=False) as tty:
            draw = tty_progress(tty)
            assert draw is not None
            draw(0, 2048)
            draw(2048, 2048)
        out = ""
        while "\n" not in out and select.select([master], [], [], 5)[0]:
            out += os.read(master, 4096).decode()
    finally:
        os.close(master)
        os.close(slave)
    assert "0.0%" in out and "100.0%" in out and "2KiB / 2KiB" in out
