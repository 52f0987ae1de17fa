"""Calling a peer daemon over TCP (HTTP/1.1, http.client): its health, the index of what it
holds for a node, a replica sent to it (chunked, within the client's bandwidth) and a replica
read back as a stream. Every request carries this node's proof of the shared secret.

Owns the client side of the peer routes and the one token bucket every upload of a client
shares. Never retries (a caller moves on to the next peer) and never interprets a replica's
bytes; every failure is a PeerError naming the peer and the cause.
"""

from __future__ import annotations

import hashlib
import http.client
import io
import select
import socket
import struct
import threading
import time
from collections.abc import Iterable
from typing import Any

from ckptd.clock import SYSTEM, Clock
from ckptd.errors import BadInput, BadValue, StorageError
from ckptd.inputs import loads
from ckptd.memory.proof import (
    EMPTY_SHA256,
    MAX_HEAD,
    MAX_RANK,
    MAX_STEP,
    NODE_RE,
    PREFIX,
    ROOT_RE,
    sign,
)

MAX_ANSWER = 8 * 1024 * 1024  # a JSON answer (an index lists up to 2^16 ranks)
SEND_PIECE = 1024 * 1024  # at most this much per chunk sent
PACED_PIECE = 64 * 1024  # per chunk under a bandwidth cap, so the pace is even
BURST_S = 0.05  # how far ahead of its pace the bucket lets a sender run


class PeerError(StorageError):
    """A peer could not do what was asked: unreachable, timed out, refused (401/403 with the
    peer's message), not holding it (404), holding another step (409: `held_step`), or a body
    cut short. `addr` names the peer; `status` and `code` are the peer's answer, if any."""

    def __init__(self, addr: str, message: str, status: int | None = None,
                 code: str | None = None, held_step: int | None = None) -> None:
        super().__init__(f"peer {addr}: {message}")
        self.addr, self.status, self.code, self.held_step = addr, status, code, held_step


def parse_addr(addr: str) -> tuple[str, int]:
    """("host", port) of "host:port" or "[v6]:port"; PeerError when it is not one."""
    host, sep, port = addr.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        host = ""
    if (not sep or not host or len(host) > 255 or not port.isascii() or not port.isdigit()
            or len(port) > 5 or not 0 < int(port) < 65536):
        raise PeerError(addr[:300], "not an address of the form host:port or [v6]:port")
    return host, int(port)


class _Bucket:
    """The send pace of one client: every upload takes from it, so together they stay
    within `rate` bytes/s."""

    def __init__(self, rate: float) -> None:
        self._rate = rate
        self._lock = threading.Lock()
        self._next = 0.0  # monotonic time at which the bytes taken so far are paid for

    def take(self, n: int) -> None:
        with self._lock:
            now = time.monotonic()
            start = max(self._next, now - BURST_S)
            self._next = start + n / self._rate
            wait = start - now
        if wait > 0:
            time.sleep(wait)


class _Stream(io.RawIOBase):
    """A replica's body as it arrives; a read that stalls or a body cut short is a PeerError;
    closing it closes the connection."""

    def __init__(self, addr: str, conn: http.client.HTTPConnection,
                 resp: http.client.HTTPResponse, length: int) -> None:
        self._addr, self._conn, self._resp = addr, conn, resp
        self.length = length
        self.received = 0

    def readable(self) -> bool:
        return True

    def readinto(self, buf: Any) -> int:
        try:
            n = self._resp.readinto(buf)
        except TimeoutError:
            raise PeerError(self._addr, f"the replica stalled after {self.received} of"
                            f" {self.length} bytes") from None
        except (OSError, http.client.HTTPException) as exc:
            raise PeerError(self._addr, f"reading the replica: {_why(exc)}") from None
        self.received += n
        if n == 0 and len(buf) and self.received < self.length:
            raise PeerError(self._addr, f"the replica was cut short after {self.received} of"
                            f" {self.length} bytes")
        return n

    def close(self) -> None:
        if not self.closed:
            self._resp.close()
            self._conn.close()
        super().close()


class PeerClient:
    """Requests to peers as `node`, proven with `secret`; every socket read and write waits at
    most `timeout_s`; uploads share a cap of `max_bandwidth` bytes/s (None: none)."""

    def __init__(self, secret: bytes, node: str, timeout_s: float = 30.0,
                 max_bandwidth: int | None = None, clock: Clock = SYSTEM) -> None:
        if NODE_RE.fullmatch(node) is None:
            raise BadValue(f"node {node[:80]!r}: 1-64 of [A-Za-z0-9._-], first a letter or digit")
        if max_bandwidth is not None and max_bandwidth <= 0:
            raise BadValue(f"max_bandwidth {max_bandwidth!r}: a positive number of bytes/s")
        self._secret, self.node, self._timeout, self._clock = secret, node, timeout_s, clock
        self._bucket = _Bucket(max_bandwidth) if max_bandwidth else None

    # -- the routes ------------------------------------------------------------------------

    def health(self, addr: str) -> dict[str, Any]:
        doc = self._json(addr, "GET", f"{PREFIX}/health")
        if not isinstance(doc, dict):
            raise PeerError(addr, "its health answer is not a JSON object")
        return doc

    def index(self, addr: str, root: str, node: str | None = None) -> list[dict[str, Any]]:
        """What `addr` holds for `node` (default: this node) under `root`: rank, step, bytes."""
        path = f"{PREFIX}/replicas/{_root(root)}/{self._node(node)}"
        doc = self._json(addr, "GET", path)
        entries = doc.get("replicas") if isinstance(doc, dict) else None
        if not isinstance(entries, list) or not all(_entry(e) for e in entries):
            raise PeerError(addr, "its index is not a list of {rank, step, bytes}")
        return entries

    def put_replica(self, addr: str, root: str, rank: int, step: int, head: bytes,
                    body: Iterable[bytes]) -> dict[str, Any]:
        """Send one replica of this node: the u32 length of `head`, `head`, then `body`."""
        if not 2 <= len(head) <= MAX_HEAD:
            raise BadValue(f"a replica head of {len(head)} bytes (2 to {MAX_HEAD})")
        path = f"{PREFIX}/replicas/{_root(root)}/{self.node}/{_int(rank, 'rank', MAX_RANK)}" \
               f"/{_int(step, 'step', MAX_STEP)}"
        headers = self._sign("PUT", path, hashlib.sha256(head).hexdigest())
        headers["Transfer-Encoding"] = "chunked"
        headers["Content-Type"] = "application/octet-stream"
        conn = self._connect(addr)
        try:
            self._request(addr, conn, "PUT", path, headers)
            self._send_chunks(addr, conn, [struct.pack("<I", len(head)) + head], body)
            doc = self._answer(addr, conn, 201)
        finally:
            conn.close()
        if not isinstance(doc, dict):
            raise PeerError(addr, "its answer to a put is not a JSON object")
        return doc

    def open_replica(self, addr: str, root: str, rank: int, step: int,
                     node: str | None = None) -> io.BufferedReader:
        """The body of a replica held by `addr` (of `node`, default this node) as a binary
        stream; close it (or use it as a context manager) to close the connection."""
        path = f"{PREFIX}/replicas/{_root(root)}/{self._node(node)}/" \
               f"{_int(rank, 'rank', MAX_RANK)}/{_int(step, 'step', MAX_STEP)}"
        conn = self._connect(addr)
        try:
            self._request(addr, conn, "GET", path, self._sign("GET", path, EMPTY_SHA256))
            resp = self._response(addr, conn)
            if resp.status != 200:
                self._fail(addr, resp)
            length = resp.getheader("Content-Length")
            if length is None or not length.isdigit():
                raise PeerError(addr, "its replica answer has no Content-Length")
        except BaseException:
            conn.close()
            raise
        return io.BufferedReader(_Stream(addr, conn, resp, int(length)), SEND_PIECE)

    # -- one request -----------------------------------------------------------------------

    def _node(self, node: str | None) -> str:
        node = self.node if node is None else node
        if NODE_RE.fullmatch(node) is None:
            raise BadValue(f"node {node[:80]!r}: 1-64 of [A-Za-z0-9._-], first a letter or digit")
        return node

    def _sign(self, method: str, path: str, body_sha256: str) -> dict[str, str]:
        return sign(self._secret, method, path, body_sha256, self.node, self._clock.time())

    def _json(self, addr: str, method: str, path: str) -> Any:
        conn = self._connect(addr)
        try:
            self._request(addr, conn, method, path, self._sign(method, path, EMPTY_SHA256))
            return self._answer(addr, conn, 200)
        finally:
            conn.close()

    def _connect(self, addr: str) -> http.client.HTTPConnection:
        host, port = parse_addr(addr)
        conn = http.client.HTTPConnection(host, port, timeout=self._timeout)
        try:
            conn.connect()
        except (OSError, http.client.HTTPException) as exc:
            conn.close()
            raise PeerError(addr, f"cannot connect: {_why(exc)}") from None
        return conn

    def _request(self, addr: str, conn: http.client.HTTPConnection, method: str, path: str,
                 headers: dict[str, str]) -> None:
        try:
            conn.putrequest(method, path, skip_accept_encoding=True)
            for name, value in headers.items():
                conn.putheader(name, value)
            conn.endheaders()
        except (OSError, http.client.HTTPException) as exc:
            raise PeerError(addr, f"sending the request: {_why(exc)}") from None

    def _send_chunks(self, addr: str, conn: http.client.HTTPConnection, first: list[bytes],
                     body: Iterable[bytes]) -> None:
        """The body, chunked and paced; it stops early when the peer answers meanwhile (a
        refusal), leaving that answer to be read."""
        sock = conn.sock
        assert isinstance(sock, socket.socket)
        piece = PACED_PIECE if self._bucket else SEND_PIECE
        try:
            for part in _pieces([*first, body], piece):
                if select.select([sock], [], [], 0)[0]:
                    return  # the peer answered before the end: a refusal, read it
                if self._bucket is not None:
                    self._bucket.take(len(part))
                sock.sendall(b"%x\r\n" % len(part))
                sock.sendall(part)
                sock.sendall(b"\r\n")
            sock.sendall(b"0\r\n\r\n")
        except TimeoutError:
            raise PeerError(addr, f"timed out sending (no progress in {self._timeout} s)"
                            ) from None
        except OSError as exc:
            if select.select([sock], [], [], 0)[0]:
                return  # it answered (and closed): read why
            raise PeerError(addr, f"sending the replica: {_why(exc)}") from None

    def _response(self, addr: str, conn: http.client.HTTPConnection) -> http.client.HTTPResponse:
        try:
            return conn.getresponse()
        except TimeoutError:
            raise PeerError(addr, f"no answer within {self._timeout} s") from None
        except (OSError, http.client.HTTPException) as exc:
            raise PeerError(addr, f"reading the answer: {_why(exc)}") from None

    def _answer(self, addr: str, conn: http.client.HTTPConnection, want: int) -> Any:
        resp = self._response(addr, conn)
        if resp.status != want:
            self._fail(addr, resp)
        return self._read_json(addr, resp)

    def _read_json(self, addr: str, resp: http.client.HTTPResponse) -> Any:
        try:
            data = resp.read(MAX_ANSWER + 1)
        except TimeoutError:
            raise PeerError(addr, f"its answer stalled (no byte in {self._timeout} s)") from None
        except (OSError, http.client.HTTPException) as exc:
            raise PeerError(addr, f"reading the answer: {_why(exc)}") from None
        if len(data) > MAX_ANSWER:
            raise PeerError(addr, f"an answer over {MAX_ANSWER} bytes")
        try:
            return loads(data, "answer")
        except BadInput as exc:
            raise PeerError(addr, f"its answer ({resp.status}) is not JSON: {exc}") from None

    def _fail(self, addr: str, resp: http.client.HTTPResponse) -> None:
        """Raise the PeerError for an answer that is not the one wanted."""
        try:
            doc = self._read_json(addr, resp)
        except PeerError:
            doc = None
        doc = doc if isinstance(doc, dict) else {}
        code = doc.get("error") if isinstance(doc.get("error"), str) else None
        message = doc.get("message") if isinstance(doc.get("message"), str) else resp.reason
        held = doc.get("held_step")
        held = held if isinstance(held, int) and not isinstance(held, bool) else None
        raise PeerError(addr, f"{resp.status} {code or ''}: {str(message)[:500]}", resp.status,
                        code, held)


def _pieces(parts: list[Any], size: int) -> Iterable[memoryview]:
    """The bytes of `parts` (bytes, or an iterable of bytes) in slices of at most `size`."""
    for part in parts:
        items = [part] if isinstance(part, bytes | bytearray | memoryview) else part
        for item in items:
            view = memoryview(item).cast("B")
            for at in range(0, len(view), size):
                yield view[at:at + size]


def _root(root: str) -> str:
    if not isinstance(root, str) or ROOT_RE.fullmatch(root) is None:
        raise BadValue(f"root {str(root)[:80]!r}: 1-128 of [A-Za-z0-9._-]")
    return root


def _int(value: int, what: str, below: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < below:
        raise BadValue(f"{what} {value!r}: an integer in [0, {below})")
    return value


def _entry(e: Any) -> bool:
    return isinstance(e, dict) and all(
        isinstance(e.get(k), int) and not isinstance(e.get(k), bool)
        for k in ("rank", "step", "bytes"))


def _why(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return "timed out"
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused"
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
