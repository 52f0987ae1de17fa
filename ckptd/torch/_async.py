"""Async saves from the training process (docs/ASYNC.md): copy each component into this
process's arena as the exact bytes of its `native` file, hand the arena to the daemon over its
socket, and return a handle. The daemon writes the files; training waits only for the copy.

Owns the process's one arena and its pending saves. Never writes into the arena while the daemon
may be reading a generation, and never blocks a training step on a missing daemon.
"""

from __future__ import annotations

import array
import json
import logging
import mmap
import os
import socket
import threading
import time
from pathlib import Path
from typing import IO, Any, cast

import torch

from ckptd import arena as layout
from ckptd.client import Client, ClientError, DaemonUnavailable, default_socket
from ckptd.torch import _arena_copy, _native

log = logging.getLogger("ckptd.torch")
INITIAL_ARENA = 64 << 20
HAND_OVER_TIMEOUT_S = 10.0
POLL_S = 30.0
MAX_ANSWER = 1 << 20


class SaveHandle:
    """One async save: `wait(timeout)`, `done()`, `error`, `skipped`, `step`, `path`."""

    def __init__(self, step: int, path: Path, skipped: bool = False) -> None:
        self.step, self.path, self.skipped = step, path, skipped
        self.error: str | None = None
        self._done = threading.Event()
        if skipped:
            self._done.set()

    def done(self) -> bool:
        """True once the save finished, written or failed (or was skipped)."""
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """True once the files are written and fsynced; False on timeout, failure or skip."""
        return self._done.wait(timeout) and self.error is None and not self.skipped

    def _finish(self, error: str | None) -> None:
        self.error = error
        if error is not None:
            log.warning("ckptd.torch: async save of step %s failed: %s", self.step, error)
        self._done.set()

    def __repr__(self) -> str:
        state = ("skipped" if self.skipped else "failed" if self.error else
                 "written" if self.done() else "writing")
        return f"<SaveHandle step={self.step} {state}>"


class _Arena:
    """This process's memfd and its mapping; grows (never shrinks) when a state needs more."""

    def __init__(self, size: int) -> None:
        self.pid = os.getpid()
        self.fd = layout.create_memfd(size)
        self.mm = mmap.mmap(self.fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        layout.init_header(self.mm)
        self.generation = 0
        self.pinned = _arena_copy.HostRegistration()

    def ensure(self, need: int) -> None:
        if need > len(self.mm):
            self.pinned.release()  # (the mapping may move)
            new = max(need, len(self.mm) * 3 // 2)
            self.mm.resize(-(-new // (2 << 20)) * (2 << 20))  # ftruncate + mremap, no copy

    def fill(self, parts: list[_native.Part]) -> list[dict[str, Any]]:
        """Serialise each component in turn into the arena as its file's bytes, its tensors'
        records left for the second pass; then copy every tensor into its record; seal it."""
        self.generation += 1
        layout.set_state(self.mm, layout.State.WRITING, self.generation)
        files, pos = [], layout.DATA_OFFSET
        copies: list[tuple[int, torch.UntypedStorage]] = []
        for name, component, build in parts:
            end = self._serialise(build(), pos, copies)
            files.append({"path": name, "component": component, "offset": pos,
                          "size": end - pos})
            pos = layout.aligned(end)
        pinned = any(real.device.type == "cuda" for _, real in copies) and self.pinned.ensure(
            self.mm, pos)
        _arena_copy.copy_storages(self.mm, copies, non_blocking=pinned)
        layout.set_state(self.mm, layout.State.SEALED, self.generation, used=pos)
        return files

    def _serialise(self, state: Any, pos: int,
                   copies: list[tuple[int, torch.UntypedStorage]]) -> int:
        """torch.save of `state` at `pos` over placeholders (the storages to copy are added
        to `copies`); a state they do not fit is written the plain way. Returns its end."""
        hook = _arena_copy.Placeholders()
        writer = _Writer(self, pos, hook)
        try:
            _save_without_crc(state, writer, _arena_copy.pickle_module(hook))
            hook.check_all_found()
        except _arena_copy.Unsupported as exc:
            log.debug("ckptd.torch: a component is copied the plain way: %s", exc)
            writer = _Writer(self, pos)
            _save_without_crc(_to_host(state), writer)
            _drop_pinned_cache()
            return writer.pos
        copies.extend(hook.found)
        return writer.pos


class _Writer:
    """The file object torch.save writes into: bytes go straight into the arena's mapping."""

    def __init__(self, arena: _Arena, pos: int,
                 hook: _arena_copy.Placeholders | None = None) -> None:
        self.arena, self.pos, self.hook = arena, pos, hook

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        n = view.nbytes
        self.arena.ensure(self.pos + n)
        if self.hook is not None and n in self.hook.sizes and self.hook.claim(view, self.pos):
            self.pos += n  # a placeholder's record: its tensor's bytes are copied in later
            return n
        self.arena.mm[self.pos:self.pos + n] = view
        self.pos += n
        return n

    def flush(self) -> None:
        return None


def _save_without_crc(state: Any, writer: _Writer, pickler: Any = None) -> None:
    """torch.save into the arena without its CRC-32 pass (most of its time on CPU tensors):
    the writer fills the CRC fields in (`ckptd.formats.zipcrc`) before writing the file."""
    import torch.serialization as ser

    crc = ser.get_crc32_options()
    ser.set_crc32_options(False)
    try:
        if pickler is None:
            torch.save(state, cast(IO[bytes], writer))
        else:
            torch.save(state, cast(IO[bytes], writer), pickle_module=pickler)
    finally:
        ser.set_crc32_options(crc)


def _to_host(state: Any) -> Any:
    """For a component placeholders do not fit: device tensors copied to pinned host memory
    with non-blocking copies, then one synchronize; without CUDA the state is returned as it is
    (torch.save copies it into the arena)."""
    if not torch.cuda.is_available():
        return state
    found: list[bool] = []

    def visit(obj: Any) -> Any:
        if isinstance(obj, torch.Tensor) and obj.device.type == "cuda":
            found.append(True)
            host = torch.empty(obj.shape, dtype=obj.dtype, pin_memory=True)
            return host.copy_(obj.detach(), non_blocking=True)
        if isinstance(obj, dict):
            return {k: visit(v) for k, v in obj.items()}
        if isinstance(obj, list | tuple) and not hasattr(obj, "_fields"):
            return type(obj)(visit(v) for v in obj)
        return obj

    out = visit(state)
    if found:
        torch.cuda.synchronize()
    return out


def _drop_pinned_cache() -> None:
    """Give the pinned host copies back to the system: torch's pinned cache keeps them."""
    empty = getattr(torch._C, "_host_emptyCache", None)
    if empty is not None and torch.cuda.is_available():
        empty()


# -- the process's state --------------------------------------------------------------------------

_lock = threading.Lock()
_arena: _Arena | None = None
_pending: list[SaveHandle] = []


def _get_arena() -> _Arena:
    global _arena
    if _arena is None or _arena.pid != os.getpid():  # a forked child never shares its parent's
        _arena = _Arena(INITIAL_ARENA)
    return _arena


def _abandon_arena() -> None:
    """The daemon may still read the arena: never write into it again; the next save makes a
    new one (the daemon's descriptor keeps the old pages until it is done)."""
    global _arena
    if _arena is not None:
        _arena.pinned.release()
        _arena.mm.close()
        os.close(_arena.fd)
        _arena = None


def flush(timeout: float | None = None) -> bool:
    """Wait for every pending async save of this process; True if all were written."""
    deadline = None if timeout is None else time.monotonic() + timeout
    with _lock:
        pending = list(_pending)
    ok = True
    for h in pending:
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        ok = h.wait(left) and ok
    with _lock:
        _pending[:] = [h for h in _pending if not h.done()]
    return ok


def save_async(root: Path, step: int, rank: int, world: int, parts: list[_native.Part],
               head: dict[str, Any], name: str, client: Any, timeout: float,
               if_busy: str, register: bool = True) -> SaveHandle:
    """The body of `ckptd.torch.save(..., blocking=False)`, after the arguments are checked."""
    final = root / f"step-{step}"
    with _lock:
        busy = [h for h in _pending if not h.done()]
    if busy and if_busy == "skip":
        log.info("ckptd.torch: step %s skipped: step %s is still being written",
                 step, busy[-1].step)
        return SaveHandle(step, final, skipped=True)
    for h in busy:
        h.wait()
    arena = _get_arena()
    files = arena.fill(parts)
    body = {"root": name, "dir": str(root.resolve()), "step": step, "rank": rank,
            "world_size": world, "generation": arena.generation, "timeout": timeout,
            "files": files, "head": head, "register": register}
    sock = str(getattr(client, "socket", None) or default_socket())
    handle = SaveHandle(step, final)
    try:
        job, not_taken = _hand_over(sock, body, arena.fd)
    except OSError as exc:  # sent, but no answer: the daemon may hold the arena
        _abandon_arena()
        handle._finish(f"no answer from ckptd at {sock} after handing over the save: {exc}")
        return handle
    if job is None:
        log.warning("ckptd.torch: the daemon was not reached or refused the async save (%s);"
                    " step %s is written by this process", not_taken, step)
        _write_here(arena, body, root, handle, client if register else False)
        return handle
    with _lock:
        _pending[:] = [h for h in _pending if not h.done()] + [handle]
    threading.Thread(target=_watch, args=(handle, sock, str(job["id"])), daemon=True,
                     name=f"ckptd-save-{step}").start()
    return handle


# -- talking to the daemon ------------------------------------------------------------------------


def _hand_over(sock_path: str, body: dict[str, Any], fd: int
               ) -> tuple[dict[str, Any] | None, str]:
    """POST /v1/persist with the arena's descriptor on the connection's first bytes: the
    daemon's answer, or None and why when it certainly did not take the arena (unreachable,
    or it refused). OSError when it was sent and no answer came (the daemon may hold it)."""
    payload = json.dumps(body, allow_nan=False).encode()
    head = (f"POST /v1/persist HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json"
            f"\r\nContent-Length: {len(payload)}\r\nConnection: close\r\n\r\n").encode()
    data = head + payload
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(HAND_OVER_TIMEOUT_S)
    try:
        try:
            s.connect(sock_path)
        except OSError as exc:
            return None, f"cannot connect to {sock_path}: {exc}"
        sent = s.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))])
        if sent < len(data):
            s.sendall(data[sent:])  # (never a zero-length send: the daemon may have answered)
        status, answer = _read_answer(s)
    finally:
        s.close()
    if status != 202:
        return None, f"{status} {answer.get('error', '')}: {answer.get('message', '')}"
    return answer, ""


def _read_answer(s: socket.socket) -> tuple[int, dict[str, Any]]:
    raw = b""
    while len(raw) <= MAX_ANSWER:
        chunk = s.recv(65536)
        if not chunk:
            break
        raw += chunk
    head, _, body = raw.partition(b"\r\n\r\n")
    try:
        status = int(head.split(b" ", 2)[1])
        answer = json.loads(body) if body else {}
    except (IndexError, ValueError) as exc:
        raise OSError(f"unreadable answer from ckptd: {raw[:200]!r}") from exc
    return status, answer if isinstance(answer, dict) else {}


def _watch(handle: SaveHandle, sock: str, job: str) -> None:
    """Long-poll the daemon for the save's outcome; a daemon gone means the save failed."""
    client = Client(sock, timeout=POLL_S + 10.0)
    misses = 0
    while True:
        try:
            status, body = client.request("GET", f"/v1/persist/{job}?timeout={POLL_S:g}")
        except DaemonUnavailable as exc:
            misses += 1
            if misses >= 3:
                handle._finish(f"ckptd went away before the save was written ({exc.message})")
                return
            time.sleep(0.2)
            continue
        except ClientError as exc:
            handle._finish(str(exc))
            return
        misses = 0
        if status == 408:
            continue
        if status == 200 and isinstance(body, dict) and body.get("state") == "done":
            handle._finish(None)
        elif status == 200 and isinstance(body, dict):
            handle._finish(str(body.get("error", "the daemon could not write the save")))
        else:
            handle._finish(f"the daemon that took the save no longer knows it ({status}): it"
                           " stopped or restarted before writing it")
        return


def _write_here(arena: _Arena, body: dict[str, Any], root: Path, handle: SaveHandle,
                client: Any) -> None:
    """The fallback: this process writes the files from its own arena, as the daemon would."""
    from ckptd import arena_write as persist

    req = layout.parse_request(body, len(arena.mm))
    try:
        view = memoryview(arena.mm)  # (released on success; a failure's traceback holds it)
        written = persist.persist(view, arena.fd, req, str(root), persist.Cancel())
        view.release()
    except Exception as exc:
        handle._finish(f"{type(exc).__name__}: {exc}")
        raise
    finally:
        layout.set_state(arena.mm, layout.State.EMPTY, arena.generation)
    handle.path = root / Path(written.path).name
    if req.rank == 0 and client is not False:
        _native._register(req.root, req.step, dict(req.head.get("metrics", {})), client)
    handle._finish(None)
