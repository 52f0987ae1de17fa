"""HTTP/1.1 + JSON over the daemon's Unix socket (docs/CLI.md, "Socket API"); what a client
sends is checked by `ckptd.api.checks`.

Reads the store, records intents (registrations, pins) and wakes the scanner and pipeline.
Never runs a stage itself and never blocks the accept loop: connections are watched by
`ckptd.api.door.ConnectionLoop`, and only one with a request to read takes a thread.
"""

from __future__ import annotations

import io
import json
import os
import re
import socket
import struct
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler
from typing import Any

from ckptd import __version__
from ckptd.api import checks
from ckptd.api.documents import ApiContext
from ckptd.api.door import Conn, ConnectionLoop, Prefixed, Writer, recv_first
from ckptd.config import RootConfig
from ckptd.errors import HttpError, ServiceUnavailable
from ckptd.lifecycle import answers
from ckptd.log import get_logger
from ckptd.model import CheckpointRecord, State, Tier
from ckptd.store import Store

MAX_BODY = 1024 * 1024
MAX_WAIT_S = 3600.0
# Requests answered at once (threads; long-polls included); connections kept open (idle ones
# cost a descriptor, not a thread: past this the longest idle are closed); how long an idle
# connection is kept, and how long a request may take to arrive once it has begun.
MAX_THREADS = 512
MAX_OPEN = 4096
IDLE_TIMEOUT_S = 5.0


# -- routing -----------------------------------------------------------------------------------

_ROOT = r"^/v1/roots/(?P<root>[^/]+)"
_STEP = _ROOT + r"/checkpoints/(?P<step>[^/]+)"
_ROUTES: list[tuple[str, re.Pattern[str], str]] = [
    (m, re.compile(p + "$"), name) for m, p, name in [
    ("GET", r"^/v1/health", "health"),
    ("GET", r"^/v1/status", "status"),
    ("GET", r"^/metrics", "metrics"),
    ("POST", r"^/v1/flush", "flush"),
    ("POST", r"^/v1/persist", "persist"),
    ("GET", r"^/v1/persist/(?P<job>[0-9a-f]{1,64})", "persist_outcome"),
    ("POST", r"^/v1/memory/open", "memory_open"),
    ("GET", _ROOT + "/checkpoints", "list"),
    ("POST", _ROOT + "/checkpoints", "register"),
    ("GET", _ROOT + "/latest", "latest"),
    ("GET", _STEP, "one"),
    ("PUT", _STEP + "/pin", "pin"),
    ("DELETE", _STEP + "/pin", "unpin"),
    ("GET", _STEP + "/wait", "wait"),
    ("PUT", _STEP + "/hold", "hold"),
    ("DELETE", _STEP + "/hold", "release_hold"),
    ("PUT", _STEP + "/lease", "hold"),  # deprecated name of /hold (docs/CLI.md)
    ("DELETE", _STEP + "/lease", "release_hold"),
    ("GET", _ROOT + "/prune", "prune_plan"),
    ("POST", _ROOT + "/prune", "prune_now"),
]]


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = f"ckptd/{__version__}"
    # An idle keep-alive connection (no next request) gives its thread back after this long;
    # a long-poll is not idle reading, so its own timeout (<= MAX_WAIT_S) bounds it.
    timeout = IDLE_TIMEOUT_S
    ctx: ApiContext  # set on the subclass the server builds

    def setup(self) -> None:
        """Called when the connection (`self.request`, a `Conn`) has bytes to read. Its first
        bytes are read with recvmsg: an async save sends its arena's descriptor with them
        (SCM_RIGHTS), which a plain read would drop. The reader outlives this request."""
        conn: Conn = self.request
        self.connection = conn.sock
        self.connection.settimeout(self.timeout)
        self.passed_fds: list[int] = []
        if conn.rfile is None:
            try:
                first, fds = recv_first(self.connection)
            except OSError:
                first = b""
            else:
                self.passed_fds = fds
            conn.rfile = io.BufferedReader(Prefixed(first, self.connection))
        self.rfile = conn.rfile
        self.writer = Writer(self.connection)
        self.wfile = self.writer

    def handle(self) -> None:
        """The requests the client has sent: one, and more only if they are already here
        (waiting for a next request is the connection loop's job, not a thread's)."""
        self.close_connection = True
        self.handle_one_request()
        while not self.close_connection and self.request.more():
            self.handle_one_request()

    def finish(self) -> None:
        self._close_fds()

    def _close_fds(self) -> None:
        for fd in self.passed_fds:
            os.close(fd)
        self.passed_fds = []

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        return  # access logs would drown journald; errors are logged as events

    def address_string(self) -> str:
        return "unix"

    def send_error(self, code: int, message: str | None = None,
                   explain: str | None = None) -> None:
        """Errors http.server raises itself (a malformed request line, a method no route
        has, headers too long) answer in the API's JSON shape too."""
        if code == 501:  # a method with no handler at all
            code, name = 405, "method_not_allowed"
        else:
            name = {400: "bad_request", 414: "too_long", 431: "too_large"}.get(code, "bad_request")
        self.close_connection = True
        self._send(code, {"error": name, "message": message or explain or "bad request"})

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def do_PUT(self) -> None:
        self._dispatch("PUT")

    def do_DELETE(self) -> None:
        self._dispatch("DELETE")

    def _dispatch(self, method: str) -> None:
        url = urllib.parse.urlsplit(self.path)
        query = {k: v[-1] for k, v in urllib.parse.parse_qs(url.query).items()}
        try:
            body = self._body() if method in ("POST", "PUT") else None
            status, payload = self._route(method, url.path, query, body)
            if status < 0:
                return  # answered by the handler itself (descriptors went with it)
        except HttpError as err:
            status, payload = err.status, {"error": err.code, "message": err.message}
        except Exception as exc:  # broad: never let a bug kill the connection thread silently
            get_logger().error("api_error", path=url.path, error=str(exc), exc_info=True)
            status, payload = 500, {"error": "internal", "message": str(exc)}
        self._close_fds()  # a descriptor no handler took is never kept
        self._send(status, payload)

    def _route(self, method: str, path: str, query: dict[str, str], body: Any
               ) -> tuple[int, Any]:
        allowed = False
        for m, pattern, name in _ROUTES:
            match = pattern.match(path)
            if match is None:
                continue
            if m != method:
                allowed = True
                continue
            args = {k: urllib.parse.unquote(v) for k, v in match.groupdict().items()}
            return getattr(self, f"h_{name}")(query=query, body=body, **args)  # type: ignore[no-any-return]
        if allowed:
            raise HttpError(405, "method_not_allowed", f"{method} is not allowed on {path}")
        raise HttpError(404, "not_found", f"no endpoint {path}")

    def _body(self) -> Any:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            raise HttpError(411, "length_required", "send a Content-Length, not chunked bodies")
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError as exc:
            raise HttpError(400, "bad_request", "Content-Length is not a number") from exc
        if length < 0:
            self.close_connection = True
            raise HttpError(400, "bad_request", "Content-Length is negative")
        if length > MAX_BODY:
            self.close_connection = True
            raise HttpError(413, "too_large", f"request body over {MAX_BODY} bytes")
        raw = self._read_body(length) if length else b""
        if not raw:
            return None
        try:
            return json.loads(raw, parse_constant=checks.no_constant,
                              parse_float=checks.finite_float)
        except (ValueError, RecursionError) as exc:
            raise HttpError(400, "bad_json", f"request body is not valid JSON: {exc}") from exc

    def _read_body(self, length: int) -> bytes:
        """The body's `length` bytes, within the connection's read timeout: a body that never
        comes is 408, one cut short is 400 (never a 500); the connection is closed after."""
        try:
            raw = self.rfile.read(length)
        except TimeoutError:
            self.close_connection = True
            raise HttpError(408, "request_timeout", f"the request body ({length} bytes) did"
                            f" not arrive within {self.timeout} s") from None
        except OSError as exc:
            self.close_connection = True
            raise HttpError(400, "bad_request", f"the request body could not be read:"
                            f" {exc.strerror or exc}") from None
        if len(raw) != length:
            self.close_connection = True
            raise HttpError(400, "bad_request", f"the request body ended after {len(raw)} of"
                            f" its {length} bytes (Content-Length)")
        return raw

    def _send(self, status: int, payload: Any) -> None:
        if isinstance(payload, str):
            data, ctype = payload.encode(), "text/plain; version=0.0.4; charset=utf-8"
        else:
            data = json.dumps(payload, allow_nan=False).encode() + b"\n"
            ctype = "application/json"
        try:
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True

    # -- handlers ----------------------------------------------------------------------------

    def h_health(self, **_: Any) -> tuple[int, Any]:
        return 200, self.ctx.health()

    def h_status(self, **_: Any) -> tuple[int, Any]:
        return 200, self.ctx.status()

    def h_flush(self, **_: Any) -> tuple[int, Any]:
        self._not_stopping()
        targets = self.ctx.workers.flush()
        return 200, {"flushing": [{"root": r, "step": s} for r, s in targets.items()]}

    def h_persist(self, body: Any, **_: Any) -> tuple[int, Any]:
        """An async save: the arena's descriptor came with this request's first bytes."""
        self._not_stopping()
        fds, self.passed_fds = self.passed_fds, []
        if len(fds) != 1:
            for fd in fds:
                os.close(fd)
            raise HttpError(400, "no_arena", "send exactly one arena descriptor (SCM_RIGHTS)"
                            " with the first bytes of a new connection")
        return 202, self.ctx.persist.accept(fds[0], body, self._peer())

    def _peer(self) -> tuple[int, int, int]:
        """The client's (pid, uid, gid), as the kernel gives them (SO_PEERCRED)."""
        pid, uid, gid = struct.unpack("3i", self.connection.getsockopt(
            socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
        return pid, uid, gid

    def h_memory_open(self, body: Any, **_: Any) -> tuple[int, Any]:
        """A restarted trainer's state from memory: the kept arenas' descriptors go with the
        answer's first bytes (SCM_RIGHTS), as the save's came with the request's."""
        self._not_stopping()
        root, step, rank = checks.memory_request(body)
        with self.ctx.memory.open(root, step, rank, self._peer()) as (doc, fds):
            self.writer.attach(fds)
            try:
                self._send(200, doc)
            finally:
                self.writer.attach([])  # never sent with a later answer, whatever happened
        return -1, None

    def h_persist_outcome(self, job: str, query: dict[str, str], **_: Any) -> tuple[int, Any]:
        timeout = checks.number(query.get("timeout", "0"), "timeout", 0.0, MAX_WAIT_S)
        outcome = self.ctx.persist.outcome(job, timeout)
        if outcome is None:
            raise HttpError(404, "no_job", f"this daemon holds no async save {job} (it was"
                            " taken by a daemon that is gone, or long forgotten)")
        return (408 if outcome["state"] == "running" else 200), outcome

    def h_metrics(self, **_: Any) -> tuple[int, Any]:
        return 200, self.ctx.metrics.render()

    def h_list(self, root: str, **_: Any) -> tuple[int, Any]:
        return 200, self.ctx.listing(self.ctx.root(root))

    def h_one(self, root: str, step: str, **_: Any) -> tuple[int, Any]:
        r = self.ctx.root(root)
        rec = _record(self.ctx.store, r, checks.step(step))
        return 200, {"root": r.name, **rec.as_json()}

    def h_latest(self, root: str, query: dict[str, str], **_: Any) -> tuple[int, Any]:
        return 200, self.ctx.latest(self.ctx.root(root), checks.tier(query.get("tier", "any")))

    def h_register(self, root: str, body: Any, **_: Any) -> tuple[int, Any]:
        self._not_stopping()
        r = self.ctx.root(root)
        step, paths, metrics = checks.parse_registration(body, r.path)
        taken = checks.taken(self.ctx.store.owners(r.name), paths, step)
        if taken:
            p, other = taken[0]
            raise HttpError(409, "path_taken", f"{p} belongs to step {other} of root {r.name!r}"
                            f" ({len(taken)} registered path(s) do): a file belongs to one"
                            " checkpoint only")
        self.ctx.store.register(r.name, step, paths, metrics, self.ctx.clock.time())
        get_logger().info("checkpoint_registered", root=r.name, step=step, paths=len(paths))
        self.ctx.scan.wake()
        return 202, {"root": r.name, "step": step, "accepted": True}

    def h_pin(self, root: str, step: str, **_: Any) -> tuple[int, Any]:
        return 200, self.ctx.set_pin(root, step, True)

    def h_unpin(self, root: str, step: str, **_: Any) -> tuple[int, Any]:
        return 200, self.ctx.set_pin(root, step, False)

    def h_hold(self, root: str, step: str, query: dict[str, str], **_: Any) -> tuple[int, Any]:
        """A reader's *hold* (a resume, a restore): retention never deletes `step` meanwhile."""
        r = self.ctx.root(root)
        self.ctx.acting(r)
        n = checks.step(step)
        owner = checks.owner(query.get("owner", ""))
        ttl = checks.number(query.get("ttl", "600"), "ttl", 1.0, 86400.0)
        with self.ctx.retention.nets:
            rec = _record(self.ctx.store, r, n)
            if not answers.in_tier(rec, Tier.ANY):
                raise HttpError(409, "gone", f"step {rec.step} of {r.name!r} has no copy left")
            self.ctx.store.hold(r.name, rec.step, owner, self.ctx.clock.time() + ttl)
        return 200, {"root": r.name, "step": rec.step, "owner": owner, "ttl_s": ttl}

    def h_release_hold(self, root: str, step: str, query: dict[str, str], **_: Any
                       ) -> tuple[int, Any]:
        r = self.ctx.root(root)
        n = checks.step(step)
        self.ctx.store.release_hold(r.name, n, checks.text(query.get("owner", ""), "owner"))
        return 200, {"root": r.name, "step": n, "released": True}

    def h_prune_plan(self, root: str, **_: Any) -> tuple[int, Any]:
        return 200, self.ctx.retention.plan_json(self.ctx.root(root))

    def h_prune_now(self, root: str, **_: Any) -> tuple[int, Any]:
        self._not_stopping()
        r = self.ctx.root(root)
        self.ctx.acting(r)
        try:
            outcomes = self.ctx.retention.apply_now(r)
        except ServiceUnavailable as exc:
            raise HttpError(503, "retention_unavailable", str(exc)) from exc
        return 200, {"root": r.name, "outcomes": outcomes}

    def h_wait(self, root: str, step: str, query: dict[str, str], **_: Any) -> tuple[int, Any]:
        r = self.ctx.root(root)
        self.ctx.acting(r)  # a standby never sees the step: say so instead of waiting it out
        n = checks.step(step)
        until = query.get("until", "valid")
        if until not in ("valid", "uploaded"):
            raise HttpError(400, "bad_field", "until must be 'valid' or 'uploaded'")
        if until == "uploaded" and not r.upload.enabled:
            raise HttpError(409, "upload_not_configured",
                            f"root {r.name!r} has no upload.url; it never uploads")
        timeout = checks.number(query.get("timeout", "30"), "timeout", 0.0, MAX_WAIT_S)
        return self._wait(r, n, until, min(max(timeout, 0.0), MAX_WAIT_S))

    def _wait(self, r: RootConfig, step: int, until: str, timeout: float) -> tuple[int, Any]:
        """Answers once the store shows `until`, looking again only after a change was
        announced: the effects hook announces a transition after carrying out its effects
        (latest.json rewritten), so a waiter never returns ahead of them."""
        deadline = time.monotonic() + timeout
        gen = self.ctx.changes.generation
        changed = True
        while True:
            rec = self.ctx.store.checkpoint(r.name, step) if changed else None
            if rec is not None:
                if rec.state is State.INVALID:
                    raise HttpError(409, "invalid", f"step {step} is invalid: {rec.reason}:"
                                    f" {rec.message}")
                if _reached(rec, until):
                    return 200, {"root": r.name, **rec.as_json()}
            left = deadline - time.monotonic()
            if left <= 0 or self.ctx.stopping.is_set():
                break
            new = self.ctx.changes.wait(gen, min(left, 1.0))
            changed, gen = new != gen, new
        raise HttpError(408, "timeout", f"step {step} did not become {until} within {timeout}s")

    def _not_stopping(self) -> None:
        if self.ctx.stopping.is_set():
            raise HttpError(503, "shutting_down", "ckptd is shutting down")


def _record(store: Store, r: RootConfig, step: int) -> CheckpointRecord:
    rec = store.checkpoint(r.name, step)
    if rec is None:
        raise HttpError(404, "no_checkpoint", f"root {r.name!r} has no step {step}")
    return rec


def _reached(rec: CheckpointRecord, until: str) -> bool:
    if until == "valid":
        return rec.state is State.VALID
    # A step retention has since removed remotely did reach "uploaded".
    return rec.state is State.VALID and answers.was_committed(rec)


class UnixHttpServer:
    """The API on a bound, listening Unix socket. One loop thread (`serve_forever`) watches
    every connection; at most MAX_THREADS requests are answered at once; an idle connection
    holds no thread, is closed after IDLE_TIMEOUT_S, and the longest idle go first when
    MAX_OPEN are open or descriptors run out. A burst waits in the listen backlog."""

    def __init__(self, sock: socket.socket, ctx: ApiContext) -> None:
        self.socket = sock
        self._handler = type("BoundHandler", (Handler,), {"ctx": ctx})
        self._loop = ConnectionLoop(sock, self._answer, MAX_THREADS, MAX_OPEN, IDLE_TIMEOUT_S)

    def _answer(self, conn: Conn) -> bool:
        """Answer what `conn` sent; True to keep the connection open for its next request."""
        try:
            handler = self._handler(conn, ("unix", 0), self)
        except OSError:  # the client went away mid-request (reset, broken pipe)
            return False
        except Exception as exc:  # broad: a bug answering one client ends its connection
            get_logger().error("api_error", error=f"{type(exc).__name__}: {exc}", exc_info=True)
            return False
        return not handler.close_connection

    def serve_forever(self, poll_interval: float = 0.1) -> None:
        # shutdown() waits for this loop to notice it: a short poll keeps a stop prompt.
        self._loop.run(poll_interval)

    def shutdown(self) -> None:
        self._loop.stop()

    def server_close(self) -> None:
        self._loop.close()

    def open_connections(self) -> int:
        return self._loop.open_connections()
