"""The persist service: takes async saves handed over on the socket (an arena descriptor and a
persist request), writes each on its own idle-priority thread through `arena_write`, then
registers the committed step so the lifecycle picks it up as a detected save.

Owns the accepted arenas (its own descriptor and mapping of each) and the outcomes the trainers'
handles ask for. Decides nothing about checkpoints beyond the door's checks.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from ckptd import arena
from ckptd import arena_write as stage
from ckptd.clock import SYSTEM, Clock
from ckptd.config import RootConfig
from ckptd.errors import BadValue, HttpError
from ckptd.log import get_logger
from ckptd.memory.own import Kept, KeptFile, OwnArenas
from ckptd.retention import executor
from ckptd.retention.views import StoreNets
from ckptd.service.supervisor import Calls
from ckptd.service.workers import lower_priority
from ckptd.store import Store

MAX_IN_FLIGHT = 32
MAX_OUTCOMES = 1024
MAX_WAIT_S = 60.0
STOP_GRACE_S = 20.0
# An async save that writes no byte for this long is stuck (degraded health, naming it).
STALL_BOUND_S = 300.0


@dataclass
class _Job:
    id: str
    req: arena.Request
    fd: int
    size: int
    peer_pid: int
    done: threading.Event = field(default_factory=threading.Event)
    cancel: stage.Cancel = field(default_factory=stage.Cancel)
    outcome: dict[str, Any] = field(default_factory=lambda: {"state": "running"})
    thread: threading.Thread | None = None


class PersistService:
    """`accept` checks and takes a save; `run` (supervised) waits for stop, then for the jobs."""

    def __init__(self, store: Store, roots: Callable[[], Mapping[str, RootConfig]],
                 wake_scan: Callable[[], None], socket_path: Callable[[], Path],
                 socket_group: Callable[[], str], calls: Calls | None = None, *,
                 nets: AbstractContextManager[Any], clock: Clock = SYSTEM,
                 own: OwnArenas | None = None,
                 kept: Callable[[Kept], None] | None = None) -> None:
        """`calls`: the supervisor's call board, where each save's write says what it is
        busy with; its bytes written are its progress. `nets`: the lock pins and readers'
        holds take, under which an earlier save of a step saved again is replaced. `clock`:
        what a save is timed and registered by (the stop's grace is a real wait). `own`: where
        a written arena is kept for a restart (None: let go once written); `kept` is told of
        each state kept (replication)."""
        self.store, self.roots, self.wake_scan = store, roots, wake_scan
        self.nets = nets
        self.clock = clock
        self.calls = calls if calls is not None else Calls(clock)
        self._socket_path, self._socket_group = socket_path, socket_group
        self.own, self._kept = own, kept
        self._jobs: OrderedDict[str, _Job] = OrderedDict()
        self._lock = threading.Lock()
        self._stopping = False
        self.grace = STOP_GRACE_S
        self.log = get_logger()

    # -- the door ---------------------------------------------------------------------------

    def accept(self, fd: int, body: Any, peer: tuple[int, int, int]) -> dict[str, Any]:
        """Take ownership of `fd` (closed here on every refusal) and start the write."""
        try:
            job = self._check(fd, body, peer)
        except BaseException:
            os.close(fd)
            raise
        with self._lock:
            running = sum(1 for j in self._jobs.values() if not j.done.is_set())
            if self._stopping:
                os.close(fd)
                raise HttpError(503, "stopping", "the daemon is stopping")
            if running >= MAX_IN_FLIGHT:
                os.close(fd)
                raise HttpError(503, "busy", f"{running} async saves are being written")
            self._jobs[job.id] = job
            self._forget_old()
        job.thread = threading.Thread(target=self._work, args=(job,), daemon=True,
                                      name=f"ckptd-persist-{job.id[:8]}")
        job.thread.start()
        self.log.info("async_save_accepted", root=job.req.root, step=job.req.step,
                      rank=job.req.rank, bytes=sum(f.size for f in job.req.files),
                      peer_pid=job.peer_pid, job=job.id)
        return {"id": job.id, "root": job.req.root, "step": job.req.step}

    def check_peer(self, peer: tuple[int, int, int], what: str) -> None:
        """403 unless the client (pid, uid, gid) is the daemon's user or in the socket's
        group: the only clients that may hand over an arena or be handed one."""
        pid, uid, gid = peer
        if not arena.peer_allowed(uid, arena.peer_groups(pid, gid), os.geteuid(),
                                  self._group_id()):
            raise HttpError(403, "forbidden", f"uid {uid} is neither the daemon's user nor in"
                            f" the socket's group: it may not {what}")

    def _check(self, fd: int, body: Any, peer: tuple[int, int, int]) -> _Job:
        pid = peer[0]
        self.check_peer(peer, "hand over an arena")
        try:
            size = arena.check_memfd(fd)
            _check_access(fd)
            req = arena.parse_request(body, size)
        except ValueError as exc:
            raise HttpError(400, "bad_arena", str(exc)) from None
        root = self.roots().get(req.root)
        if root is None:
            raise HttpError(404, "no_root", f"no root named {req.root!r} in the config")
        if os.path.realpath(req.dir) != os.path.realpath(root.path):
            raise HttpError(422, "outside_root", f"{req.dir!r} is not root {req.root!r}'s"
                            f" directory ({root.path})")
        try:
            head = mmap.mmap(fd, arena.DATA_OFFSET, mmap.MAP_SHARED, mmap.PROT_READ)
        except OSError as exc:  # the access check passed, yet it cannot be mapped
            raise HttpError(400, "bad_arena", f"the arena cannot be mapped:"
                            f" {exc.strerror or exc}") from None
        with head:
            try:
                h = arena.read_header(head)
            except ValueError as exc:
                raise HttpError(400, "bad_arena", str(exc)) from None
        if h.state is not arena.State.SEALED or h.generation != req.generation:
            raise HttpError(409, "not_sealed", f"the arena holds generation {h.generation} in"
                            f" state {h.state.name}, not sealed generation {req.generation}")
        return _Job(secrets.token_hex(16), req, fd, size, pid)

    def _group_id(self) -> int | None:
        import grp

        name = self._socket_group()
        try:
            return grp.getgrnam(name).gr_gid if name else os.stat(self._socket_path()).st_gid
        except (KeyError, OSError):
            return None

    # -- outcomes ---------------------------------------------------------------------------

    def outcome(self, job_id: str, timeout: float) -> dict[str, Any] | None:
        """The job's outcome once finished or after `timeout` (state "running"); None if this
        daemon never took it (it took it before a restart, or it was forgotten)."""
        with self._lock:
            job = self._jobs.get(job_id)
        if job is None:
            return None
        job.done.wait(min(max(timeout, 0.0), MAX_WAIT_S))
        return dict(job.outcome)

    def in_flight(self) -> list[dict[str, Any]]:
        """The saves being written, for `status` (stage `persist`)."""
        with self._lock:
            running = [j for j in self._jobs.values() if not j.done.is_set()]
        return [{"root": j.req.root, "step": j.req.step, "stage": "persist", "rank": j.req.rank,
                 "done_bytes": j.cancel.written,
                 "total_bytes": sum(f.size for f in j.req.files)} for j in running]

    def _forget_old(self) -> None:
        while len(self._jobs) > MAX_OUTCOMES:
            oldest = next((k for k, j in self._jobs.items() if j.done.is_set()), None)
            if oldest is None:
                return
            del self._jobs[oldest]

    # -- the work ---------------------------------------------------------------------------

    def _work(self, job: _Job) -> None:
        lower_priority()
        started = self.clock.monotonic()
        mm: mmap.mmap | None = None
        who = f"persist-{job.id[:8]}"
        self.calls.begin(who, "persist", job.req.root, job.req.step, STALL_BOUND_S,
                         progress=lambda: job.cancel.written)
        written = None
        try:
            mm = mmap.mmap(job.fd, job.size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            written = self._write(job, mm)
            arena_state = arena.State.PERSISTED
            job.outcome = {"state": "done", "path": written.path, "files": written.files,
                           "seconds": round(self.clock.monotonic() - started, 3)}
        except Exception as exc:  # broad: every failure is the save's outcome
            arena_state = arena.State.FAILED
            job.outcome = {"state": "failed", "error": f"{type(exc).__name__}: {exc}"}
            self.log.error("async_save_failed", root=job.req.root, step=job.req.step,
                           rank=job.req.rank, error=job.outcome["error"], job=job.id)
        finally:
            if mm is not None:
                self._release(mm, job.req.generation, arena_state)
            if written is not None and arena_state is arena.State.PERSISTED:
                self._keep(job, written)
            os.close(job.fd)
            self.calls.end(who)
            job.done.set()

    def _write(self, job: _Job, mm: mmap.mmap) -> stage.Written:
        req = job.req
        root = self.roots().get(req.root)
        if root is None:
            raise HttpError(404, "no_root", f"root {req.root!r} left the config")
        # Not `with memoryview(...)`: on a failure the traceback still holds slices of it, and
        # releasing it then would replace the save's error with a BufferError.
        view = memoryview(mm)
        nets = StoreNets(self.store, root, self.nets, self.clock.time)
        written = stage.persist(view, job.fd, req, str(root.path), job.cancel,
                                partial(executor.replace_save, root.path, req.step, nets=nets))
        view.release()
        self.log.info("async_save_written", root=req.root, step=req.step, rank=req.rank,
                      files=len(written.files), job=job.id)
        if req.rank == 0 and req.register:
            metrics = req.head.get("metrics")
            self.store.register(req.root, req.step, [],
                                metrics if isinstance(metrics, dict) else {}, self.clock.time())
            self.wake_scan()
        return written

    def _keep(self, job: _Job, written: stage.Written) -> None:
        """Keep the persisted arena for a restart (its descriptor, no copy), with the hash of
        each file as it was written from it."""
        if self.own is None:
            return
        hashes = {str(e["path"]): str(e["hash"]) for e in written.files}
        req = job.req
        files = tuple(KeptFile(f.path, f.component, f.offset, f.size, hashes[f.path])
                      for f in req.files if f.path in hashes)
        if len(files) != len(req.files):
            return  # not every file's hash came back: nothing to check a load against
        kept = Kept(req.root, req.rank, req.world_size, req.step, req.generation,
                    os.dup(job.fd), job.size, files, dict(req.head))
        self.own.keep(kept)
        self.log.info("memory_kept", root=req.root, step=req.step, rank=req.rank,
                      bytes=kept.nbytes)
        if self._kept is not None:
            self._kept(kept)

    @staticmethod
    def _release(mm: mmap.mmap, generation: int, state: arena.State) -> None:
        try:
            if arena.read_header(mm).generation == generation:
                arena.set_state(mm, state, generation)
        except ValueError:
            pass  # the trainer scribbled over the header: it is its arena to mend
        try:
            mm.close()
        except BufferError:
            pass  # a failed write's slices are still referenced: unmapped when collected

    # -- supervision ------------------------------------------------------------------------

    def run(self, stop: threading.Event) -> None:
        """Nothing to loop over: jobs run on their own threads. On stop, give the jobs in
        flight a grace period to finish, then cancel them (never committed, never valid)."""
        stop.wait()
        deadline = time.monotonic() + self.grace  # a real wait on threads: the real clock
        for job in list(self._jobs.values()):
            job.done.wait(max(0.0, deadline - time.monotonic()))
        with self._lock:
            self._stopping = True  # no save is taken from here on
            jobs = list(self._jobs.values())
        for job in jobs:
            job.cancel.set()
        for job in list(self._jobs.values()):
            if job.thread is not None:
                job.thread.join(2.0)


def _check_access(fd: int) -> None:
    """The arena is mapped for reading and writing (the daemon marks it persisted or failed):
    a descriptor reopened read-only or write-only is refused here, not a 500 at mmap."""
    mode = fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE
    if mode != os.O_RDWR:
        how = {os.O_RDONLY: "read-only", os.O_WRONLY: "write-only"}.get(mode, f"mode {mode}")
        raise BadValue(f"the arena descriptor is open {how}; pass the memfd itself (open"
                         " for reading and writing)")
