"""Retention in the daemon: plan from the store's facts, execute with fresh guards, record.

Owns when retention runs for a root (after stages, on a timer, under disk pressure) and the
translation between store records and the planner's/executor's plain types. The decisions
themselves live in `ckptd.policy.retention`; the deletes and their safety nets in
`ckptd.stages.prune`.
"""

from __future__ import annotations

import shutil
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckptd.backends import Backend
from ckptd.config import RootConfig
from ckptd.lifecycle.table import Event
from ckptd.log import get_logger
from ckptd.model import CKPTD_DIR, CheckpointRecord, Local, Remote, State, Tier
from ckptd.policy import retention
from ckptd.stages import compress, prune
from ckptd.store import Store

TIMER_S = 60.0
# After compress_older could not replace a checkpoint's originals, leave it this long.
COMPRESS_RETRY_S = 3600.0


@dataclass(frozen=True)
class RootHealth:
    """What the last retention run learned about a root (status, metrics)."""

    preflight_ok: bool
    message: str
    next_save_estimate: int
    min_free_unmet: bool


def objects_dir(root: RootConfig, step: int) -> Path:
    return root.path / CKPTD_DIR / "objects" / f"step-{step}"


class Pruner:
    """Runs retention per root on its own thread, never inside a stage worker."""

    def __init__(self, store: Store, roots: Callable[[], Mapping[str, RootConfig]],
                 backend_for: Callable[[RootConfig], Backend | None]) -> None:
        self.store = store
        self.roots = roots
        self.backend_for = backend_for
        self.health: dict[str, RootHealth] = {}
        self._compress_backoff: dict[tuple[str, int], float] = {}
        self.log = get_logger()
        self._wanted: set[str] = set()
        self._asked: list[tuple[str, Future[list[prune.Outcome]]]] = []
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._running = threading.Event()
        # Local deletes and scans never interleave: a scan that walks a root while a
        # checkpoint is being moved into the trash would see it half gone.
        self.exclusive = threading.RLock()

    # -- scheduling --------------------------------------------------------------------------

    def wake(self) -> None:
        self._wake.set()

    def plan_json(self, root: RootConfig) -> dict[str, Any]:
        return self.plan(root).as_json(root.name)

    def apply_now(self, root: RootConfig) -> list[dict[str, Any]]:
        return [{"step": o.step, "tier": o.tier, "action": o.action, "reason": o.reason,
                 "bytes_freed": o.bytes_freed} for o in self.run_now(root.name)]

    def health_json(self, name: str) -> dict[str, Any] | None:
        return health_json(self.health.get(name))

    def request(self, root: str) -> None:
        with self._lock:
            self._wanted.add(root)
        self._wake.set()

    def run_now(self, name: str, timeout: float = 300.0) -> list[prune.Outcome]:
        """Run retention on `name` now, on the retention thread (never beside another run),
        and wait for the outcomes. Raises TimeoutError when the thread does not get to it."""
        if not self._running.is_set():
            raise TimeoutError("retention is not running")
        future: Future[list[prune.Outcome]] = Future()
        with self._lock:
            self._asked.append((name, future))
        self._wake.set()
        try:
            return future.result(timeout)
        finally:
            future.cancel()  # never run later for a caller that gave up

    def run(self, stop: threading.Event) -> None:
        """The retention service: every run happens here, one at a time."""
        self._running.set()
        try:
            self._want_all()
            last_timer = time.monotonic()
            while not stop.is_set():
                self._wake.wait(1.0)
                self._wake.clear()
                if time.monotonic() - last_timer >= TIMER_S:
                    last_timer = time.monotonic()
                    self._want_all()
                self._want_pressured()
                self._serve_asked(stop)
                with self._lock:
                    wanted, self._wanted = self._wanted, set()
                for name in sorted(wanted):
                    root = self.roots().get(name)
                    if root is not None and not stop.is_set():
                        self.run_root(root)
        finally:
            self._running.clear()

    def _serve_asked(self, stop: threading.Event) -> None:
        with self._lock:
            asked, self._asked = self._asked, []
        for name, future in asked:
            root = self.roots().get(name)
            if stop.is_set() or root is None:
                future.set_exception(TimeoutError("retention is stopping"))
            elif future.set_running_or_notify_cancel():
                future.set_result(self.run_root(root))

    def _want_all(self) -> None:
        with self._lock:
            self._wanted.update(self.roots())

    def _want_pressured(self) -> None:
        """Free space under min_free: prune now, not at the next timer."""
        for root in self.roots().values():
            disk = disk_of(root)
            if disk is not None and disk.free_bytes < disk.min_free_bytes:
                with self._lock:
                    self._wanted.add(root.name)

    # -- one run -----------------------------------------------------------------------------

    def plan(self, root: RootConfig, now: float | None = None) -> retention.Plan:
        """The plan as it stands (what `ckptd prune --dry-run` prints)."""
        now = time.time() if now is None else now
        return self._plan(root, self.store.checkpoints(root.name), now)

    def _plan(self, root: RootConfig, records: list[CheckpointRecord],
              now: float) -> retention.Plan:
        in_use = self.store.in_use(root.name, now)
        views = [view_of(r, root.metric, r.step in in_use) for r in records]
        disk = disk_of(root) or retention.Disk(0, 0, 0)
        return retention.plan(views, local_rules(root), remote_rules(root), disk, now,
                              metric_mode=root.metric_mode,
                              upload_configured=root.upload.enabled)

    def run_root(self, root: RootConfig) -> list[prune.Outcome]:
        try:
            # Only the local deletes hold the lock (with the guards they check, read inside it):
            # remote calls and compressing in place can take long and must not hold up scans,
            # pins or readers' leases.
            with self.exclusive:
                now = time.time()
                plan, outcomes = self._run_local(root, now)
                self._record(root, [o for o in outcomes if o.action != "deferred"])
            remote = self._remote(root, plan, now)
            self._record(root, remote + [o for o in outcomes if o.action == "deferred"])
            self._finish_compressed(root)
            return outcomes + remote
        except Exception as exc:  # retention must never take the daemon down
            self.log.error("prune_run_failed", root=root.name, error=str(exc), exc_info=True)
            self.store.set_root_error(root.name, f"retention: {exc}", time.time())
            return []

    def _run_local(self, root: RootConfig, now: float
                   ) -> tuple[retention.Plan, list[prune.Outcome]]:
        records = self.store.checkpoints(root.name)
        plan = self._plan(root, records, now)
        self._check_preflight(root, records, plan)
        guards = self._guards(root, now)
        targets = {r.step: target_of(root, r, self.store.members(r.id)) for r in records}
        outcomes = prune.execute_local(
            root.path, plan, targets, guards, prune.trash_dir_for(root.path),
            on_trashed=lambda step, _entry: self._pruned(root.name, step),
            root=root.name)
        return plan, outcomes

    def _pruned(self, name: str, step: int) -> None:
        self.store.record(name, step, Event.PRUNED_LOCAL, time.time())

    def _finish_compressed(self, root: RootConfig) -> None:
        """A crash after a row was recorded `compressed` but before its originals went leaves
        them beside the copy: finish the job (verified, backed off like any failure)."""
        for rec in self.store.checkpoints(root.name):
            if rec.local is Local.COMPRESSED and (root.path / rec.path).exists():
                self._replace(root, rec.step, rec.id, rec.path)

    def _remote(self, root: RootConfig, plan: retention.Plan, now: float) -> list[prune.Outcome]:
        if not any(i.remote is retention.Action.DELETE for i in plan.items):
            return []
        backend = self.backend_for(root)
        if backend is None:
            return []
        from ckptd.stages.upload import delete_step

        return prune.execute_remote(backend, root.name, plan, self._guards(root, now),
                                    delete_step)

    def _guards(self, root: RootConfig, now: float) -> prune.Guards:
        records = self.store.checkpoints(root.name)
        latest = self.store.latest(root.name, Tier.ANY)
        best = self.store.best(root.name, root.metric, root.metric_mode)
        return prune.Guards(
            latest_step=latest.step if latest else None,
            best_step=best.step if best else None,
            pinned=frozenset(r.step for r in records if r.pinned),
            in_use=self.store.in_use(root.name, now),
            remote_verified=frozenset(r.step for r in records if r.remote is Remote.UPLOADED),
            upload_configured=root.upload.enabled,
            invalid=frozenset(r.step for r in records if r.state is State.INVALID),
        )

    def _record(self, root: RootConfig, outcomes: list[prune.Outcome]) -> None:
        """Record what was done as lifecycle events; their effects (the copy removed,
        latest.json) follow the transition."""
        for o in outcomes:
            if o.action == "deleted" and o.tier == "local":  # "trashed" was recorded already
                self.store.record(root.name, o.step, Event.PRUNED_LOCAL, time.time())
            elif o.action == "deleted" and o.tier == "remote":
                self.store.record(root.name, o.step, Event.PRUNED_REMOTE, time.time())
            elif o.action == "deferred" and o.reason == "compress":
                self._compress_in_place(root, o.step)

    def _compress_in_place(self, root: RootConfig, step: int) -> bool:
        """compress_older: replace the originals with the verified local compressed copy."""
        rec = self.store.checkpoint(root.name, step)
        if rec is None or rec.local is not Local.PRESENT or not self.store.has_copy(root.name,
                                                                                     step):
            return False  # the compress stage makes the copy first; a later run replaces
        manifest = compress.read_local_manifest(root.path, step)
        if manifest is None:
            self.store.record(root.name, step, Event.COPY_LOST, time.time())
            return False
        if time.monotonic() < self._compress_backoff.get((root.name, step), 0.0):
            return False
        if step in self.store.in_use(root.name, time.time()):
            return False  # a reader holds the originals
        # Recorded first: a crash while the originals go leaves a row that says "compressed"
        # with originals still beside the copy (finished later), never one that lost its copy.
        if not self.store.record(root.name, step, Event.COMPRESSED_LOCAL, time.time()):
            return False
        if not self._replace(root, step, rec.id, rec.path):
            self.store.record(root.name, step, Event.COMPRESS_UNDONE, time.time())
            return False
        self.log.info("checkpoint_compressed_locally", root=root.name, step=step)
        return True

    def _replace(self, root: RootConfig, step: int, cid: int, anchor: str) -> bool:
        if time.monotonic() < self._compress_backoff.get((root.name, step), 0.0):
            return False
        manifest = compress.read_local_manifest(root.path, step)
        try:
            if manifest is None:
                raise FileNotFoundError(f"no local compressed copy of step {step}")
            compress.replace_originals(root.path, manifest, list(self.store.members(cid)),
                                       anchor=anchor)
        except Exception as exc:
            self._compress_backoff[(root.name, step)] = time.monotonic() + COMPRESS_RETRY_S
            self.log.error("compress_older_failed", root=root.name, step=step, error=str(exc),
                           retry_in_s=COMPRESS_RETRY_S)
            return False
        return True

    def _check_preflight(self, root: RootConfig, records: list[CheckpointRecord],
                         plan: retention.Plan) -> None:
        disk = disk_of(root)
        if disk is None:
            return
        sizes = [r.bytes for r in records if r.state is State.VALID and r.bytes][-5:]
        pre = retention.preflight(sizes, disk, plan.reclaimable_bytes)
        prev = self.health.get(root.name)
        self.health[root.name] = RootHealth(pre.ok, pre.message, pre.next_save_estimate,
                                            plan.min_free_unmet)
        if not pre.ok and (prev is None or prev.preflight_ok):
            self.log.warning("preflight_capacity_warning", root=root.name, message=pre.message,
                             next_save_estimate=pre.next_save_estimate,
                             projected_free=pre.projected_free)


def view_of(r: CheckpointRecord, metric: str, in_use: bool) -> retention.CheckpointView:
    return retention.CheckpointView(
        step=r.step, state=r.state, local=r.local, remote=r.remote,
        completed=r.completed if r.completed is not None else r.created, bytes=r.bytes,
        metric=r.metrics.get(metric) if metric else None, pinned=r.pinned, in_use=in_use)


def local_rules(root: RootConfig) -> retention.LocalRules:
    lr = root.retention.local
    return retention.LocalRules(keep_last=lr.keep_last, keep_best=lr.keep_best,
                                keep_every=lr.keep_every, keep_within=lr.keep_within,
                                compress_older=lr.compress_older,
                                delete_invalid=lr.delete_invalid)


def remote_rules(root: RootConfig) -> retention.RemoteRules:
    rr = root.retention.remote
    return retention.RemoteRules(keep_last=rr.keep_last, keep_best=rr.keep_best,
                                 keep_every=rr.keep_every, keep_within=rr.keep_within)


def disk_of(root: RootConfig) -> retention.Disk | None:
    try:
        usage = shutil.disk_usage(root.path)
    except OSError:
        return None
    need = root.retention.local.min_free.required(usage.total)
    return retention.Disk(usage.free, usage.total, need)


def target_of(root: RootConfig, r: CheckpointRecord, members: tuple[str, ...]
              ) -> prune.Target:
    if r.local is Local.COMPRESSED:
        return prune.Target(r.step, f"{CKPTD_DIR}/objects/step-{r.step}", (), r.local, r.remote,
                            True)
    anchor = root.path / r.path
    is_dir = anchor.is_dir() and not anchor.is_symlink()
    return prune.Target(r.step, r.path, members, r.local, r.remote, is_dir)


def health_json(h: RootHealth | None) -> dict[str, Any] | None:
    if h is None:
        return None
    return {"ok": h.preflight_ok, "message": h.message or None,
            "next_save_estimate_bytes": h.next_save_estimate, "min_free_unmet": h.min_free_unmet}
