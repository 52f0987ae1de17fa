"""Descriptors passed on the daemon's socket: the first bytes of a connection read with recvmsg,
so an `SCM_RIGHTS` descriptor sent with them (an async save's arena) is kept, and a reader that
gives those bytes back to the HTTP parser. Knows nothing of HTTP or of what a descriptor is for.
"""

from __future__ import annotations

import array
import io
import os
import socket
from typing import Any

MAX_PASSED_FDS = 4


def recv_first(conn: socket.socket) -> tuple[bytes, list[int]]:
    """The connection's first bytes, and any descriptors sent with them."""
    data, anc, flags, _ = conn.recvmsg(65536, socket.CMSG_SPACE(MAX_PASSED_FDS * 4))
    fds = array.array("i")
    for level, kind, payload in anc:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[:len(payload) - len(payload) % fds.itemsize])
    if flags & socket.MSG_CTRUNC:  # more than we take: none of them is kept
        for fd in fds:
            os.close(fd)
        return data, []
    return data, list(fds)


class Prefixed(io.RawIOBase):
    """A socket's reader that first gives back bytes already received."""

    def __init__(self, first: bytes, conn: socket.socket) -> None:
        self._first, self._conn = memoryview(first), conn

    def readable(self) -> bool:
        return True

    def readinto(self, buf: Any) -> int:
        if self._first:
            n = min(len(buf), len(self._first))
            buf[:n] = self._first[:n]
            self._first = self._first[n:]
            return n
        return self._conn.recv_into(buf)
