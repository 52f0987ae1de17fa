"""Client for training processes: talk to the local ckptd daemon over its Unix socket.

Standard library only and cheap to import. Never raises into a training loop unless
`strict=True`: failures log a warning and return None/False; except `latest()`, which raises
when it cannot tell (a resume must never silently start over). Imports nothing else of ckptd.
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import socket as _socket
import stat
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
    """Nothing answered on the socket (no daemon, a wrong path, a refused connection, a
    daemon shutting down). `latest()` raises it, `strict` or not, when `latest.json` cannot
    answer for the daemon either."""


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


def refused_message(path: str) -> str:
    """What a refused socket (EACCES/EPERM on connect) means and how to fix it: the socket is
    mode 0660, for its owner and its group (`daemon.socket_group`; `ckptd` in the deploy docs)."""
    try:
        import grp

        group = grp.getgrgid(os.stat(path).st_gid).gr_name
    except (OSError, KeyError, ImportError):
        group = "ckptd"  # the socket cannot be looked at either: the deploy docs' group
    return (f"permission denied on {path}: add yourself to group {group} (`sudo usermod -aG"
            f" {group} $USER`, then log in again), or run as the daemon's user")


# Where the daemon reads its config (ckptd.config.find_config, which this mirrors: the client
# imports nothing of ckptd): $CKPTD_CONFIG, else the first of these that is a file.
DEFAULT_CONFIG = "/etc/ckptd/ckptd.toml"
LOCAL_CONFIG = "ckptd.toml"
CONFIG_FILE_MAX = 1024 * 1024  # ckptd.config.load.MAX_CONFIG_BYTES
_SOCKET_PATH_MAX = 107  # sun_path, less its NUL


def default_socket() -> str:
    """The daemon's socket, found as the command line finds it: $CKPTD_SOCKET, else
    `[daemon] socket` of the config the daemon reads (`config_path()`), else the default."""
    return os.environ.get("CKPTD_SOCKET") or config_socket(config_path()) or DEFAULT_SOCKET


def config_path() -> str | None:
    """The config file the daemon reads: $CKPTD_CONFIG, else /etc/ckptd/ckptd.toml, else
    ./ckptd.toml (the first that is a file), else None."""
    chosen = os.environ.get("CKPTD_CONFIG")
    if chosen:
        return chosen
    for candidate in (DEFAULT_CONFIG, os.path.join(os.getcwd(), LOCAL_CONFIG)):
        if os.path.isfile(candidate):
            return candidate
    return None


def config_socket(path: str | os.PathLike[str] | None) -> str | None:
    """`[daemon] socket` of the config at `path`, resolved as the daemon resolves it (`~`
    expanded, relative to the file's directory), or None when the file has none. Reads at
    most 1 MiB of a regular file and only that key; a config that cannot be read is named in
    a warning and gives None (the default socket is tried)."""
    if path is None:
        return None
    import tomllib  # only where no $CKPTD_SOCKET says it: the client stays cheap to import

    try:
        raw = _read_regular(path, CONFIG_FILE_MAX)
        daemon = tomllib.loads(raw.decode("utf-8")).get("daemon", {})
    except PermissionError:  # a config kept from training users (it may hold secrets)
        log.debug("ckptd: config %s not readable; the default socket is tried", path)
        return None
    except (OSError, ValueError, RecursionError) as exc:  # TOMLDecodeError, UnicodeError
        log.warning("ckptd: config %s not read for the daemon's socket: %s", path, exc)
        return None
    value = daemon.get("socket") if isinstance(daemon, dict) else None
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        log.warning("ckptd: config %s: daemon.socket is not a path; using the default", path)
        return None
    base = os.path.dirname(os.path.abspath(path))
    sock = os.path.normpath(os.path.join(base, os.path.expanduser(value)))
    if len(os.fsencode(sock)) > _SOCKET_PATH_MAX:
        log.warning("ckptd: config %s: daemon.socket is too long for a socket path", path)
        return None
    return sock


def _read_regular(path: str | os.PathLike[str], cap: int, dir_fd: int | None = None) -> bytes:
    """At most `cap` bytes of a regular file (ValueError over it); never blocks on a FIFO
    and never follows a link at the last component."""
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NOCTTY
    fd = os.open(path, flags, dir_fd=dir_fd)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError("not a regular file")
        chunks, got = [], 0
        while got <= cap:
            chunk = os.read(fd, cap + 1 - got)
            if not chunk:
                break
            chunks.append(chunk)
            got += len(chunk)
    finally:
        os.close(fd)
    if got > cap:
        raise ValueError(f"over {cap} bytes")
    return b"".join(chunks)


LATEST_FILE_MAX = 64 * 1024


class _NoAnswer(Exception):
    """latest.json cannot answer: missing, unreadable or not a latest.json document."""


def _latest_doc(root_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """`<root>/.ckptd/latest.json`: its document, whose `step` is a step or None (the root
    has no valid checkpoint). `_NoAnswer` says why there is none to be had. Neither `.ckptd`
    nor the file is followed if a symlink, a FIFO never blocks the read, and at most 64 KiB
    are read."""
    where = os.path.join(root_dir, ".ckptd", "latest.json")
    nofollow = os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        dfd = os.open(Path(root_dir) / ".ckptd", os.O_RDONLY | os.O_DIRECTORY | nofollow)
        try:
            raw = _read_regular("latest.json", LATEST_FILE_MAX, dir_fd=dfd)
        finally:
            os.close(dfd)
        data = json.loads(raw, parse_constant=_no_constant)
    except FileNotFoundError:
        raise _NoAnswer(f"{where}: no such file") from None
    except (OSError, ValueError, RecursionError) as exc:
        raise _NoAnswer(f"{where}: unreadable ({exc})") from None
    step = data.get("step", ...) if isinstance(data, dict) else ...
    if step is not None and not _is_step(step):
        raise _NoAnswer(f"{where}: not a latest.json document (step {str(step)[:40]!r})")
    if step is not None and not isinstance(data.get("path"), str):
        raise _NoAnswer(f"{where}: not a latest.json document (no path)")
    return data  # type: ignore[no-any-return]


def _is_step(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**63


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def read_latest_file(root_dir: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The daemon's last word on a root, from `<root>/.ckptd/latest.json` (no daemon needed):
    its document when it names a step, else None (no file, an unreadable one, or a root
    with no valid checkpoint)."""
    try:
        doc = _latest_doc(root_dir)
    except _NoAnswer:
        return None
    return doc if doc.get("step") is not None else None


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
        except PermissionError as exc:  # EACCES/EPERM: the daemon may well be running
            raise DaemonUnavailable(0, "permission_denied", refused_message(self.socket)) from exc
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
        """The latest valid checkpoint of `root`, or None when the daemon says the root has
        none. Without an answering daemon, `<root_dir>/.ckptd/latest.json` answers (`root_dir`
        defaults to `root` when that is a directory): its step, or None when it says the root
        has none. When neither can tell (no daemon and no readable latest.json) this raises
        DaemonUnavailable, `strict` or not: a job resuming from the answer must not start
        again from step 0 because the daemon was not reached. Any other refusal of the daemon
        (no such root, a bad tier) raises ClientError."""
        path = f"/v1/roots/{_q(root)}/latest?tier={_q(tier)}"
        try:
            doc = self.request_json("GET", path)
        except DaemonUnavailable as exc:
            return _latest_without_daemon(root, tier, root_dir, exc)
        except ClientError as exc:
            if exc.status == 404 and exc.code == "no_checkpoint":
                return None
            if exc.status == 503:  # shutting down: as good as not there
                unavailable = DaemonUnavailable(exc.status, exc.code, exc.message)
                return _latest_without_daemon(root, tier, root_dir, unavailable)
            raise
        if not isinstance(doc, dict) or not _is_step(doc.get("step")):
            raise ClientError(200, "bad_answer", f"ckptd at {self.socket}: latest of {root!r}"
                              f" is not a checkpoint: {str(doc)[:200]}")
        return doc

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

    # The name `hold` had before: deprecated, kept for existing callers (docs/CLI.md).
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


def _latest_without_daemon(root: str, tier: str, root_dir: str | os.PathLike[str] | None,
                           unreached: DaemonUnavailable) -> dict[str, Any] | None:
    """`latest()`'s answer from latest.json; DaemonUnavailable naming both when it has none."""
    directory = root_dir if root_dir is not None else (root if os.path.isdir(root) else None)
    if directory is None:
        why = "no root_dir to read <root>/.ckptd/latest.json from"
        raise DaemonUnavailable(0, "unreachable", f"{unreached.message}; and {why}") from None
    try:
        data = _latest_doc(directory)
    except _NoAnswer as exc:
        raise DaemonUnavailable(0, "unreachable", f"{unreached.message}; and {exc}") from None
    if data["step"] is None:
        return None  # the daemon's last word: the root has no valid checkpoint
    local, remote = str(data.get("local", "present")), str(data.get("remote", "none"))
    in_tier = {"any": True, "local": local in ("present", "compressed"),
               "remote": remote == "uploaded"}.get(tier, False)
    if not in_tier:
        raise DaemonUnavailable(0, "unreachable", f"{unreached.message}; and latest.json names"
                                f" step {data['step']}, which is not in tier {tier!r}") from None
    return {"root": root, "step": data["step"], "path": data["path"], "state": "valid",
            "local": local, "remote": remote, "source": "latest.json"}


def _q(s: str) -> str:
    return urllib.parse.quote(str(s), safe="")


def _decode(raw: bytes, content_type: str) -> Any:
    if "json" in content_type:
        try:
            return json.loads(raw)
        except (ValueError, RecursionError):
            return raw.decode("utf-8", "replace")
    return raw.decode("utf-8", "replace")
