"""A daemon in the test process on real files, a real SQLite store and a real Unix socket, set
up from keyword arguments (`Harness`), and a raw HTTP request for bytes a client would refuse
to send (`raw`), and the checkpoints such a daemon lists, by step (`checkpoints`).
`support.inproc.InProcessDaemon` is the same idea driven by a rendered layout.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any

from ckptd.client import Client
from ckptd.config import load_config
from ckptd.daemon import Daemon
from ckptd.store import Store
from support.config import render_config, without_disk_floor


class Harness:
    """One daemon in this process on real files, a real store and a real socket."""

    def __init__(self, tmp: Path, sock_dir: Path, store_factory: type[Store] = Store,
                 **root: Any) -> None:
        self.root = tmp / "ckpt"
        self.root.mkdir(parents=True, exist_ok=True)
        self.config_path = tmp / "ckptd.toml"
        self.daemon_cfg = {"state_dir": str(tmp / "state"), "socket": str(sock_dir / "s.sock"),
                           "scan_interval": "1s", "workers": 1}
        if root.pop("uploads", False):
            root["upload"] = {"url": f"file://{tmp / 'remote'}"}
        self.root_cfg = without_disk_floor(
            {"name": "r", "path": str(self.root), "settle": "200ms", **root})
        self.write_config()
        self.daemon = Daemon(load_config(self.config_path), self.config_path,
                             store_factory=store_factory)
        self.daemon.supervisor._base = 0.05  # noqa: SLF001 - restart quickly in tests
        self.client = Client(sock_dir / "s.sock", strict=True)

    def write_config(self) -> None:
        self.config_path.write_text(render_config(self.daemon_cfg, [self.root_cfg]))

    def latest_json(self) -> dict[str, Any] | None:
        try:
            doc: dict[str, Any] = json.loads((self.root / ".ckptd" / "latest.json").read_text())
        except FileNotFoundError:
            return None
        return doc


def raw(sock_path: Path, method: str, path: str, body: bytes = b"",
        decode: bool = True) -> tuple[int, Any]:
    """One HTTP request with a body sent byte for byte (the client would refuse to encode it);
    the answer's JSON decoded, or its bytes as sent (`decode=False`)."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(20)
    s.connect(str(sock_path))
    head = (f"{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n"
            "Content-Type: application/json\r\nConnection: close\r\n\r\n").encode()
    s.sendall(head + body)
    data = b""
    while chunk := s.recv(65536):
        data += chunk
    s.close()
    status = int(data.split(b" ", 2)[1])
    payload = data.split(b"\r\n\r\n", 1)[1]
    if not decode:
        return status, payload
    return status, json.loads(payload) if payload.startswith(b"{") else payload


def checkpoints(h: Harness) -> dict[int, dict[str, Any]]:
    status, doc = h.client.request("GET", "/v1/roots/r/checkpoints")
    assert status == 200, doc
    return {c["step"]: c for c in doc["checkpoints"]}
