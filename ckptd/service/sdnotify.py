"""systemd's service protocols, stdlib only: sd_notify (readiness, status, watchdog), the
watchdog period from WATCHDOG_USEC, and inherited sockets from LISTEN_FDS.

Owns talking to the service manager; never raises into the daemon when the manager is absent.
"""

from __future__ import annotations

import logging
import os
import re
import socket
import threading
import time
from collections.abc import Callable, Mapping, MutableMapping
from pathlib import Path

from ckptd.errors import BadValue

SD_LISTEN_FDS_START = 3
SEND_TIMEOUT_S = 2.0

ErrorHook = Callable[[str], None]

_KEY = re.compile(r"^[A-Z][A-Z0-9_]*$")
_log = logging.getLogger("ckptd.service.sdnotify")


def _log_warning(message: str) -> None:
    _log.warning(message)


def monotonic_usec() -> int:
    """CLOCK_MONOTONIC in microseconds: the clock systemd reads MONOTONIC_USEC against."""
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000


def format_message(fields: Mapping[str, object]) -> str:
    """`KEY=value` lines. A newline inside a value would start a forged assignment, so it
    becomes a space. Raises ValueError on a key systemd would not accept (a caller's bug)."""
    lines = []
    for key, value in fields.items():
        name = key.upper()
        if not _KEY.match(name):
            raise BadValue(f"not a sd_notify field name: {key!r}")
        text = str(value).replace("\r", " ").replace("\n", " ")
        lines.append(f"{name}={text}")
    return "\n".join(lines)


def socket_address(value: str) -> str | None:
    """NOTIFY_SOCKET as a bind address: a path, or `@name` for the abstract namespace.
    None for forms this module does not speak (e.g. `vsock:`)."""
    if value.startswith("@"):
        return "\0" + value[1:]
    if value.startswith("/"):
        return value
    return None


class Notifier:
    """Sends sd_notify datagrams to `address` (NOTIFY_SOCKET's value). A no-op without one.

    Every method returns True when the datagram was sent. Send failures are reported to
    `on_error` once (the manager going away must not flood the log) and never raised."""

    def __init__(self, address: str | None, on_error: ErrorHook | None = None) -> None:
        self.address = address or None
        self.failures = 0
        self._on_error = on_error or _log_warning
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()

    @classmethod
    def from_env(cls, env: MutableMapping[str, str] | None = None, *, unset: bool = False,
                 on_error: ErrorHook | None = None) -> Notifier:
        """From NOTIFY_SOCKET. `unset=True` removes it so child processes do not inherit it."""
        env = os.environ if env is None else env
        address = env.get("NOTIFY_SOCKET") or None
        if unset:
            env.pop("NOTIFY_SOCKET", None)
        return cls(address, on_error)

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def notify(self, **fields: object) -> bool:
        """Send `KEY=value` assignments, e.g. `notify(ready=1, status="scanning")`."""
        return self.send(format_message(fields))

    def ready(self, status: str | None = None) -> bool:
        return self.notify(READY=1, **_status(status))

    def status(self, text: str) -> bool:
        return self.notify(STATUS=text)

    def stopping(self, status: str | None = None) -> bool:
        return self.notify(STOPPING=1, **_status(status))

    def reloading(self, status: str | None = None) -> bool:
        """Start of a reload; send `ready()` when it is over (systemd waits for READY=1)."""
        return self.notify(RELOADING=1, MONOTONIC_USEC=monotonic_usec(), **_status(status))

    def watchdog(self) -> bool:
        return self.notify(WATCHDOG=1)

    def send(self, message: str) -> bool:
        if self.address is None:
            return False
        target = socket_address(self.address)
        if target is None:
            self._failed(f"NOTIFY_SOCKET={self.address!r} is not a path or @abstract name")
            return False
        try:
            with self._lock:
                self._socket().sendto(message.encode(), target)
        except OSError as exc:
            self._failed(f"sd_notify to {self.address} failed: {exc}")
            return False
        return True

    def close(self) -> None:
        with self._lock:
            if self._sock is not None:
                self._sock.close()
                self._sock = None

    def _socket(self) -> socket.socket:
        if self._sock is None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            # A full receive queue on the manager's side must not hang the main loop.
            sock.settimeout(SEND_TIMEOUT_S)
            self._sock = sock
        return self._sock

    def _failed(self, message: str) -> None:
        self.failures += 1
        if self.failures == 1:
            self._on_error(message)


def _status(status: str | None) -> dict[str, str]:
    return {} if status is None else {"STATUS": status}


def watchdog_interval(env: Mapping[str, str] | None = None) -> float | None:
    """Seconds between WATCHDOG=1 pings (half of WatchdogSec=, as systemd advises), or None
    when the watchdog is off or meant for another process (WATCHDOG_PID)."""
    env = os.environ if env is None else env
    try:
        usec = int(env.get("WATCHDOG_USEC", ""))
    except ValueError:
        return None
    if usec <= 0:
        return None
    pid = env.get("WATCHDOG_PID")
    if pid is not None and pid != str(os.getpid()):
        return None
    return usec / 1_000_000 / 2


class ProgressWatchdog:
    """Pings the systemd watchdog only while the daemon says it is making progress.

    The main loop calls `beat(healthy)` often (about every second); a ping goes out at most
    once per `period`. While `healthy` is False no ping goes out, so systemd restarts a daemon
    whose loop is alive but whose work is stuck, instead of the loop masking it."""

    def __init__(self, notifier: Notifier, period: float | None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.notifier = notifier
        self.period = period
        self.unhealthy_since: float | None = None
        self._clock = clock
        self._last_ping: float | None = None

    @classmethod
    def from_env(cls, notifier: Notifier, env: Mapping[str, str] | None = None
                 ) -> ProgressWatchdog:
        return cls(notifier, watchdog_interval(env))

    @property
    def enabled(self) -> bool:
        return self.period is not None and self.notifier.enabled

    def beat(self, healthy: bool) -> bool:
        """Record the daemon's health; True when a WATCHDOG=1 ping was sent."""
        now = self._clock()
        if not healthy:
            if self.unhealthy_since is None:
                self.unhealthy_since = now
            return False
        self.unhealthy_since = None
        if self.period is None or not self._due(now):
            return False
        if not self.notifier.watchdog():
            return False
        self._last_ping = now
        return True

    def _due(self, now: float) -> bool:
        assert self.period is not None
        return self._last_ping is None or now - self._last_ping >= self.period


def listen_fds_with_names(env: MutableMapping[str, str] | None = None, *, unset: bool = True
                          ) -> list[tuple[str, socket.socket]]:
    """Sockets systemd passed by socket activation, with their FileDescriptorName= (default
    "unknown"). Empty unless LISTEN_PID is this process. Each fd is made close-on-exec, and the
    LISTEN_* variables are removed (unless `unset=False`) so children never claim them."""
    env = os.environ if env is None else env
    count, names = _take_listen_env(env, unset)
    found = []
    for i in range(count):
        sock = _adopt(SD_LISTEN_FDS_START + i)
        if sock is not None:
            found.append((names[i], sock))
    return found


def listen_fds(env: MutableMapping[str, str] | None = None, *, unset: bool = True
               ) -> list[socket.socket]:
    """The sockets of `listen_fds_with_names`, in fd order (fd 3 first)."""
    return [sock for _, sock in listen_fds_with_names(env, unset=unset)]


def _take_listen_env(env: MutableMapping[str, str], unset: bool) -> tuple[int, list[str]]:
    pid, fds, names = env.get("LISTEN_PID"), env.get("LISTEN_FDS"), env.get("LISTEN_FDNAMES")
    if unset:
        for key in ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"):
            env.pop(key, None)
    if pid != str(os.getpid()) or fds is None or not fds.isdigit():
        return 0, []
    count = int(fds)
    given = names.split(":") if names else []
    if len(given) != count:
        given = ["unknown"] * count
    return count, given


def _adopt(fd: int) -> socket.socket | None:
    try:
        os.set_inheritable(fd, False)  # FD_CLOEXEC: a stage's subprocess must not hold it
        return socket.socket(fileno=fd)  # family and type are read from the fd itself
    except OSError as exc:  # not a socket (ListenFIFO=) or already closed: not ours to use
        _log.warning("inherited fd %d is not a usable socket: %s", fd, exc)
        return None


def unix_listener(socks: list[socket.socket], path: Path | str | None = None
                  ) -> socket.socket | None:
    """The listening AF_UNIX stream socket among `socks` (bound to `path` when given)."""
    for sock in socks:
        if sock.family != socket.AF_UNIX or sock.type != socket.SOCK_STREAM:
            continue
        if path is not None and sock.getsockname() != str(path):
            continue
        if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
            return sock
    return None
