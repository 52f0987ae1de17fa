"""The core of the state store: one SQLite connection, transactions, and the one way a status
changes: an event applied through the lifecycle table, logged, and handed after commit to the
effects hook. The table decides every transition; the one thing decided here is that a
transition's `discard_early` effect is dropped while a live upload claim on the row may be
sending that save (`_uploading_now`).
"""

from __future__ import annotations

import os
import sqlite3
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ckptd.lifecycle.table import (
    Effect,
    Event,
    Policy,
    Refused,
    Row,
    Stage,
    Status,
    next_stage,
    transition,
)
from ckptd.model import RootError
from ckptd.store import schema
from ckptd.store.reads import Reads
from ckptd.store.rows import (
    Applied,
    status_of,
)

# The transition log keeps this many of the newest entries.
TRANSITIONS_KEPT = 50_000

OnCommit = Callable[[Sequence[Applied]], None]


class Core(Reads):
    """Thread-safe facade over one SQLite file. One connection, serialized by a lock."""

    def __init__(self, path: Path, on_commit: OnCommit | None = None) -> None:
        self.path = path
        self._lock = threading.RLock()
        self._db = schema.open_db(path)
        st = os.stat(path)
        self._identity = (st.st_dev, st.st_ino)
        self._on_commit = on_commit
        self._applied: list[Applied] = []
        self._policies: dict[str, Policy] = {}
        self._pins: dict[str, set[int]] = {}  # pins kept beside each root, for rows to come

    def lost(self) -> str | None:
        """Why the file this store has open is no longer the state database at its path
        (deleted, or replaced by another file), or None while it still is."""
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return f"state database {self.path} was deleted while the daemon ran"
        except OSError as exc:
            return f"state database {self.path} cannot be checked: {exc.strerror or exc}"
        if (st.st_dev, st.st_ino) != self._identity:
            return f"state database {self.path} was replaced by another file while the daemon ran"
        return None

    def close(self) -> None:
        with self._lock:
            self._db.close()

    @property
    def schema_version(self) -> int:
        with self._lock:
            return schema.schema_version(self._db)

    def set_on_commit(self, hook: OnCommit | None) -> None:
        self._on_commit = hook

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        applied: list[Applied] = []
        with self._lock:
            outer = not self._db.in_transaction
            if outer:
                self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                if outer:
                    self._db.execute("ROLLBACK")
                    self._applied.clear()
                raise
            if outer:
                self._db.execute("COMMIT")
                applied, self._applied = self._applied, []
        if applied and self._on_commit is not None:
            self._on_commit(applied)  # outside the lock: effects read the store


    def _apply(self, db: sqlite3.Connection, row: sqlite3.Row, event: Event, now: float,
               **fields: Any) -> Status | None:
        """Apply `event` to an existing row through the lifecycle table, with extra column
        values. Raises Refused (nothing written) when the table refuses."""
        source = status_of(row)
        t = transition(source, event)
        if t.row is Row.SUPERSEDE:
            db.execute("UPDATE checkpoints SET superseded=1, stage=NULL, claim_owner=NULL"
                       " WHERE id=?", (row["id"],))
        elif t.row is Row.DELETE:
            db.execute("DELETE FROM checkpoints WHERE id=?", (row["id"],))
        else:
            assert t.to is not None
            cols = {"state": t.to.state.value, "local": t.to.local.value,
                    "remote": t.to.remote.value, "copy": "ready" if t.to.copy else "",
                    "stage": self._stage(row["root"], t.to), **fields}
            db.execute(f"UPDATE checkpoints SET {', '.join(c + '=?' for c in cols)}"  # noqa: S608
                       " WHERE id=?", (*cols.values(), row["id"]))
        if t.to != source or t.row is not Row.KEEP:
            self._log(db, int(row["id"]), row["root"], int(row["step"]), event, source, t.to,
                      now)
        effects = t.effects
        if Effect.DISCARD_EARLY in effects and _uploading_now(row, now):
            # An upload of this save is under way: what it sent is its own to commit (a
            # re-save then replaces it) or to leave; deleting under it could commit a hole.
            effects = effects - {Effect.DISCARD_EARLY}
        if effects:
            self._applied.append(Applied(row["root"], int(row["step"]), event, source, t.to,
                                         effects))
        return t.to

    def _insert(self, db: sqlite3.Connection, root: str, event: Event, now: float,
                **fields: Any) -> int:
        t = transition(None, event)
        assert t.to is not None
        cols = {"root": root, "state": t.to.state.value, "local": t.to.local.value,
                "remote": t.to.remote.value, "copy": "ready" if t.to.copy else "",
                "stage": self._stage(root, t.to), "created": now, **fields}
        if int(fields["step"]) in self._pins.get(root, ()):
            cols["pinned"] = 1  # pinned beside the root before this store knew the step
        cur = db.execute(f"INSERT INTO checkpoints ({', '.join(cols)})"  # noqa: S608
                         f" VALUES ({', '.join('?' * len(cols))})", tuple(cols.values()))
        cid = int(cur.lastrowid or 0)
        self._log(db, cid, root, int(fields["step"]), event, None, t.to, now)
        self._applied.append(Applied(root, int(fields["step"]), event, None, t.to, t.effects))
        return cid

    def _stage(self, root: str, s: Status) -> str | None:
        stage = next_stage(s, self._policies.get(root, Policy()))
        return None if stage is None else stage.value

    @staticmethod
    def _log(db: sqlite3.Connection, cid: int, root: str, step: int, event: Event,
             source: Status | None, target: Status | None, now: float) -> None:
        cur = db.execute("INSERT INTO transitions (checkpoint_id, root, step, event, source,"
                         " target, at) VALUES (?,?,?,?,?,?,?)",
                         (cid, root, step, event.value, str(source or "new"),
                          str(target or "gone"), now))
        if (cur.lastrowid or 0) % 1000 == 0:
            db.execute("DELETE FROM transitions WHERE id <= ?",
                       ((cur.lastrowid or 0) - TRANSITIONS_KEPT,))

    def set_root_pins(self, root: str, steps: set[int]) -> None:
        """Pins read from beside the root (they outlive a lost state database): rows of
        those steps are pinned now, and when they first appear."""
        with self._tx() as db:
            self._pins[root] = set(steps)
            db.executemany("UPDATE checkpoints SET pinned=1 WHERE root=? AND step=?"
                           " AND superseded=0", [(root, s) for s in sorted(steps)])

    def set_policies(self, policies: Mapping[str, Policy]) -> None:
        """The roots' policies (start, reload): the stage each checkpoint needs next is
        recomputed from its status by the lifecycle table."""
        with self._tx() as db:
            self._policies = dict(policies)
            rows = db.execute("SELECT id, root, state, local, remote, copy FROM checkpoints"
                              " WHERE superseded=0").fetchall()
            db.executemany("UPDATE checkpoints SET stage=? WHERE id=?",
                           [(self._stage(r["root"], status_of(r)), r["id"]) for r in rows])

    @staticmethod
    def _forget_registration(db: sqlite3.Connection, root: str, step: int) -> None:
        # Its registration has served; left behind it would look like a save still to come.
        db.execute("DELETE FROM registrations WHERE root=? AND step=?", (root, step))

    @staticmethod
    def _current(db: sqlite3.Connection, root: str, step: int) -> sqlite3.Row | None:
        row: sqlite3.Row | None = db.execute(
            "SELECT * FROM checkpoints WHERE root=? AND step=? AND superseded=0",
            (root, step)).fetchone()
        return row

    def _atomically(self, db: sqlite3.Connection, fn: Callable[[], object]) -> bool:
        """Run `fn` under a savepoint; a refusal undoes all of it. False when refused."""
        mark = len(self._applied)
        db.execute("SAVEPOINT outcome")
        try:
            fn()
        except Refused:
            db.execute("ROLLBACK TO outcome")
            del self._applied[mark:]
            return False
        finally:
            db.execute("RELEASE outcome")
        return True

    @staticmethod
    def _release_claim(db: sqlite3.Connection, cid: int) -> None:
        db.execute("UPDATE checkpoints SET claim_owner=NULL, claim_stage=NULL,"
                   " claim_expires=NULL WHERE id=?", (cid,))

    @staticmethod
    def _set_error(db: sqlite3.Connection, root: str, kind: RootError, error: str,
                   now: float) -> None:
        db.execute("INSERT INTO roots (name, last_error, last_error_at, last_error_kind)"
                   " VALUES (?,?,?,?) ON CONFLICT(name) DO UPDATE SET"
                   " last_error=excluded.last_error, last_error_at=excluded.last_error_at,"
                   " last_error_kind=excluded.last_error_kind", (root, error, now, kind.value))


def _uploading_now(row: sqlite3.Row, now: float) -> bool:
    """Whether a worker's claim to upload this row is live (its upload may be writing now)."""
    return (row["claim_owner"] is not None and row["claim_stage"] == Stage.UPLOAD.value
            and float(row["claim_expires"] or 0.0) >= now)
