"""What the test servers' launchers (s3server.py, azurite.py, gcsserver.py) share: a free
loopback port, a child that dies with pytest, and a stop by PID."""

from __future__ import annotations

import ctypes
import random
import signal
import socket
import subprocess

# The Azure and GCS emulators' ports: below the kernel's ephemeral range, so no outgoing
# connection takes one between the check and the server's bind, and apart from s3server.py's
# (15000-22701 and 10000 above them).
EMULATOR_PORTS = (11000, 14900)


def free_port(port_range: tuple[int, int] = EMULATOR_PORTS) -> int:
    """A loopback port in `port_range` that is free right now."""
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(*port_range)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise RuntimeError("no free loopback port found")


def die_with_parent() -> None:
    """In the child (`preexec_fn`): SIGTERM when pytest dies, even by SIGKILL, so no server
    outlives it."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def stop_process(proc: subprocess.Popen[bytes], grace: float) -> None:
    """SIGTERM by PID, SIGKILL after `grace` seconds."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(grace)
