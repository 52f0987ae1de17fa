"""The one hook after a transition commits: publish latest.json, have the retention executor
release a compressed copy the transition dropped, hand what a save that will not commit sent
early to the retention service (its executor deletes it), wake the workers, retention and
scanner, and wake long-polls.

Owns every consequence of a transition; nothing else writes latest.json. Deletes nothing
itself: a copy is released by `executor.release_copy`, which reads its nets under the lock pins
and holds take (a copy a net holds stays, and retention's plan releases it later). Decides
nothing about checkpoints: the table said which effects follow. Reads time only from the clock
it is given.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from datetime import UTC, datetime
from typing import Any, Protocol

from ckptd import fileio
from ckptd.backends import Backend, ObjectMeta
from ckptd.clock import SYSTEM, Clock
from ckptd.config import RootConfig
from ckptd.copies import store as copies
from ckptd.errors import CkptdError
from ckptd.lifecycle import answers
from ckptd.lifecycle.changes import Changes
from ckptd.lifecycle.policy import policy_of
from ckptd.lifecycle.table import Effect, Event
from ckptd.log import get_logger
from ckptd.model import CKPTD_DIR, Local, Remote, Tier
from ckptd.retention import executor, views
from ckptd.stages.sending.ledger import LEDGER_NAME, Ledger
from ckptd.store import Applied, Store


class Wakeable(Protocol):
    def wake(self) -> None: ...


class RetentionQueue(Protocol):
    def request(self, root: str) -> None: ...

    def discard_early(self, root: str, step: int, sent: Mapping[str, ObjectMeta]) -> None: ...


class LatestPublisher:
    """Keeps `<root>/.ckptd/latest.json` equal to the store's latest of each root: step, path,
    layout and where it can be had (local, remote). A root with none gets `"step": null`, not
    a missing file: a trainer with no daemon to ask then tells "none yet" (start at step 0)
    from "cannot tell" (no file: `Client.latest` raises)."""

    def __init__(self, store: Store, clock: Clock = SYSTEM) -> None:
        self.store = store
        self.clock = clock
        self._lock = threading.Lock()
        self.log = get_logger()

    def publish(self, root: RootConfig) -> None:
        with self._lock:
            rec = self.store.latest(root.name, Tier.ANY)
            target = root.path / CKPTD_DIR / "latest.json"
            doc: dict[str, Any] = {"step": None, "path": None} if rec is None else {
                "step": rec.step, "path": str(root.path / rec.path), "layout": rec.layout,
                "local": str(rec.local), "remote": str(rec.remote)}
            key = json.dumps(doc, sort_keys=True)
            info = self.store.root_info(root.name)
            if info["latest_doc"] == key and target.exists():
                return
            try:
                target.parent.mkdir(exist_ok=True)
                updated = datetime.fromtimestamp(self.clock.time(), UTC).isoformat(
                    timespec="seconds")
                fileio.atomic_write_json(target, {**doc, "updated": updated})
            except OSError as exc:
                self.log.warning("latest_write_failed", root=root.name, error=str(exc))
                return
            step = None if rec is None else rec.step
            self.store.set_published_latest(root.name, step, key)
            if info["latest_step"] != step:
                self.log.info("latest_changed", root=root.name, step=step,
                              previous=info["latest_step"])


class Effects:
    """Carries out the effects of committed transitions, in commit order, on the committing
    thread. A failing effect is logged and never undoes the transition."""

    def __init__(self, store: Store, roots: Callable[[], Mapping[str, RootConfig]],
                 changes: Changes, workers: Wakeable, retention: RetentionQueue,
                 scan: Wakeable, nets: AbstractContextManager[Any],
                 backend_for: Callable[[RootConfig], Backend | None],
                 clock: Clock = SYSTEM) -> None:
        """`nets`: the lock pins and readers' holds take (the retention service's); `clock`:
        what latest.json's `updated` and the nets' readers' holds are judged by."""
        self.store = store
        self.clock = clock
        self.nets = nets
        self.backend_for = backend_for
        self.roots = roots
        self.changes = changes
        self.workers = workers
        self.retention = retention
        self.scan = scan
        self.publisher = LatestPublisher(store, clock)
        self._local = threading.local()
        self.log = get_logger()

    def __call__(self, applied: Sequence[Applied]) -> None:
        local = self._local
        if getattr(local, "queue", None) is not None:
            local.queue.extend(applied)  # an effect's own transition: after this batch
            return
        local.queue = list(applied)
        try:
            while local.queue:
                batch, local.queue = local.queue, []
                self._carry_out(batch)
        finally:
            local.queue = None
            # Last: long-polls look at the store again only once every effect is done.
            self.changes.notify()

    def _carry_out(self, applied: Sequence[Applied]) -> None:
        roots = self.roots()
        publish: set[str] = set()
        retain: set[str] = set()
        effects: set[Effect] = set()
        for a in applied:
            root = roots.get(a.root)
            if root is None:
                continue
            effects |= a.effects
            if Effect.DISCARD_EARLY in a.effects:  # before `_copies`: the ledger is the copy's
                self._discard_early(root, a.step)
            try:
                self._copies(root, a)
            except OSError as exc:
                self.log.warning("copy_removal_failed", root=a.root, step=a.step, error=str(exc))
            if Effect.PUBLISH in a.effects:
                publish.add(a.root)
            if Effect.WAKE_RETENTION in a.effects:
                retain.add(a.root)
        for name in sorted(publish):
            self.publish(roots[name])
        if Effect.WAKE_WORKERS in effects:
            self.workers.wake()
        for name in sorted(retain):
            self.retention.request(name)
        if Effect.WAKE_SCAN in effects:
            self.scan.wake()

    def publish(self, root: RootConfig) -> None:
        try:
            self.publisher.publish(root)
        except Exception as exc:  # broad: a full disk or a lost root must not fail the transition
            self.log.warning("latest_write_failed", root=root.name, error=str(exc))

    def _copies(self, root: RootConfig, a: Applied) -> None:
        local = a.target.local if a.target is not None else Local.PRUNED
        remote = a.target.remote if a.target is not None else Remote.NONE
        if Effect.REMOVE_COPY in a.effects:
            self._release(root, a.step, local, remote)
        if Effect.RELEASE_COPY in a.effects and a.target is not None and (
                not answers.copy_needed_by(a.target, policy_of(root).keeps_copies)):
            # The copy was made for the upload; the planner applies the same rule, so a
            # release refused now is planned again.
            if self._release(root, a.step, local, remote):
                self.store.record(a.root, a.step, Event.COPY_DROPPED)

    def _discard_early(self, root: RootConfig, step: int) -> None:
        """The save of `step` whose transition said it will not commit: what it sent ahead
        (its copy's upload ledger, read now, before a re-save's copy replaces it) goes to the
        retention service, whose executor deletes each object still the one put, while the
        step is uncommitted. Reads only here: no remote call on the committing thread."""
        try:
            backend = self.backend_for(root)
        except (CkptdError, OSError) as exc:  # a bad remote: the upload stage says why
            self.log.warning("early_objects_kept", root=root.name, step=step, why=str(exc))
            return
        if backend is None:
            return
        ledger = Ledger.load(copies.objects_dir(root.path, step) / LEDGER_NAME, backend.url)
        sent = ledger.sent()
        if sent:
            self.retention.discard_early(root.name, step, sent)

    def _release(self, root: RootConfig, step: int, local: Local, remote: Remote) -> bool:
        nets = views.StoreNets(self.store, root, self.nets, self.clock.time)
        out = executor.release_copy(root.path, views.copy_target(step, local, remote),
                                    nets, root=root.name)
        return out.action == "deleted"
