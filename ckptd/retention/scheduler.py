"""The retention service: one thread runs every retention run, for every root, one at a time.

Owns when retention runs (after stages, on a timer, under disk pressure, on `run_now`), the
translation between store records and the planner's/executor's plain types (`guards_for`:
the nets every destructive act is checked against), and recording the outcomes
(compress_older in place included). Decides nothing (`planner`) and deletes nothing: every
delete is an executor entry point (`execute_local`, `execute_copies`, `execute_remote`,
`replace_originals`).
"""

from __future__ import annotations

import os
import shutil
import stat
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckptd.backends import Backend
from ckptd.config import RootConfig
from ckptd.copies import store as copies
from ckptd.errors import NotFound, ServiceUnavailable
from ckptd.lifecycle.table import Event
from ckptd.log import get_logger
from ckptd.model import CKPTD_DIR, CheckpointRecord, Local, Remote, State, Tier
from ckptd.retention import executor, planner
from ckptd.service.supervisor import Calls
from ckptd.store import Store

TIMER_S = 60.0
POLL_S = 1.0  # how often the loop looks at free space (and at its stop event)
# After compress_older could not replace a checkpoint's originals, leave it this long.
COMPRESS_RETRY_S = 3600.0
# `ckptd prune ROOT` waits 600 s for its answer: give up (503) before it does.
RUN_NOW_TIMEOUT_S = 540.0
# One root's run quiet for longer than this is a stuck call in health (it shows no progress of
# its own: a verify pass over a very large copy takes minutes, a stalled delete forever).
RUN_BOUND_S = 1800.0
# How long run_now waits for a loop that is not running (a restart in progress) to pick it up.
IDLE_WAIT_S = 10.0

Waiters = dict[str, list["Future[list[executor.Outcome]]"]]


@dataclass(frozen=True)
class RootHealth:
    """What the last retention run learned about a root (status, metrics)."""

    preflight_ok: bool
    message: str
    next_save_estimate: int
    min_free_unmet: bool


class RetentionService:
    """Every retention run happens on the thread inside `run`, so two never overlap, whoever
    asked (a stage, the timer, disk pressure, `POST /v1/roots/{root}/prune` through `run_now`).

    A run's local-delete phase holds two locks: `exclusive`, which scans take (a scan never
    sees a checkpoint half moved), and `nets`, which pins and readers' leases take (none lands
    between the nets' reading and the last delete). Pins never wait on a scan: they share no
    lock (see docs/DESIGN.md for what may interleave with what).
    """

    def __init__(self, store: Store, roots: Callable[[], Mapping[str, RootConfig]],
                 backend_for: Callable[[RootConfig], Backend | None], *,
                 timer_s: float = TIMER_S, api_timeout: float = RUN_NOW_TIMEOUT_S,
                 node: str = "", calls: Calls | None = None,
                 bound_s: float = RUN_BOUND_S) -> None:
        self.store = store
        self.calls = calls if calls is not None else Calls()
        self.bound_s = bound_s
        self.roots = roots
        self.timer_s = timer_s
        self.api_timeout = api_timeout
        self.exclusive = threading.RLock()
        self.nets = threading.RLock()
        self.log = get_logger()
        self._runner = _Runner(store, backend_for, self.exclusive, self.nets, node)
        self._mutex = threading.Lock()  # guards the three fields below
        self._wanted: set[str] = set()
        self._waiting: Waiters = {}
        self._loop_thread: int | None = None
        self._wake = threading.Event()

    # -- asking for runs ---------------------------------------------------------------------

    def request(self, root: str) -> None:
        """Run `root` soon (coalesced with other requests); returns at once."""
        with self._mutex:
            self._wanted.add(root)
        self._wake.set()

    def run_now(self, root: str, timeout: float = RUN_NOW_TIMEOUT_S) -> list[executor.Outcome]:
        """Have the retention thread run `root` (a run that starts after this call) and return
        its outcomes. Raises what the run raised, NotFound for an unknown root, and
        ServiceUnavailable when no run of it finished within `timeout` (at most IDLE_WAIT_S
        when the loop is not running: nothing was done then)."""
        if root not in self.roots():
            raise NotFound(f"no root named {root!r}")
        fut: Future[list[executor.Outcome]] = Future()
        with self._mutex:
            if self._loop_thread == threading.get_ident():
                raise RuntimeError("run_now on the retention thread would wait for itself")
            self._waiting.setdefault(root, []).append(fut)
            running = self._loop_thread is not None
        self._wake.set()
        first = timeout if running else min(timeout, IDLE_WAIT_S)
        if not wait([fut], first).done:
            if self._withdraw(root, fut):
                why = "is not running" if not running else f"did not get to it in {first:g}s"
                raise ServiceUnavailable(f"retention of root {root!r} was not run: the"
                                         f" retention service {why}")
            if not wait([fut], max(0.0, timeout - first)).done:
                raise ServiceUnavailable(f"retention of root {root!r} did not finish within"
                                         f" {timeout:g}s; it goes on in the background")
        return fut.result()

    def _withdraw(self, root: str, fut: Future[list[executor.Outcome]]) -> bool:
        """Take back a run_now the loop has not picked up; False when it has."""
        with self._mutex:
            futures = self._waiting.get(root, [])
            if fut not in futures:
                return False
            futures.remove(fut)
            if not futures:
                del self._waiting[root]
            return True

    # -- the loop ----------------------------------------------------------------------------

    def run(self, stop: threading.Event) -> None:
        """Run retention until `stop` is set: every root at once, then as asked, on the timer and
        under disk pressure. One root's failed run is logged, recorded as its error and raised
        to its run_now callers; any other exception escapes (the loop is then not running)."""
        self._enter()
        try:
            next_timer = time.monotonic()
            while not stop.is_set():
                self._wake.clear()
                if time.monotonic() >= next_timer:
                    next_timer = time.monotonic() + self.timer_s
                    self._want(self.roots())
                self._want(self._pressured())
                self._serve_all(stop)
                self._wake.wait(POLL_S)
        finally:
            self._leave(stop.is_set())

    def _enter(self) -> None:
        with self._mutex:
            if self._loop_thread is not None:
                raise RuntimeError("the retention loop is already running")
            self._loop_thread = threading.get_ident()

    def _leave(self, stopped: bool) -> None:
        with self._mutex:
            self._loop_thread = None
            # Stopped on purpose: nobody will serve them. After a crash a restart may.
            waiting, self._waiting = (self._waiting, {}) if stopped else ({}, self._waiting)
        for futures in waiting.values():
            for fut in futures:
                fut.set_exception(ServiceUnavailable("the retention service stopped"))

    def _want(self, names: Iterable[str]) -> None:
        with self._mutex:
            self._wanted.update(names)

    def _pressured(self) -> list[str]:
        """Roots whose free space is under min_free: prune now, not at the next timer."""
        out = []
        for root in self.roots().values():
            disk = disk_of(root)
            if disk is not None and disk.free_bytes < disk.min_free_bytes:
                out.append(root.name)
        return out

    def _serve_all(self, stop: threading.Event) -> None:
        """Run every root asked for, those a caller waits on first; one run serves every
        run_now of its root that was waiting when it started."""
        with self._mutex:
            waiting, self._waiting = self._waiting, {}
            wanted, self._wanted = self._wanted, set()
        order = sorted(waiting) + sorted(wanted - waiting.keys())
        served = 0
        try:
            for name in order:
                if stop.is_set():
                    return
                self._serve(name, waiting.get(name, []))
                served += 1
        finally:  # stopped, or crashed: what is left waits for the next loop (or its stop)
            self._give_back(order[served:], waiting, wanted)

    def _give_back(self, names: list[str], waiting: Waiters, wanted: set[str]) -> None:
        with self._mutex:
            for name in names:
                left = [f for f in waiting.get(name, []) if not f.done()]
                if left:
                    self._waiting.setdefault(name, [])[:0] = left
            self._wanted.update(n for n in names if n in wanted)

    def _serve(self, name: str, futures: list[Future[list[executor.Outcome]]]) -> None:
        root = self.roots().get(name)
        if root is None:  # removed by a reload since it was asked for
            for fut in futures:
                fut.set_exception(NotFound(f"no root named {name!r}"))
            return
        try:
            # A caller waiting is `ckptd prune --apply`: the user's say-so for adopted ones.
            self.calls.begin("retention", "retention", name, None, self.bound_s)
            try:
                outcomes = self._runner.run(root, delete_adopted=bool(futures))
            finally:
                self.calls.end("retention")
        except Exception as exc:  # one root's failure must not stop the others' retention
            try:
                self.log.error("prune_run_failed", root=name, error=str(exc), exc_info=True)
                self.store.set_root_error(name, f"retention: {exc}", time.time())
            finally:  # even when recording fails, nobody is left waiting
                for fut in futures:
                    fut.set_exception(exc)
            return
        self.store.clear_root_error(name, "retention:")  # a run went through again
        for fut in futures:
            fut.set_result(outcomes)

    # -- reads -------------------------------------------------------------------------------

    def plan(self, root: str, now: float | None = None) -> planner.Plan:
        """The plan as it stands (what `ckptd prune --dry-run` prints); reads only, on the
        caller's thread."""
        config = self.roots().get(root)
        if config is None:
            raise NotFound(f"no root named {root!r}")
        return self._runner.plan(config, time.time() if now is None else now)

    def health(self, root: str) -> RootHealth | None:
        return self._runner.health.get(root)

    # -- what the API asks ---------------------------------------------------------------------

    def wake(self) -> None:
        self._wake.set()

    def plan_json(self, root: RootConfig) -> dict[str, Any]:
        return self.plan(root.name).as_json(root.name)

    def apply_now(self, root: RootConfig) -> list[dict[str, Any]]:
        return [o.as_json() for o in self.run_now(root.name, self.api_timeout)]

    def adopted_json(self, root: RootConfig) -> dict[str, Any] | None:
        """What retention does with the checkpoints that were there before ckptd: `held` are
        kept only because they are adopted (a `ckptd prune --apply` would delete them; an
        upload of each makes it deletable by the rules)."""
        records = [r for r in self.store.checkpoints(root.name)
                   if r.adopted and r.local is not Local.PRUNED]
        if not records:
            return None
        plan = self.plan(root.name)
        held = sorted(i.step for i in plan.items
                      if {r for r in i.reasons if r.startswith("local:")} == {"local:adopted"})
        return {"count": len(records), "held": held,
                "message": (f"{len(records)} checkpoint(s) were there before ckptd: never"
                            " deleted locally without a verified remote copy; "
                            + (f"{len(held)} kept only for that (steps {held[:10]}); "
                               f"`ckptd prune {root.name} --apply` deletes them"
                               if held else "none of them would be deleted by the rules"))}

    def announce_adopted(self, root: RootConfig) -> None:
        """Say at start what retention will do with the root's adopted checkpoints."""
        adopted = self.adopted_json(root)
        if adopted is not None:
            self.log.info("adopted_checkpoints", root=root.name, count=adopted["count"],
                          held=adopted["held"], message=adopted["message"])

    def health_json(self, name: str) -> dict[str, Any] | None:
        return health_json(self.health(name))


class _Runner:
    """One retention run of one root: plan from the store's facts, execute with fresh guards,
    record. Only the service's thread calls `run`."""

    def __init__(self, store: Store, backend_for: Callable[[RootConfig], Backend | None],
                 lock: threading.RLock, nets: threading.RLock, node: str = "") -> None:
        self.store = store
        self.backend_for = backend_for
        self.node = node  # daemon.node: remote retention of a multi-node root is its coordinator's
        self.exclusive = lock
        self.nets = nets
        self.health: dict[str, RootHealth] = {}
        self._compress_backoff: dict[tuple[str, int], float] = {}
        self.log = get_logger()

    def plan(self, root: RootConfig, now: float) -> planner.Plan:
        return self._plan(root, self.store.checkpoints(root.name), now)

    def _plan(self, root: RootConfig, records: list[CheckpointRecord],
              now: float, delete_adopted: bool = False) -> planner.Plan:
        in_use = self.store.in_use(root.name, now)
        views = [view_of(r, root.metric, r.step in in_use, self._has_copy(root, r))
                 for r in records]
        disk = disk_of(root) or planner.Disk(0, 0, 0)
        return planner.plan(views, local_rules(root), remote_rules(root), disk, now,
                            metric_mode=root.metric_mode, upload_configured=root.upload.enabled,
                            delete_adopted=delete_adopted)

    def _has_copy(self, root: RootConfig, r: CheckpointRecord) -> bool:
        status = self.store.status(root.name, r.step)
        return status is not None and status.copy

    def run(self, root: RootConfig, delete_adopted: bool = False) -> list[executor.Outcome]:
        # Only the local deletes hold the lock (with the guards they check, read inside it):
        # remote calls and compressing in place can take long and must not hold up scans,
        # pins or readers' leases.
        with self.exclusive, self.nets:
            now = time.time()
            plan, outcomes = self._run_local(root, now, delete_adopted)
            self._record(root, [o for o in outcomes if o.action != "deferred"])
        remote = self._remote(root, plan, now)
        self._record(root, remote + [o for o in outcomes if o.action == "deferred"])
        self._finish_compressed(root)
        return outcomes + remote

    def _run_local(self, root: RootConfig, now: float, delete_adopted: bool = False
                   ) -> tuple[planner.Plan, list[executor.Outcome]]:
        records = self.store.checkpoints(root.name)
        plan = self._plan(root, records, now, delete_adopted)
        self._check_preflight(root, records, plan)
        guards = self._guards(root, now, delete_adopted)
        targets = {r.step: target_of(root, r, self.store.members(r.id)) for r in records}
        outcomes = executor.execute_local(
            root.path, plan, targets, guards, executor.trash_dir_for(root.path),
            on_trashed=lambda step, _entry: self._pruned(root.name, step),
            root=root.name)
        copies = {r.step: copy_target(r.step, r.local, r.remote) for r in records}
        outcomes += executor.execute_copies(root.path, plan, copies, guards, root=root.name)
        return plan, outcomes

    def _pruned(self, name: str, step: int) -> None:
        self.store.record(name, step, Event.PRUNED_LOCAL, time.time())

    def _finish_compressed(self, root: RootConfig) -> None:
        """A crash after a row was recorded `compressed` but before its originals went leaves
        them beside the copy: finish the job (verified, backed off like any failure)."""
        for rec in self.store.checkpoints(root.name):
            if rec.local is not Local.COMPRESSED or not (root.path / rec.path).exists():
                continue
            if time.monotonic() < self._compress_backoff.get((root.name, rec.step), 0.0):
                continue
            checked = self._check_replaceable(root, rec.step, rec.id)
            if checked is not None:
                self._replace(root, rec.step, rec.path, *checked)

    def _remote(self, root: RootConfig, plan: planner.Plan, now: float) -> list[executor.Outcome]:
        if not any(i.remote is planner.Action.DELETE for i in plan.items):
            return []
        backend = self.backend_for(root)
        if backend is None or (root.multi_node and not self._coordinates(root, backend)):
            return []
        from ckptd.stages.upload import delete_step

        return executor.execute_remote(backend, root.name, plan, self._guards(root, now),
                                       delete_step)

    def _coordinates(self, root: RootConfig, backend: Backend) -> bool:
        """A multi-node root's remote deletes are made by one node only: the coordinator of
        its newest committed step (the node holding that step's commit record)."""
        newest = self.store.latest(root.name, Tier.REMOTE)
        if newest is None:
            return False
        from ckptd.errors import CkptdError
        from ckptd.remote import layout as remote

        try:
            nodes = remote.read_manifest(backend, root.name, newest.step).nodes
        except CkptdError as exc:
            self.log.warning("remote_retention_skipped", root=root.name, error=str(exc))
            return False
        return any(n == self.node and record for n, _a, record in nodes)

    def _guards(self, root: RootConfig, now: float,
                delete_adopted: bool = False) -> executor.Guards:
        return guards_for(self.store, root, now, delete_adopted)

    def _record(self, root: RootConfig, outcomes: list[executor.Outcome]) -> None:
        """Record what was done as lifecycle events; their effects (a released compressed
        copy removed, latest.json) follow the transition."""
        for o in outcomes:
            if o.action == "deleted" and o.tier == "local":  # "trashed" was recorded already
                self.store.record(root.name, o.step, Event.PRUNED_LOCAL, time.time())
            elif o.action == "deleted" and o.tier == "remote":
                self.store.record(root.name, o.step, Event.PRUNED_REMOTE, time.time())
            elif o.action == "deleted" and o.tier == "copy":
                self.store.record(root.name, o.step, Event.COPY_DROPPED, time.time())
            elif o.action == "deferred" and o.reason == "compress":
                self._compress_in_place(root, o.step)

    def _compress_in_place(self, root: RootConfig, step: int) -> bool:
        """compress_older: replace the originals with the verified local compressed copy."""
        rec = self.store.checkpoint(root.name, step)
        if rec is None or rec.local is not Local.PRESENT or not self.store.has_copy(root.name,
                                                                                     step):
            return False  # the compress stage makes the copy first; a later run replaces
        manifest = copies.read_local_manifest(root.path, step)
        if manifest is None:
            self.store.record(root.name, step, Event.COPY_LOST, time.time())
            return False
        if time.monotonic() < self._compress_backoff.get((root.name, step), 0.0):
            return False
        if step in self.store.in_use(root.name, time.time()):
            return False  # a reader holds the originals
        checked = self._check_replaceable(root, step, rec.id)
        if checked is None:
            return False
        # Recorded before the originals go: a crash meanwhile leaves a row that says
        # "compressed" with originals still beside the copy (finished later), never one that
        # lost its copy. After the long checks, so the row says so only for the moves' time.
        if not self.store.record(root.name, step, Event.COMPRESSED_LOCAL, time.time()):
            return False
        if not self._replace(root, step, rec.path, *checked):
            self.store.record(root.name, step, Event.COMPRESS_UNDONE, time.time())
            return False
        self.log.info("checkpoint_compressed_locally", root=root.name, step=step)
        return True

    def _check_replaceable(self, root: RootConfig, step: int, cid: int
                           ) -> tuple[Any, list[str]] | None:
        """The long checks before the originals may go (the copy decoded, every original
        re-hashed), without the locks: the copy's manifest and the members, or None."""
        members = list(self.store.members(cid))
        try:
            manifest = copies.read_local_manifest(root.path, step)
            if manifest is None:
                raise FileNotFoundError(f"no local compressed copy of step {step}")
            copies.check_replaceable(root.path, manifest, members)
        except Exception as exc:
            self._replace_failed(root, step, str(exc))
            return None
        return manifest, members

    def _replace(self, root: RootConfig, step: int, anchor: str, manifest: Any,
                 members: list[str]) -> bool:
        """The originals go through the executor's `replace_originals`: holding the locks
        like any local delete, the nets and a quick re-check of the originals' sizes."""
        rec = self.store.checkpoint(root.name, step)
        target = executor.Target(step, anchor, tuple(members), Local.PRESENT,
                                 rec.remote if rec else Remote.NONE, False)
        with self.exclusive, self.nets:
            out = executor.replace_originals(
                root.path, target, self._guards(root, time.time()),
                lambda: copies.check_replaceable(root.path, manifest, members, verify=False,
                                                   rehash=False),
                root=root.name)
        if out.action == "failed":
            return self._replace_failed(root, step, out.reason)
        return out.action == "deleted"

    def _replace_failed(self, root: RootConfig, step: int, error: str) -> bool:
        self._compress_backoff[(root.name, step)] = time.monotonic() + COMPRESS_RETRY_S
        self.log.error("compress_older_failed", root=root.name, step=step, error=error,
                       retry_in_s=COMPRESS_RETRY_S)
        return False

    def _check_preflight(self, root: RootConfig, records: list[CheckpointRecord],
                         plan: planner.Plan) -> None:
        disk = disk_of(root)
        if disk is None:
            return
        sizes = [r.bytes for r in records if r.state is State.VALID and r.bytes][-5:]
        pre = planner.preflight(sizes, disk, plan.reclaimable_bytes)
        prev = self.health.get(root.name)
        self.health[root.name] = RootHealth(pre.ok, pre.message, pre.next_save_estimate,
                                            plan.min_free_unmet)
        if not pre.ok and (prev is None or prev.preflight_ok):
            self.log.warning("preflight_capacity_warning", root=root.name, message=pre.message,
                             next_save_estimate=pre.next_save_estimate,
                             projected_free=pre.projected_free)


def guards_for(store: Store, root: RootConfig, now: float,
               delete_adopted: bool = False) -> executor.Guards:
    """The nets, read from the store now: what every executor entry point checks."""
    records = store.checkpoints(root.name)
    latest = store.latest(root.name, Tier.ANY)
    best = store.best(root.name, root.metric, root.metric_mode)
    return executor.Guards(
        latest_step=latest.step if latest else None,
        best_step=best.step if best else None,
        pinned=frozenset(r.step for r in records if r.pinned),
        in_use=store.in_use(root.name, now),
        remote_verified=frozenset(r.step for r in records if r.remote is Remote.UPLOADED),
        upload_configured=root.upload.enabled,
        invalid=frozenset(r.step for r in records if r.state is State.INVALID),
        shared=_shared(store, root, records),
        adopted=frozenset() if delete_adopted else frozenset(
            r.step for r in records if r.adopted and r.remote is not Remote.UPLOADED),
    )


def _shared(store: Store, root: RootConfig, records: list[CheckpointRecord]) -> frozenset[int]:
    """Steps on disk whose files, or whose directory, hold another on-disk checkpoint's
    file: a file belongs to one checkpoint, so a delete never reaches past its own."""
    present = [r for r in records if r.local is Local.PRESENT]
    owners: dict[str, set[int]] = {}
    for r in present:
        for f in store.members(r.id):
            owners.setdefault(f, set()).add(r.step)
    shared = {s for steps in owners.values() if len(steps) > 1 for s in steps}
    for r in present:
        if _real_dir(root.path / r.path):
            prefix = r.path.rstrip("/") + "/"
            if any(f.startswith(prefix) and steps - {r.step}
                   for f, steps in owners.items()):
                shared.add(r.step)
    return frozenset(shared)


def copy_target(step: int, local: Local, remote: Remote) -> executor.Target:
    """A step's local compressed copy as the executor's Target (`release_copy`)."""
    return executor.Target(step, f"{CKPTD_DIR}/objects/step-{step}", (), local, remote, True)


def view_of(r: CheckpointRecord, metric: str, in_use: bool,
            copy: bool = False) -> planner.CheckpointView:
    return planner.CheckpointView(
        step=r.step, state=r.state, local=r.local, remote=r.remote,
        completed=r.completed if r.completed is not None else r.created, bytes=r.bytes,
        metric=r.metrics.get(metric) if metric else None, pinned=r.pinned, in_use=in_use,
        adopted=r.adopted, copy=copy)


def local_rules(root: RootConfig) -> planner.LocalRules:
    lr = root.retention.local
    return planner.LocalRules(keep_last=lr.keep_last, keep_best=lr.keep_best,
                              keep_every=lr.keep_every, keep_within=lr.keep_within,
                              compress_older=lr.compress_older,
                              delete_invalid=lr.delete_invalid)


def remote_rules(root: RootConfig) -> planner.RemoteRules:
    rr = root.retention.remote
    return planner.RemoteRules(keep_last=rr.keep_last, keep_best=rr.keep_best,
                               keep_every=rr.keep_every, keep_within=rr.keep_within)


def disk_of(root: RootConfig) -> planner.Disk | None:
    try:
        usage = shutil.disk_usage(root.path)
    except OSError:
        return None
    need = root.retention.local.min_free.required(usage.total)
    return planner.Disk(usage.free, usage.total, need)


def target_of(root: RootConfig, r: CheckpointRecord, members: tuple[str, ...]
              ) -> executor.Target:
    if r.local is Local.COMPRESSED:
        return copy_target(r.step, r.local, r.remote)
    anchor = root.path / r.path
    is_dir = _real_dir(anchor)
    return executor.Target(r.step, r.path, members, r.local, r.remote, is_dir)


def health_json(h: RootHealth | None) -> dict[str, Any] | None:
    if h is None:
        return None
    return {"ok": h.preflight_ok, "message": h.message or None,
            "next_save_estimate_bytes": h.next_save_estimate, "min_free_unmet": h.min_free_unmet}


def _real_dir(path: Path) -> bool:
    """A directory, not a link to one. Any error (a name too long, a permission) is "no": one
    checkpoint's odd path never fails the run for the others."""
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except (OSError, ValueError):
        return False
