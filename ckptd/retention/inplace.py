"""compress_older in place: the flow around the executor's `replace_originals` (copy checked, row
recorded before the moves and undone if they fail, a crash's half finished) and its back-off.
Deletes nothing itself (the executor does); never compresses (the compress stage made the copy);
reads time only from the clock it is given.
"""

from __future__ import annotations

import threading

from ckptd.clock import SYSTEM, Clock
from ckptd.config import RootConfig
from ckptd.copies import store as copies
from ckptd.lifecycle.table import Event
from ckptd.log import get_logger
from ckptd.model import Local, Remote
from ckptd.remote.manifest import Manifest
from ckptd.retention import executor
from ckptd.retention.views import StoreNets
from ckptd.store import Store

# After compress_older could not replace a checkpoint's originals, leave it this long.
REPLACE_RETRY_S = 3600.0

Checked = tuple[Manifest, list[str]]  # the copy's manifest, the originals it replaces


class InPlace:
    """Replaces originals by their copies for every root, under the retention locks
    (`exclusive`, `nets`: the moves are a local delete like any other)."""

    def __init__(self, store: Store, exclusive: threading.RLock, nets: threading.RLock,
                 clock: Clock = SYSTEM) -> None:
        self.store = store
        self.clock = clock
        self.exclusive = exclusive
        self.nets = nets
        # Keyed by the row, not the step: a re-save of the step is a new row that a failure of
        # the save it replaced (its originals rewritten under a compressed row) never holds back.
        self._backoff: dict[int, float] = {}
        self.log = get_logger()

    def replace_originals(self, root: RootConfig, step: int) -> bool:
        """compress_older: replace the originals with the verified local compressed copy."""
        rec = self.store.checkpoint(root.name, step)
        if rec is None or rec.local is not Local.PRESENT or not self.store.has_copy(root.name,
                                                                                     step):
            return False  # the compress stage makes the copy first; a later run replaces
        manifest = copies.read_local_manifest(root.path, step)
        if manifest is None:
            self.store.record(root.name, step, Event.COPY_LOST, self.clock.time())
            return False
        if self._backing_off(rec.id):
            return False
        if step in self.store.in_use(root.name, self.clock.time()):
            return False  # a reader holds the originals
        checked = self._check_replaceable(root, step, rec.id)
        if checked is None:
            return False
        # Recorded before the originals go: a crash meanwhile leaves a row that says
        # "compressed" with originals still beside the copy (finished later), never one that
        # lost its copy. After the long checks, so the row says so only for the moves' time.
        if not self.store.record(root.name, step, Event.COMPRESSED_LOCAL, self.clock.time()):
            return False
        if not self._replace(root, rec.id, step, rec.path, checked):
            self.store.record(root.name, step, Event.COMPRESS_UNDONE, self.clock.time())
            return False
        self.log.info("checkpoint_compressed_locally", root=root.name, step=step)
        return True

    def finish(self, root: RootConfig) -> None:
        """A crash after a row was recorded `compressed` but before its originals went leaves
        them beside the copy: finish the job (verified, backed off like any failure)."""
        for rec in self.store.checkpoints(root.name):
            if rec.local is not Local.COMPRESSED or not (root.path / rec.path).exists():
                continue
            if self._backing_off(rec.id):
                continue
            checked = self._check_replaceable(root, rec.step, rec.id)
            if checked is not None:
                self._replace(root, rec.id, rec.step, rec.path, checked)

    def _backing_off(self, cid: int) -> bool:
        return self.clock.monotonic() < self._backoff.get(cid, 0.0)

    def _check_replaceable(self, root: RootConfig, step: int, cid: int) -> Checked | None:
        """The long checks before the originals may go (the copy decoded, every original
        re-hashed), without the locks: the copy's manifest and the members, or None."""
        members = list(self.store.members(cid))
        try:
            manifest = copies.read_local_manifest(root.path, step)
            if manifest is None:
                raise FileNotFoundError(f"no local compressed copy of step {step}")
            copies.check_replaceable(root.path, manifest, members)
        except Exception as exc:
            self._failed(root, step, cid, str(exc))
            return None
        return manifest, members

    def _replace(self, root: RootConfig, cid: int, step: int, anchor: str, checked: Checked
                 ) -> bool:
        """The originals go through the executor's `replace_originals`: holding the locks
        like any local delete, the nets and a quick re-check of the originals' sizes."""
        manifest, members = checked
        rec = self.store.checkpoint(root.name, step)
        target = executor.Target(step, anchor, tuple(members), Local.PRESENT,
                                 rec.remote if rec else Remote.NONE, False)
        with self.exclusive, self.nets:
            out = executor.replace_originals(
                root.path, target, StoreNets(self.store, root, self.nets, self.clock.time),
                lambda: copies.check_replaceable(root.path, manifest, members, verify=False,
                                                   rehash=False),
                root=root.name)
        if out.action == "failed":
            return self._failed(root, step, cid, out.reason)
        return out.action == "deleted"

    def _failed(self, root: RootConfig, step: int, cid: int, error: str) -> bool:
        self._backoff[cid] = self.clock.monotonic() + REPLACE_RETRY_S
        self.log.error("compress_older_failed", root=root.name, step=step, error=error,
                       retry_in_s=REPLACE_RETRY_S)
        return False
