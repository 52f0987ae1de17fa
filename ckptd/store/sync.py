"""What a scan records in the state store: its reconcile of a root's rows with the candidates it
found, and a save given up on. What the API, retention and discovery record lives beside it
(`intents`, `events`, `roots`).
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Sequence
from typing import Any

from ckptd.lifecycle.table import (
    Event,
    Sighting,
    classify,
)
from ckptd.model import State
from ckptd.store.core import Core
from ckptd.store.rows import (
    RECORD_COLUMNS,
    Found,
    SyncChange,
    expected_json,
    metrics_json,
    one_per_step,
    overlaps,
    status_of,
)

# What a scan reads of a row: a record's columns and the upload claim (`Core._apply`), never
# the member list (`_files` reads it when a candidate's fingerprint differs from the row's).
_COLUMNS = RECORD_COLUMNS + ", claim_owner, claim_stage, claim_expires"

_SCAN_EVENTS = {Event.FOUND_PENDING: "", Event.FOUND_COMPLETE: "checkpoint_complete",
                Event.RESAVED: "checkpoint_superseded", Event.VANISHED: "checkpoint_vanished",
                Event.REAPPEARED: "checkpoint_reappeared"}


class Sync(Core):
    """What a scan records."""

    def sync_root(self, root: str, found: Sequence[Found], now: float,
                  unreadable: frozenset[str] = frozenset(), adopt: bool = True
                  ) -> list[SyncChange]:
        """Reconcile the rows of `root` with one scan's candidates. Returns what changed.
        Rows at, under or above an `unreadable` directory are never marked vanished: an
        unreadable directory is not a deleted checkpoint. What the root's first scan finds is
        adopted unless `adopt` is False (another ckptd acted on the root before)."""
        changes: list[SyncChange] = []
        with self._tx() as db:
            regs = self._registration_metrics(root)
            adopt = self._first_scan(db, root, now) and adopt
            for f in one_per_step(found):
                change = self._sync_one(db, root, f, regs.get(f.candidate.step, {}), now, adopt)
                if change:
                    changes.append(change)
            seen = {f.candidate.step for f in found}
            changes.extend(self._sync_gone(db, root, seen, unreadable, now))
        return changes

    @staticmethod
    def _last_change(db: sqlite3.Connection, cid: int) -> float:
        """When the row's status last changed (its transitions' log)."""
        row = db.execute("SELECT MAX(at) AS at FROM transitions WHERE checkpoint_id=?",
                         (cid,)).fetchone()
        return float(row["at"] or 0.0)

    @staticmethod
    def _first_scan(db: sqlite3.Connection, root: str, now: float) -> bool:
        """Is this the first scan of `root` ever (what it finds was there before ckptd)?"""
        row = db.execute("SELECT first_scan FROM roots WHERE name=?", (root,)).fetchone()
        if row is not None and row["first_scan"] is not None:
            return False
        db.execute("INSERT INTO roots (name, first_scan) VALUES (?,?) ON CONFLICT(name)"
                   " DO UPDATE SET first_scan=excluded.first_scan", (root, now))
        return True

    def _registration_metrics(self, root: str) -> dict[int, dict[str, float]]:
        rows = self._db.execute("SELECT step, metrics FROM registrations WHERE root=?", (root,))
        return {int(r["step"]): json.loads(r["metrics"]) for r in rows}

    def _sync_one(self, db: sqlite3.Connection, root: str, f: Found,
                  reg_metrics: dict[str, float], now: float,
                  adopt: bool = False) -> SyncChange | None:
        c = f.candidate
        row = db.execute(
            f"SELECT {_COLUMNS} FROM checkpoints WHERE root=? AND step=? AND superseded=0",
            (root, c.step)).fetchone()
        metrics = {**c.metrics, **reg_metrics}
        if row is None:
            self._insert_found(db, root, f, metrics, now, pinned=False, adopted=adopt)
            return SyncChange("checkpoint_discovered", c.step, c.layout, c.path,
                              ("adopted; " if adopt else "")
                              + ("complete" if c.complete else c.waiting_for))
        same_files = row["fingerprint"] == f.fingerprint  # it digests the member paths
        fewer = not same_files and set(c.files) < set(_files(db, int(row["id"])))
        seen = Sighting(complete=c.complete,
                        same_save=same_files and row["path"] == c.path,
                        fewer_files=fewer, same_path=row["path"] == c.path,
                        fresh=fewer and f.newest_mtime > max(float(row["created"]),
                                                             self._last_change(db, row["id"])))
        event = classify(status_of(row), seen)
        if event is None:
            return None
        if event in (Event.FOUND_PENDING, Event.FOUND_COMPLETE):
            self._apply(db, row, event, now, **_found_fields(f, metrics, now))
        elif event is Event.RESAVED:
            self._apply(db, row, event, now)
            self._insert_found(db, root, f, metrics, now, pinned=bool(row["pinned"]))
            return SyncChange("checkpoint_superseded", c.step, c.layout, c.path,
                              f"previous {row['layout']} at {row['path']} ({row['state']})")
        else:
            self._apply(db, row, event, now)
            if event is Event.VANISHED:
                self._forget_registration(db, root, c.step)
                return SyncChange("checkpoint_vanished", c.step, c.layout, c.path,
                                  "partly deleted")
        name = _SCAN_EVENTS[event]
        return SyncChange(name, c.step, c.layout, c.path) if name else None

    def _insert_found(self, db: sqlite3.Connection, root: str, f: Found,
                      metrics: dict[str, float], now: float, pinned: bool,
                      adopted: bool = False) -> None:
        event = Event.FOUND_COMPLETE if f.candidate.complete else Event.FOUND_PENDING
        self._insert(db, root, event, now, step=f.candidate.step, pinned=int(pinned),
                     adopted=int(adopted), **_found_fields(f, metrics, now))

    def _sync_gone(self, db: sqlite3.Connection, root: str, seen: set[int],
                   unreadable: frozenset[str], now: float) -> list[SyncChange]:
        changes = []
        rows = db.execute(f"SELECT {_COLUMNS} FROM checkpoints WHERE root=? AND"
                          " superseded=0 AND local='present'", (root,)).fetchall()
        for r in rows:
            if r["step"] in seen or overlaps(r["path"], unreadable):
                continue
            self._apply(db, r, Event.VANISHED, now)
            if r["state"] != State.PENDING.value:
                self._forget_registration(db, root, int(r["step"]))
                changes.append(SyncChange("checkpoint_vanished", r["step"], r["layout"],
                                          r["path"]))
        return changes

    def give_up(self, root: str, step: int, reason: str, message: str, now: float) -> bool:
        """A save that stayed incomplete past its deadline: invalid with the reason given."""
        with self._tx() as db:
            row = self._current(db, root, step)
            return row is not None and self._atomically(db, lambda: self._apply(
                db, row, Event.GAVE_UP, now, reason=reason, message=message))


def _found_fields(f: Found, metrics: dict[str, float], now: float) -> dict[str, Any]:
    c = f.candidate
    return {"layout": c.layout, "path": c.path, "files": json.dumps(list(c.files)),
            "expected": expected_json(c), "metrics": metrics_json(metrics),
            "fingerprint": f.fingerprint, "completed": now if c.complete else None, "bytes": 0}


def _files(db: sqlite3.Connection, cid: int) -> list[str]:
    """A row's member list, read only when a scan's candidate may differ from it (a 10,000-file
    step's list is hundreds of KB: a scan must not copy every kept step's out of SQLite)."""
    return list(json.loads(db.execute("SELECT files FROM checkpoints WHERE id=?",
                                      (cid,)).fetchone()["files"]))
