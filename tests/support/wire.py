"""Talking to a daemon the way outside programs do: raw HTTP bytes on its Unix socket (what
the Client would never send) and the `ckptd` CLI as a subprocess."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any


def http(sock: Path, raw: bytes) -> tuple[int, dict[str, Any]]:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    s.connect(str(sock))
    s.sendall(raw)
    data = b""
    while True:
        chunk = s.recv(65536)
        if not chunk:
            break
        data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        length = [int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length")]
        if length and len(body) >= length[0]:
            break
    s.close()
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body) if body else {}


def cli(*args: str, sock: Path | None = None, config: Path | None = None
        ) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "ckptd", *args]
    if sock:
        cmd += ["--socket", str(sock)]
    if config:
        cmd += ["--config", str(config)]
    env = {k: v for k, v in os.environ.items() if k not in ("CKPTD_SOCKET", "CKPTD_CONFIG")}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env)


def request(sock: Path, method: str, path: str, body: bytes = b"",
            headers: dict[str, str] | None = None) -> tuple[int, dict[str, Any]]:
    """One raw request with `body` sent as is (and its Content-Length unless given)."""
    head = {"Host": "x", "Connection": "close", **(headers or {})}
    if body and "Content-Length" not in head and "Transfer-Encoding" not in head:
        head["Content-Length"] = str(len(body))
    lines = "".join(f"{k}: {v}\r\n" for k, v in head.items())
    return http(sock, f"{method} {path} HTTP/1.1\r\n{lines}\r\n".encode() + body)
