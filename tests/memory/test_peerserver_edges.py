"""The peer server at its edges, over raw sockets on 127.0.0.1: requests kept alive and sent
ahead, a GET with a body, a head trickled in, an idle connection, malformed chunked framing, a
length over the cap refused before a byte of the body, any path answered in the JSON shape."""

from __future__ import annotations

import hashlib
import json
import socket
import struct
import time
from collections.abc import Iterator

import pytest
from hypothesis import given
from hypothesis import strategies as st
from peerkit import Peer, head_of, proven, raw, small_error
from support.fuzzing import fuzz

from ckptd.errors import HttpError
from ckptd.memory.peerclient import parse_addr
from ckptd.memory.peerserver import parse_target


def request(method: str, path: str, node: str = "n1", extra: dict[str, str] | None = None,
            body_sha: str | None = None) -> bytes:
    headers = proven(method, path, node, **({"body_sha": body_sha} if body_sha else {}))
    lines = [f"{method} {path} HTTP/1.1", "Host: peer",
             *(f"{k}: {v}" for k, v in {**headers, **(extra or {})}.items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def answers(sock: socket.socket, n: int) -> list[tuple[int, bytes]]:
    """`n` answers read off `sock` (each with a Content-Length)."""
    f = sock.makefile("rb")
    out = []
    for _ in range(n):
        status = int(f.readline().split()[1])
        length = 0
        while (line := f.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode().partition(":")
            if name.lower() == "content-length":
                length = int(value)
        out.append((status, f.read(length)))
    return out


def connect(p: Peer) -> socket.socket:
    return socket.create_connection(parse_addr(p.addr), timeout=5)


def test_requests_on_one_connection_and_sent_ahead(peer: Peer) -> None:
    with connect(peer) as sock:
        sock.sendall(request("GET", "/v1/peer/health"))
        assert answers(sock, 1)[0][0] == 200
        sock.sendall(request("GET", "/v1/peer/health") + request("GET", "/v1/peer/replicas/r/n1"))
        got = answers(sock, 2)
        assert [s for s, _ in got] == [200, 200]
        assert json.loads(got[1][1]) == {"root": "r", "node": "n1", "replicas": []}


def test_a_get_with_a_body_is_a_400_and_the_connection_closed(peer: Peer) -> None:
    with connect(peer) as sock:
        sock.sendall(request("GET", "/v1/peer/health", extra={"Content-Length": "5"}) + b"hello")
        (status, data), = answers(sock, 1)
        assert status == 400 and small_error(data)["error"] == "unexpected_body"
        assert sock.recv(10) == b""


def test_a_head_trickled_in_is_cut_off_within_the_timeout() -> None:
    p = Peer(timeout_s=0.6)
    try:
        with connect(p) as sock:
            t0 = time.monotonic()
            sock.settimeout(3)
            try:
                deadline = t0 + 5.0  # far past the timeout: the server cuts in first
                for byte in b"GET /v1/peer/health HTTP/1.1\r\nHost: x\r\n" * 4:
                    if time.monotonic() > deadline:
                        break
                    sock.sendall(bytes([byte]))
                    time.sleep(0.05)  # a byte at a time: each read well within the timeout
                while sock.recv(4096):
                    pass
            except OSError:  # the server closed it: a reset, or a broken pipe
                pass
            assert time.monotonic() - t0 < 3.0  # not 0.6 s per byte
    finally:
        p.server.close()


def test_an_idle_connection_is_closed() -> None:
    p = Peer(timeout_s=0.3)
    try:
        with connect(p) as sock:
            sock.sendall(request("GET", "/v1/peer/health"))
            assert answers(sock, 1)[0][0] == 200
            t0 = time.monotonic()
            sock.settimeout(5)
            assert sock.recv(10) == b""
            assert time.monotonic() - t0 < 3
    finally:
        p.server.close()


@pytest.mark.parametrize("framing", [
    b"zz\r\n", b"5\r\nab", b"3\r\nabcdef\r\n0\r\n\r\n",
])
def test_malformed_chunked_bodies_are_400_and_nothing_is_kept(peer: Peer, framing: bytes) -> None:
    path = "/v1/peer/replicas/r/n1/0/1"
    head = head_of("r", "n1", 0, 1)
    first = struct.pack("<I", len(head)) + head
    with connect(peer) as sock:
        sock.sendall(request("PUT", path, extra={"Transfer-Encoding": "chunked"},
                             body_sha=hashlib.sha256(head).hexdigest())
                     + b"%x\r\n" % len(first) + first + b"\r\n" + framing)
        sock.shutdown(socket.SHUT_WR)
        (status, data), = answers(sock, 1)
    assert status == 400 and small_error(data)
    assert peer.replicas.held_bytes() == 0 and peer.replicas.reserved_bytes() == 0


def test_a_length_over_the_cap_is_refused_before_the_body() -> None:
    p = Peer(max_bytes=1000)
    try:
        path = "/v1/peer/replicas/r/n1/0/1"
        with connect(p) as sock:
            sock.sendall(request("PUT", path, extra={"Content-Length": str(10**12)},
                                 body_sha=hashlib.sha256(b"{}").hexdigest()))
            (status, data), = answers(sock, 1)
        assert status == 507 and small_error(data)["error"] == "too_large"
        assert p.replicas.reserved_bytes() == 0
    finally:
        p.server.close()


def test_a_put_with_two_lengths_is_a_400(peer: Peer) -> None:
    path = "/v1/peer/replicas/r/n1/0/1"
    with connect(peer) as sock:
        sock.sendall(request("PUT", path, body_sha=hashlib.sha256(b"{}").hexdigest())[:-2]
                     + b"Content-Length: 10\r\nContent-Length: 12\r\n\r\n" + b"x" * 12)
        (status, data), = answers(sock, 1)
    assert status == 400 and "more than once" in small_error(data)["message"]


def test_a_put_with_content_length_is_taken(peer: Peer) -> None:
    path = "/v1/peer/replicas/r/n1/2/9"
    head = head_of("r", "n1", 2, 9)
    body = struct.pack("<I", len(head)) + head + b"rest"
    status, data = raw(peer.addr, "PUT", path,
                       proven("PUT", path, body_sha=hashlib.sha256(head).hexdigest()), body)
    assert status == 201 and json.loads(data)["bytes"] == len(body)
    found = peer.replicas.find("r", "n1", 2)
    assert found is not None and b"".join(found.chunks) == body


@fuzz(100)
@given(path=st.text(max_size=60).map(lambda t: "/v1/peer/" + t)
       | st.lists(st.sampled_from(["v1", "peer", "replicas", "health", "r", "n1", "0", "7",
                                   "", "..", "%2F", "-1", "99999"]), max_size=8)
       .map(lambda parts: "/" + "/".join(parts)))
def test_any_path_is_a_route_or_an_http_error(path: str) -> None:
    try:
        route, args = parse_target(path)
    except HttpError as err:
        assert err.status in (400, 404)
    else:
        assert route in ("health", "index", "replica")
        assert all(isinstance(v, str | int) for v in args.values())


request_bytes = st.one_of(
    st.binary(max_size=300),
    st.lists(st.sampled_from([b"GET ", b"PUT ", b"/v1/peer/health", b"/v1/peer/replicas/r/n1/0/1",
                              b" HTTP/1.1\r\n", b"\r\n", b"Content-Length: 5\r\n",
                              b"Transfer-Encoding: chunked\r\n", b"X-Ckptd-Node: n1\r\n",
                              b"X-Ckptd-Proof: " + b"0" * 64 + b"\r\n", b"5\r\nhello\r\n",
                              b"\x00", b"\xff" * 3]), max_size=12).map(b"".join))


@pytest.fixture(scope="module")
def holding() -> Iterator[Peer]:
    p = Peer(timeout_s=1.0)
    p.replicas.put("r", "n1", 0, 1, [b"SECRET-STATE"], 12)
    yield p
    p.server.close()


@fuzz(40)
@given(data=request_bytes)
def test_any_bytes_sent_get_an_answer_but_never_a_500_or_state(holding: Peer,
                                                              data: bytes) -> None:
    p = holding
    with connect(p) as sock:
        try:
            sock.sendall(data)
            sock.shutdown(socket.SHUT_WR)
            got = b""
            while chunk := sock.recv(65536):
                got += chunk
        except OSError:
            got = b""
    assert not got.startswith(b"HTTP/1.1 5"), got
    assert b"SECRET" not in got and b"holder" not in got
    assert p.replicas.reserved_bytes() == 0
