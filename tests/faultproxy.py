"""A fault-injecting TCP proxy for HTTP/1.1, run as its own process in front of a test server.

`python tests/faultproxy.py --target HOST:PORT --dir DIR` listens on 127.0.0.1 (free port,
written to DIR/port), reads faults from DIR/control.json at each new request and keeps counts in
DIR/stats.json (each request line is appended to DIR/requests.log, so that thousands of
requests cost no more to count than a few). It exits by itself when its parent dies or after
--max-lifetime seconds.

Modes (control.json {"mode": ..., "count": K, ...}; faults apply to the first K occurrences):
  pass    forward everything
  drop    cut the connection once `after_bytes` bytes of a request body went upstream
  stall   accept a connection, answer nothing for `stall_s` seconds, then close it
  status  answer HTTP `status` (500, 503, ...) to a request without forwarding it
  cut_response  forward a whole request, then reset the connection instead of passing on the
          answer (the server did the work; the client never hears of it)
  slow    forward a request body at `bytes_per_s` (a slow link: uploads take a while)
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import struct
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from support.wait import WaitTimeout, wait_until

MAX_HEADER_BYTES = 64 * 1024
IO_TIMEOUT_S = 60.0  # a connection idle this long is closed: no thread outlives a test for long
CHUNK = 64 * 1024


# -- the test-side handle -----------------------------------------------------------------


@dataclass
class FaultProxy:
    """Handle on a running proxy process: its port, control and counters."""

    process: subprocess.Popen[bytes]
    port: int
    dir: Path

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @classmethod
    def start(
        cls, target: tuple[str, int], workdir: Path, max_lifetime_s: float = 300.0
    ) -> FaultProxy:
        workdir.mkdir(parents=True, exist_ok=True)
        _write_json(workdir / "control.json", {"mode": "pass"})
        cmd = [
            sys.executable,
            str(Path(__file__).resolve()),
            "--target",
            f"{target[0]}:{target[1]}",
            "--dir",
            str(workdir),
            "--max-lifetime",
            str(max_lifetime_s),
            "--parent-pid",
            str(os.getpid()),
        ]
        log = open(workdir / "proxy.log", "wb")  # noqa: SIM115 - kept by the child
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        log.close()
        port = _wait_for_port(workdir / "port", proc)
        return cls(process=proc, port=port, dir=workdir)

    def set(self, mode: str, count: int = 1, **params: Any) -> None:
        """Inject `mode` for the next `count` occurrences; counters of injected faults reset."""
        _write_json(self.dir / "control.json", {"mode": mode, "count": count, **params})

    def stats(self) -> dict[str, Any]:
        path = self.dir / "stats.json"
        if not path.exists():
            return {"connections": 0, "requests": 0, "faults": 0, "peers": [], "log": []}
        data: dict[str, Any] = json.loads(path.read_text())
        log = self.dir / "requests.log"
        data["log"] = log.read_text("latin-1").splitlines() if log.exists() else []
        return data

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)


def _wait_for_port(path: Path, proc: subprocess.Popen[bytes], timeout: float = 10.0) -> int:
    def port() -> int | None:
        if path.exists() and path.read_text().strip():
            return int(path.read_text())
        if proc.poll() is not None:
            raise RuntimeError(f"fault proxy exited with {proc.returncode}")
        return None

    try:
        return wait_until(port, timeout, "the fault proxy to report its port", interval=0.02)
    except WaitTimeout:
        proc.kill()
        raise


def _write_json(path: Path, data: Any) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


# -- the proxy process --------------------------------------------------------------------


class Control:
    """Current fault settings (re-read when control.json changes) and the counters."""

    def __init__(self, workdir: Path) -> None:
        self.dir = workdir
        self.lock = threading.Lock()
        self.settings: dict[str, Any] = {"mode": "pass"}
        self.mtime = 0.0
        self.injected = 0
        self.stats: dict[str, Any] = {
            "connections": 0,
            "requests": 0,
            "faults": 0,
            "peers": [],
        }

    def _reload(self) -> None:
        path = self.dir / "control.json"
        mtime = path.stat().st_mtime_ns
        if mtime != self.mtime:
            self.mtime = mtime
            self.settings = json.loads(path.read_text())
            self.injected = 0

    def claim(self, mode: str) -> dict[str, Any] | None:
        """The settings if a `mode` fault should hit now (and count it), else None."""
        with self.lock:
            self._reload()
            if self.settings.get("mode") != mode:
                return None
            if self.injected >= int(self.settings.get("count", 1)):
                return None
            self.injected += 1
            self.stats["faults"] += 1
            self._save()
            return dict(self.settings)

    def count(self, what: str, entry: Any = None) -> None:
        with self.lock:
            self.stats[what] += 1
            if entry is not None and what == "connections":
                self.stats["peers"].append(entry)
            elif entry is not None:
                with open(self.dir / "requests.log", "a", encoding="latin-1") as log:
                    log.write(f"{entry}\n")
            self._save()

    def _save(self) -> None:
        _write_json(self.dir / "stats.json", self.stats)


def serve(target: tuple[str, int], workdir: Path, max_lifetime: float, parent: int) -> None:
    control = Control(workdir)
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    listener.settimeout(0.5)
    control._save()
    (workdir / "port").write_text(str(listener.getsockname()[1]))
    deadline = time.monotonic() + max_lifetime
    while time.monotonic() < deadline and _parent_alive(parent):
        try:
            client, peer = listener.accept()
        except TimeoutError:
            continue
        control.count("connections", f"{peer[0]}:{peer[1]}")
        threading.Thread(target=_connection, args=(client, target, control), daemon=True).start()
    listener.close()


def _parent_alive(parent: int) -> bool:
    return os.getppid() == parent


class _Link:
    """One client connection and its upstream; the answer pump can be told to swallow."""

    def __init__(self, client: socket.socket, upstream: socket.socket) -> None:
        self.client = client
        self.upstream = upstream
        self.swallow = threading.Event()
        self.answered = threading.Event()


def _connection(client: socket.socket, target: tuple[str, int], control: Control) -> None:
    client.settimeout(IO_TIMEOUT_S)
    upstream: socket.socket | None = None
    try:
        stall = control.claim("stall")
        if stall is not None:
            _stall(client, float(stall.get("stall_s", 5.0)))
            return
        upstream = socket.create_connection(target, timeout=IO_TIMEOUT_S)
        link = _Link(client, upstream)
        threading.Thread(target=_pump, args=(link,), daemon=True).start()
        _requests(link, control)
    except OSError:
        pass  # a peer went away: the end of this connection either way
    finally:
        _close(client)
        if upstream is not None:
            _close(upstream)


def _stall(client: socket.socket, seconds: float) -> None:
    """Swallow whatever arrives and answer nothing, then close."""
    end = time.monotonic() + seconds
    while (left := end - time.monotonic()) > 0:
        client.settimeout(min(left, 0.5))
        try:
            if not client.recv(CHUNK):
                return
        except TimeoutError:
            continue


def _requests(link: _Link, control: Control) -> None:
    """Forward request after request, injecting the faults that are due on the way."""
    client, upstream = link.client, link.upstream
    buf = b""
    while True:
        head, buf = _read_head(client, buf)
        if head is None:
            return
        request_line = head.split(b"\r\n", 1)[0].decode("latin-1")
        control.count("requests", request_line)
        length = _content_length(head)
        status = control.claim("status")
        if status is not None:
            _drain(client, buf, length)
            _answer(client, int(status.get("status", 503)))
            return
        drop = control.claim("drop") if length > 0 else None
        limit = int(drop.get("after_bytes", 0)) if drop is not None else None
        slow = control.claim("slow") if length > 0 else None
        rate = float(slow.get("bytes_per_s", 1e6)) if slow is not None else None
        if control.claim("cut_response") is not None:
            link.swallow.set()
        upstream.sendall(head)
        rest = _forward_body(client, upstream, buf, length, limit, rate)
        if rest is None or link.swallow.is_set():
            if link.swallow.is_set():
                link.answered.wait(IO_TIMEOUT_S)  # the server has acted on the request
            _reset(client)
            return
        buf = rest


def _read_head(client: socket.socket, buf: bytes) -> tuple[bytes | None, bytes]:
    while b"\r\n\r\n" not in buf:
        if len(buf) > MAX_HEADER_BYTES:
            return None, b""
        data = client.recv(CHUNK)
        if not data:
            return None, b""
        buf += data
    end = buf.index(b"\r\n\r\n") + 4
    return buf[:end], buf[end:]


def _content_length(head: bytes) -> int:
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value.strip())
    return 0


def _forward_body(
    client: socket.socket,
    upstream: socket.socket,
    buf: bytes,
    length: int,
    limit: int | None,
    rate: float | None = None,
) -> bytes | None:
    """Send `length` body bytes upstream, at most `rate` bytes/s if given.

    Returns what was read past the body, or None if the connection was cut at `limit` bytes.
    """
    sent = 0
    started = time.monotonic()
    while sent < length:
        if not buf:
            buf = client.recv(CHUNK)
            if not buf:
                raise ConnectionError("client closed mid-body")
        piece = buf[: min(length - sent, CHUNK)]
        if limit is not None and sent + len(piece) >= limit:
            upstream.sendall(piece[: max(0, limit - sent)])
            return None
        upstream.sendall(piece)
        sent += len(piece)
        buf = buf[len(piece) :]
        if rate:
            time.sleep(max(0.0, started + sent / rate - time.monotonic()))
    return buf


def _drain(client: socket.socket, buf: bytes, length: int) -> None:
    """Read the body we will not forward, so closing does not reset the answer away."""
    left = length - len(buf)
    while left > 0:
        data = client.recv(min(CHUNK, left))
        if not data:
            return
        left -= len(data)


def _answer(client: socket.socket, status: int) -> None:
    reason = {500: "Internal Server Error", 503: "Service Unavailable"}.get(status, "Error")
    code = "SlowDown" if status == 503 else "InternalError"
    body = (
        f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code>'
        f"<Message>injected by the fault proxy</Message></Error>"
    ).encode()
    head = (
        f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/xml\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode()
    client.sendall(head + body)


def _pump(link: _Link) -> None:
    """Pass answers to the client, or drop them when the request side said to swallow."""
    try:
        while data := link.upstream.recv(CHUNK):
            if link.swallow.is_set():
                link.answered.set()
                return
            link.client.sendall(data)
    except OSError:
        pass
    finally:
        link.answered.set()
        if not link.swallow.is_set():
            _close(link.client)


def _reset(sock: socket.socket) -> None:
    """Close with RST (linger 0): the client sees a reset connection, as on a network fault."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    _close(sock)


def _close(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", required=True, help="HOST:PORT to forward to")
    parser.add_argument("--dir", required=True, type=Path, help="control/stats directory")
    parser.add_argument("--max-lifetime", type=float, default=300.0)
    parser.add_argument("--parent-pid", type=int, default=os.getppid())
    args = parser.parse_args(argv)
    host, _, port = args.target.rpartition(":")
    serve((host, int(port)), args.dir, args.max_lifetime, args.parent_pid)


if __name__ == "__main__":
    main()
