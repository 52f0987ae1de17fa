"""What the peer server and client tests share: a real PeerServer on 127.0.0.1 (port 0) with
its replicas, a client, raw requests with or without a proof. Holds no tests."""

from __future__ import annotations

import http.client
import json
import time
from typing import Any

from ckptd.memory.peerclient import PeerClient, parse_addr
from ckptd.memory.peerserver import PeerServer
from ckptd.memory.proof import EMPTY_SHA256, Verifier, sign
from ckptd.memory.replicas import Replicas

SECRET = b"the-job-secret"


def head_of(root: str, node: str, rank: int, step: int, **extra: Any) -> bytes:
    return json.dumps({"root": root, "node": node, "rank": rank, "step": step, **extra}).encode()


class Peer:
    def __init__(self, max_bytes: int = 64 << 20, timeout_s: float = 2.0,
                 host: str = "127.0.0.1") -> None:
        self.replicas = Replicas(max_bytes)
        self.server = PeerServer((host, 0), Verifier(SECRET), self.replicas, "holder",
                                 timeout_s=timeout_s)
        self.server.start()
        h, port = self.server.address
        self.addr = f"[{h}]:{port}" if ":" in h else f"{h}:{port}"


def client(node: str = "n1", **kw: Any) -> PeerClient:
    return PeerClient(SECRET, node, timeout_s=kw.pop("timeout_s", 2.0), **kw)


def raw(addr: str, method: str, path: str, headers: dict[str, str] | None = None,
        body: bytes | None = None) -> tuple[int, bytes]:
    host, port = parse_addr(addr)
    conn = http.client.HTTPConnection(host, port, timeout=5)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def proven(method: str, path: str, node: str = "n1", body_sha: str = EMPTY_SHA256,
           secret: bytes = SECRET) -> dict[str, str]:
    return sign(secret, method, path, body_sha, node, time.time())


def small_error(data: bytes) -> dict[str, Any]:
    doc = json.loads(data)
    assert set(doc) == {"error", "message"}, doc
    assert len(data) < 400
    return dict(doc)
