"""What a new user meets first: the config is found the way the daemon finds its own, so a
resume on a fresh node needs no undocumented variable, and every command says which it used."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from support import Harness
from writers import save_torch


def test_restore_on_a_fresh_node_finds_ckptd_toml_in_the_working_dir(tmp_path: Path,
                                                                     short_dir: Path) -> None:
    h = Harness(tmp_path / "node1", short_dir, uploads=True)
    save_torch(h.root / "model_step_9.pt")
    h.daemon.start()
    try:
        assert h.client.wait("r", 9, until="uploaded", timeout=60)
    finally:
        h.daemon.stop(grace=5)
    fresh = tmp_path / "node2"
    fresh.mkdir()
    (fresh / "ckptd.toml").write_text(h.config_path.read_text())
    env = {k: v for k, v in os.environ.items() if k != "CKPTD_CONFIG"}
    done = subprocess.run([sys.executable, "-m", "ckptd", "restore", "r", "latest", "--to",
                           str(fresh / "resume")], cwd=fresh, env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert f"config {fresh / 'ckptd.toml'}" in done.stderr
    assert (fresh / "resume" / "model_step_9.pt").read_bytes() == (
        h.root / "model_step_9.pt").read_bytes()
