"""The server peer daemons call over TCP (HTTP/1.1): health, a replica put, the index of what
is held for a node and a replica read back. Every request's proof is checked before a byte of
its body is read; a replica is served only to the node it came from.

Owns the peer routes and their checks. Never interprets a replica past its head's identity
(root, node, rank, step), never writes a file, and answers every error as `{"error",
"message"}` with no byte of any state.
"""

from __future__ import annotations

import hashlib
import hmac
import io
import json
import select
import socket
import struct
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterable
from http.server import BaseHTTPRequestHandler
from typing import Any

from ckptd import __version__
from ckptd.api.door import Conn, ConnectionLoop, Prefixed, Writer
from ckptd.errors import BadInput, HttpError, InternalError
from ckptd.inputs import loads
from ckptd.log import get_logger
from ckptd.memory import httpbody
from ckptd.memory.proof import (
    EMPTY_SHA256,
    MAX_HEAD,
    MAX_RANK,
    MAX_STEP,
    NODE_RE,
    PREFIX,
    ROOT_RE,
    Proven,
    Verifier,
)
from ckptd.memory.replicas import Replicas, Upload

PIECE = 1024 * 1024  # a held replica's chunks are about this big
_SMALL = 256 * 1024  # a part of the body smaller than this is joined to the next
LINGER_S = 1.0  # after an early answer, how long the rest of a body is read and dropped
LINGER_BYTES = 16 * 1024 * 1024


def parse_target(path: str) -> tuple[str, dict[str, Any]]:
    """The route (health, index, replica) and its arguments for a request path; HttpError 404
    for a path no route has, 400 for a bad root, node, rank or step."""
    parts = urllib.parse.urlsplit(path).path.split("/")
    if parts[:3] != PREFIX.split("/"):
        raise HttpError(404, "not_found", f"no endpoint {path[:200]}")
    rest = parts[3:]
    if rest == ["health"]:
        return "health", {}
    if not rest or rest[0] != "replicas" or len(rest) not in (3, 5):
        raise HttpError(404, "not_found", f"no endpoint {path[:200]}")
    root, node = rest[1], rest[2]
    if ROOT_RE.fullmatch(root) is None:
        raise HttpError(400, "bad_root", f"root {root[:40]!r}: 1-128 of [A-Za-z0-9._-]")
    if NODE_RE.fullmatch(node) is None:
        raise HttpError(400, "bad_node", f"node {node[:40]!r}: 1-64 of [A-Za-z0-9._-],"
                        " first a letter or digit")
    if len(rest) == 3:
        return "index", {"root": root, "node": node}
    rank = _number(rest[3], "rank", MAX_RANK)
    step = _number(rest[4], "step", MAX_STEP)
    return "replica", {"root": root, "node": node, "rank": rank, "step": step}


def _number(text: str, what: str, below: int) -> int:
    if not (text.isascii() and text.isdigit()) or len(text) > 19 or int(text) >= below:
        raise HttpError(400, f"bad_{what}", f"{what} {text[:40]!r}: a decimal integer"
                        f" below {below}")
    return int(text)


def read_head(body: httpbody.Body, upload: Upload) -> tuple[bytes, bytes]:
    """A replica body's prefix (u32 little-endian length) and its head's bytes, room taken
    for them before they are read (when the body's length was not known up front)."""
    if body.length is None:
        upload.grow(4)
    prefix = body.read_exact(4)
    (size,) = struct.unpack("<I", prefix)
    if not 2 <= size <= MAX_HEAD:
        raise HttpError(400, "bad_head", f"a replica head of {size} bytes (at most {MAX_HEAD})")
    if body.length is None:
        upload.grow(size)
    return prefix, body.read_exact(size)


class OtherStep(HttpError):
    """409: another step of the replica asked for is held (`held_step`)."""

    def __init__(self, held_step: int, message: str) -> None:
        super().__init__(409, "other_step", message)
        self.held_step = held_step


def check_head(head: bytes, want: dict[str, Any]) -> None:
    """The head is a JSON object naming the replica the path names; else HttpError 400."""
    try:
        doc = loads(head, "replica head")
    except BadInput as exc:
        raise HttpError(400, "bad_head", str(exc)) from None
    if not isinstance(doc, dict):
        raise HttpError(400, "bad_head", "the replica head is not a JSON object")
    for key in ("root", "node", "rank", "step"):
        if key not in doc or type(doc[key]) is not type(want[key]) or doc[key] != want[key]:
            raise HttpError(400, "head_mismatch", f"the replica head's {key} is"
                            f" {str(doc.get(key))[:40]!r}, the path's {want[key]!r}")


class _Pieces:
    """A body's parts gathered into chunks of about PIECE bytes (tiny parts are not kept one
    by one: their per-object overhead would outgrow the bytes counted)."""

    def __init__(self) -> None:
        self.chunks: list[bytes] = []
        self._buf = bytearray()

    def add(self, data: bytes) -> None:
        if len(data) >= _SMALL and not self._buf:
            self.chunks.append(data)
            return
        self._buf += data
        if len(self._buf) >= PIECE:
            self.flush()

    def flush(self) -> list[bytes]:
        if self._buf:
            self.chunks.append(bytes(self._buf))
            self._buf = bytearray()
        return self.chunks


class _Reader(Prefixed):
    """A connection's reader. Until a request's proof is checked, its reads wait at most until
    `deadline`: a client that trickles a request's head holds a thread for at most the
    timeout in all, not per read."""

    def __init__(self, sock: socket.socket, timeout: float) -> None:
        super().__init__(b"", sock)
        self._sock, self._timeout = sock, timeout
        self.deadline: float | None = None

    def readinto(self, buf: Any) -> int | None:
        if self.deadline is not None and self._sock.gettimeout() != 0.0:  # 0: Conn.more
            left = self.deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("the request's head did not arrive in time")
            self._sock.settimeout(min(self._timeout, left))
        return super().readinto(buf)

    def hurry(self) -> None:
        self.deadline = time.monotonic() + self._timeout

    def unhurry(self) -> None:
        self.deadline = None
        self._sock.settimeout(self._timeout)


class PeerHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = f"ckptd/{__version__}"
    verifier: Verifier  # these are set on the subclass each server builds
    replicas: Replicas
    node: str
    roots: Callable[[], Iterable[str]] | None = None

    def setup(self) -> None:
        conn: Conn = self.request
        self.connection = conn.sock
        self.connection.settimeout(self.timeout)
        if conn.rfile is None:
            reader = _Reader(self.connection, self.timeout or 30.0)
            conn.rfile = io.BufferedReader(reader, 64 * 1024)
        self.rfile = conn.rfile
        self.reader: _Reader = conn.rfile.raw  # type: ignore[assignment]
        self.wfile = Writer(self.connection)
        self.body_left = False  # a body this request sent that was not read

    def handle(self) -> None:
        self.close_connection = True
        self.handle_one_request()
        while not self.close_connection and self.request.more():
            self.handle_one_request()

    def handle_one_request(self) -> None:
        self.reader.hurry()
        try:
            super().handle_one_request()
        finally:
            self.reader.unhurry()

    def finish(self) -> None:
        """The reader outlives this request (bytes sent ahead stay in it): never closed here."""
        try:
            self.wfile.flush()
        except OSError:
            self.close_connection = True

    def handle_expect_100(self) -> bool:
        return True  # no interim answer before the proof is checked

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        return

    def send_error(self, code: int, message: str | None = None,
                   explain: str | None = None) -> None:
        if code == 501:
            code, name = 405, "method_not_allowed"
        else:
            name = {414: "too_long", 431: "too_large"}.get(code, "bad_request")
        self.close_connection = True
        self._send_json(code, {"error": name, "message": message or explain or "bad request"})

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_PUT(self) -> None:
        self._dispatch("PUT")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def do_DELETE(self) -> None:
        self._dispatch("DELETE")

    def _dispatch(self, method: str) -> None:
        te, length = self.headers.get("Transfer-Encoding"), self.headers.get("Content-Length")
        self.body_left = te is not None or (length is not None and length.strip() != "0")
        try:
            proven = self.verifier.check(method, self.path, self.headers)
            self.reader.unhurry()  # a proven peer's body may take its time, read by read
            route, args = parse_target(self.path)
            if route == "health":
                self._allow(method, "GET")
                self._no_body(proven)
                self._answer_json(200, {"node": self.node, "status": "ok"})
            elif route == "index":
                self._allow(method, "GET")
                self._yours(proven, args["node"])
                self._no_body(proven)
                self._answer_json(200, {**args, "replicas": self.replicas.index(**args)})
            elif method == "PUT":
                self._yours(proven, args["node"])
                self._answer_json(201, self._put(proven, args, te, length))
            else:
                self._allow(method, "GET")
                self._yours(proven, args["node"])
                self._get(proven, args)
        except HttpError as err:
            doc: dict[str, Any] = {"error": err.code, "message": err.message}
            if isinstance(err, OtherStep):
                doc["held_step"] = err.held_step
            self._answer_json(err.status, doc)
        except Exception as exc:  # broad: a bug answering one peer ends its connection only
            get_logger().error("peer_api_error", path=self.path[:200], error=str(exc),
                               exc_info=True)
            self._answer_json(500, {"error": "internal", "message": "internal error"})

    def _allow(self, method: str, allowed: str) -> None:
        if method != allowed:
            raise HttpError(405, "method_not_allowed", f"{method} is not allowed on"
                            f" {self.path[:200]}")

    def _yours(self, proven: Proven, node: str) -> None:
        if proven.node != node:
            raise HttpError(403, "not_yours", f"node {proven.node!r} may not touch the"
                            f" replicas of node {node!r}")

    def _no_body(self, proven: Proven) -> None:
        if proven.body_sha256 != EMPTY_SHA256 or self.body_left:
            raise HttpError(400, "unexpected_body", "a GET carries no body (and signs the"
                            " sha256 of none)")

    def _put(self, proven: Proven, args: dict[str, Any], te: str | None,
             length: str | None) -> dict[str, Any]:
        for name in ("Transfer-Encoding", "Content-Length"):
            if len(self.headers.get_all(name) or []) > 1:
                raise HttpError(400, "bad_request", f"{name} given more than once")
        if self.roots is not None and args["root"] not in set(self.roots()):
            raise HttpError(404, "no_root", f"this daemon has no root {args['root']!r}: it"
                            " holds no replica of it")
        body = httpbody.Body(self.rfile, httpbody.framing(te, length))
        with self.replicas.begin(**args, expect=body.length or 0) as upload:
            prefix, head = read_head(body, upload)
            if not _same_hash(head, proven.body_sha256):
                raise HttpError(401, "bad_proof", "the replica head's sha256 is not the one"
                                " the proof signed")
            check_head(head, args)
            pieces = _Pieces()
            pieces.add(prefix + head)
            while True:
                data = body.read(PIECE)
                if not data:
                    break
                if body.length is None:
                    upload.grow(len(data))
                pieces.add(data)
            self.body_left = False
            replica = upload.commit(pieces.flush())
        get_logger().info("peer_replica_received", root=args["root"], node=args["node"],
                          rank=args["rank"], step=args["step"], bytes=replica.nbytes)
        return {**args, "bytes": replica.nbytes}

    def _get(self, proven: Proven, args: dict[str, Any]) -> None:
        self._no_body(proven)
        held = self.replicas.find(args["root"], args["node"], args["rank"])
        if held is None:
            raise HttpError(404, "not_held", f"no replica of rank {args['rank']} of node"
                            f" {args['node']!r} is held for root {args['root']!r}")
        if held.step != args["step"]:
            raise OtherStep(held.step, f"step {held.step} is held for rank {args['rank']},"
                            f" not step {args['step']}")
        try:
            self.send_response(200)
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("Content-Length", str(held.nbytes))
            self.end_headers()
            for chunk in held.chunks:
                self.wfile.write(chunk)
        except OSError:  # the peer went away or stopped reading (timeout)
            self.close_connection = True

    def _answer_json(self, status: int, payload: dict[str, Any]) -> None:
        if self.body_left:
            self.close_connection = True
        self._send_json(status, payload)
        if self.body_left:
            self._linger()

    def _send_json(self, status: int, payload: dict[str, Any]) -> None:
        data = json.dumps(payload, allow_nan=False).encode() + b"\n"
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            if self.close_connection:
                self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(data)
        except OSError:
            self.close_connection = True

    def _linger(self) -> None:
        """After answering before the body was read: stop sending, and read a little of what
        the peer still sends (for a short while) so that closing does not reset the
        connection before the answer is read."""
        sock = self.connection
        deadline = time.monotonic() + LINGER_S
        dropped = 0
        try:
            sock.shutdown(socket.SHUT_WR)
            while dropped < LINGER_BYTES:
                left = deadline - time.monotonic()
                if left <= 0 or not select.select([sock], [], [], left)[0]:
                    return
                data = sock.recv(256 * 1024)
                if not data:
                    return
                dropped += len(data)
        except OSError:
            return


def _same_hash(head: bytes, want: str) -> bool:
    return hmac.compare_digest(hashlib.sha256(head).hexdigest(), want)


class PeerServer:
    """The peer API on `listen` (host, port; port 0: an ephemeral one), served from its own
    daemon thread once `start`ed. At most `max_threads` requests are answered at once and
    `max_open` connections kept; every read and write waits at most `timeout_s`, and a
    connection idle that long is closed."""

    def __init__(self, listen: tuple[str, int], verifier: Verifier, replicas: Replicas,
                 node: str, timeout_s: float = 30.0, max_threads: int = 16,
                 max_open: int = 256, roots: Callable[[], Iterable[str]] | None = None) -> None:
        """`roots`: the root names a replica may be held for (None: any)."""
        self._listen = listen
        self._handler = type("BoundPeerHandler", (PeerHandler,), {
            "verifier": verifier, "replicas": replicas, "node": node, "timeout": timeout_s,
            "roots": staticmethod(roots) if roots is not None else None})
        self._timeout = timeout_s
        self._threads, self._max_open = max_threads, max_open
        self._loop: ConnectionLoop | None = None
        self._thread: threading.Thread | None = None

    @property
    def address(self) -> tuple[str, int]:
        if self._loop is None:
            raise InternalError("the peer server is not started")
        host, port = self._loop.listener.getsockname()[:2]
        return host, port

    def start(self) -> None:
        host, port = self._listen
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.create_server((host, port), family=family, backlog=128)
        self._loop = ConnectionLoop(sock, self._answer, self._threads, self._max_open,
                                    self._timeout)
        self._thread = threading.Thread(target=self._loop.run, name="ckptd-peers",
                                        daemon=True)
        self._thread.start()

    def _answer(self, conn: Conn) -> bool:
        try:
            handler = self._handler(conn, conn.sock.getpeername()[:2], self)
        except OSError:
            return False
        except Exception as exc:  # broad: a bug answering one peer ends its connection only
            get_logger().error("peer_api_error", error=f"{type(exc).__name__}: {exc}",
                               exc_info=True)
            return False
        return not handler.close_connection

    def stop(self) -> None:
        if self._loop is not None:
            self._loop.stop()

    def close(self) -> None:
        if self._loop is not None:
            self._loop.stop()
            self._loop.close()
            self._loop = None
