"""An async save's request sent to a daemon by hand, and a sealed arena to send. Holds no tests."""

from __future__ import annotations

import array
import json
import os
import socket
from pathlib import Path
from typing import Any

from ckptd import arena


def post_persist(sock: Path, body: Any, fd: int | None) -> tuple[int, dict[str, Any]]:
    payload = json.dumps(body).encode()
    data = (b"POST /v1/persist HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(payload)) + payload
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(10)
        s.connect(str(sock))
        anc = [] if fd is None else [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                                      array.array("i", [fd]))]
        s.sendmsg([data], anc)
        raw = b""
        while chunk := s.recv(65536):
            raw += chunk
    head, _, rest = raw.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(rest)


def sealed_arena(files: int = 1) -> tuple[int, dict[str, Any]]:
    fd = arena.create_memfd(2 * arena.DATA_OFFSET)
    os.pwrite(fd, arena.pack_header(arena.State.SEALED, 1, 8192), 0)
    body = {"root": "r1", "dir": "", "step": 1, "rank": 0, "world_size": 1, "generation": 1,
            "files": [{"path": "model.pt", "component": "model", "offset": 4096, "size": 10}],
            "head": {"format": "ckptd-native/1", "step": 1, "world_size": 1}}
    return fd, body
