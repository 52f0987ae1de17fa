"""Client for training processes: talk to the local ckptd daemon over its Unix socket.

Standard library only and cheap to import. Never raises into a training loop unless
`strict=True`: failures log a warning and return None/False. Imports nothing else of ckptd.
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import socket as _socket
import time
import urllib.parse
from pathlib import Path
from typing import Any

DEFAULT_SOCKET = "/run/ckptd/ckptd.sock"
log = logging.getLogger("ckptd.client")


class ClientError(Exception):
    """The daemon answered with an error, or could not be reached (`status` is 0 then)."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}" if code else message)
        self.status = status
        self.code = code
        self.message = message


class DaemonUnavailable(ClientError):
    """Nothing answered on the socket."""


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self._path)
        except OSError:
            sock.close()
            raise
        self.sock = sock


def default_socket() -> str:
    return os.environ.get("CKPTD_SOCKET") or DEFAULT_SOCKET


LATEST_FILE_MAX = 64 * 1024


def read_latest_file(root_dir: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The daemon's last word on a root, from `<root>/.ckptd/latest.json` (no daemon needed):
    None unless it is a sound one. Neither `.ckptd` nor the file is followed if a symlink, a
    FIFO never blocks the read, and at most 64 KiB are read."""
    nofollow = os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        dfd = os.open(Path(root_dir) / ".ckptd", os.O_RDONLY | os.O_DIRECTORY | nofollow)
        try:
            fd = os.open("latest.json", os.O_RDONLY | os.O_NONBLOCK | nofollow, dir_fd=dfd)
        finally:
            os.close(dfd)
        try:
            raw = os.read(fd, LATEST_FILE_MAX + 1)
        finally:
            os.close(fd)
        data = json.loads(raw) if len(raw) <= LATEST_FILE_MAX else None
    except (OSError, ValueError, RecursionError):
        return None
    if not isinstance(data, dict):
        return None
    step = data.get("step")
    if (not isinstance(step, int) or isinstance(step, bool) or not 0 <= step < 2**63
            or not isinstance(data.get("path"), str)):
        return None
    return data


class Client:
    """A handle on the daemon. Each call opens a short-lived connection."""

    def __init__(
        self, socket: str | os.PathLike[str] | None = None, timeout: float = 5.0,
        strict: bool = False,
    ) -> None:
        self.socket = str(socket) if socket else default_socket()
        self.timeout = timeout
        self.strict = strict

    # -- raw request -------------------------------------------------------------------------

    def request(
        self, method: str, path: str, body: Any = None, timeout: float | None = None
    ) -> tuple[int, Any]:
        """One HTTP request; returns (status, decoded JSON or text). Raises ClientError."""
        conn = _UnixConnection(self.socket, self.timeout if timeout is None else timeout)
        headers = {"Accept": "application/json"}
        payload = None
        if body is not None:
            payload = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        try:
            conn.request(method, path, body=payload, headers=headers)
            resp = conn.getresponse()
            raw = resp.read()
        except (OSError, http.client.HTTPException) as exc:
            raise DaemonUnavailable(0, "unreachable", f"ckptd at {self.socket}: {exc}") from exc
        finally:
            conn.close()
        return resp.status, _decode(raw, resp.getheader("Content-Type", ""))

    def request_json(self, method: str, path: str, body: Any = None, ok: tuple[int, ...] = (200,),
                     timeout: float | None = None) -> Any:
        """One request whose status must be in `ok`; raises ClientError otherwise."""
        status, data = self.request(method, path, body, timeout)
        if status not in ok:
            code = data.get("error", "") if isinstance(data, dict) else ""
            msg = data.get("message", str(data)) if isinstance(data, dict) else str(data)
            raise ClientError(status, code, msg)
        return data

    def _soft(self, what: str, default: Any, fn: Any, *args: Any, **kw: Any) -> Any:
        try:
            return fn(*args, **kw)
        except ClientError as exc:
            if self.strict:
                raise
            log.warning("ckptd %s failed: %s", what, exc)
            return default

    # -- API ---------------------------------------------------------------------------------

    def _get(self, what: str, path: str) -> Any:
        return self._soft(what, None, self.request_json, "GET", path)

    def health(self) -> dict[str, Any] | None:
        doc: dict[str, Any] | None = self._get("health", "/v1/health")
        return doc

    def status(self) -> dict[str, Any] | None:
        doc: dict[str, Any] | None = self._get("status", "/v1/status")
        return doc

    def checkpoints(self, root: str) -> list[dict[str, Any]] | None:
        data = self._get("list", f"/v1/roots/{_q(root)}/checkpoints")
        return None if data is None else list(data["checkpoints"])

    def checkpoint(self, root: str, step: int) -> dict[str, Any] | None:
        doc: dict[str, Any] | None = self._get("checkpoint",
                                               f"/v1/roots/{_q(root)}/checkpoints/{int(step)}")
        return doc

    def register(self, root: str, step: int, paths: list[str] | None = None,
                 metrics: dict[str, float] | None = None) -> bool:
        """Tell the daemon that the save of `step` finished. True when the daemon took it."""
        body: dict[str, Any] = {"step": int(step)}
        if paths:
            body["paths"] = [str(p) for p in paths]
        if metrics:
            body["metrics"] = {k: float(v) for k, v in metrics.items()}
        path = f"/v1/roots/{_q(root)}/checkpoints"
        took = self._soft("register", None, self.request_json, "POST", path, body, (200, 202))
        return took is not None

    def latest(self, root: str, tier: str = "any",
               root_dir: str | os.PathLike[str] | None = None) -> dict[str, Any] | None:
        """The latest valid checkpoint of `root` or None. Falls back to
        `<root_dir>/.ckptd/latest.json` when the daemon is unreachable (`root_dir` defaults to
        `root` when that is a directory)."""
        path = f"/v1/roots/{_q(root)}/latest?tier={_q(tier)}"
        try:
            return self.request_json("GET", path)  # type: ignore[no-any-return]
        except DaemonUnavailable as exc:
            fallback = _fallback_latest(root, root_dir)
            if fallback is not None:
                return fallback
            if self.strict:
                raise
            log.warning("ckptd latest failed: %s", exc)
            return None
        except ClientError as exc:
            if exc.status == 404 and exc.code == "no_checkpoint":
                return None
            if self.strict:
                raise
            log.warning("ckptd latest failed: %s", exc)
            return None

    def wait(self, root: str, step: int, until: str = "valid", timeout: float = 600.0) -> bool:
        """Block until `step` reaches `until` (valid | uploaded). False on timeout or failure."""
        deadline = time.monotonic() + (timeout if timeout >= 0 else 0.0)  # NaN: ask once
        asked = False
        while True:
            left = deadline - time.monotonic()
            if left <= 0 and asked:  # asked at least once: timeout=0 is "is it there now?"
                return False
            asked = True
            chunk = min(max(left, 0.0), 60.0)
            path = (f"/v1/roots/{_q(root)}/checkpoints/{int(step)}/wait"
                    f"?until={_q(until)}&timeout={chunk:.3f}")
            try:
                status, data = self.request("GET", path, timeout=chunk + self.timeout)
            except ClientError as exc:
                return bool(self._soft_fail("wait", exc))
            if status == 200:
                return True
            code = data.get("error", "") if isinstance(data, dict) else ""
            # 404 no_root: no such root, now or later; any other 404: not seen yet
            if status not in (404, 408) or code == "no_root":
                msg = data.get("message", "") if isinstance(data, dict) else str(data)
                return bool(self._soft_fail("wait", ClientError(status, code, msg)))
            if status == 404:
                time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))

    def pin(self, root: str, step: int) -> bool:
        path = f"/v1/roots/{_q(root)}/checkpoints/{int(step)}/pin"
        return self._soft("pin", None, self.request_json, "PUT", path) is not None

    def unpin(self, root: str, step: int) -> bool:
        path = f"/v1/roots/{_q(root)}/checkpoints/{int(step)}/pin"
        return self._soft("unpin", None, self.request_json, "DELETE", path) is not None

    def hold(self, root: str, step: int, ttl: float = 600.0, owner: str | None = None
             ) -> Hold:
        """A reader's *hold* on `step` while reading it, so retention cannot delete it; a
        context manager. `with client.hold("llm-7b", 1000): load(...)`"""
        return Hold(self, root, int(step), ttl, owner or f"{os.getpid()}-{time.monotonic_ns()}")

    # The name `hold` had before (deprecated, kept for existing callers).
    lease = hold

    def _soft_fail(self, what: str, exc: ClientError) -> bool:
        if self.strict:
            raise exc
        log.warning("ckptd %s failed: %s", what, exc)
        return False


class Hold:
    """A reader's hold on one step (`Client.hold`): taken on enter, released on exit."""

    def __init__(self, client: Client, root: str, step: int, ttl: float, owner: str) -> None:
        self.client, self.root, self.step, self.ttl, self.owner = client, root, step, ttl, owner
        self.held = False

    def _path(self) -> str:
        return (f"/v1/roots/{_q(self.root)}/checkpoints/{self.step}/hold"
                f"?owner={_q(self.owner)}&ttl={self.ttl:.0f}")

    def __enter__(self) -> Hold:
        try:
            self.client.request_json("PUT", self._path())
            self.held = True
        except DaemonUnavailable as exc:
            if self.client.strict:
                raise
            # No daemon, no retention to hold the step against: nothing to warn about.
            log.info("ckptd not reached; %s step %s read without a hold: %s", self.root,
                     self.step, exc)
        except ClientError as exc:
            if self.client.strict:
                raise
            log.warning("ckptd hold failed: %s", exc)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.held:
            self.client._soft("release hold", None, self.client.request_json, "DELETE",
                              self._path())


def _fallback_latest(root: str, root_dir: str | os.PathLike[str] | None) -> dict[str, Any] | None:
    directory = root_dir if root_dir is not None else (root if os.path.isdir(root) else None)
    if directory is None:
        return None
    data = read_latest_file(directory)
    if data is None:
        return None
    return {"root": root, "step": data["step"], "path": data.get("path"), "state": "valid",
            "local": data.get("local", "present"), "remote": data.get("remote", "none"),
            "source": "latest.json"}


def _q(s: str) -> str:
    return urllib.parse.quote(str(s), safe="")


def _decode(raw: bytes, content_type: str) -> Any:
    if "json" in content_type:
        try:
            return json.loads(raw)
        except (ValueError, RecursionError):
            return raw.decode("utf-8", "replace")
    return raw.decode("utf-8", "replace")
