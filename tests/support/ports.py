"""A TCP port for a torch.distributed rendezvous (MASTER_PORT), which rank 0 binds seconds
after it is chosen, once its imports are done.

A port the kernel hands out for `bind(0)` lies in its ephemeral range, from which every
outgoing connection on the machine also takes its local port: one took such a port between
the choice and rank 0's bind in a CI run (EADDRINUSE). These ports lie below that range, each
pytest-xdist worker in a slice of its own, and are free when chosen.
"""

from __future__ import annotations

import os
import random
import socket

BASE = 20000
SLICE = 500


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def rendezvous_port() -> int:
    """A free port outside the ephemeral range, in this xdist worker's slice; a kernel-chosen
    one only where no such slice exists or none of it is free."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    index = int(worker[2:]) if worker[2:].isdigit() else 0
    lo = BASE + index * SLICE
    if lo + SLICE <= _ephemeral_low():
        ports = list(range(lo, lo + SLICE))
        random.shuffle(ports)
        for port in ports:
            if _bindable(port):
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
