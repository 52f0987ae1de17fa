"""The config as input: a deeply nested one on reload keeps the old one; numbers are bounded;
`metrics.listen` is checked as `run` uses it; a taken metrics port and a code-running trusted
global are one line and exit 78. The real `ckptd config check` and `ckptd run`."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from support import Harness
from support.config import render_config
from writers import save_torch


def test_a_deeply_nested_config_on_reload_keeps_the_old_one(h: Harness) -> None:
    h.config_path.write_text(h.config_path.read_text() + "x = " + "[" * 5000 + "]" * 5000 + "\n")
    assert not h.daemon.reload()
    assert h.client.health()["status"] == "ok"  # type: ignore[index]
    save_torch(h.root / "model_step_3.pt")
    assert h.client.wait("r", 3, until="valid", timeout=30)


@pytest.mark.parametrize(("key", "value", "says"), [
    ("workers", 100000000, "daemon.workers"),
    ("workers", 1e8, "daemon.workers"),
    ("scan_interval", "99999999999999d", "daemon.scan_interval"),
])
def test_numbers_in_the_config_are_bounded(tmp_path: Path, key: str, value: Any,
                                           says: str) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text(render_config({"state_dir": str(tmp_path / "s"), key: value},
                                 [{"name": "r", "path": str(tmp_path / "ckpt")}]))
    done = subprocess.run([sys.executable, "-m", "ckptd", "config", "check", str(cfg)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 78 and says in done.stderr, done.stderr


@pytest.mark.parametrize(("listen", "ok"), [
    ("127.0.0.1:9464", True), ("[::1]:9464", True), (":9464", True), ("localhost:9464", True),
    ("9464", False), ("127.0.0.1:", False), ("127.0.0.1:99999", False), ("1.2.3.4.5:80", False),
    ("host name:80", False), ("metrics.example:80", False), ("127.0.0.1:\u0661", False),
])
def test_metrics_listen_is_checked_as_run_uses_it(tmp_path: Path, listen: str,
                                                  ok: bool) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text(render_config({"state_dir": str(tmp_path / "s")},
                                 [{"name": "r", "path": str(tmp_path / "ckpt")}])
                   + f'\n[metrics]\nlisten = "{listen}"\n')
    done = subprocess.run([sys.executable, "-m", "ckptd", "config", "check", str(cfg)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == (0 if ok else 78), done.stderr
    if not ok:
        assert "metrics.listen" in done.stderr


def test_a_taken_metrics_port_is_one_line_and_exit_78(tmp_path: Path, short_dir: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        cfg = tmp_path / "c.toml"
        cfg.write_text(render_config({"state_dir": str(tmp_path / "s"),
                                      "socket": str(short_dir / "s.sock")},
                                     [{"name": "r", "path": str(tmp_path / "ckpt")}])
                       + f'\n[metrics]\nlisten = "127.0.0.1:{port}"\n')
        done = subprocess.run([sys.executable, "-m", "ckptd", "run", "--config", str(cfg)],
                              capture_output=True, text=True, timeout=60)
    assert done.returncode == 78, done.stderr
    assert "metrics.listen" in done.stderr and "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("name", ["pdb.run", "timeit.timeit", "_posixsubprocess.fork_exec",
                                  "os.system", "builtins.eval", "subprocess.Popen",
                                  "multiprocessing.Process", "signal.signal", "pty.spawn",
                                  "torch.load", "deepspeed.Thing.__reduce__"])
def test_a_code_running_trusted_global_is_refused(tmp_path: Path, name: str) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text(render_config({"state_dir": str(tmp_path / "s")},
                                 [{"name": "r", "path": str(tmp_path / "ckpt"),
                                   "trusted_globals": [name]}]))
    done = subprocess.run([sys.executable, "-m", "ckptd", "config", "check", str(cfg)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 78 and "never trusted" in done.stderr, done.stderr
