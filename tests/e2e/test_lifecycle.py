"""The daemon's life end to end, with real torch checkpoints: SIGTERM in the middle of a long
validation (a `ckptd run` process), and in the test process: local compressed copies replacing
older checkpoints and restored byte for byte, reloads (a root added; a bad config refused; the
SIGHUP that triggers one is covered in test_systemd), and a disk too full for a compressed copy."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from support.ckpts import save_single
from support.config import root_table
from support.published import published_step
from support.wait import WaitTimeout, wait_scans, wait_until
from support.wire import cli

from ckptd.client import Client


def file_remote(path: Path) -> dict[str, Any]:
    return {"url": f"file://{path}"}


def temp_leftovers(root: Path) -> list[Path]:
    return sorted(p for p in (root / ".ckptd").rglob("*") if p.name.startswith(".ckptd-tmp-"))


# --- a. SIGTERM while a long stage runs ------------------------------------------------------


def test_sigterm_during_long_validation(daemon_factory: Any, tmp_path: Path) -> None:
    if shutil.disk_usage(tmp_path).free < 3 << 30:
        pytest.skip("needs 3 GB free for a 320 MiB checkpoint, its copy and its upload")
    # Uploading makes validation stage a compressed copy in the same pass: a stop mid-stage
    # could leave half of it behind. The daemon either finishes the stage within its grace
    # period or leaves it to be redone after the restart; both must end whole.
    d = daemon_factory(roots=[{"name": "r1", "upload": file_remote(tmp_path / "remote")}])
    root = d.roots["r1"]
    torch.save({"w": torch.randn(80 * 1024 * 1024)}, root / "model_step_1.pt")  # 320 MiB

    def validating() -> bool:
        st = Client(d.socket, timeout=2).status() or {}
        return any(w["step"] == 1 and w["stage"] == "validate" and w["done_bytes"] > 0
                   for w in st.get("in_flight", []))

    wait_until(validating, 30, "step 1 validating", detail=lambda: d.log_text()[-4000:])
    assert d.proc is not None
    t0 = time.monotonic()
    d.proc.send_signal(signal.SIGTERM)
    try:
        rc = d.proc.wait(25)
    except subprocess.TimeoutExpired:
        d.proc.kill()
        raise AssertionError(f"no exit within the grace period\n{d.log_text()[-3000:]}"
                             ) from None
    stopped_in = time.monotonic() - t0
    assert rc == 0, d.log_text()[-3000:]
    assert stopped_in < 22, stopped_in
    assert d.events("daemon_stopping") and d.events("daemon_stopped")
    assert not d.socket.exists()

    d.start()
    rec = d.wait_for("r1", 1, timeout=60)
    assert rec["state"] == "valid", rec
    assert d.client.wait("r1", 1, until="uploaded", timeout=60), d.log_text()[-3000:]
    assert d.client.latest("r1")["step"] == 1  # type: ignore[index]
    # "uploaded" is recorded before the worker drops the copy made for the upload (renamed
    # to a temp name, then removed) and publishes latest.json: only a daemon done with its
    # work has nothing temporary left, so look after a graceful stop, not between the two.
    assert d.stop() == 0, d.log_text()[-3000:]
    assert temp_leftovers(root) == []
    assert not list((tmp_path / "remote").rglob(".ckptd-tmp-*"))


def test_a_stop_past_its_grace_cancels_the_stage_and_leaves_no_staging(inproc_daemon: Any,
                                                                       tmp_path: Path) -> None:
    """A stage still running when the stop's grace ends is cancelled at its next chunk: its
    staging dir is removed then, not left behind for the next start to find."""
    d = inproc_daemon(roots=[{"name": "r1", "upload": file_remote(tmp_path / "remote")}])
    root = d.roots["r1"]
    torch.save({"w": torch.randn(32 * 1024 * 1024)}, root / "model_step_1.pt")  # 128 MiB

    def staging() -> bool:
        st = Client(d.socket, timeout=2).status() or {}
        return any(w["stage"] == "validate" and w["done_bytes"] > 0
                   for w in st.get("in_flight", [])) and bool(temp_leftovers(root))

    wait_until(staging, 30, "step 1 validating into a staging dir",
               detail=lambda: d.log_text()[-4000:])
    t0 = time.monotonic()
    d.stop(grace=0.0)
    assert time.monotonic() - t0 < 5
    assert d.events("stage_cancelled")[-1]["step"] == 1
    assert not d.events("stage_failed")  # a cancel is not a failure: no backoff after restart
    assert temp_leftovers(root) == []
    d.start()
    assert d.wait_for("r1", 1, timeout=60)["state"] == "valid"
    assert d.client.wait("r1", 1, until="uploaded", timeout=60), d.log_text()[-3000:]


# --- b. compress_older -----------------------------------------------------------------------


def test_compress_older_replaces_originals_and_restores(inproc_daemon: Any,
                                                        tmp_path: Path) -> None:
    remote = tmp_path / "remote"
    d = inproc_daemon(roots=[{
        "name": "r1", "upload": file_remote(remote),
        # keep_within keeps every step; compress_older turns the kept ones beyond the
        # newest keep_last into compressed copies (a copy no rule keeps is deleted instead).
        "retention": {"local": {"keep_last": 1, "keep_best": 0, "keep_within": "1h",
                                "compress_older": True, "min_free": "0"}},
    }])
    root = d.roots["r1"]
    c = d.client
    originals = {}
    for step in (1, 2, 3):
        originals[step] = save_single(root, step, n=256).read_bytes()
        assert d.wait_for("r1", step)["state"] == "valid"
        assert c.wait("r1", step, until="uploaded", timeout=60), d.log_text()[-3000:]

    def settled() -> dict[int, str] | None:
        local = {x["step"]: x["local"] for x in c.checkpoints("r1") or []}
        return local if local == {1: "compressed", 2: "compressed", 3: "present"} else None

    wait_until(settled, 30, "steps 1, 2 compressed and 3 present",
               detail=lambda: d.log_text()[-4000:])
    # The row says "compressed" just before the originals move into the trash (a crash between
    # leaves them beside the copy, finished at the next run): wait for the move.
    wait_until(lambda: not any((root / f"model_step_{s}.pt").exists() for s in (1, 2)), 30,
               "the originals of steps 1 and 2 gone", detail=lambda: d.log_text()[-4000:])
    for step in (1, 2):
        assert not (root / f"model_step_{step}.pt").exists()
        assert (root / ".ckptd" / "objects" / f"step-{step}" / "MANIFEST.json").is_file()
    assert (root / "model_step_3.pt").read_bytes() == originals[3]
    assert {x["step"]: x["remote"] for x in c.checkpoints("r1") or []} == {
        1: "uploaded", 2: "uploaded", 3: "uploaded"}

    out = tmp_path / "restored"
    r = cli("restore", "r1", "1", "--to", str(out), config=d.config)
    assert r.returncode == 0, r.stderr
    assert (out / "model_step_1.pt").read_bytes() == originals[1]
    # The local copy alone is enough: with the remote gone, step 2 still comes back whole.
    away = remote.rename(tmp_path / "remote-away")
    r = cli("restore", "r1", "2", "--to", str(out), config=d.config)
    assert r.returncode == 0, r.stderr
    assert (out / "model_step_2.pt").read_bytes() == originals[2]
    away.rename(remote)

    r = cli("latest", "r1", "--json", sock=d.socket)
    assert r.returncode == 0 and json.loads(r.stdout)["step"] == 3


# --- c. SIGHUP reloads -----------------------------------------------------------------------


def test_reload_adds_a_root_and_refuses_a_bad_config(inproc_daemon: Any,
                                                     tmp_path: Path) -> None:
    d = inproc_daemon()
    save_single(d.roots["r1"], 1)
    assert d.wait_for("r1", 1)["state"] == "valid"

    r2 = tmp_path / "roots" / "r2"
    r2.mkdir(parents=True)
    good = d.config.read_text() + root_table("r2", r2)
    d.config.write_text(good)
    assert d.reload() is True
    reloaded = d.events("config_reloaded")
    assert reloaded[-1]["added"] == ["r2"]
    save_single(r2, 5)
    rec = d.wait_for("r2", 5)
    assert (rec["state"], rec["layout"]) == ("valid", "single")
    assert d.client.latest("r2")["step"] == 5  # type: ignore[index]
    assert published_step(r2) == 5

    d.config.write_text(good.replace("[daemon]\n", "[daemon]\nno_such_key = 1\n"))
    assert d.reload() is False
    rejected = d.events("config_reload_rejected")
    assert "no_such_key" in rejected[-1]["error"]
    assert len(d.events("config_reloaded")) == 1
    assert d.client.health()["status"] == "ok"  # type: ignore[index]
    save_single(d.roots["r1"], 2)
    save_single(r2, 6)
    assert d.wait_for("r1", 2)["state"] == "valid"
    assert d.wait_for("r2", 6)["state"] == "valid"
    assert [x["name"] for x in d.client.status()["roots"]] == ["r1", "r2"]  # type: ignore[index]


# --- d. no room for the compressed copy ------------------------------------------------------


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """An 8 MiB tmpfs mounted for the test (root only), unmounted whatever happens."""
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mnt)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {r.stderr.strip()}")
    try:
        yield mnt
    finally:
        def unmounted() -> bool:  # busy while anything still has a file open there: retry
            return subprocess.run(["umount", str(mnt)], capture_output=True).returncode == 0

        try:
            wait_until(unmounted, 5, f"umount {mnt}", interval=0.1)
        except WaitTimeout:
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def test_no_room_for_the_copy_defers_it_and_keeps_serving(small_tmpfs: Path,
                                                          inproc_daemon: Any,
                                                          tmp_path: Path) -> None:
    # small_tmpfs comes first, so it is unmounted after the daemon has stopped.
    root_dir = small_tmpfs / "r1"
    d = inproc_daemon(roots=[{"name": "r1", "path": str(root_dir),
                               "upload": file_remote(tmp_path / "remote"),
                               "compress": {"codec": "none"}}])
    # Something else fills 3 MiB of the 8 MiB, then a 3 MiB incompressible checkpoint fits but
    # its (uncompressed, codec "none") copy does not.
    (root_dir / "train.log").write_bytes(os.urandom(3 << 20))
    g = torch.Generator().manual_seed(0)
    noise = torch.randint(0, 256, (3 << 20,), dtype=torch.uint8, generator=g)
    torch.save({"w": noise}, root_dir / "model_step_1.pt")
    assert shutil.disk_usage(small_tmpfs).free < 3 << 20

    rec = d.wait_for("r1", 1, timeout=30)
    assert rec["state"] == "valid", rec
    deferred = d.wait_event("compressed_copy_deferred", 10)
    assert deferred[0]["step"] == 1
    assert d.client.latest("r1")["step"] == 1  # type: ignore[index]
    assert published_step(root_dir) == 1
    wait_until(lambda: [e for e in d.events("stage_failed") if e["kind"] == "DiskFull"], 10,
               "a compress retry failing for space", detail=lambda: d.log_text()[-4000:])
    for _ in range(2):  # the daemon keeps serving, scan after scan, while no copy can be made
        assert d.client.health()["status"] == "ok"  # type: ignore[index]
        assert d.client.checkpoint("r1", 1)["state"] == "valid"  # type: ignore[index]
        wait_scans(d.client, wake=d.wake_scan)
    assert temp_leftovers(root_dir) == []

    # Room again: a retry makes the copy and the step goes up after all.
    (root_dir / "train.log").unlink()
    assert d.client.wait("r1", 1, until="uploaded", timeout=30), d.log_text()[-3000:]
    assert (root_dir / "model_step_1.pt").stat().st_size > 3 << 20
    assert d.client.health()["status"] == "ok"  # type: ignore[index]
