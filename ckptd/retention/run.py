"""One retention run of one root: plan from the store's facts, execute with fresh guards, record
the outcomes, compress in place what the plan defers. Never chooses when it runs (the scheduler)
or what is kept (the planner), and deletes nothing itself (the executor does). What it decides
is only whether the remote part runs: not while the bucket's hold objects cannot be read, and
on a multi-node root only on the node that coordinates it (`cluster.coordinator`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from ckptd.backends import Backend
from ckptd.clock import SYSTEM, Clock
from ckptd.cluster.coordinator import coordinates
from ckptd.config import RootConfig
from ckptd.errors import CkptdError
from ckptd.fetch import holds
from ckptd.lifecycle.table import Event
from ckptd.log import get_logger
from ckptd.model import CheckpointRecord, State, Tier
from ckptd.remote import keys as remote
from ckptd.retention import executor, planner, trash
from ckptd.retention.inplace import InPlace
from ckptd.retention.outcomes import LocalRun, Outcome
from ckptd.retention.report import RootHealth
from ckptd.retention.views import (
    StoreNets,
    copy_target,
    disk_of,
    target_of,
    view_of,
)
from ckptd.store import Store

_EVENTS = {("deleted", "local"): Event.PRUNED_LOCAL,  # "trashed" was recorded already
           ("deleted", "remote"): Event.PRUNED_REMOTE,
           ("deleted", "copy"): Event.COPY_DROPPED}


class RetentionRun:
    """Runs a root's retention; only the retention service's thread calls `run`. `exclusive`
    and `nets` are the service's locks, held for the local deletes."""

    def __init__(self, store: Store, backend_for: Callable[[RootConfig], Backend | None],
                 exclusive: threading.RLock, nets: threading.RLock, node: str = "",
                 clock: Clock = SYSTEM) -> None:
        """`clock`: what a run's `now` is read from (readers' holds, recorded events)."""
        self.store = store
        self.clock = clock
        self.backend_for = backend_for
        self.node = node  # daemon.node: remote retention of a multi-node root is its coordinator's
        self.exclusive = exclusive
        self.nets = nets
        self.health: dict[str, RootHealth] = {}
        self.inplace = InPlace(store, exclusive, nets, clock)
        self.log = get_logger()

    def plan(self, root: RootConfig, now: float, delete_adopted: bool = False,
             records: list[CheckpointRecord] | None = None) -> planner.Plan:
        if records is None:
            records = self.store.checkpoints(root.name)
        in_use = self.store.in_use(root.name, now)
        views = [view_of(r, root.metric, r.step in in_use, self._has_copy(root, r))
                 for r in records]
        disk = disk_of(root) or planner.Disk(0, 0, 0)
        return planner.plan(views, root.retention.local, root.retention.remote, disk, now,
                            metric_mode=root.metric_mode, upload_configured=root.upload.enabled,
                            delete_adopted=delete_adopted, committed_only=root.multi_node)

    def _has_copy(self, root: RootConfig, r: CheckpointRecord) -> bool:
        status = self.store.status(root.name, r.step)
        return status is not None and status.copy

    def run(self, root: RootConfig, delete_adopted: bool = False) -> list[Outcome]:
        # Only the local deletes hold the lock (with the guards they check, read inside it):
        # remote calls and compressing in place can take long and must not hold up scans,
        # pins or readers' holds.
        with self.exclusive, self.nets:
            now = self.clock.time()
            plan, local, outcomes = self._run_local(root, now, delete_adopted)
            self._record(root, outcomes)
        remote_out = self._remote(root, plan)
        self._record(root, remote_out)
        for step in local.compress:
            self.inplace.replace_originals(root, step)
        self.inplace.finish(root)
        return outcomes + remote_out

    def _run_local(self, root: RootConfig, now: float, delete_adopted: bool = False
                   ) -> tuple[planner.Plan, LocalRun, list[Outcome]]:
        """The plan, what its local part did (and left to compress in place), and the
        outcomes of its local deletes and copy releases."""
        records = self.store.checkpoints(root.name)
        plan = self.plan(root, now, delete_adopted, records)
        self._check_preflight(root, records, plan)
        nets = self._nets(root, delete_adopted)
        targets = {r.step: target_of(root, r, self.store.members(r.id)) for r in records}
        local = executor.execute_local(
            root.path, plan, targets, nets, trash.trash_dir_for(root.path),
            on_trashed=lambda step, _entry: self._pruned(root.name, step),
            root=root.name)
        copies = {r.step: copy_target(r.step, r.local, r.remote) for r in records}
        outcomes = local.outcomes + executor.execute_copies(root.path, plan, copies, nets,
                                                            root=root.name)
        return plan, local, outcomes

    def _pruned(self, name: str, step: int) -> None:
        self.store.record(name, step, Event.PRUNED_LOCAL, self.clock.time())

    def _remote(self, root: RootConfig, plan: planner.Plan) -> list[Outcome]:
        if not any(i.remote is planner.Action.DELETE for i in plan.items):
            return []
        backend = self.backend_for(root)
        if backend is None or (root.multi_node and not self._coordinates(root, backend)):
            return []
        from ckptd.stages.upload import delete_step

        held = self._bucket_holds(root, backend, plan)
        return executor.execute_remote(backend, root.name, plan,
                                       self._nets(root, also_in_use=held), delete_step)

    def _bucket_holds(self, root: RootConfig, backend: Backend, plan: planner.Plan
                      ) -> frozenset[int]:
        """Steps readers hold in the bucket (`<root>/_holds/`, docs/RETENTION.md): read just
        before the remote deletes, by the clock now; the stale hold objects are removed."""
        try:
            found = holds.read_holds(backend, root.name, self.clock.time())
        except CkptdError as exc:  # a hold cannot be ruled out: no remote delete this run
            self.log.warning("remote_holds_unread", root=root.name, error=str(exc))
            return frozenset(i.step for i in plan.items)
        if found.over_cap:
            self.log.warning("remote_holds_over_cap", root=root.name,
                             limit=holds.MAX_HOLD_OBJECTS)
        try:
            holds.sweep_stale(backend, root.name, found.stale)
        except CkptdError as exc:  # they hold nothing: removing them can wait
            self.log.warning("remote_holds_sweep_failed", root=root.name, error=str(exc))
        return frozenset(i.step for i in plan.items if found.held(i.step))

    def _coordinates(self, root: RootConfig, backend: Backend) -> bool:
        """Whether this node makes the multi-node root's remote deletes (`coordinates`)."""
        newest = self.store.latest(root.name, Tier.REMOTE)
        if newest is None:
            return False
        try:
            nodes = remote.read_manifest(backend, root.name, newest.step).nodes
        except CkptdError as exc:
            self.log.warning("remote_retention_skipped", root=root.name, error=str(exc))
            return False
        return coordinates(self.node, nodes)

    def _nets(self, root: RootConfig, delete_adopted: bool = False,
              also_in_use: frozenset[int] = frozenset()) -> StoreNets:
        """The nets every executor call of this run reads itself, under `self.nets`;
        `also_in_use`: steps held where the store does not see it (readers' hold objects in
        the bucket)."""
        return StoreNets(self.store, root, self.nets, self.clock.time, delete_adopted, also_in_use)

    def _record(self, root: RootConfig, outcomes: list[Outcome]) -> None:
        """Record what was done as lifecycle events; their effects (a released compressed
        copy removed, latest.json) follow the transition."""
        for o in outcomes:
            event = _EVENTS.get((o.action, o.tier))
            if event is not None:
                self.store.record(root.name, o.step, event, self.clock.time())

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
