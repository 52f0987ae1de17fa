"""Events recorded on a step outside the scan and the stage work: what retention and the
effects of a transition record (`record`), a step committed remotely that discovery found
(`add_remote_only`), and a flush's `expedite`. Decides nothing: the lifecycle table does.
"""

from __future__ import annotations

import json

from ckptd.lifecycle.table import Event
from ckptd.remote.manifest import Manifest
from ckptd.store.core import Core
from ckptd.store.rows import metrics_json


class Events(Core):
    """Lifecycle events on a step's current row, from outside the scan and the workers."""

    def record(self, root: str, step: int, event: Event, now: float = 0.0) -> bool:
        """Apply `event` to the current row of a step (retention, discovery, the effects of a
        transition). False when there is no such row or the table refuses."""
        with self._tx() as db:
            row = self._current(db, root, step)
            if row is None or not self._atomically(db, lambda: self._apply(db, row, event, now)):
                return False
            if event is Event.PRUNED_LOCAL:
                self._forget_registration(db, root, step)
            return True

    def expedite(self, root: str, step: int) -> None:
        """Forget the backoff of a step's failed attempts (a flush wants it now)."""
        with self._tx() as db:
            db.execute("UPDATE checkpoints SET next_attempt=0, attempts=0 WHERE root=? AND step=?"
                       " AND superseded=0", (root, step))

    def add_remote_only(self, root: str, manifest: Manifest, now: float) -> bool:
        """A step committed remotely that this store does not know (a fresh node, a lost
        state dir): recorded as valid, uploaded, not present locally. False if known."""
        with self._tx() as db:
            if self._current(db, root, manifest.step) is not None:
                return False
            cid = self._insert(
                db, root, Event.REMOTE_FOUND, now, step=manifest.step, layout=manifest.layout,
                path=f"step-{manifest.step}",
                files=json.dumps([f.path for f in manifest.files]), bytes=manifest.size,
                stored_bytes=manifest.stored_size, metrics=metrics_json(manifest.metrics),
                completed=now)
            db.executemany(
                "INSERT INTO files (checkpoint_id, path, size, hash, hash_alg, codec, stored_size,"
                " key) VALUES (?,?,?,?,?,?,?,?)",
                [(cid, f.path, f.size, f.hash, f.hash_alg, f.codec, f.stored_size, f.key)
                 for f in manifest.files])
            return True
