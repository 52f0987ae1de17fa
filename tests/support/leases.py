"""A `ckptd run` process for one node of a root whose remote is a shared file:// directory, and
the root's status such a daemon answers. Holds no tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ckptd.client import Client
from support.config import write_layout
from support.proc import DaemonHandle


def _daemon(base: Path, sock_dir: Path, root: Path, remote: Path, node: str,
            lease_timeout: str = "4s") -> DaemonHandle:
    base.mkdir(parents=True, exist_ok=True)
    layout = write_layout(base, sock_dir / f"{node}.sock",
                          [{"name": "r", "path": root, "upload": {"url": f"file://{remote}"}}],
                          node=node, lease_timeout=lease_timeout)
    return DaemonHandle(layout, base / "daemon.log")


def _root_status(d: DaemonHandle) -> dict[str, Any]:
    doc = Client(d.socket, timeout=5.0, strict=True).status()
    assert doc is not None
    (root,) = doc["roots"]
    return root  # type: ignore[no-any-return]
