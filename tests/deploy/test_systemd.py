"""systemd integration: the unit files pass `systemd-analyze verify`, and the sd_notify,
watchdog and LISTEN_FDS protocols work against real sockets (never a real systemd manager)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ckptd.config import DEFAULT_SOCKET_PATH
from ckptd.daemon import STOP_GRACE_S
from ckptd.errors import ConfigError
from ckptd.service import sdnotify
from ckptd.service.sdnotify import Notifier, ProgressWatchdog

REPO = Path(__file__).resolve().parents[2]
UNITS = REPO / "systemd"
BAD_OUTPUT = re.compile(r"Unknown key|Unknown section|Invalid|Failed to parse|[Ww]arning"
                        r"|not executable|No such file")


# -- helpers -----------------------------------------------------------------------------------


class NotifyReceiver:
    """A datagram socket standing in for systemd's notify socket."""

    def __init__(self, sock: socket.socket, env_value: str) -> None:
        self.sock = sock
        self.env_value = env_value

    def recv(self, timeout: float = 2.0) -> dict[str, str]:
        self.sock.settimeout(timeout)
        data = self.sock.recv(4096).decode()
        return dict(line.split("=", 1) for line in data.split("\n"))

    def recv_until(self, key: str, timeout: float = 10.0) -> list[dict[str, str]]:
        """Messages up to and including the first carrying `key`."""
        deadline = time.monotonic() + timeout
        seen: list[dict[str, str]] = []
        while not seen or key not in seen[-1]:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no {key} within {timeout}s; got {seen}")
            seen.append(self.recv(left))
        return seen

    def empty(self) -> bool:
        self.sock.setblocking(False)
        try:
            self.sock.recv(4096)
        except BlockingIOError:
            return True
        return False


@pytest.fixture
def receiver(short_dir: Path) -> Iterator[NotifyReceiver]:
    path = short_dir / "notify"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    try:
        yield NotifyReceiver(sock, str(path))
    finally:
        sock.close()


def unit_keys(path: Path) -> dict[str, list[str]]:
    """`Key=value` assignments of a unit file (systemd allows a key more than once)."""
    keys: dict[str, list[str]] = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith(("#", ";", "[")):
            k, _, v = line.partition("=")
            keys.setdefault(k.strip(), []).append(v.strip())
    return keys


# -- unit files --------------------------------------------------------------------------------


@pytest.mark.skipif(shutil.which("systemd-analyze") is None,
                    reason="systemd-analyze is not installed; the unit files were not verified")
def test_units_pass_systemd_analyze_verify(tmp_path: Path) -> None:
    shutil.copy(UNITS / "ckptd.socket", tmp_path)
    service = (UNITS / "ckptd.service").read_text()
    # The daemon's binary is not installed here; verify checks ExecStart exists.
    service = re.sub(r"^ExecStart=\S+", "ExecStart=/usr/bin/true", service, flags=re.M)
    (tmp_path / "ckptd.service").write_text(service)
    dropins = tmp_path / "ckptd.service.d"
    dropins.mkdir()
    shutil.copy(UNITS / "ckptd.service.d" / "roots.conf.example", dropins / "roots.conf")
    out = subprocess.run(
        ["systemd-analyze", "verify", "--man=no",
         str(tmp_path / "ckptd.service"), str(tmp_path / "ckptd.socket")],
        capture_output=True, text=True, timeout=60,
        env={**os.environ, "SYSTEMD_LOG_LEVEL": "notice", "SYSTEMD_PAGER": ""},
    )
    text = out.stdout + out.stderr
    assert out.returncode == 0, text
    assert not BAD_OUTPUT.search(text), text


def test_verify_catches_unknown_keys(tmp_path: Path) -> None:
    """The check above would see a misspelt key (guards the grep, not the units)."""
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed")
    unit = tmp_path / "x.service"
    unit.write_text("[Service]\nExecStart=/usr/bin/true\nWatchdogSecs=5\n")
    out = subprocess.run(["systemd-analyze", "verify", "--man=no", str(unit)],
                         capture_output=True, text=True, timeout=60)
    assert BAD_OUTPUT.search(out.stdout + out.stderr)


def test_service_contract() -> None:
    keys = unit_keys(UNITS / "ckptd.service")
    one = {k: v[-1] for k, v in keys.items()}
    assert one["Type"] == "notify" and one["NotifyAccess"] == "main"
    assert one["RestartPreventExitStatus"] == str(ConfigError.exit_code)
    assert one["Restart"] == "on-failure"
    assert int(one["TimeoutStopSec"]) > STOP_GRACE_S  # SIGKILL never cuts the grace period short
    assert one["ExecReload"] == "/bin/kill -HUP $MAINPID"
    assert one["KillMode"] == "mixed" and one["ProtectSystem"] == "strict"
    assert "MemoryDenyWriteExecute" not in keys  # torch/numpy JIT need W+X mappings
    assert re.match(r"^\S+ run --config /etc/ckptd/ckptd\.toml$", one["ExecStart"])


def test_socket_unit_matches_default_socket() -> None:
    one = {k: v[-1] for k, v in unit_keys(UNITS / "ckptd.socket").items()}
    assert one["ListenStream"] == str(DEFAULT_SOCKET_PATH)
    assert one["SocketMode"] == "0660" and one["SocketGroup"] == "ckptd"
    assert one["Service"] == "ckptd.service"


def test_dropin_makes_a_root_writable() -> None:
    keys = unit_keys(UNITS / "ckptd.service.d" / "roots.conf.example")
    assert keys["ReadWritePaths"] == ["/data/ckpt"]


# -- sd_notify ---------------------------------------------------------------------------------


def test_notify_messages_reach_the_socket(receiver: NotifyReceiver) -> None:
    n = Notifier.from_env({"NOTIFY_SOCKET": receiver.env_value})
    assert n.enabled
    assert n.ready(status="scanned 2 roots")
    assert receiver.recv() == {"READY": "1", "STATUS": "scanned 2 roots"}
    assert n.status("queue 3; llm-7b latest 1200")
    assert receiver.recv() == {"STATUS": "queue 3; llm-7b latest 1200"}
    assert n.watchdog() and receiver.recv() == {"WATCHDOG": "1"}
    assert n.stopping() and receiver.recv() == {"STOPPING": "1"}
    n.close()


def test_reloading_carries_the_monotonic_clock(receiver: NotifyReceiver) -> None:
    n = Notifier(receiver.env_value)
    before = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    assert n.reloading()
    msg = receiver.recv()
    after = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    assert msg["RELOADING"] == "1"
    assert before <= int(msg["MONOTONIC_USEC"]) <= after


def test_abstract_socket_name() -> None:
    name = f"ckptd-test-{uuid.uuid4().hex}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind("\0" + name)
    try:
        n = Notifier.from_env({"NOTIFY_SOCKET": "@" + name})
        assert n.notify(ready=1, status="up")
        assert NotifyReceiver(sock, "@" + name).recv() == {"READY": "1", "STATUS": "up"}
    finally:
        sock.close()


def test_a_newline_cannot_forge_a_field(receiver: NotifyReceiver) -> None:
    Notifier(receiver.env_value).status("bad\nREADY=1")
    assert receiver.recv() == {"STATUS": "bad READY=1"}
    with pytest.raises(ValueError):
        sdnotify.format_message({"not valid": 1})


def test_noop_without_notify_socket() -> None:
    n = Notifier.from_env({})
    assert not n.enabled
    assert not n.ready() and not n.watchdog() and not n.reloading()
    assert n.failures == 0


def test_from_env_can_unset_for_children(receiver: NotifyReceiver) -> None:
    env = {"NOTIFY_SOCKET": receiver.env_value}
    n = Notifier.from_env(env, unset=True)
    assert env == {} and n.ready()
    assert receiver.recv() == {"READY": "1"}


def test_send_errors_are_reported_once_and_never_raised(short_dir: Path) -> None:
    errors: list[str] = []
    n = Notifier(str(short_dir / "nobody-listens"), on_error=errors.append)
    assert not n.ready()
    assert not n.watchdog()
    assert n.failures == 2 and len(errors) == 1 and "nobody-listens" in errors[0]
    assert not Notifier("vsock:2:1234", on_error=errors.append).ready()
    assert len(errors) == 2


# -- watchdog ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("env", "expected"), [
    ({}, None),
    ({"WATCHDOG_USEC": "60000000"}, 30.0),
    ({"WATCHDOG_USEC": "60000000", "WATCHDOG_PID": "self"}, 30.0),
    ({"WATCHDOG_USEC": "60000000", "WATCHDOG_PID": "other"}, None),
    ({"WATCHDOG_USEC": "0"}, None),
    ({"WATCHDOG_USEC": "soon"}, None),
    ({"WATCHDOG_USEC": "-5"}, None),
])
def test_watchdog_interval(env: dict[str, str], expected: float | None) -> None:
    pids = {"self": str(os.getpid()), "other": str(os.getpid() + 1)}
    env = {k: pids.get(v, v) for k, v in env.items()}
    assert sdnotify.watchdog_interval(env) == expected


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_progress_watchdog_pings_only_when_healthy(receiver: NotifyReceiver) -> None:
    clock = FakeClock()
    wd = ProgressWatchdog(Notifier(receiver.env_value), period=30.0, clock=clock)
    assert wd.enabled
    assert wd.beat(True) and receiver.recv() == {"WATCHDOG": "1"}
    clock.now += 10
    assert not wd.beat(True) and receiver.empty()  # not due yet
    clock.now += 25
    assert not wd.beat(False) and receiver.empty()  # due, but a worker is stalled
    assert wd.unhealthy_since == clock.now
    clock.now += 100
    assert not wd.beat(False) and receiver.empty()
    clock.now += 1
    assert wd.beat(True) and receiver.recv() == {"WATCHDOG": "1"}  # recovered: ping at once
    assert wd.unhealthy_since is None


def test_progress_watchdog_off_without_watchdog_usec(receiver: NotifyReceiver) -> None:
    wd = ProgressWatchdog.from_env(Notifier(receiver.env_value), {})
    assert not wd.enabled and not wd.beat(True) and receiver.empty()
    wd = ProgressWatchdog.from_env(Notifier(None), {"WATCHDOG_USEC": "2000000"})
    assert wd.period == 1.0 and not wd.enabled and not wd.beat(True)


# -- LISTEN_FDS --------------------------------------------------------------------------------

# What systemd does before exec: the socket at fd 3, LISTEN_PID = the process's own pid.
_ACTIVATE = textwrap.dedent("""
    import os, sys
    fd = int(os.environ.pop("TEST_FD"))
    if fd != 3:
        os.dup2(fd, 3)
        os.close(fd)
    os.environ.update(LISTEN_PID=str(os.getpid()), LISTEN_FDS="1", LISTEN_FDNAMES="api")
""")

_CHILD = _ACTIVATE + textwrap.dedent("""
    from ckptd.service import sdnotify
    named = sdnotify.listen_fds_with_names()
    assert [n for n, _ in named] == ["api"], named
    sock = sdnotify.unix_listener([s for _, s in named], sys.argv[1])
    assert sock is not None and sock.fileno() == 3
    assert not os.get_inheritable(3), "fd 3 must be close-on-exec"
    assert not any(k.startswith("LISTEN_") for k in os.environ), "LISTEN_* must be unset"
    conn, _ = sock.accept()
    conn.sendall(b"pong:" + conn.recv(16))
    conn.close()
""")


def test_listen_fds_hands_over_a_usable_socket(short_dir: Path) -> None:
    path = short_dir / "act.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(4)
    fd = listener.fileno()
    env = {**os.environ, "TEST_FD": str(fd), "PYTHONPATH": str(REPO)}
    child = subprocess.Popen([sys.executable, "-c", _CHILD, str(path)], pass_fds=[fd], env=env,
                             stderr=subprocess.PIPE)
    listener.close()  # only the child holds it now, as after systemd's fork
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as c:
            c.settimeout(10)
            c.connect(str(path))
            c.sendall(b"ping")
            assert c.recv(16) == b"pong:ping"
        assert child.wait(10) == 0, child.stderr.read() if child.stderr else ""
    finally:
        child.kill()
        child.wait()
        if child.stderr:
            child.stderr.close()


def test_listen_fds_ignores_another_processes_fds() -> None:
    env = {"LISTEN_PID": str(os.getpid() + 1), "LISTEN_FDS": "1", "LISTEN_FDNAMES": "x"}
    assert sdnotify.listen_fds(env) == []
    assert env == {}  # unset all the same: a child must not claim them either


def test_listen_fds_without_activation() -> None:
    env: dict[str, str] = {}
    assert sdnotify.listen_fds(env) == []
    env = {"LISTEN_PID": str(os.getpid()), "LISTEN_FDS": "x"}
    assert sdnotify.listen_fds(env, unset=False) == [] and "LISTEN_FDS" in env


def test_unix_listener_picks_the_listening_stream_socket(short_dir: Path) -> None:
    dgram = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    idle = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    live = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        dgram.bind(str(short_dir / "d"))
        idle.bind(str(short_dir / "i"))
        live.bind(str(short_dir / "l"))
        live.listen(1)
        socks = [dgram, idle, live]
        assert sdnotify.unix_listener(socks) is live
        assert sdnotify.unix_listener(socks, short_dir / "l") is live
        assert sdnotify.unix_listener(socks, short_dir / "other") is None
    finally:
        for s in (dgram, idle, live):
            s.close()


# -- the daemon speaking these protocols ----------------------------------------------------------


def test_daemon_ready_only_when_serving_then_watchdog_and_stopping(
        daemon_factory: Any, receiver: NotifyReceiver) -> None:
    d = daemon_factory(start=False)
    d.extra_env.update(NOTIFY_SOCKET=receiver.env_value, WATCHDOG_USEC="2000000")
    d.start(wait=False)
    messages = receiver.recv_until("READY", timeout=30)
    assert d.client.health() is not None  # READY=1 came after the socket accepted requests
    assert "STATUS" in messages[-1] or any("STATUS" in m for m in messages)
    receiver.recv_until("WATCHDOG", timeout=5)
    assert d.stop(signal.SIGTERM) == 0
    receiver.recv_until("STOPPING", timeout=5)


def test_daemon_serves_on_an_inherited_socket(daemon_factory: Any) -> None:
    d = daemon_factory(start=False)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(d.socket))
    listener.listen(16)
    fd = listener.fileno()
    wrapper = _ACTIVATE + "os.execv(sys.executable, [sys.executable] + sys.argv[1:])\n"
    log = open(d.log, "ab")  # noqa: SIM115 - handed to the child
    d.proc = subprocess.Popen(
        [sys.executable, "-c", wrapper, "-m", "ckptd", "run", "--config", str(d.config)],
        pass_fds=[fd], stdout=log, stderr=subprocess.STDOUT,
        env={**os.environ, "TEST_FD": str(fd), "PYTHONPATH": str(REPO)})
    log.close()
    listener.close()
    d.wait_ready()
    assert d.stop(signal.SIGTERM) == 0
    assert d.socket.exists(), "the socket file belongs to systemd's socket unit: keep it"


def test_daemon_reload_is_bracketed_by_reloading_and_ready(
        daemon_factory: Any, receiver: NotifyReceiver) -> None:
    d = daemon_factory(start=False)
    d.extra_env.update(NOTIFY_SOCKET=receiver.env_value)
    d.start(wait=False)
    receiver.recv_until("READY", timeout=30)
    good = d.config.read_text()
    for text in (good, good + "\nthis is not toml\n"):  # a rejected config must end the reload too
        d.config.write_text(text)
        assert d.proc is not None
        d.proc.send_signal(signal.SIGHUP)
        reloading = receiver.recv_until("RELOADING", timeout=10)[-1]
        assert abs(int(reloading["MONOTONIC_USEC"]) - sdnotify.monotonic_usec()) < 10_000_000
        receiver.recv_until("READY", timeout=10)
        assert d.client.health() is not None
