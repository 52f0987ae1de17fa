"""Shared fixtures: a real ckptd daemon process on a real Unix socket, with its own config,
state dir and roots; stopped by PID at the end of each test, pass or fail."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from ckptd.client import Client

os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A short temp dir for sockets (AF_UNIX paths must stay under ~100 bytes)."""
    d = Path(tempfile.mkdtemp(prefix="ckd-", dir="/tmp"))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return repr(v)
    if isinstance(v, list):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    return '"' + str(v).replace("\\", "\\\\").replace('"', '\\"') + '"'


def render_config(daemon: dict[str, Any], roots: list[dict[str, Any]]) -> str:
    """A TOML config from plain dicts (nested dicts in a root become sub-tables)."""
    lines = ["[daemon]"] + [f"{k} = {toml_value(v)}" for k, v in daemon.items()]
    for r in roots:
        lines += ["", "[[roots]]"]
        lines += [f"{k} = {toml_value(v)}" for k, v in r.items() if not isinstance(v, dict)]
        for k, sub in r.items():
            if isinstance(sub, dict):
                lines += _subtable(f"roots.{k}", sub)
    return "\n".join(lines) + "\n"


def _subtable(name: str, d: dict[str, Any]) -> list[str]:
    lines = ["", f"[{name}]"]
    lines += [f"{k} = {toml_value(v)}" for k, v in d.items() if not isinstance(v, dict)]
    for k, sub in d.items():
        if isinstance(sub, dict):
            lines += _subtable(f"{name}.{k}", sub)
    return lines


@dataclass
class DaemonHandle:
    """A running `ckptd run` process and what it was started with."""

    base: Path
    config: Path
    socket: Path
    state_dir: Path
    roots: dict[str, Path]
    log: Path
    proc: subprocess.Popen[bytes] | None = None
    extra_env: dict[str, str] = field(default_factory=dict)

    @property
    def client(self) -> Client:
        return Client(self.socket, timeout=10.0, strict=True)

    def start(self, wait: bool = True) -> DaemonHandle:
        env = {**os.environ, **self.extra_env, "CKPTD_SOCKET": str(self.socket)}
        logf = open(self.log, "ab")  # noqa: SIM115 - handed to the child
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "ckptd", "run", "--config", str(self.config)],
            stdout=logf, stderr=subprocess.STDOUT, env=env,
        )
        logf.close()
        if wait:
            self.wait_ready()
        return self

    def wait_ready(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        c = Client(self.socket, timeout=1.0)
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise AssertionError(f"daemon exited {self.proc.returncode}:\n{self.log_text()}")
            if c.health() is not None:
                return
            time.sleep(0.05)
        raise AssertionError(f"daemon not ready in {timeout}s:\n{self.log_text()}")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int | None:
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(10)

    def kill9(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait(10)

    def log_text(self) -> str:
        try:
            return self.log.read_text(errors="replace")
        except OSError:
            return ""

    def wait_for(self, root: str, step: int, state: str = "valid", timeout: float = 30.0
                 ) -> dict[str, Any]:
        """Poll until `step` of `root` is in `state` (any terminal state is returned)."""
        deadline = time.monotonic() + timeout
        last = None
        while time.monotonic() < deadline:
            last = Client(self.socket, timeout=5.0).checkpoint(root, step)
            if last is not None and last["state"] in {state, "valid", "invalid"}:
                return last
            time.sleep(0.1)
        raise AssertionError(f"{root} step {step} not {state} in {timeout}s (last: {last})\n"
                             f"{self.log_text()[-4000:]}")


@pytest.fixture
def daemon_factory(tmp_path: Path, short_dir: Path) -> Iterator[Any]:
    """Build (and later stop) daemons: `daemon_factory(roots=[{...}], **daemon_keys)`."""
    handles: list[DaemonHandle] = []

    def make(roots: list[dict[str, Any]] | None = None, start: bool = True,
             **daemon_keys: Any) -> DaemonHandle:
        roots = roots if roots is not None else [{"name": "r1"}]
        state_dir = tmp_path / "state"
        sock = short_dir / "ckptd.sock"
        root_paths: dict[str, Path] = {}
        rendered = []
        for r in roots:
            r = dict(r)
            path = Path(r.pop("path", tmp_path / "roots" / r["name"]))
            path.mkdir(parents=True, exist_ok=True)
            root_paths[r["name"]] = path
            rendered.append({"name": r.pop("name"), "path": str(path),
                             "settle": r.pop("settle", "300ms"), **r})
        daemon = {"state_dir": str(state_dir), "socket": str(sock), "scan_interval": "1s",
                  "log_format": "json", "log_level": "debug", **daemon_keys}
        config = tmp_path / "ckptd.toml"
        config.write_text(render_config(daemon, rendered))
        h = DaemonHandle(tmp_path, config, sock, state_dir, root_paths, tmp_path / "daemon.log")
        handles.append(h)
        return h.start() if start else h

    yield make
    for h in handles:
        h.stop()
