"""A restarted trainer's state from memory (SPEC.md "Restoring from memory"): the daemon hands
over the arenas it kept (this node's, or a copy a peer held for it) with the answer to
`POST /v1/memory/open` (SCM_RIGHTS), and the components are read straight from them.

A kept state is read only when it is whole: each arena's header says persisted at the
generation the daemon kept, and every file's bytes hash (xxh3-128) to what the daemon recorded
when it wrote them, checked before the first object is filled and the header looked at again
after the last. Every file is read with `torch.load(weights_only=True)`: no code runs.
"""

from __future__ import annotations

import array
import io
import json
import mmap
import os
import socket
from typing import Any

import xxhash

from ckptd import arena
from ckptd.errors import CkptdError, CorruptData, Malformed, NotFound

MAX_ANSWER = 1 << 20
MAX_FDS = 4
HASH_CHUNK = 64 << 20


def open_state(sock_path: str, root: str, step: int, rank: int, timeout: float
               ) -> tuple[dict[str, Any], list[int]]:
    """The daemon's answer and the descriptors that came with it; NotFound with the daemon's
    reasons when no tier in memory holds the step, or no daemon answered."""
    body = json.dumps({"root": root, "step": step, "rank": rank}).encode()
    head = (f"POST /v1/memory/open HTTP/1.1\r\nHost: localhost\r\nContent-Type:"
            f" application/json\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    fds: list[int] = []
    try:
        try:
            s.connect(sock_path)
            s.sendall(head.encode() + body)
            raw = _receive(s, fds)
        except OSError as exc:
            raise NotFound(f"no daemon answered at {sock_path} ({exc})") from None
    except BaseException:
        _close_all(fds)
        raise
    finally:
        s.close()
    top, _, payload = raw.partition(b"\r\n\r\n")
    try:
        status = int(top.split(b" ", 2)[1])
        doc = json.loads(payload) if payload else {}
    except (IndexError, ValueError):
        _close_all(fds)
        raise NotFound(f"an unreadable answer from the daemon: {raw[:200]!r}") from None
    if status != 200 or not isinstance(doc, dict):
        _close_all(fds)
        message = doc.get("message", "") if isinstance(doc, dict) else ""
        raise NotFound(f"not in memory: {message or status}")
    return doc, fds


def _receive(s: socket.socket, fds: list[int]) -> bytes:
    chunks, got = [], 0
    while got <= MAX_ANSWER:
        data, anc, _, _ = s.recvmsg(65536, socket.CMSG_SPACE(MAX_FDS * 4))
        for level, kind, payload in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                got_fds = array.array("i")
                got_fds.frombytes(payload[:len(payload) - len(payload) % got_fds.itemsize])
                fds.extend(got_fds)
        if not data:
            break
        chunks.append(data)
        got += len(data)
    return b"".join(chunks)


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass
    fds.clear()


class _View(io.RawIOBase):
    """A file over a slice of an arena's mapping: what torch.load reads a component from,
    each record copied once, straight from the shared pages into its storage."""

    def __init__(self, view: memoryview) -> None:
        self._view, self._pos = view, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._pos, 2: len(self._view)}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, buf: Any) -> int:
        piece = self._view[self._pos:self._pos + len(buf)]
        n = len(piece)
        memoryview(buf).cast("B")[:n] = piece
        self._pos += n
        return n


class MemoryState:
    """The arenas handed over for one rank's load, mapped read-only and checked whole."""

    def __init__(self, doc: dict[str, Any], fds: list[int]) -> None:
        self.doc, self.source = doc, str(doc.get("source", "memory"))
        self.where = f"{self.source}:{doc.get('root')}/step-{doc.get('step')}"
        self._maps: list[mmap.mmap] = []
        self._arenas: list[tuple[mmap.mmap, int]] = []
        self.files: dict[str, tuple[memoryview, dict[str, Any]]] = {}
        self.head: dict[str, Any] = {}
        try:
            self._map(doc, fds)
        except BaseException:
            self.close()
            raise
        finally:
            _close_all(fds)

    def _map(self, doc: dict[str, Any], fds: list[int]) -> None:
        arenas = doc.get("arenas")
        if not isinstance(arenas, list) or len(arenas) != len(fds) or not fds:
            raise CorruptData(f"{self.where}: the daemon's answer names {len(arenas or [])}"
                              f" arenas and came with {len(fds)} descriptors")
        for entry, fd in zip(arenas, fds, strict=True):
            size = os.fstat(fd).st_size
            # Copy-on-write: the tensors a load makes point into these pages (no copy), and a
            # write to one (an optimizer step) copies that page, never touching the arena.
            # Pages not written still show the arena, so its header is read live.
            mm = mmap.mmap(fd, size, mmap.MAP_PRIVATE, mmap.PROT_READ | mmap.PROT_WRITE)
            self._maps.append(mm)
            generation = int(entry["generation"])
            self._arenas.append((mm, generation))
            if entry.get("rank") == 0 or not self.head:
                self.head = dict(entry.get("head") or {})
            for f in entry["files"]:
                offset, length = int(f["offset"]), int(f["size"])
                if not arena.DATA_OFFSET <= offset <= offset + length <= size:
                    raise CorruptData(f"{self.where}: {f['path']} lies outside its arena")
                self.files[str(f["path"])] = (memoryview(mm)[offset:offset + length], f)
        self.check_whole()
        for name, (view, f) in self.files.items():
            h = xxhash.xxh3_128()
            for at in range(0, len(view), HASH_CHUNK):
                h.update(view[at:at + HASH_CHUNK])
            if h.hexdigest() != f["hash"]:
                raise CorruptData(f"{self.where}: {name} does not hash to what the daemon"
                                  " recorded when it wrote it")

    def check_whole(self) -> None:
        """CorruptData unless every arena still holds its generation, persisted."""
        for mm, generation in self._arenas:
            try:
                header = arena.read_header(mm)
            except Malformed as exc:
                raise CorruptData(f"{self.where}: {exc}") from None
            if header.state is not arena.State.PERSISTED or header.generation != generation:
                raise CorruptData(f"{self.where}: the arena holds generation"
                                  f" {header.generation} {header.state.name.lower()}, not"
                                  f" generation {generation} persisted")

    def file(self, name: str) -> io.BufferedReader:
        if name not in self.files:
            raise NotFound(f"{self.where} holds no {name}")
        return io.BufferedReader(_View(self.files[name][0]), buffer_size=1 << 20)

    def load(self, name: str, map_location: Any) -> Any:
        """`name`'s object, read as `torch.load(weights_only=True, mmap=True)` reads a file:
        each tensor's storage a slice of the file's pages (here the arena's, copy-on-write),
        none copied; torch's own read (one copy per storage) where that is not to be had."""
        import torch
        import torch.serialization as ts

        overall = getattr(ts, "_load", None)
        if overall is None or "overall_storage" not in _parameters(overall) or \
                map_location not in ("cpu", None) and map_location != torch.device("cpu"):
            return torch.load(self.file(name), map_location=map_location, weights_only=True)
        view = self.files[name][0]
        unpickler, reader = (getattr(ts, "_weights_only_unpickler"),  # noqa: B009
                             getattr(ts, "_open_zipfile_reader"))  # noqa: B009
        with reader(self.file(name)) as opened:
            storage = torch.frombuffer(view, dtype=torch.uint8).untyped_storage()
            return overall(opened, map_location, unpickler, overall_storage=storage)

    def entries(self) -> list[dict[str, Any]]:
        return [{k: f[k] for k in ("path", "component", "size", "hash")}
                for _, f in self.files.values()]

    def close(self) -> None:
        self.files.clear()
        for mm in self._maps:
            try:
                mm.close()
            except BufferError:
                pass  # a view still referenced: unmapped when collected
        self._maps.clear()


def _parameters(fn: Any) -> set[str]:
    import inspect

    try:
        return set(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return set()


class TornState(CkptdError):
    """The state changed while it was read (its arena was reused): not a whole state."""
