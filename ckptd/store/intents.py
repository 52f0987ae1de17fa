"""What the API records for users and readers in the state store: registrations (a step's
files and metrics named before a scan finds them), pins, and readers' *holds*. Decides nothing:
a registration's transition is the lifecycle table's.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from ckptd.lifecycle.table import Event
from ckptd.store.core import Core
from ckptd.store.rows import metrics_json


class Intents(Core):
    """Registrations, pins and readers' holds."""

    def register(self, root: str, step: int, paths: Sequence[str], metrics: dict[str, float],
                 now: float) -> None:
        with self._tx() as db:
            old = db.execute("SELECT paths, metrics FROM registrations WHERE root=? AND step=?",
                             (root, step)).fetchone()
            merged_metrics = json.loads(metrics_json(json.loads(old["metrics"]) if old else {},
                                                     metrics))
            merged_paths = list(paths) or (json.loads(old["paths"]) if old else [])
            db.execute(
                "INSERT OR REPLACE INTO registrations (root, step, paths, metrics, created)"
                " VALUES (?,?,?,?,?)",
                (root, step, json.dumps(merged_paths), json.dumps(merged_metrics), now),
            )
            row = self._current(db, root, step)
            if row is not None:
                self._apply(db, row, Event.REGISTERED, now,
                            metrics=metrics_json(json.loads(row["metrics"]), metrics))

    def set_pinned(self, root: str, step: int, pinned: bool) -> bool:
        with self._tx() as db:
            cur = db.execute("UPDATE checkpoints SET pinned=? WHERE root=? AND step=?"
                             " AND superseded=0", (int(pinned), root, step))
            waiting = self._pins.setdefault(root, set())
            registered = db.execute("SELECT 1 FROM registrations WHERE root=? AND step=?",
                                    (root, step)).fetchone() is not None
            # A step registered but not seen by a scan yet is pinned as soon as it is.
            known = cur.rowcount > 0 or registered or step in waiting
            if known:
                (waiting.add if pinned else waiting.discard)(step)
            return known

    def pinned_steps(self, root: str) -> set[int]:
        """Every pinned step of the root: rows pinned, and pins waiting for their row."""
        rows = self._rows("SELECT step FROM checkpoints WHERE root=? AND superseded=0"
                          " AND pinned=1", (root,))
        return {int(r["step"]) for r in rows} | self._pins.get(root, set())

    def hold(self, root: str, step: int, owner: str, expires: float) -> None:
        """A reader's *hold* on a step until `expires`: retention never deletes it meanwhile
        (taken again by the same owner, it is renewed)."""
        with self._tx() as db:
            db.execute("INSERT OR REPLACE INTO holds (root, step, owner, expires)"
                       " VALUES (?,?,?,?)", (root, step, owner, expires))

    def release_hold(self, root: str, step: int, owner: str) -> None:
        with self._tx() as db:
            db.execute("DELETE FROM holds WHERE root=? AND step=? AND owner=?",
                       (root, step, owner))
