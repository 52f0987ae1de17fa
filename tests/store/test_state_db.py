"""The state database as input: a corrupt or truncated one is refused in one line and never
repaired into an empty one; one deleted while the daemon runs stops all acting; pins outlive
its loss. The real `ckptd run` or a real daemon in the test process."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from support import Harness
from support.config import render_config
from writers import save_torch


@pytest.mark.parametrize("content", [b"", b"this is not a database" * 100,
                                     b"SQLite format 3\x00" + b"\xff" * 4000])
def test_a_corrupt_or_truncated_state_db_is_refused_in_one_line(tmp_path: Path, short_dir: Path,
                                                                 content: bytes) -> None:
    state = tmp_path / "state"
    state.mkdir()
    (state / "state.db").write_bytes(content)
    cfg = tmp_path / "c.toml"
    cfg.write_text(render_config({"state_dir": str(state), "socket": str(short_dir / "s")},
                                 [{"name": "r", "path": str(tmp_path / "ckpt")}]))
    done = subprocess.run([sys.executable, "-m", "ckptd", "run", "--config", str(cfg)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 78, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr
    assert str(state / "state.db") in done.stderr
    assert (state / "state.db").read_bytes() == content  # never "repaired" into an empty one


def test_a_state_db_deleted_while_running_stops_all_acting(h: Harness) -> None:
    save_torch(h.root / "model_step_1.pt")
    assert h.client.wait("r", 1, until="valid", timeout=30)
    h.daemon.store.path.unlink()
    h.daemon.health.check_state()  # the main loop's beat, run now
    health = h.client.health()
    assert health is not None and health["status"] == "degraded"
    assert "was deleted" in health["problem"]
    assert not h.daemon.health.healthy()  # the watchdog is not fed: systemd restarts the daemon
    stopped = {s["name"] for s in health["services"] if s["state"] == "stopped"}
    assert {"scan", "retention", "worker-0"} <= stopped  # their threads have ended
    scans = h.client.status()["scans"]  # type: ignore[index]
    save_torch(h.root / "model_step_2.pt")  # nothing acts any more, woken or not
    h.daemon.scanner.wake()
    assert h.client.latest("r")["step"] == 1  # type: ignore[index]
    assert h.client.status()["scans"] == scans  # type: ignore[index]


def test_pins_survive_the_loss_of_the_state_db(tmp_path: Path, short_dir: Path) -> None:
    h = Harness(tmp_path, short_dir, retention={"local": {"keep_last": 1, "keep_best": 0}})
    h.daemon.start()
    try:
        save_torch(h.root / "model_step_1.pt")
        assert h.client.wait("r", 1, until="valid", timeout=30)
        assert h.client.pin("r", 1)
        assert json.loads((h.root / ".ckptd" / "pins.json").read_text())["steps"] == [1]
    finally:
        h.daemon.stop(grace=5)
    (tmp_path / "state" / "state.db").unlink()
    for extra in (tmp_path / "state").glob("state.db-*"):
        extra.unlink()
    h2 = Harness(tmp_path, short_dir, retention={"local": {"keep_last": 1, "keep_best": 0}})
    h2.daemon.start()
    try:
        save_torch(h2.root / "model_step_2.pt")
        save_torch(h2.root / "model_step_3.pt")
        assert h2.client.wait("r", 3, until="valid", timeout=30)
        assert h2.client.wait("r", 1, until="valid", timeout=30)
        rec = h2.daemon.store.checkpoint("r", 1)
        assert rec is not None and rec.pinned
        h2.daemon.retention.apply_now(h2.daemon.roots()["r"])
        assert (h2.root / "model_step_1.pt").exists()  # keep_last = 1, but pinned
    finally:
        h2.daemon.stop(grace=5)
