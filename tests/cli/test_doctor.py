"""`ckptd doctor`: each mistake a new setup makes is found and named with its fix; a sound
setup (a real daemon, a real S3 server) passes. Runs the real CLI."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support.ckpts import save_single
from support.config import render_config, without_disk_floor

from ckptd.cli import doctor
from ckptd.config import load_config

pytest_plugins = ["s3server"]

REPO = Path(__file__).resolve().parents[2]
UNIT = REPO / "systemd" / "ckptd.service"


def _doctor(cfg: Path, *extra: str) -> tuple[int, dict[str, Any]]:
    done = subprocess.run([sys.executable, "-m", "ckptd", "doctor", "--config", str(cfg),
                           "--json", *extra], capture_output=True, text=True, timeout=120)
    assert "Traceback" not in done.stderr, done.stderr
    return done.returncode, json.loads(done.stdout)


def _by_what(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["what"]: c for c in doc["checks"]}


def test_a_sound_setup_passes_with_a_real_s3_remote(tmp_path: Path, short_dir: Path,
                                                      s3_server: Any, s3_url: str) -> None:
    root = tmp_path / "ckpt"
    root.mkdir()
    save_single(root, 100)
    cfg = tmp_path / "c.toml"
    cfg.write_text(render_config(
        {"state_dir": str(tmp_path / "state"), "socket": str(short_dir / "s.sock")},
        [without_disk_floor({"name": "r", "path": str(root), "upload": {
            "url": s3_url, "endpoint": s3_server.endpoint, "region": s3_server.region,
            "access_key_id": s3_server.access_key,
            "secret_access_key": s3_server.secret_key}})]))
    rc, doc = _doctor(cfg, "--unit", str(tmp_path / "no.service"))
    checks = _by_what(doc)
    assert rc == 0 and doc["ok"], doc
    assert checks["root r remote"]["status"] == "ok"
    assert "create-only" in checks["root r remote"]["message"]
    assert "step 100" in checks["root r space"]["message"]
    assert checks["daemon"]["status"] == "warning"  # not running: said, not a problem
    assert checks["systemd unit"]["status"] == "skipped"
    assert not (root / ".ckptd").exists() or list((root / ".ckptd").iterdir()) == []


def test_each_mistake_is_named_with_its_fix(tmp_path: Path, short_dir: Path) -> None:
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    cfg = tmp_path / "c.toml"
    cfg.write_text(render_config(
        {"state_dir": str(a_file / "state"), "socket": str(short_dir / "s.sock"),
         "socket_group": "no-such-group-ckptd"},
        [{"name": "gone", "path": str(tmp_path / "missing")},
         {"name": "remote", "path": str(tmp_path / "ok"),
          "upload": {"url": "file:///proc/ckptd-not-writable"}}]))
    (tmp_path / "ok").mkdir()
    rc, doc = _doctor(cfg, "--unit", str(tmp_path / "no.service"))
    checks = _by_what(doc)
    assert rc == 1 and not doc["ok"]
    for what, says in [("state dir", "not a directory"),
                       ("socket group", "no-such-group-ckptd"),
                       ("root gone", "does not exist"),
                       ("root remote remote", "cannot write")]:
        assert checks[what]["status"] == "problem", checks[what]
        assert says in checks[what]["message"] and checks[what]["fix"], checks[what]
    text = subprocess.run([sys.executable, "-m", "ckptd", "doctor", "--config", str(cfg)],
                          capture_output=True, text=True, timeout=120).stdout
    assert "PROBLEM  root gone:" in text and "fix: create it" in text


def test_the_units_sandbox_hiding_a_root_is_found(tmp_path: Path, short_dir: Path) -> None:
    """The repository's own unit: PrivateTmp hides /tmp, ProtectSystem=strict makes a root
    read-only unless a drop-in lists it in ReadWritePaths=."""
    unit = tmp_path / "ckptd.service"
    unit.write_text(UNIT.read_text())
    data = Path("/srv/ckptd-doctor-test-root")
    cfg_text = render_config({"state_dir": str(tmp_path / "s"), "socket": str(short_dir / "s")},
                             [{"name": "t", "path": str(tmp_path / "r")}, {"name": "d",
                                                                     "path": str(data)}])
    config = load_config_text(tmp_path, cfg_text)
    checks = {c.what: c for c in doctor.unit_checks(config, unit)}
    assert checks["unit sandbox, root t"].status == "problem"
    assert "PrivateTmp" in checks["unit sandbox, root t"].message
    assert checks["unit sandbox, root d"].status == "problem"
    assert f"ReadWritePaths=-{data}" in checks["unit sandbox, root d"].fix
    drop = tmp_path / "ckptd.service.d"
    drop.mkdir()
    (drop / "roots.conf").write_text(f"[Service]\nReadWritePaths=-{data}\n")
    checks = {c.what: c for c in doctor.unit_checks(config, unit)}
    assert checks["unit sandbox, root d"].status == "ok"


def load_config_text(tmp_path: Path, text: str) -> Any:
    path = tmp_path / "doctor.toml"
    path.write_text(text)
    return load_config(path)


def test_every_command_says_what_it_does_with_an_example() -> None:
    from ckptd.cli.main import COMMANDS

    for name in COMMANDS:
        done = subprocess.run([sys.executable, "-m", "ckptd", name, "--help"],
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0 and "examples:" in done.stdout, (name, done.stdout)
        assert f"ckptd {name}" in done.stdout.split("examples:")[1], name


@pytest.fixture
def silent_endpoint() -> Iterator[str]:
    """An S3 endpoint that accepts connections and never answers."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(64)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        srv.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(srv.accept()[0])
            except OSError:
                continue

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{srv.getsockname()[1]}"
    finally:
        stop.set()
        t.join()
        for c in held:
            c.close()
        srv.close()


def test_a_remote_that_never_answers_is_said_in_bounded_time(
        tmp_path: Path, short_dir: Path, silent_endpoint: str) -> None:
    root = tmp_path / "ckpt"
    root.mkdir()
    cfg = tmp_path / "c.toml"
    cfg.write_text(render_config(
        {"state_dir": str(tmp_path / "state"), "socket": str(short_dir / "s.sock")},
        [{"name": "r", "path": str(root), "upload": {
            "url": "s3://bucket/p", "endpoint": silent_endpoint, "region": "us-east-1",
            "access_key_id": "k", "secret_access_key": "s"}}]))
    started = time.monotonic()
    rc, doc = _doctor(cfg, "--unit", str(tmp_path / "no.service"))
    assert time.monotonic() - started < 60
    check = _by_what(doc)["root r remote"]
    assert rc == 1 and check["status"] == "problem" and "cannot write" in check["message"]


def test_odd_files_where_doctor_looks_are_said_not_tracebacks(tmp_path: Path,
                                                              short_dir: Path) -> None:
    """lease.json a FIFO (reading it would block), a directory, or nested past the parser;
    a unit drop-in that is a directory; a config without roots. Nothing is removed."""
    roots = []
    for i, make in enumerate([lambda p: os.mkfifo(p), lambda p: p.mkdir(),
                              lambda p: p.write_bytes(b"[" * 60_000)]):
        root = tmp_path / f"ckpt{i}"
        (root / ".ckptd").mkdir(parents=True)
        make(root / ".ckptd" / "lease.json")
        roots.append({"name": f"r{i}", "path": str(root)})
    unit = tmp_path / "ckptd.service"
    unit.write_text(UNIT.read_text())
    (tmp_path / "ckptd.service.d" / "x.conf").mkdir(parents=True)
    cfg = tmp_path / "c.toml"
    daemon = {"state_dir": str(tmp_path / "state"), "socket": str(short_dir / "s.sock")}
    cfg.write_text(render_config(daemon, roots))
    rc, doc = _doctor(cfg, "--unit", str(unit))
    checks = _by_what(doc)
    for i in range(3):
        assert checks[f"root r{i} lease"]["status"] == "warning", checks
        assert (tmp_path / f"ckpt{i}" / ".ckptd" / "lease.json").exists()
    assert checks["systemd unit"]["status"] == "warning"
    assert "x.conf" in checks["systemd unit"]["message"]

    cfg.write_text(render_config(daemon, []))
    rc, doc = _doctor(cfg, "--unit", str(tmp_path / "no.service"))
    assert _by_what(doc)["roots"]["status"] == "warning" and doc["ok"]


@pytest.mark.parametrize(("env", "status", "says"), [
    ("auto", "ok", "c ("),
    ("numpy", "ok", "numpy (no compiled kernels: CKPTD_CODEC_KERNELS=numpy)"),
    ("avx9", "problem", "CKPTD_CODEC_KERNELS"),
])
def test_it_says_which_codec_kernels_run(tmp_path: Path, short_dir: Path, env: str,
                                         status: str, says: str) -> None:
    if env == "auto":
        pytest.importorskip("ckptd.codec._planes", reason="the compiled kernels are not built")
    cfg = tmp_path / "c.toml"
    cfg.write_text(render_config({"state_dir": str(tmp_path / "state"),
                                  "socket": str(short_dir / "s.sock")}, []))
    run_env = {**os.environ, "CKPTD_CODEC_KERNELS": env}
    done = subprocess.run([sys.executable, "-m", "ckptd", "doctor", "--config", str(cfg),
                           "--json", "--no-remote", "--unit", str(tmp_path / "no.service")],
                          capture_output=True, text=True, timeout=120, env=run_env)
    assert "Traceback" not in done.stderr, done.stderr
    doc = json.loads(done.stdout)
    check = _by_what(doc)["codec kernels"]
    assert check["status"] == status and says in check["message"], check
    assert doc["codec_kernels"] == check["message"]
    text = subprocess.run([sys.executable, "-m", "ckptd", "doctor", "--config", str(cfg),
                           "--no-remote", "--unit", str(tmp_path / "no.service")],
                          capture_output=True, text=True, timeout=120, env=run_env).stdout
    assert f"codec kernels: {check['message']}" in text
