"""HTTP/1.1 + JSON over the daemon's Unix socket (SPEC "Socket API").

Reads the store, records intents (registrations, pins) and wakes the scanner and pipeline.
Never runs a stage itself and never blocks the accept loop (one thread per connection).
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import socket
import socketserver
import threading
import time
import urllib.parse
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

from ckptd import __version__
from ckptd.changes import Changes
from ckptd.log import get_logger
from ckptd.model import CheckpointRecord, Remote, State, Tier
from ckptd.store import Store

MAX_BODY = 1024 * 1024
MAX_WAIT_S = 3600.0
MAX_STEP = 2**63 - 1  # SQLite's INTEGER: a larger step is refused at the door, not a 500


class HttpError(Exception):
    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message


@dataclass(frozen=True)
class RootView:
    """What the API needs of one root's config."""

    name: str
    path: Path
    metric: str
    metric_mode: str
    upload_enabled: bool


class ApiContext:
    """Everything a request handler may touch, built by the daemon."""

    def __init__(self, store: Store, roots: Callable[[], Mapping[str, RootView]], changes: Changes,
                 wake_scan: Callable[[], None], in_flight: Callable[[], list[dict[str, Any]]],
                 extra_routes: Mapping[tuple[str, str], Callable[..., Any]] | None = None) -> None:
        self.store = store
        self.roots = roots
        self.changes = changes
        self.wake_scan = wake_scan
        self.in_flight = in_flight
        self.started = time.monotonic()
        self.stopping = threading.Event()
        self.extra_routes = dict(extra_routes or {})
        self.metrics_text: Callable[[], str] = lambda: ""
        # Retention hooks, set by the daemon: the plan (dry run), and a run now.
        self.prune_plan: Callable[[str], dict[str, Any]] = lambda root: {"root": root, "plan": []}
        self.prune_now: Callable[[str], list[dict[str, Any]]] = lambda root: []
        self.root_health: Callable[[str], dict[str, Any] | None] = lambda root: None
        self.refresh_remote: Callable[[str], None] = lambda root: None
        self.flush: Callable[[], dict[str, int]] = lambda: {}
        # Held by retention while it deletes: a pin or a reader's lease waits for the run to
        # end, so the safety nets a run checked are never out of date while it acts.
        self.retention_lock: Any = threading.RLock()
        self.flushing: Callable[[], dict[str, int]] = lambda: {}

    def uptime(self) -> float:
        return round(time.monotonic() - self.started, 3)

    def root(self, name: str) -> RootView:
        root = self.roots().get(name)
        if root is None:
            raise HttpError(404, "no_root", f"no root named {name!r} in the config")
        return root

    # -- views -------------------------------------------------------------------------------

    def health(self) -> dict[str, Any]:
        return {"status": "ok", "version": __version__, "uptime_s": self.uptime()}

    def status(self) -> dict[str, Any]:
        roots = [self.root_status(r) for r in self.roots().values()]
        return {"status": "stopping" if self.stopping.is_set() else "ok", "version": __version__,
                "uptime_s": self.uptime(), "roots": roots, "in_flight": self.in_flight(),
                "flushing": [{"root": r, "step": s} for r, s in self.flushing().items()]}

    def root_status(self, root: RootView) -> dict[str, Any]:
        latest = self.store.latest(root.name)
        best = self.store.best(root.name, root.metric, root.metric_mode)
        return {
            "name": root.name, "path": str(root.path),
            "latest": latest.step if latest else None,
            "best": best.step if best else None,
            "counts": self.store.counts(root.name),
            "queue": self.store.queue_length(root.name, uploads=root.upload_enabled),
            "disk_free_bytes": disk_free(root.path),
            "last_error": self.store.root_info(root.name)["last_error"] or None,
            "preflight": self.root_health(root.name),
        }

    def listing(self, root: RootView) -> dict[str, Any]:
        self.refresh_remote(root.name)
        return {"root": root.name,
                "checkpoints": [c.as_json() for c in self.store.checkpoints(root.name)]}

    def latest(self, root: RootView, tier: Tier) -> dict[str, Any]:
        rec = self.store.latest(root.name, tier)
        if rec is None:
            raise HttpError(404, "no_checkpoint", f"root {root.name!r} has no valid checkpoint"
                            f" in tier {tier.value!r}")
        return latest_json(root, rec)


def latest_json(root: RootView, rec: CheckpointRecord) -> dict[str, Any]:
    return {"root": root.name, "step": rec.step, "path": str(root.path / rec.path),
            "state": str(rec.state), "local": str(rec.local), "remote": str(rec.remote),
            "layout": rec.layout, "metrics": rec.metrics}


def disk_free(path: Path) -> int | None:
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


# -- routing -----------------------------------------------------------------------------------

_ROUTES: list[tuple[str, re.Pattern[str], str]] = [
    ("GET", re.compile(r"^/v1/health$"), "health"),
    ("GET", re.compile(r"^/v1/status$"), "status"),
    ("GET", re.compile(r"^/metrics$"), "metrics"),
    ("POST", re.compile(r"^/v1/flush$"), "flush"),
    ("GET", re.compile(r"^/v1/roots/(?P<root>[^/]+)/checkpoints$"), "list"),
    ("POST", re.compile(r"^/v1/roots/(?P<root>[^/]+)/checkpoints$"), "register"),
    ("GET", re.compile(r"^/v1/roots/(?P<root>[^/]+)/latest$"), "latest"),
    ("GET", re.compile(r"^/v1/roots/(?P<root>[^/]+)/checkpoints/(?P<step>[^/]+)$"), "one"),
    ("PUT", re.compile(r"^/v1/roots/(?P<root>[^/]+)/checkpoints/(?P<step>[^/]+)/pin$"), "pin"),
    ("DELETE", re.compile(r"^/v1/roots/(?P<root>[^/]+)/checkpoints/(?P<step>[^/]+)/pin$"),
     "unpin"),
    ("GET", re.compile(r"^/v1/roots/(?P<root>[^/]+)/checkpoints/(?P<step>[^/]+)/wait$"), "wait"),
    ("PUT", re.compile(r"^/v1/roots/(?P<root>[^/]+)/checkpoints/(?P<step>[^/]+)/lease$"),
     "lease"),
    ("DELETE", re.compile(r"^/v1/roots/(?P<root>[^/]+)/checkpoints/(?P<step>[^/]+)/lease$"),
     "unlease"),
    ("GET", re.compile(r"^/v1/roots/(?P<root>[^/]+)/prune$"), "prune_plan"),
    ("POST", re.compile(r"^/v1/roots/(?P<root>[^/]+)/prune$"), "prune_now"),
]


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = f"ckptd/{__version__}"
    # An idle keep-alive connection gives its thread back after this long (long-polls are
    # capped well below it by their own timeout; clients reconnect freely).
    timeout = MAX_WAIT_S + 60
    ctx: ApiContext  # set on the subclass the server builds

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        return  # access logs would drown journald; errors are logged as events

    def address_string(self) -> str:
        return "unix"

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
        except HttpError as err:
            status, payload = err.status, {"error": err.code, "message": err.message}
        except Exception as exc:  # never let a bug kill the connection thread silently
            get_logger().error("api_error", path=url.path, error=str(exc), exc_info=True)
            status, payload = 500, {"error": "internal", "message": str(exc)}
        self._send(status, payload)

    def _route(self, method: str, path: str, query: dict[str, str], body: Any
               ) -> tuple[int, Any]:
        extra = self.ctx.extra_routes.get((method, path))
        if extra is not None:
            return 200, extra(query, body)
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
        raw = self.rfile.read(length) if length else b""
        if not raw:
            return None
        try:
            return json.loads(raw, parse_constant=_no_constant, parse_float=_finite_float)
        except (ValueError, RecursionError) as exc:
            raise HttpError(400, "bad_json", f"request body is not valid JSON: {exc}") from exc

    def _send(self, status: int, payload: Any) -> None:
        if isinstance(payload, str):
            data, ctype = payload.encode(), "text/plain; version=0.0.4; charset=utf-8"
        else:
            data, ctype = json.dumps(payload).encode() + b"\n", "application/json"
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
        targets = self.ctx.flush()
        return 200, {"flushing": [{"root": r, "step": s} for r, s in targets.items()]}

    def h_metrics(self, **_: Any) -> tuple[int, Any]:
        return 200, self.ctx.metrics_text()

    def h_list(self, root: str, **_: Any) -> tuple[int, Any]:
        return 200, self.ctx.listing(self.ctx.root(root))

    def h_one(self, root: str, step: str, **_: Any) -> tuple[int, Any]:
        r = self.ctx.root(root)
        rec = self._record(r, _step(step))
        return 200, {"root": r.name, **rec.as_json()}

    def h_latest(self, root: str, query: dict[str, str], **_: Any) -> tuple[int, Any]:
        return 200, self.ctx.latest(self.ctx.root(root), _tier(query.get("tier", "any")))

    def h_register(self, root: str, body: Any, **_: Any) -> tuple[int, Any]:
        self._not_stopping()
        r = self.ctx.root(root)
        step, paths, metrics = parse_registration(body, r.path)
        self.ctx.store.register(r.name, step, paths, metrics, time.time())
        get_logger().info("checkpoint_registered", root=r.name, step=step, paths=len(paths))
        self.ctx.wake_scan()
        return 202, {"root": r.name, "step": step, "accepted": True}

    def h_pin(self, root: str, step: str, **_: Any) -> tuple[int, Any]:
        return self._set_pin(root, step, True)

    def h_unpin(self, root: str, step: str, **_: Any) -> tuple[int, Any]:
        return self._set_pin(root, step, False)

    def _set_pin(self, root: str, step: str, pinned: bool) -> tuple[int, Any]:
        r = self.ctx.root(root)
        n = _step(step)
        with self.ctx.retention_lock:
            done = self.ctx.store.set_pinned(r.name, n, pinned)
        if not done:
            raise HttpError(404, "no_checkpoint", f"root {r.name!r} has no step {n}")
        get_logger().info("checkpoint_pinned" if pinned else "checkpoint_unpinned",
                          root=r.name, step=n)
        self.ctx.changes.notify()
        return 200, {"root": r.name, "step": n, "pinned": pinned}

    def h_lease(self, root: str, step: str, query: dict[str, str], **_: Any) -> tuple[int, Any]:
        """A reader (a resume, a restore) holds `step`: retention never deletes it meanwhile."""
        r = self.ctx.root(root)
        rec = self._record(r, _step(step))
        owner = query.get("owner", "")
        if not owner or len(owner) > 128:
            raise HttpError(400, "bad_field", "owner must be a non-empty id (<= 128 chars)")
        ttl = min(max(_float(query.get("ttl", "600"), "ttl"), 1.0), 86400.0)
        with self.ctx.retention_lock:
            rec = self._record(r, rec.step)
            if rec.local.value == "pruned" and rec.remote is not Remote.UPLOADED:
                raise HttpError(409, "gone", f"step {rec.step} of {r.name!r} has no copy left")
            self.ctx.store.lease_reader(r.name, rec.step, owner, time.time() + ttl)
        return 200, {"root": r.name, "step": rec.step, "owner": owner, "ttl_s": ttl}

    def h_unlease(self, root: str, step: str, query: dict[str, str], **_: Any) -> tuple[int, Any]:
        r = self.ctx.root(root)
        n = _step(step)
        self.ctx.store.release_reader(r.name, n, query.get("owner", ""))
        return 200, {"root": r.name, "step": n, "released": True}

    def h_prune_plan(self, root: str, **_: Any) -> tuple[int, Any]:
        return 200, self.ctx.prune_plan(self.ctx.root(root).name)

    def h_prune_now(self, root: str, **_: Any) -> tuple[int, Any]:
        self._not_stopping()
        r = self.ctx.root(root)
        return 200, {"root": r.name, "outcomes": self.ctx.prune_now(r.name)}

    def h_wait(self, root: str, step: str, query: dict[str, str], **_: Any) -> tuple[int, Any]:
        r = self.ctx.root(root)
        n = _step(step)
        until = query.get("until", "valid")
        if until not in ("valid", "uploaded"):
            raise HttpError(400, "bad_field", "until must be 'valid' or 'uploaded'")
        if until == "uploaded" and not r.upload_enabled:
            raise HttpError(409, "upload_not_configured",
                            f"root {r.name!r} has no upload.url; it never uploads")
        timeout = _float(query.get("timeout", "30"), "timeout")
        return self._wait(r, n, until, min(max(timeout, 0.0), MAX_WAIT_S))

    def _wait(self, r: RootView, step: int, until: str, timeout: float) -> tuple[int, Any]:
        deadline = time.monotonic() + timeout
        gen = self.ctx.changes.generation
        while True:
            rec = self.ctx.store.checkpoint(r.name, step)
            if rec is not None:
                if rec.state is State.INVALID:
                    raise HttpError(409, "invalid", f"step {step} is invalid: {rec.reason}:"
                                    f" {rec.message}")
                if _reached(rec, until):
                    return 200, {"root": r.name, **rec.as_json()}
            left = deadline - time.monotonic()
            if left <= 0 or self.ctx.stopping.is_set():
                break
            gen = self.ctx.changes.wait(gen, min(left, 1.0))
        raise HttpError(408, "timeout", f"step {step} did not become {until} within {timeout}s")

    def _record(self, r: RootView, step: int) -> CheckpointRecord:
        rec = self.ctx.store.checkpoint(r.name, step)
        if rec is None:
            raise HttpError(404, "no_checkpoint", f"root {r.name!r} has no step {step}")
        return rec

    def _not_stopping(self) -> None:
        if self.ctx.stopping.is_set():
            raise HttpError(503, "shutting_down", "ckptd is shutting down")


def _reached(rec: CheckpointRecord, until: str) -> bool:
    if until == "valid":
        return rec.state is State.VALID
    # A step retention has since removed remotely did reach "uploaded".
    return rec.state is State.VALID and rec.remote in (Remote.UPLOADED, Remote.PRUNED)


def _step(text: str) -> int:
    # isascii: "²" is a digit to str.isdigit; the length keeps int() off huge strings.
    if not (text.isascii() and text.isdigit()) or len(text) > 19 or int(text) > MAX_STEP:
        raise HttpError(400, "bad_field", f"step must be an integer from 0 to {MAX_STEP},"
                        f" got {text[:40]!r}")
    return int(text)


def _tier(text: str) -> Tier:
    try:
        return Tier(text)
    except ValueError as exc:
        raise HttpError(400, "bad_field", "tier must be any, local or remote") from exc


def _float(text: str, name: str) -> float:
    try:
        value = float(text)
    except ValueError as exc:
        raise HttpError(400, "bad_field", f"{name} must be a number of seconds") from exc
    if not math.isfinite(value):
        raise HttpError(400, "bad_field", f"{name} must be a finite number of seconds")
    return value


def _no_constant(name: str) -> Any:
    """JSON is strict here: NaN and Infinity are not JSON numbers."""
    raise ValueError(f"{name} is not a JSON number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e999 parses as infinity
        raise ValueError(f"{text[:40]} is out of range")
    return value


def parse_registration(body: Any, root_path: Path) -> tuple[int, list[str], dict[str, float]]:
    """Check a registration body; paths become root-relative. Raises HttpError."""
    if not isinstance(body, dict):
        raise HttpError(400, "bad_json", "body must be a JSON object with a 'step'")
    unknown = set(body) - {"step", "paths", "metrics"}
    if unknown:
        raise HttpError(400, "bad_field", f"unknown field(s): {', '.join(sorted(unknown))}")
    step = body.get("step")
    if not isinstance(step, int) or isinstance(step, bool) or not 0 <= step <= MAX_STEP:
        raise HttpError(400, "bad_field", f"step must be an integer from 0 to {MAX_STEP}")
    paths = body.get("paths") or []
    if not isinstance(paths, list) or not all(isinstance(p, str) and p for p in paths):
        raise HttpError(400, "bad_field", "paths must be a list of non-empty strings")
    metrics = body.get("metrics") or {}
    if not isinstance(metrics, dict) or not all(
        isinstance(k, str) and isinstance(v, int | float) and not isinstance(v, bool)
        for k, v in metrics.items()
    ):
        raise HttpError(400, "bad_field", "metrics must map names to numbers")
    rel = [relative_inside(root_path, p) for p in paths]
    return step, rel, {k: float(v) for k, v in metrics.items()}


def relative_inside(root: Path, p: str) -> str:
    """`p` (absolute, or relative to the root) as a root-relative path; 422 when it leaves
    the root, directly or through a symlink."""
    candidate = Path(p) if os.path.isabs(p) else root / p
    real_root = os.path.realpath(root)
    real = os.path.realpath(candidate)
    if real != real_root and not real.startswith(real_root + os.sep):
        raise HttpError(422, "outside_root", f"{p} is outside the root {root}")
    rel = os.path.relpath(real, real_root)
    if rel == "." or rel.split(os.sep)[0] == ".ckptd":
        raise HttpError(422, "outside_root", f"{p} is not a checkpoint path inside {root}")
    return rel.replace(os.sep, "/")


class UnixHttpServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True
    allow_reuse_address = False

    def __init__(self, sock: socket.socket, ctx: ApiContext) -> None:
        handler = type("BoundHandler", (Handler,), {"ctx": ctx})
        super().__init__(str(sock.getsockname()), handler, bind_and_activate=False)
        self.socket.close()
        self.socket = sock

    def serve_forever(self, poll_interval: float = 0.1) -> None:
        # shutdown() waits for this loop to notice it: a short poll keeps a stop prompt
        # (the default 0.5 s added half a second to every SIGTERM).
        super().serve_forever(poll_interval)

    def get_request(self) -> tuple[socket.socket, Any]:
        conn, _ = self.socket.accept()
        return conn, ("unix", 0)


def bind_socket(path: Path, group: str = "") -> socket.socket:
    """Bind the Unix socket at `path` with mode 0660 (and `group` when given). A stale socket
    file is replaced; a live one (another daemon answering) is an error."""
    import grp

    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists() or path.is_symlink():
        if _alive(path):
            raise OSError(f"another process is serving on {path}")
        path.unlink()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o117)  # the file is created 0660: never a window where it is wider
    try:
        sock.bind(str(path))
    finally:
        os.umask(old)
    os.chmod(path, 0o660)
    if group:
        os.chown(path, -1, grp.getgrnam(group).gr_gid)
    sock.listen(64)
    return sock


def _alive(path: Path) -> bool:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(1.0)
    try:
        s.connect(str(path))
        return True
    except OSError:
        return False
    finally:
        s.close()
