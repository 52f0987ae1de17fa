"""The daemon's own inputs: the socket path never unlinks someone's file, and a step number past
any integer's range (or in foreign digits) never stalls a root. Against the real `ckptd run`
and a real daemon in the test process (real socket, real SQLite)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from support import Harness
from support.config import render_config
from writers import save_torch


def test_the_socket_path_never_unlinks_a_regular_file(tmp_path: Path, short_dir: Path) -> None:
    precious = short_dir / "model.pt"
    precious.write_bytes(b"weights")
    cfg = tmp_path / "c.toml"
    cfg.write_text(render_config({"state_dir": str(tmp_path / "state"),
                                  "socket": str(precious)},
                                 [{"name": "r", "path": str(tmp_path / "ckpt")}]))
    done = subprocess.run([sys.executable, "-m", "ckptd", "run", "--config", str(cfg)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 78, done.stderr
    assert precious.read_bytes() == b"weights"
    assert "not a socket" in done.stderr and "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


# -- steps ---------------------------------------------------------------------------------------


def test_a_huge_step_or_foreign_digits_never_stall_a_root(h: Harness) -> None:
    """A file named with a step of 2^63 or more, or with Arabic-Indic digits, is unrecognised
    (listed in status); the root's real checkpoints carry on."""
    save_torch(h.root / f"model_step_{2**63}.pt")
    save_torch(h.root / "model_step_\u0661\u0662.pt")
    (h.root / "step-99999999999999999999999").mkdir()
    save_torch(h.root / "model_step_7.pt")
    assert h.client.wait("r", 7, until="valid", timeout=30)
    status, doc = h.client.request("GET", "/v1/roots/r/checkpoints")
    steps = [c["step"] for c in doc["checkpoints"]]
    assert steps == [7]
    root = h.client.status()["roots"][0]  # type: ignore[index]
    assert f"model_step_{2**63}.pt" in root["unrecognised"]
    assert root["last_error"] is None
