"""Orbax (orbax-checkpoint 0.12.8, JAX on the CPU) writes the checkpoints: CheckpointManager
with async saves, metrics and best_fn. A save killed mid-write is never valid; whole saves are
valid, ranked by the metrics Orbax saved (`<step>/metrics/metrics`), uploaded, restored byte
for byte, and Orbax itself restores from the restored copy."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from fw import files_of, kill_when, restore, run_ranks, same_files, start_ranks

from ckptd.client import Client


def test_a_whole_orbax_run_is_valid_ranked_uploaded_and_restores(inproc_daemon: Any,
                                                                tmp_path: Path) -> None:
    remote = tmp_path / "remote"
    d = inproc_daemon(roots=[{"name": "jx", "path": tmp_path / "ckpt", "metric": "loss",
                              "metric_mode": "min", "upload": {"url": f"file://{remote}"}}])
    root = d.roots["jx"]
    run_ranks("orbax_train.py", [str(root), "100", "200", "300"])
    for step in (100, 200, 300):
        d.wait_for("jx", step, "valid", timeout=60)
        assert d.client.wait("jx", step, until="uploaded", timeout=60)
    rec = d.client.checkpoint("jx", 300)
    assert rec is not None and rec["layout"] == "orbax"
    assert rec["metrics"] == {"loss": 0.3, "accuracy": 0.7}
    status = Client(d.socket).status()
    assert status is not None and status["roots"][0]["best"] == 200  # lowest loss, not latest
    assert (d.client.latest("jx") or {})["step"] == 300

    out = tmp_path / "restored"
    restore(d.config, "jx", 300, out)
    same_files(root, out, files_of(d, "jx", 300))
    (line,) = [ln for ln in run_ranks("orbax_train.py", [str(out), "--restore", "300"])[0]
               .splitlines() if ln.startswith("{")]
    assert json.loads(line) == {"step": 300, "same": True, "latest": 300}


def test_an_orbax_save_killed_mid_write_is_never_valid(inproc_daemon: Any,
                                                       tmp_path: Path) -> None:
    d = inproc_daemon(roots=[{"name": "jx", "path": tmp_path / "ckpt"}])
    root = d.roots["jx"]
    run_ranks("orbax_train.py", [str(root), "100"])
    d.wait_for("jx", 100, "valid", timeout=60)
    procs = start_ranks("orbax_train.py", [str(root), "200"])
    # Orbax writes into `200.orbax-checkpoint-tmp*` and renames it to `200` last: kill while
    # the temporary dir exists.
    kill_when(procs, lambda: any(p.name.startswith("200.orbax-checkpoint-tmp")
                                 for p in root.iterdir()))
    assert not (root / "200").exists()
    d.wake_scan()
    d.wait_for("jx", 100, "valid")
    rec = Client(d.socket).checkpoint("jx", 200)
    assert rec is None or rec["state"] != "valid"
    assert (d.client.latest("jx") or {})["step"] == 100
