"""A root given as a link: the link is followed once, when the config is read (start, reload),
and every component acts on the directory it names; no link below a root is ever followed. A
root that cannot act is not ok in health, `ckptd status`, the readiness probe and `doctor`.
Real `ckptd run` processes, real torch files, a real file:// remote."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from support.ckpts import save_single
from support.config import write_layout
from support.proc import DaemonHandle
from support.wait import wait_until

from ckptd.client import Client
from ckptd.config import load_config

KEEP_TWO = {"local": {"keep_last": 2, "keep_best": 0, "min_free": "0"}}


def _ckptd(*argv: str) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([sys.executable, "-m", "ckptd", *argv], capture_output=True,
                          text=True, timeout=120)
    assert "Traceback" not in done.stderr, done.stderr
    return done


def _health(d: DaemonHandle) -> dict[str, Any]:
    doc = Client(d.socket, timeout=5.0, strict=True).health()
    assert doc is not None
    return doc


def _root_status(d: DaemonHandle) -> dict[str, Any]:
    doc = Client(d.socket, timeout=5.0, strict=True).status()
    assert doc is not None
    (root,) = doc["roots"]
    return root  # type: ignore[no-any-return]


def _record(d: DaemonHandle, step: int) -> dict[str, Any] | None:
    return Client(d.socket, timeout=5.0).checkpoint("r", step)


def test_a_root_given_as_a_link_is_acted_on_end_to_end(tmp_path: Path,
                                                       short_dir: Path) -> None:
    """Discovered, validated, uploaded to file://, leased and pruned: the lease, latest.json,
    the copies and the trash all live in the directory the link names."""
    real, remote = tmp_path / "real", tmp_path / "remote"
    real.mkdir()
    link = tmp_path / "root-link"
    link.symlink_to(real)
    (tmp_path / "d").mkdir()
    layout = write_layout(tmp_path / "d", short_dir / "d.sock",
                          [{"name": "r", "path": link, "upload": {"url": f"file://{remote}"},
                            "retention": KEEP_TWO}])
    d = DaemonHandle(layout, tmp_path / "d" / "daemon.log")
    try:
        d.start()
        wait_until(lambda: _root_status(d)["acting"], 30, "the root's lease taken")
        for step in (1, 2, 3, 4):
            save_single(link, step)  # the trainer writes through the link
            d.wait_for("r", step, "valid")
        wait_until(lambda: all((_record(d, s) or {}).get("remote") == "uploaded"
                               for s in (1, 2, 3, 4)), 60, "every step uploaded")
        assert sorted(p.parent.name for p in (remote / "r").rglob("MANIFEST.json")) == [
            "step-1", "step-2", "step-3", "step-4"]
        wait_until(lambda: not (real / "model_step_1.pt").exists()
                   and not (real / "model_step_2.pt").exists(), 60, "steps 1 and 2 pruned")
        assert (real / "model_step_3.pt").exists() and (real / "model_step_4.pt").exists()
        assert d.events("checkpoint_pruned")
        assert not d.events("lease_failed")
        lease = json.loads((real / ".ckptd" / "lease.json").read_text())
        assert lease["pid"] == d.proc.pid and not lease["released"]  # type: ignore[union-attr]
        latest = json.loads((real / ".ckptd" / "latest.json").read_text())
        assert latest["step"] == 4
        assert not link.is_symlink() or os.readlink(link) == str(real)  # the link untouched
        assert _root_status(d)["path"] == str(real)  # followed once, when the config was read
        assert load_config(layout.config).roots[0].path == real
        h = _health(d)
        assert h["status"] == "ok" and h["roots_not_acting"] == []
        assert _ckptd("probe", "ready", "--socket", str(d.socket)).returncode == 0
    finally:
        d.stop()


def test_a_link_below_the_root_is_never_followed(tmp_path: Path, short_dir: Path) -> None:
    """A root given as a link still follows no link inside it: a linked directory is never
    walked, a linked file out of the root is refused and never uploaded, and nothing is written
    where a link below the root points."""
    real, outside, remote = tmp_path / "real", tmp_path / "outside", tmp_path / "remote"
    real.mkdir()
    (outside / "step-9").mkdir(parents=True)
    save_single(outside / "step-9", 9)  # a checkpoint out of the root, reached by a link
    save_single(outside, 7)
    link = tmp_path / "root-link"
    link.symlink_to(real)
    (real / "linked-dir").symlink_to(outside)
    (tmp_path / "d").mkdir()
    layout = write_layout(tmp_path / "d", short_dir / "d.sock",
                          [{"name": "r", "path": link, "upload": {"url": f"file://{remote}"}}])
    d = DaemonHandle(layout, tmp_path / "d" / "daemon.log")
    try:
        d.start()
        wait_until(lambda: _root_status(d)["acting"], 30, "the root's lease taken")
        save_single(real, 1)
        (real / "model_step_7.pt").symlink_to(outside / "model_step_7.pt")
        d.wait_for("r", 1, "valid")
        rec = d.wait_for("r", 7, "invalid")
        assert "unsafe_path" in json.dumps(rec)
        wait_until(lambda: (_record(d, 1) or {}).get("remote") == "uploaded", 60,
                   "step 1 uploaded")
        assert _record(d, 9) is None  # the linked directory was never walked
        assert sorted(p.parent.name for p in (remote / "r").rglob("MANIFEST.json")) == [
            "step-1"]
        assert sorted(p.name for p in outside.iterdir()) == ["model_step_7.pt", "step-9"]
        assert sorted(p.name for p in (outside / "step-9").iterdir()) == ["model_step_9.pt"]
    finally:
        d.stop()


def test_a_root_that_cannot_act_is_not_ok_in_health_probe_status_and_doctor(
        tmp_path: Path, short_dir: Path) -> None:
    """The root's path did not exist when the config was read, and became a link afterwards:
    the daemon refuses to follow a link it did not resolve at load, so the root cannot act.
    That shows as `degraded` with the reason in /v1/health, `ckptd status`, `ckptd probe
    ready` and `ckptd doctor` (whose own look at the config would find nothing wrong); a
    reload follows the link and the root acts."""
    real, later = tmp_path / "real", tmp_path / "later"
    real.mkdir()
    (tmp_path / "d").mkdir()
    layout = write_layout(tmp_path / "d", short_dir / "d.sock",
                          [{"name": "r", "path": real}])
    text = layout.config.read_text().replace(f'"{real}"', f'"{later}"')
    layout.config.write_text(text)
    d = DaemonHandle(layout, tmp_path / "d" / "daemon.log")
    try:
        d.start()
        later.symlink_to(real)
        why = "became a symlink after the config was read"
        wait_until(lambda: why in json.dumps(_health(d)), 30, "the lease refusing the link")
        h = _health(d)
        assert h["status"] == "degraded"
        [bad] = h["roots_not_acting"]
        assert bad["root"] == "r" and why in bad["problem"]
        st = _root_status(d)
        assert not st["acting"] and why in (st["not_acting"] or "")
        text_status = _ckptd("status", "--socket", str(d.socket))
        assert "degraded" in text_status.stdout and "r: NOT ACTING" in text_status.stdout
        probe = _ckptd("probe", "ready", "--socket", str(d.socket))
        assert probe.returncode == 1 and "root r cannot act" in probe.stderr
        assert why in probe.stderr
        assert _ckptd("probe", "live", "--socket", str(d.socket)).returncode == 0
        doctor = _ckptd("doctor", "--config", str(layout.config), "--json", "--no-remote",
                        "--unit", str(tmp_path / "no.service"))
        checks = json.loads(doctor.stdout)["checks"]
        assert doctor.returncode == 1
        assert [c for c in checks if c["what"] == "root r" and c["status"] == "problem"
                and why in c["message"]]
        assert not (real / ".ckptd").exists()  # never acted through the late link

        d.signal(signal.SIGHUP)  # the reload follows the link now
        # The lease thread takes the root at its next look after the reload: until then the
        # root is neither a problem nor acting, so wait for both, not for health alone.
        wait_until(lambda: _health(d)["status"] == "ok" and _root_status(d)["acting"], 30,
                   "the root acting after reload")
        assert _health(d)["roots_not_acting"] == []
        assert _root_status(d)["acting"] and (real / ".ckptd" / "lease.json").exists()
        assert _ckptd("probe", "ready", "--socket", str(d.socket)).returncode == 0
    finally:
        d.stop()
