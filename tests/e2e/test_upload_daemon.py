"""The daemon end to end with uploads: file:// and a real S3 server (SeaweedFS), remote
awareness on a fresh node, restore from remote, flush, a re-save replacing its remote copy
(all with the daemon in the test process), and kill -9 mid-upload (a `ckptd run` process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from support.ckpts import flip_byte, save_single
from support.uploads import upload_cfg, wait_remote
from support.wait import wait_until

from ckptd.client import Client

pytest_plugins = ["s3server"]


def test_file_remote_upload_latest_remote_and_wait(inproc_daemon: Any, tmp_path: Path) -> None:
    remote = tmp_path / "remote"
    d = inproc_daemon(roots=[{"name": "r1", "upload": upload_cfg(f"file://{remote}")}])
    root = d.roots["r1"]
    save_single(root, 10)
    flip_byte(save_single(root, 20))
    c = d.client
    assert c.wait("r1", 10, until="uploaded", timeout=60)
    rec = wait_remote(c, "r1", 10)
    assert rec["stored_bytes"] > 0
    assert d.wait_for("r1", 20)["state"] == "invalid"
    manifest = json.loads((remote / "r1" / "step-10" / "MANIFEST.json").read_text())
    assert manifest["format"] == "ckptd-manifest/1" and manifest["step"] == 10
    assert not (remote / "r1" / "step-20").exists()  # invalid: never uploaded
    assert json.loads((remote / "r1" / "LATEST").read_text())["step"] == 10
    assert c.latest("r1", tier="remote")["step"] == 10  # type: ignore[index]
    # the local compressed copy served the upload and is gone (compress_older is off)
    assert not (root / ".ckptd" / "objects" / "step-10").exists()


def test_s3_fresh_node_lists_and_restores(inproc_daemon: Any, s3_server: Any, s3_url: str,
                                          tmp_path: Path) -> None:
    d = inproc_daemon(roots=[{"name": "r1", "upload": upload_cfg(s3_url, s3_server)}])
    root = d.roots["r1"]
    original = save_single(root, 7, n=256).read_bytes()
    assert d.client.wait("r1", 7, until="uploaded", timeout=60)
    d.stop()
    # A fresh node: same config, empty disk and state dir.
    import shutil

    shutil.rmtree(d.state_dir)
    shutil.rmtree(root)
    root.mkdir()
    d.start()
    ls = wait_until(lambda: d.client.checkpoints("r1") or [], 30, "r1 listing its remote steps")
    assert [(x["step"], x["state"], x["local"], x["remote"]) for x in ls] == [
        (7, "valid", "pruned", "uploaded")]
    assert d.client.latest("r1")["step"] == 7  # type: ignore[index]
    out = tmp_path / "restored"
    r = subprocess.run([sys.executable, "-m", "ckptd", "restore", "r1", "latest", "--to",
                        str(out), "--config", str(d.config)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    restored = out / "model_step_7.pt"
    assert restored.read_bytes() == original  # byte for byte
    assert torch.load(restored, weights_only=True)["step"] == 7
    # ckptd.torch.load of "latest" on the fresh node restores from the remote first
    import ckptd.torch as ct

    os.environ["CKPTD_CONFIG"] = str(d.config)
    try:
        model = torch.nn.Linear(256, 256)
        step, meta = ct.load(root, "latest", model=model, client=d.client)
    finally:
        del os.environ["CKPTD_CONFIG"]
    assert step == 7
    assert torch.equal(model.weight, torch.load(restored, weights_only=True)["model"]["weight"])


def test_kill9_mid_upload_then_restart_completes(daemon_factory: Any, s3_server: Any,
                                                 s3_url: str, fault_proxy: Any) -> None:
    fault_proxy.set("slow", bytes_per_s=2_000_000)
    slow = type("S", (), {"endpoint": fault_proxy.endpoint, "region": s3_server.region,
                          "access_key": s3_server.access_key,
                          "secret_key": s3_server.secret_key})()
    d = daemon_factory(roots=[{"name": "r1", "upload": upload_cfg(
        s3_url, slow, part_size="5MiB", concurrency=2), "compress": {"codec": "none"}}])
    root = d.roots["r1"]
    torch.save({"w": torch.randn(4 * 1024 * 1024)}, root / "model_step_1.pt")  # 16 MiB
    def uploading() -> bool:
        # The object is larger than a part: it goes up early, as a multipart upload that the
        # upload stage waits for (its done_bytes stay 0 meanwhile): either is an upload under way.
        st = Client(d.socket, timeout=2).status() or {}
        return any(w["stage"] == "upload" for w in st.get("in_flight", []))

    wait_until(uploading, 60, "an upload under way", detail=lambda: d.log_text()[-3000:])
    d.kill9()
    from ckptd.backends import make_backend

    direct = make_backend(s3_url, endpoint=s3_server.endpoint, region=s3_server.region,
                          access_key_id=s3_server.access_key,
                          secret_access_key=s3_server.secret_key)
    keys = [m.key for m in direct.list("r1")]
    assert not any(k.endswith("MANIFEST.json") for k in keys)  # half-uploaded: no commit
    fault_proxy.set("pass")
    d.start()
    assert d.client.wait("r1", 1, until="uploaded", timeout=90), d.log_text()[-3000:]
    keys = [m.key for m in direct.list("r1")]
    assert "r1/step-1/MANIFEST.json" in keys
    assert d.client.checkpoint("r1", 1)["remote"] == "uploaded"  # type: ignore[index]
    assert os.path.exists(root / "model_step_1.pt")


def test_flush_puts_the_newest_valid_step_first(s3_server: Any, s3_url: str, fault_proxy: Any,
                                                inproc_daemon: Any) -> None:
    """SIGUSR1 / POST /v1/flush: the newest valid step of each uploading root goes to the
    front; `ckptd status` shows it until it is uploaded. (SIGUSR1 reaching the flush is
    test_daemon's test_signals_flush_then_exit_zero_and_remove_socket. The daemon comes
    after the proxy among the fixtures, so it stops before the proxy goes away.)"""
    fault_proxy.set("status", count=10_000, status=503)  # the remote is down for now
    down = type("S", (), {"endpoint": fault_proxy.endpoint, "region": s3_server.region,
                          "access_key": s3_server.access_key,
                          "secret_key": s3_server.secret_key})()
    d = inproc_daemon(roots=[{"name": "r1", "upload": upload_cfg(s3_url, down)}])
    root = d.roots["r1"]
    for step in (1, 2, 3):
        save_single(root, step)
        d.wait_for("r1", step)
    c = d.client
    flushed = c.request_json("POST", "/v1/flush")
    assert flushed == {"flushing": [{"root": "r1", "step": 3}]}
    assert c.status()["flushing"] == [{"root": "r1", "step": 3}]  # type: ignore[index]
    fault_proxy.set("pass")
    assert c.wait("r1", 3, until="uploaded", timeout=120), d.log_text()[-3000:]
    wait_until(lambda: c.status()["flushing"] == [], 30,  # type: ignore[index]
               "the flush to end")
    assert c.status()["flushing"] == []  # type: ignore[index]
    assert d.events("flush_done")
    assert d.request_flush() == {}  # nothing left to put first
    assert len(d.events("flush_requested")) == 2


def test_resave_of_an_uploaded_step_replaces_the_remote_copy(inproc_daemon: Any,
                                                             tmp_path: Path) -> None:
    """A rollback re-saves step 4 after its first save was uploaded: the later save wins
    remotely too (no endless 'already committed' retries, no stale bytes on restore)."""
    remote = tmp_path / "remote"
    d = inproc_daemon(roots=[{"name": "r1", "upload": upload_cfg(f"file://{remote}")}])
    root = d.roots["r1"]
    p = save_single(root, 4)
    c = d.client
    assert c.wait("r1", 4, until="uploaded", timeout=60)
    first = json.loads((remote / "r1" / "step-4" / "MANIFEST.json").read_text())
    torch.save({"w": torch.arange(1000.0)}, p)  # the re-save (another size: seen as changed)
    new_bytes = p.read_bytes()

    def replaced() -> bool:
        try:  # absent for a moment: the old step is deleted (manifest first) before re-upload
            m = json.loads((remote / "r1" / "step-4" / "MANIFEST.json").read_text())
        except FileNotFoundError:
            m = first
        return bool(m["files"][0]["hash"] != first["files"][0]["hash"])

    wait_until(replaced, 60, "the remote step 4 replaced", detail=lambda: d.log_text()[-3000:])
    assert c.wait("r1", 4, until="uploaded", timeout=60)
    out = tmp_path / "out"
    from ckptd.backends import make_backend
    from ckptd.fetch.source import read_remote_manifest
    from ckptd.restore.files import restore_remote

    backend = make_backend(f"file://{remote}")
    restore_remote(backend, read_remote_manifest(backend, "r1", 4), out)
    assert (out / "model_step_4.pt").read_bytes() == new_bytes
    assert d.events("remote_step_replaced")


def test_a_start_removes_the_temp_file_of_a_crashed_file_put(inproc_daemon: Any,
                                                             tmp_path: Path) -> None:
    """A process killed mid-put leaves its temp file in the file:// remote: the next daemon
    start removes it once stale, and the finished object beside it stays."""
    from ckptd.backends import LocalBackend
    from ckptd.backends.localfiles import TMP_MARK
    from ckptd.service.recovery import STALE_PUT_S

    remote = tmp_path / "remote"
    LocalBackend(remote).put("r1/kept", b"finished")
    writer = subprocess.Popen([sys.executable, "-c", "import sys\n"
                               "from ckptd.backends import LocalBackend\n"
                               f"LocalBackend({str(remote)!r}).put('r1/cut', sys.stdin.buffer)\n"],
                              stdin=subprocess.PIPE)
    assert writer.stdin is not None
    writer.stdin.write(b"x" * 4096)  # the put reads to EOF, which never comes
    writer.stdin.flush()
    temps = wait_until(lambda: [p for p in (remote / "r1").iterdir() if TMP_MARK in p.name],
                       30, "the put's temp file")
    writer.kill()
    writer.wait()
    writer.stdin.close()
    old = time.time() - STALE_PUT_S - 60
    os.utime(temps[0], (old, old))
    d = inproc_daemon(roots=[{"name": "r1", "upload": upload_cfg(f"file://{remote}")}])
    assert d.events("daemon_recovered")[-1]["temp_files_removed"] >= 1
    assert sorted(p.name for p in (remote / "r1").iterdir()) == ["kept"]
    assert (remote / "r1" / "kept").read_bytes() == b"finished"


def test_a_put_temp_files_age_is_judged_by_the_daemons_clock(inproc_daemon: Any,
                                                             tmp_path: Path) -> None:
    """Start-up recovery judges a put's temp file stale by the daemon's clock: one written just
    now is left to a put that may still be writing it, and the same file at a start an hour
    later on that clock (moved, not waited for) is removed."""
    from support.clock import FakeClock

    from ckptd.backends.localfiles import TMP_MARK
    from ckptd.service.recovery import STALE_PUT_S

    (tmp_path / "remote" / "r1").mkdir(parents=True)
    temp = tmp_path / "remote" / "r1" / f".cut{TMP_MARK}0123456789ab"
    temp.write_bytes(b"x" * 4096)
    roots = [{"name": "r1", "upload": upload_cfg(f"file://{tmp_path / 'remote'}")}]
    clock = FakeClock(running=True)
    d = inproc_daemon(roots=roots, clock=clock)
    assert d.events("daemon_recovered")[-1]["temp_files_removed"] == 0 and temp.exists()
    d.stop()
    clock.advance(STALE_PUT_S + 60)
    d.start()
    assert d.events("daemon_recovered")[-1]["temp_files_removed"] >= 1
    assert not temp.exists()
