"""The peers' server and client over real TCP on 127.0.0.1: health, a replica put, listed and
read back verbatim; every request proven (401 and 403 with a small JSON error and no byte of
state); other and stale steps, the byte cap, a stalled sender or server cut off in time, and
the client's bandwidth cap."""

from __future__ import annotations

import hashlib
import http.client
import json
import socket
import struct
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from ckptd.memory.peerclient import PeerClient, PeerError, parse_addr
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


@pytest.fixture
def peer() -> Iterator[Peer]:
    p = Peer()
    yield p
    p.server.close()


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


def test_health_index_put_and_read_back_verbatim(peer: Peer) -> None:
    c = client()
    assert c.health(peer.addr) == {"node": "holder", "status": "ok"}
    head = head_of("r", "n1", 3, 100, codec="zstd")
    rest = [b"a" * 1000, b"", bytes(range(256)) * 5000, b"z"]
    doc = c.put_replica(peer.addr, "r", 3, 100, head, iter(rest))
    whole = struct.pack("<I", len(head)) + head + b"".join(rest)
    assert doc == {"root": "r", "node": "n1", "rank": 3, "step": 100, "bytes": len(whole)}
    assert c.index(peer.addr, "r") == [{"rank": 3, "step": 100, "bytes": len(whole)}]
    with c.open_replica(peer.addr, "r", 3, 100) as stream:
        got = stream.read(10) + stream.read()
    assert got == whole
    assert peer.replicas.held_bytes("r") == len(whole)


def test_no_proof_or_a_wrong_one_is_a_401_with_no_state(peer: Peer) -> None:
    c = client()
    head = head_of("r", "n1", 0, 7)
    c.put_replica(peer.addr, "r", 0, 7, head, [b"SECRET-STATE" * 10])
    for path in ("/v1/peer/health", "/v1/peer/replicas/r/n1", "/v1/peer/replicas/r/n1/0/7",
                 "/nowhere"):
        status, data = raw(peer.addr, "GET", path)
        assert status == 401 and small_error(data)["error"] == "no_proof"
        assert b"SECRET" not in data and b"holder" not in data
        status, data = raw(peer.addr, "GET", path, proven("GET", path, secret=b"other"))
        assert status == 401 and small_error(data)["error"] == "bad_proof"
        assert b"SECRET" not in data
    with pytest.raises(PeerError) as info:
        PeerClient(b"other", "n1").open_replica(peer.addr, "r", 0, 7)
    assert info.value.status == 401 and peer.addr in str(info.value)
    with pytest.raises(PeerError) as info:  # a replayed request
        headers = proven("GET", "/v1/peer/health")
        raw(peer.addr, "GET", "/v1/peer/health", headers)
        status, data = raw(peer.addr, "GET", "/v1/peer/health", headers)
        raise PeerError(peer.addr, small_error(data)["error"], status)
    assert info.value.status == 401 and "replayed" in str(info.value)


def test_a_put_without_a_valid_proof_reads_no_body_and_keeps_nothing(peer: Peer) -> None:
    path = "/v1/peer/replicas/r/n1/0/1"
    head = head_of("r", "n1", 0, 1)
    body = struct.pack("<I", len(head)) + head + b"x" * 100
    status, data = raw(peer.addr, "PUT", path, {}, body)
    assert status == 401 and small_error(data)
    sha = hashlib.sha256(b"another head").hexdigest()
    status, data = raw(peer.addr, "PUT", path, proven("PUT", path, body_sha=sha), body)
    assert status == 401 and small_error(data)["error"] == "bad_proof"  # head's hash differs
    assert peer.replicas.held_bytes() == 0 and peer.replicas.reserved_bytes() == 0


def test_another_nodes_replicas_are_forbidden(peer: Peer) -> None:
    client("n1").put_replica(peer.addr, "r", 0, 7, head_of("r", "n1", 0, 7), [b"x"])
    other = client("n2")
    for call in (lambda: other.index(peer.addr, "r", node="n1"),
                 lambda: other.open_replica(peer.addr, "r", 0, 7, node="n1")):
        with pytest.raises(PeerError) as info:
            call()
        assert info.value.status == 403 and info.value.code == "not_yours"
    path = "/v1/peer/replicas/r/n1/0/8"
    head = head_of("r", "n1", 0, 8)
    status, data = raw(peer.addr, "PUT", path,
                       proven("PUT", path, "n2", hashlib.sha256(head).hexdigest()),
                       struct.pack("<I", len(head)) + head)
    assert status == 403 and small_error(data)["error"] == "not_yours"
    assert other.index(peer.addr, "r") == []


def test_other_step_stale_step_and_not_held(peer: Peer) -> None:
    c = client()
    c.put_replica(peer.addr, "r", 0, 7, head_of("r", "n1", 0, 7), [b"x"])
    with pytest.raises(PeerError) as info:
        c.open_replica(peer.addr, "r", 0, 6)
    assert info.value.status == 409 and info.value.held_step == 7
    with pytest.raises(PeerError) as info:
        c.open_replica(peer.addr, "r", 1, 7)
    assert info.value.status == 404
    with pytest.raises(PeerError) as info:
        c.put_replica(peer.addr, "r", 0, 5, head_of("r", "n1", 0, 5), [b"old"])
    assert info.value.status == 409 and info.value.code == "stale"
    with c.open_replica(peer.addr, "r", 0, 7) as stream:
        assert stream.read().endswith(b"x")


@pytest.mark.parametrize(("path", "status"), [
    ("/v1/peer/replicas/r/n1/65536/1", 400), ("/v1/peer/replicas/r/n1/0/9223372036854775808", 400),
    ("/v1/peer/replicas/r/n1/-1/1", 400), ("/v1/peer/replicas/r/n1/0/1e3", 400),
    ("/v1/peer/replicas/r%2F/n1", 400), ("/v1/peer/replicas/" + "r" * 129 + "/n1", 400),
    ("/v1/peer/replicas/r/-n1", 400), ("/v1/peer/replicas/r/n1/0", 404), ("/v1/peer", 404),
    ("/v1/peer/healthz", 404), ("/v1/roots", 404),
])
def test_bad_paths_are_400_and_unknown_ones_404(peer: Peer, path: str, status: int) -> None:
    got, data = raw(peer.addr, "GET", path, proven("GET", path))
    assert got == status and small_error(data)


def test_a_wrong_method_is_a_405(peer: Peer) -> None:
    for method, path in (("DELETE", "/v1/peer/health"), ("PUT", "/v1/peer/replicas/r/n1"),
                         ("POST", "/v1/peer/replicas/r/n1/0/1")):
        got, data = raw(peer.addr, method, path, proven(method, path))
        assert got == 405 and small_error(data)["error"] == "method_not_allowed"


def test_a_head_that_names_another_replica_or_is_not_json_is_a_400(peer: Peer) -> None:
    c = client()
    for head in (head_of("r", "n1", 0, 8), head_of("r", "n1", 1, 7), head_of("x", "n1", 0, 7),
                 head_of("r", "n2", 0, 7), b'{"root": "r"}', b"[1, 2]", b"\xff\xfe",
                 b'{"root": "r", "node": "n1", "rank": 0, "step": 7.0}'):
        with pytest.raises(PeerError) as info:
            c.put_replica(peer.addr, "r", 0, 7, head, [b"body"])
        assert info.value.status == 400, head
    assert peer.replicas.held_bytes() == 0 and peer.replicas.reserved_bytes() == 0


def test_over_the_cap_is_507_and_the_oldest_go_first() -> None:
    p = Peer(max_bytes=20_000)
    try:
        c = client()
        for rank, step in ((0, 1), (1, 2), (2, 3)):
            c.put_replica(p.addr, "r", rank, step, head_of("r", "n1", rank, step),
                          [b"x" * 7000])
        assert [e["rank"] for e in c.index(p.addr, "r")] == [1, 2]  # step 1 dropped
        with pytest.raises(PeerError) as info:  # refused as soon as it cannot fit
            c.put_replica(p.addr, "r", 3, 9, head_of("r", "n1", 3, 9),
                          (b"y" * 65536 for _ in range(256)))
        assert info.value.status == 507 and info.value.code == "too_large"
        assert p.replicas.reserved_bytes() == 0
        assert [e["rank"] for e in c.index(p.addr, "r")] == [1, 2]  # nothing newer dropped
    finally:
        p.server.close()


def test_a_stalled_sender_is_cut_off_and_nothing_is_kept() -> None:
    p = Peer(timeout_s=0.5)
    try:
        path = "/v1/peer/replicas/r/n1/0/1"
        head = head_of("r", "n1", 0, 1)
        headers = proven("PUT", path, body_sha=hashlib.sha256(head).hexdigest())
        sock = socket.create_connection(parse_addr(p.addr), timeout=5)
        lines = [f"PUT {path} HTTP/1.1", "Host: x", "Content-Length: 100000",
                 *(f"{k}: {v}" for k, v in headers.items())]
        sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
        sock.sendall(struct.pack("<I", len(head)) + head + b"partial")
        t0 = time.monotonic()
        answer = sock.recv(4096)
        took = time.monotonic() - t0
        sock.close()
        assert answer.startswith(b"HTTP/1.1 408"), answer
        assert took < 2.0
        assert p.replicas.held_bytes() == 0 and p.replicas.reserved_bytes() == 0
    finally:
        p.server.close()


def test_a_client_reading_from_a_stalled_server_raises_in_time() -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    done = threading.Event()

    def stall() -> None:
        conn, _ = listener.accept()
        conn.recv(65536)
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\n" + b"x" * 1000)
        done.wait(10)
        conn.close()

    t = threading.Thread(target=stall, daemon=True)
    t.start()
    try:
        c = client(timeout_s=0.5)
        t0 = time.monotonic()
        with pytest.raises(PeerError) as info, \
                c.open_replica(f"127.0.0.1:{port}", "r", 0, 1) as stream:
            stream.read()
        assert time.monotonic() - t0 < 3.0
        assert f"127.0.0.1:{port}" in str(info.value)
    finally:
        done.set()
        listener.close()


def test_a_body_cut_short_and_a_refused_connection_are_peer_errors() -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def cut() -> None:
        conn, _ = listener.accept()
        conn.recv(65536)
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 5000\r\n\r\n" + b"x" * 100)
        conn.close()

    threading.Thread(target=cut, daemon=True).start()
    with pytest.raises(PeerError, match="cut short"), \
            client().open_replica(f"127.0.0.1:{port}", "r", 0, 1) as stream:
        stream.read()
    listener.close()
    with pytest.raises(PeerError, match="refused"):
        client().health(f"127.0.0.1:{port}")
    for bad in ("nowhere", "host:0", "::1:80", "host:99999", "[::1]"):
        with pytest.raises(PeerError):
            client().health(bad)


def test_the_bandwidth_cap_holds_across_uploads(peer: Peer) -> None:
    c = client(max_bandwidth=4 << 20)
    t0 = time.monotonic()
    threads = [threading.Thread(target=c.put_replica, args=(
        peer.addr, "r", rank, 1, head_of("r", "n1", rank, 1), [b"x" * (1 << 20)]))
        for rank in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    took = time.monotonic() - t0
    assert len(client().index(peer.addr, "r")) == 2
    assert took >= 0.4, took  # 2 MiB at 4 MiB/s: about 0.5 s
    assert took < 5


def test_ipv6_loopback_when_there_is_one() -> None:
    try:
        p = Peer(host="::1")
    except OSError:
        pytest.skip("no IPv6 loopback here")
    try:
        assert p.addr.startswith("[::1]:")
        assert client().health(p.addr)["status"] == "ok"
    finally:
        p.server.close()
