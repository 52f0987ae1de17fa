"""Connections on the daemon's socket: binding it (`bind_socket`), the loop that accepts and
watches them (`ConnectionLoop`: bounded threads, idle connections closed), the first bytes of a
connection read with recvmsg so an `SCM_RIGHTS` descriptor sent with them (an async save's arena)
is kept, and the reader that gives those bytes back to the HTTP parser. Knows nothing of HTTP
or of what a descriptor is for.
"""

from __future__ import annotations

import array
import collections
import contextlib
import errno
import io
import os
import queue
import selectors
import socket
import stat
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ckptd.errors import ConfigError

MAX_PASSED_FDS = 4
# A burst of a few hundred clients at once is queued, not refused.
LISTEN_BACKLOG = 1024


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


    def readinto(self, buf: Any) -> int | None:
        if self._first:
            n = min(len(buf), len(self._first))
            buf[:n] = self._first[:n]
            self._first = self._first[n:]
            return n
        try:
            return self._conn.recv_into(buf)
        except BlockingIOError:
            return None  # a non-blocking look for more (`Conn.more`): nothing there yet


class Writer(io.BufferedIOBase):
    """A socket's writer that sends every byte it is given (a plain SocketIO may send part);
    descriptors given to `attach` go (SCM_RIGHTS) with the first bytes written after it."""

    def __init__(self, conn: socket.socket) -> None:
        self._conn = conn
        self._fds: list[int] = []

    def writable(self) -> bool:
        return True

    def attach(self, fds: list[int]) -> None:
        self._fds = list(fds)

    def write(self, data: Any) -> int:
        with memoryview(data) as view:
            n = view.nbytes
            if self._fds and n:
                fds, self._fds = self._fds, []
                sent = self._conn.sendmsg(
                    [view], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
                if sent < n:
                    self._conn.sendall(view[sent:])
                return n
        self._conn.sendall(data)
        return n


# -- the connection loop -------------------------------------------------------------------------


class Conn:
    """One open connection: its socket, the reader that outlives each request (bytes a client
    sent ahead stay buffered in it), and when it was last busy."""

    __slots__ = ("rfile", "seen", "sock")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.rfile: io.BufferedReader | None = None
        self.seen = time.monotonic()

    def more(self) -> bool:
        """Has the client sent (part of) another request already? Never blocks."""
        if self.rfile is None:
            return False
        timeout = self.sock.gettimeout()
        self.sock.setblocking(False)
        try:
            return bool(self.rfile.peek(1))
        except OSError:
            return False
        finally:
            self.sock.settimeout(timeout)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()


class ConnectionLoop:
    """Accepts connections and watches them all on one thread (a selector); only a connection
    with bytes to read is handed to one of at most `threads` threads, which runs `serve(conn)`
    (True: keep the connection, give it back to the selector). An idle connection costs a
    descriptor, never a thread, so a new client never waits behind idle ones. A connection
    idle for `idle_s` is closed; past `max_open` connections, or when descriptors run out,
    the longest idle ones are closed first."""

    def __init__(self, listener: socket.socket, serve: Callable[[Conn], bool], threads: int,
                 max_open: int, idle_s: float) -> None:
        self.listener = listener
        self._serve = serve
        self._max_open, self._idle_s = max_open, idle_s
        self._pool = _Pool(threads)
        self._sel = selectors.DefaultSelector()
        self._idle: dict[int, Conn] = {}  # by descriptor, longest idle first
        self._back: collections.deque[Conn] = collections.deque()  # from the handler threads
        self._busy = 0
        self._lock = threading.Lock()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._stop = threading.Event()
        self._ended = threading.Event()
        self._ended.set()

    def run(self, poll_interval: float = 0.1) -> None:
        """The loop, on the calling thread, until `stop` (run again after a crash; never after
        a stop)."""
        self._ended.clear()
        self.listener.setblocking(False)
        self._sel.register(self.listener, selectors.EVENT_READ, None)
        self._sel.register(self._wake_r, selectors.EVENT_READ, self)
        try:
            while not self._stop.is_set():
                for key, _ in self._sel.select(poll_interval):
                    if key.data is None:
                        self._accept(poll_interval)
                    elif key.data is self:
                        with contextlib.suppress(OSError):
                            self._wake_r.recv(4096)
                    else:
                        self._hand_over(key.data)
                self._take_back()
                self._reap(time.monotonic() - self._idle_s)
        finally:
            self._sel.unregister(self.listener)
            self._sel.unregister(self._wake_r)
            self._ended.set()

    def stop(self) -> None:
        """End `run` (waits for it); connections being answered finish on their threads."""
        self._stop.set()
        self._wake()
        self._ended.wait()

    def close(self) -> None:
        """Close the listener and every idle connection (after `stop`)."""
        self._stop.set()
        for conn in [*self._idle.values(), *self._drain_back()]:
            conn.close()
        self._idle.clear()
        self.listener.close()
        self._sel.close()
        self._wake_r.close()
        self._wake_w.close()
        self._pool.close()

    def open_connections(self) -> int:
        return len(self._idle) + self._busy

    # -- the loop's steps ------------------------------------------------------------------

    def _accept(self, pause: float) -> None:
        for _ in range(ACCEPT_BATCH):
            try:
                sock, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError, ConnectionAbortedError):
                return
            except OSError as exc:
                if exc.errno not in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    raise
                if not self._close_idlest(CLOSE_BATCH):  # nothing to free: the backlog waits
                    self._stop.wait(pause)
                return
            sock.setblocking(False)
            conn = Conn(sock)
            self._idle[sock.fileno()] = conn
            self._sel.register(sock, selectors.EVENT_READ, conn)
            over = self.open_connections() - self._max_open
            if over > 0:
                self._close_idlest(over)

    def _hand_over(self, conn: Conn) -> None:
        self._sel.unregister(conn.sock)
        del self._idle[conn.sock.fileno()]
        with self._lock:
            self._busy += 1
        self._pool.submit(lambda: self._answer(conn))

    def _answer(self, conn: Conn) -> None:
        """On a pool thread: answer what the client sent; then give the connection back."""
        keep = False
        try:
            keep = self._serve(conn)
        finally:
            with self._lock:
                self._busy -= 1
                if keep and not self._stop.is_set():
                    conn.seen = time.monotonic()
                    self._back.append(conn)
                else:
                    conn.close()
            if keep:
                self._wake()

    def _take_back(self) -> None:
        for conn in self._drain_back():
            with contextlib.suppress(OSError, ValueError, KeyError):
                conn.sock.setblocking(False)
                self._sel.register(conn.sock, selectors.EVENT_READ, conn)
                self._idle[conn.sock.fileno()] = conn
                continue
            conn.close()

    def _drain_back(self) -> list[Conn]:
        with self._lock:
            back = list(self._back)
            self._back.clear()
        return back

    def _reap(self, before: float) -> None:
        """Close the connections idle since before `before` (the dict is in idle order)."""
        while self._idle:
            fd, conn = next(iter(self._idle.items()))
            if conn.seen >= before:
                return
            self._drop(fd, conn)

    def _close_idlest(self, n: int) -> int:
        closed = 0
        while self._idle and closed < n:
            fd, conn = next(iter(self._idle.items()))
            self._drop(fd, conn)
            closed += 1
        return closed

    def _drop(self, fd: int, conn: Conn) -> None:
        del self._idle[fd]
        with contextlib.suppress(KeyError, ValueError):
            self._sel.unregister(conn.sock)
        conn.close()

    def _wake(self) -> None:
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")


ACCEPT_BATCH = 64  # connections accepted per look at the listener
CLOSE_BATCH = 16  # idle connections closed at once when descriptors run out


class _Pool:
    """At most `size` daemon threads, started as work needs them; one idle for a while ends."""

    IDLE_EXIT_S = 30.0

    def __init__(self, size: int) -> None:
        self._size = size
        self._queue: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads = self._waiting = 0

    def submit(self, work: Callable[[], None]) -> None:
        with self._lock:
            spawn = self._waiting == 0 and self._threads < self._size
            if spawn:
                self._threads += 1
            else:
                self._waiting -= 1  # this one will take it
        self._queue.put(work)
        if spawn:
            threading.Thread(target=self._run, daemon=True, name="ckptd-api").start()

    def _run(self) -> None:
        while True:
            try:
                work = self._queue.get(timeout=self.IDLE_EXIT_S)
            except queue.Empty:
                with self._lock:
                    if self._waiting > 0:
                        self._waiting -= 1
                        self._threads -= 1
                        return
                continue
            if work is None:
                with self._lock:
                    self._threads -= 1
                return
            with contextlib.suppress(Exception):  # the work logs its own failures
                work()
            with self._lock:
                self._waiting += 1

    def close(self) -> None:
        with self._lock:
            n = self._threads
        for _ in range(n):
            self._queue.put(None)


def bind_socket(path: Path, group: str = "") -> socket.socket:
    """Bind the Unix socket at `path` with mode 0660 (and `group` when given). Only a stale
    socket is ever removed: anything else at the path (a file, a directory, a link) and a live
    socket (another daemon answering) are config errors, as is a directory we cannot use."""
    import grp

    where = f"daemon.socket = {str(path)!r}"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        st = os.lstat(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        raise ConfigError(f"{where}: cannot create the socket in {path.parent}:"
                          f" {exc.strerror or exc} (the directory must exist or be creatable,"
                          " and be writable by the daemon's user)") from None
    else:
        if not stat.S_ISSOCK(st.st_mode):
            raise ConfigError(f"{where}: something that is not a socket is there; ckptd never"
                              " removes it: point daemon.socket elsewhere")
        if _alive(path):
            raise ConfigError(f"{where}: another process is serving on it")
        path.unlink()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o117)  # the file is created 0660: never a window where it is wider
    try:
        sock.bind(str(path))
        os.chmod(path, 0o660)
        if group:
            os.chown(path, -1, grp.getgrnam(group).gr_gid)
    except (OSError, KeyError) as exc:
        sock.close()
        why = f"no group {group!r}" if isinstance(exc, KeyError) else exc.strerror or str(exc)
        raise ConfigError(f"{where}: {why}") from None
    finally:
        os.umask(old)
    sock.listen(LISTEN_BACKLOG)
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
