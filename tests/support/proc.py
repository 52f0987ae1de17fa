"""A real `ckptd run` process on a real Unix socket: for what only a process shows (signals,
exit codes, systemd protocols, the CLI, kill -9). Stopped by PID, never by name."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckptd.client import Client
from support.config import Layout
from support.wait import wait_until

TERMINAL = frozenset({"valid", "invalid"})


def parse_events(text: str, name: str) -> list[dict[str, Any]]:
    """The JSON log lines of `text` with event `name`."""
    out = []
    for line in text.splitlines():
        try:
            doc = json.loads(line)
        except ValueError:
            continue
        if isinstance(doc, dict) and doc.get("event") == name:
            out.append(doc)
    return out


def wait_for_state(client: Client, root: str, step: int, state: str, timeout: float,
                   log: Any) -> dict[str, Any]:
    """Poll until `step` of `root` is in `state`; any terminal state is returned too."""
    def reached() -> dict[str, Any] | None:
        rec = client.checkpoint(root, step)
        return rec if rec is not None and rec["state"] in {state, *TERMINAL} else None

    return wait_until(reached, timeout, f"{root} step {step} {state}",
                      interval=0.05, detail=lambda: log()[-4000:])


@dataclass
class DaemonHandle:
    """A running `ckptd run` process and what it was started with."""

    layout: Layout
    log: Path
    proc: subprocess.Popen[bytes] | None = None
    extra_env: dict[str, str] = field(default_factory=dict)

    @property
    def config(self) -> Path:
        return self.layout.config

    @property
    def socket(self) -> Path:
        return self.layout.socket

    @property
    def state_dir(self) -> Path:
        return self.layout.state_dir

    @property
    def roots(self) -> dict[str, Path]:
        return self.layout.roots

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
        c = Client(self.socket, timeout=1.0)

        def serving() -> bool:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise AssertionError(f"daemon exited {self.proc.returncode}:\n{self.log_text()}")
            return c.health() is not None

        wait_until(serving, timeout, "the daemon to answer /v1/health", interval=0.02,
                   detail=self.log_text)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int | None:
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(10)

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def kill9(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait(10)

    def log_text(self) -> str:
        try:
            return self.log.read_text(errors="replace")
        except OSError:
            return ""

    def events(self, name: str) -> list[dict[str, Any]]:
        return parse_events(self.log_text(), name)

    def wait_for(self, root: str, step: int, state: str = "valid", timeout: float = 30.0
                 ) -> dict[str, Any]:
        return wait_for_state(Client(self.socket, timeout=5.0), root, step, state, timeout,
                              self.log_text)
