"""The state store: one SQLite file (WAL), the checkpoints' statuses, the transition log and
work leases: the single source of truth of the daemon.

Every change of a checkpoint's status is a lifecycle event applied through the pure table in
`ckptd.lifecycle.table`; this module only persists what the table decides, logs the transition,
and hands each committed transition to the effects hook. No SQL lives anywhere else.
"""

from __future__ import annotations

import json
import sqlite3
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ckptd.lifecycle.table import (
    STAGE_PRIORITY,
    Event,
    Policy,
    Refused,
    Row,
    Sighting,
    Stage,
    Status,
    classify,
    next_stage,
    transition,
)
from ckptd.manifest import Manifest, StoredFile
from ckptd.model import CheckpointRecord, FileRecord, Local, Remote, State, Tier, ValidationResult
from ckptd.store import schema
from ckptd.store.rows import (
    Applied,
    Found,
    Job,
    SyncChange,
    expected_json,
    job_of,
    one_per_step,
    overlaps,
    record_of,
    status_of,
)

# Backoff between attempts of a stage that failed.
RETRY_BASE_S = 2.0
RETRY_MAX_S = 300.0
# A permanent cause (refused credentials) waits for a person; capped so a fix is picked up.
PERMANENT_RETRY_S = 600.0
# The transition log keeps this many of the newest entries.
TRANSITIONS_KEPT = 50_000

OnCommit = Callable[[Sequence[Applied]], None]
_SCAN_EVENTS = {Event.FOUND_PENDING: "", Event.FOUND_COMPLETE: "checkpoint_complete",
                Event.RESAVED: "checkpoint_superseded", Event.VANISHED: "checkpoint_vanished",
                Event.REAPPEARED: "checkpoint_reappeared"}


class Store:
    """Thread-safe facade over one SQLite file. One connection, serialized by a lock."""

    def __init__(self, path: Path, on_commit: OnCommit | None = None) -> None:
        self.path = path
        self._lock = threading.RLock()
        self._db = schema.open_db(path)
        self._on_commit = on_commit
        self._applied: list[Applied] = []
        self._policies: dict[str, Policy] = {}

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

    def _rows(self, sql: str, args: Sequence[Any] = ()) -> list[sqlite3.Row]:
        with self._lock:
            return list(self._db.execute(sql, args).fetchall())

    # -- the one way a status changes --------------------------------------------------------

    def _apply(self, db: sqlite3.Connection, row: sqlite3.Row, event: Event, now: float,
               **fields: Any) -> Status | None:
        """Apply `event` to an existing row through the lifecycle table, with extra column
        values. Raises Refused (nothing written) when the table refuses."""
        source = status_of(row)
        t = transition(source, event)
        if t.row is Row.SUPERSEDE:
            db.execute("UPDATE checkpoints SET superseded=1, stage=NULL, lease_owner=NULL"
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
        if t.effects:
            self._applied.append(Applied(row["root"], int(row["step"]), event, source, t.to,
                                         t.effects))
        return t.to

    def _insert(self, db: sqlite3.Connection, root: str, event: Event, now: float,
                **fields: Any) -> int:
        t = transition(None, event)
        assert t.to is not None
        cols = {"root": root, "state": t.to.state.value, "local": t.to.local.value,
                "remote": t.to.remote.value, "copy": "ready" if t.to.copy else "",
                "stage": self._stage(root, t.to), "created": now, **fields}
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

    def set_policies(self, policies: Mapping[str, Policy]) -> None:
        """The roots' policies (start, reload): the stage each checkpoint needs next is
        recomputed from its status by the lifecycle table."""
        with self._tx() as db:
            self._policies = dict(policies)
            rows = db.execute("SELECT id, root, state, local, remote, copy FROM checkpoints"
                              " WHERE superseded=0").fetchall()
            db.executemany("UPDATE checkpoints SET stage=? WHERE id=?",
                           [(self._stage(r["root"], status_of(r)), r["id"]) for r in rows])

    def transitions(self, root: str, step: int) -> list[tuple[str, str, str]]:
        """The logged (event, source, target) of every save of one step, oldest first."""
        rows = self._rows("SELECT event, source, target FROM transitions WHERE root=? AND"
                          " step=? ORDER BY id", (root, step))
        return [(r["event"], r["source"], r["target"]) for r in rows]

    # -- reconcile with a scan -------------------------------------------------------------

    def sync_root(self, root: str, found: Sequence[Found], now: float,
                  unreadable: frozenset[str] = frozenset()) -> list[SyncChange]:
        """Reconcile the rows of `root` with one scan's candidates. Returns what changed.
        Rows at, under or above an `unreadable` directory are never marked vanished: an
        unreadable directory is not a deleted checkpoint."""
        changes: list[SyncChange] = []
        with self._tx() as db:
            regs = self._registration_metrics(root)
            for f in one_per_step(found):
                change = self._sync_one(db, root, f, regs.get(f.candidate.step, {}), now)
                if change:
                    changes.append(change)
            seen = {f.candidate.step for f in found}
            changes.extend(self._sync_gone(db, root, seen, unreadable, now))
        return changes

    def _registration_metrics(self, root: str) -> dict[int, dict[str, float]]:
        rows = self._db.execute("SELECT step, metrics FROM registrations WHERE root=?", (root,))
        return {int(r["step"]): json.loads(r["metrics"]) for r in rows}

    def _sync_one(self, db: sqlite3.Connection, root: str, f: Found,
                  reg_metrics: dict[str, float], now: float) -> SyncChange | None:
        c = f.candidate
        row = db.execute(
            "SELECT * FROM checkpoints WHERE root=? AND step=? AND superseded=0", (root, c.step)
        ).fetchone()
        metrics = {**c.metrics, **reg_metrics}
        if row is None:
            self._insert_found(db, root, f, metrics, now, pinned=False)
            return SyncChange("checkpoint_discovered", c.step, c.layout, c.path,
                              "complete" if c.complete else c.waiting_for)
        seen = Sighting(complete=c.complete,
                        same_save=row["fingerprint"] == f.fingerprint and row["path"] == c.path,
                        fewer_files=set(c.files) < set(json.loads(row["files"])),
                        same_path=row["path"] == c.path)
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
                      metrics: dict[str, float], now: float, pinned: bool) -> None:
        event = Event.FOUND_COMPLETE if f.candidate.complete else Event.FOUND_PENDING
        self._insert(db, root, event, now, step=f.candidate.step, pinned=int(pinned),
                     **_found_fields(f, metrics, now))

    def _sync_gone(self, db: sqlite3.Connection, root: str, seen: set[int],
                   unreadable: frozenset[str], now: float) -> list[SyncChange]:
        changes = []
        rows = db.execute("SELECT * FROM checkpoints WHERE root=? AND superseded=0"
                          " AND local='present'", (root,)).fetchall()
        for r in rows:
            if r["step"] in seen or overlaps(r["path"], unreadable):
                continue
            self._apply(db, r, Event.VANISHED, now)
            if r["state"] != State.PENDING.value:
                self._forget_registration(db, root, int(r["step"]))
                changes.append(SyncChange("checkpoint_vanished", r["step"], r["layout"],
                                          r["path"]))
        return changes

    @staticmethod
    def _forget_registration(db: sqlite3.Connection, root: str, step: int) -> None:
        # Its registration has served; left behind it would look like a save still to come.
        db.execute("DELETE FROM registrations WHERE root=? AND step=?", (root, step))

    # -- registrations, pins -----------------------------------------------------------------

    def register(self, root: str, step: int, paths: Sequence[str], metrics: dict[str, float],
                 now: float) -> None:
        with self._tx() as db:
            old = db.execute("SELECT paths, metrics FROM registrations WHERE root=? AND step=?",
                             (root, step)).fetchone()
            merged_metrics = {**(json.loads(old["metrics"]) if old else {}), **metrics}
            merged_paths = list(paths) or (json.loads(old["paths"]) if old else [])
            db.execute(
                "INSERT OR REPLACE INTO registrations (root, step, paths, metrics, created)"
                " VALUES (?,?,?,?,?)",
                (root, step, json.dumps(merged_paths), json.dumps(merged_metrics), now),
            )
            row = self._current(db, root, step)
            if row is not None:
                m = {**json.loads(row["metrics"]), **metrics}
                self._apply(db, row, Event.REGISTERED, now, metrics=json.dumps(m))

    def registrations(self, root: str) -> dict[int, tuple[str, ...]]:
        rows = self._rows("SELECT step, paths FROM registrations WHERE root=?", (root,))
        return {int(r["step"]): tuple(json.loads(r["paths"])) for r in rows}

    def set_pinned(self, root: str, step: int, pinned: bool) -> bool:
        with self._tx() as db:
            cur = db.execute("UPDATE checkpoints SET pinned=? WHERE root=? AND step=?"
                             " AND superseded=0", (int(pinned), root, step))
            return cur.rowcount > 0

    @staticmethod
    def _current(db: sqlite3.Connection, root: str, step: int) -> sqlite3.Row | None:
        row: sqlite3.Row | None = db.execute(
            "SELECT * FROM checkpoints WHERE root=? AND step=? AND superseded=0",
            (root, step)).fetchone()
        return row

    # -- work claiming -----------------------------------------------------------------------

    def claim(self, owner: str, now: float, lease_s: float,
              only: frozenset[tuple[str, int]] | None = None) -> Job | None:
        """Claim the next piece of work: the stage the lifecycle table left due on a row,
        validation first (newest step first, so the resume point moves soonest), then a
        missing compressed copy, then an upload. `only` (a flush) restricts copies and
        uploads to its steps; validation never yields to a flush."""
        with self._tx() as db:
            rows = db.execute(
                "SELECT * FROM checkpoints WHERE stage IS NOT NULL AND superseded=0"
                " AND next_attempt<=? AND (lease_owner IS NULL OR lease_expires<?)",
                (now, now)).fetchall()
            due = [r for r in rows if only is None or r["stage"] == Stage.VALIDATE.value
                   or (r["root"], int(r["step"])) in only]
            if not due:
                return None
            row = min(due, key=lambda r: (STAGE_PRIORITY[Stage(r["stage"])], -int(r["step"])))
            stage = Stage(row["stage"])
            db.execute("UPDATE checkpoints SET lease_owner=?, lease_stage=?, lease_expires=?"
                       " WHERE id=?", (owner, stage.value, now + lease_s, row["id"]))
            if stage is Stage.UPLOAD and row["remote"] == Remote.NONE.value:
                self._apply(db, row, Event.UPLOAD_STARTED, now)
                row = db.execute("SELECT * FROM checkpoints WHERE id=?", (row["id"],)).fetchone()
            return job_of(row, stage, owner)

    def renew(self, checkpoint_id: int, owner: str, now: float, lease_s: float) -> bool:
        with self._tx() as db:
            cur = db.execute("UPDATE checkpoints SET lease_expires=? WHERE id=? AND lease_owner=?"
                             " AND superseded=0", (now + lease_s, checkpoint_id, owner))
            return cur.rowcount > 0

    def release_all(self) -> int:
        """Drop every lease (startup: only one daemon holds the state dir, so all are stale)."""
        with self._tx() as db:
            return db.execute("UPDATE checkpoints SET lease_owner=NULL, lease_stage=NULL,"
                              " lease_expires=NULL WHERE lease_owner IS NOT NULL").rowcount

    def _held(self, db: sqlite3.Connection, job: Job, owner: str) -> sqlite3.Row | None:
        row: sqlite3.Row | None = db.execute("SELECT * FROM checkpoints WHERE id=?",
                                             (job.checkpoint.id,)).fetchone()
        if row is None or row["superseded"] or row["lease_owner"] != owner:
            return None
        return row

    def _outcome(self, job: Job, owner: str, events: Sequence[Event], now: float,
                 before: Callable[[sqlite3.Connection, sqlite3.Row], None] | None = None,
                 **fields: Any) -> bool:
        """Record a stage's outcome as lifecycle events (the first carries `fields`) and
        release the lease. False when the lease is lost or the table refuses (the row moved
        on meanwhile): then nothing of the outcome is written."""
        with self._tx() as db:
            row = self._held(db, job, owner)
            if row is None:
                return False
            ok = self._atomically(db, lambda: self._apply_all(db, row, events, now, before,
                                                              fields))
            self._unlease(db, job.checkpoint.id)
            return ok

    def _apply_all(self, db: sqlite3.Connection, row: sqlite3.Row, events: Sequence[Event],
                   now: float, before: Callable[[sqlite3.Connection, sqlite3.Row], None] | None,
                   fields: dict[str, Any]) -> None:
        if before is not None:
            before(db, row)
        for i, event in enumerate(events):
            self._apply(db, row, event, now, **(fields if i == 0 else {}))
            row = db.execute("SELECT * FROM checkpoints WHERE id=?", (row["id"],)).fetchone()

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

    def finish_validation(self, job: Job, owner: str, fingerprint: str,
                          result: ValidationResult, now: float,
                          stored: Sequence[StoredFile] = (), size_on_disk: int = 0) -> bool:
        """Record a validation outcome. False (and nothing written) when the lease was lost or
        the files changed since the job was claimed (a re-save: the next scan supersedes)."""
        row = self._rows("SELECT fingerprint, metrics FROM checkpoints WHERE id=?",
                         (job.checkpoint.id,))
        if not row or row[0]["fingerprint"] != fingerprint:
            self.defer(job, owner, 0.0, now)
            return False
        metrics = {**result.metrics, **json.loads(row[0]["metrics"])}
        # An invalid result may stop before hashing every file: then report what is on disk.
        total = sum(f.size for f in result.files) if result.valid else max(
            size_on_disk, sum(f.size for f in result.files))

        def files(db: sqlite3.Connection, r: sqlite3.Row) -> None:
            if r["fingerprint"] != fingerprint:
                raise Refused(status_of(r), Event.VALIDATED, "the files changed meanwhile")
            cid = r["id"]
            db.execute("DELETE FROM files WHERE checkpoint_id=?", (cid,))
            db.executemany(
                "INSERT INTO files (checkpoint_id, path, size, hash, hash_alg) VALUES (?,?,?,?,?)",
                [(cid, f.path, f.size, f.hash, f.hash_alg) for f in result.files])
            if result.valid and stored:
                self._record_copy(db, cid, stored)

        events = [Event.VALIDATED if result.valid else Event.REJECTED]
        if result.valid and stored:
            events.append(Event.COPY_MADE)
        return self._outcome(job, owner, events, now, before=files, reason=result.reason,
                             message=result.message, metrics=json.dumps(metrics),
                             bytes=total, attempts=0)

    @staticmethod
    def _record_copy(db: sqlite3.Connection, cid: int, stored: Sequence[StoredFile]) -> None:
        db.executemany("UPDATE files SET codec=?, stored_size=?, key=? WHERE checkpoint_id=?"
                       " AND path=?", [(f.codec, f.stored_size, f.key, cid, f.path)
                                       for f in stored])
        db.execute("UPDATE checkpoints SET stored_bytes=? WHERE id=?",
                   (sum(f.stored_size for f in stored), cid))

    def invalidate(self, job: Job, owner: str, reason: str, message: str,
                   now: float = 0.0) -> bool:
        """A valid checkpoint turned out damaged on a later read: invalid from now on."""
        return self._outcome(job, owner, [Event.DAMAGED], now, reason=reason, message=message)

    def finish_compress(self, job: Job, owner: str, stored: Sequence[StoredFile],
                        now: float = 0.0) -> bool:
        """Record a compressed copy made after validation (e.g. upload enabled later)."""
        return self._outcome(job, owner, [Event.COPY_MADE], now,
                             before=lambda db, r: self._record_copy(db, int(r["id"]), stored))

    def finish_upload(self, job: Job, owner: str, now: float) -> bool:
        """The step's manifest is committed remotely and every object verified."""
        return self._outcome(job, owner, [Event.UPLOADED], now, attempts=0)

    def copy_lost(self, job: Job, owner: str, now: float = 0.0) -> None:
        """The job's row's compressed copy is missing or not its content. A present row gets it
        rebuilt by the compress stage; for a compressed row it was the only local copy. The
        lease stays for the failure to be recorded."""
        with self._tx() as db:
            row = self._held(db, job, owner)
            if row is not None:
                self._atomically(db, lambda: self._apply(db, row, Event.COPY_LOST, now))

    @staticmethod
    def _unlease(db: sqlite3.Connection, cid: int) -> None:
        db.execute("UPDATE checkpoints SET lease_owner=NULL, lease_stage=NULL,"
                   " lease_expires=NULL WHERE id=?", (cid,))

    def fail_attempt(self, job: Job, owner: str, error: str, now: float,
                     permanent: bool = False) -> float:
        """A stage failed: back off and retry later (longer for a permanent cause, such as
        refused credentials, which only a person can fix; the error shows in status)."""
        with self._tx() as db:
            row = db.execute("SELECT attempts, root FROM checkpoints WHERE id=? AND lease_owner=?",
                             (job.checkpoint.id, owner)).fetchone()
            if row is None:
                return 0.0
            attempts = int(row["attempts"]) + 1
            delay = float(min(RETRY_MAX_S, RETRY_BASE_S * 2 ** (attempts - 1)))
            if permanent:
                delay = PERMANENT_RETRY_S
            db.execute("UPDATE checkpoints SET attempts=?, next_attempt=?, lease_owner=NULL,"
                       " lease_stage=NULL, lease_expires=NULL WHERE id=?",
                       (attempts, now + delay, job.checkpoint.id))
            self._set_error(db, row["root"], error, now)
            return delay

    def defer(self, job: Job, owner: str, delay: float, now: float) -> None:
        """Give the job back without an outcome; nobody claims it for `delay` seconds."""
        with self._tx() as db:
            db.execute("UPDATE checkpoints SET next_attempt=?, lease_owner=NULL, lease_stage=NULL,"
                       " lease_expires=NULL WHERE id=? AND lease_owner=?",
                       (now + delay, job.checkpoint.id, owner))

    def retry_now(self, root: str | None = None) -> int:
        """Forget every backoff (a reload: the operator may have fixed the cause)."""
        with self._tx() as db:
            where, args = ("", ()) if root is None else (" AND root=?", (root,))
            return db.execute("UPDATE checkpoints SET next_attempt=0 WHERE superseded=0"  # noqa: S608
                              f" AND next_attempt>0{where}", args).rowcount

    def members(self, checkpoint_id: int) -> tuple[str, ...]:
        """Root-relative member files as the layout reported them."""
        rows = self._rows("SELECT files FROM checkpoints WHERE id=?", (checkpoint_id,))
        return tuple(json.loads(rows[0]["files"])) if rows else ()

    def stored_files(self, checkpoint_id: int) -> list[StoredFile]:
        rows = self._rows("SELECT * FROM files WHERE checkpoint_id=? ORDER BY path",
                          (checkpoint_id,))
        return [StoredFile(r["path"], int(r["size"]), r["hash"], r["hash_alg"], r["codec"],
                           int(r["stored_size"] or 0), r["key"]) for r in rows]

    # -- retention and discovery -------------------------------------------------------------

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

    def replaced_upload(self, root: str, step: int) -> bool:
        """Did this node upload an earlier save of `step` that a re-save has since replaced?
        Only then may the remote copy of the step be replaced by the new one."""
        rows = self._rows("SELECT 1 FROM checkpoints WHERE root=? AND step=? AND superseded=1"
                          " AND remote IN ('uploaded','uploading') LIMIT 1", (root, step))
        return bool(rows)

    def has_copy(self, root: str, step: int) -> bool:
        rows = self._rows("SELECT copy FROM checkpoints WHERE root=? AND step=? AND superseded=0",
                          (root, step))
        return bool(rows) and rows[0]["copy"] == "ready"

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
                stored_bytes=manifest.stored_size, metrics=json.dumps(manifest.metrics),
                completed=now)
            db.executemany(
                "INSERT INTO files (checkpoint_id, path, size, hash, hash_alg, codec, stored_size,"
                " key) VALUES (?,?,?,?,?,?,?,?)",
                [(cid, f.path, f.size, f.hash, f.hash_alg, f.codec, f.stored_size, f.key)
                 for f in manifest.files])
            return True

    # -- readers' leases (a client loading a checkpoint: never pruned meanwhile) -------------

    def lease_reader(self, root: str, step: int, owner: str, expires: float) -> None:
        with self._tx() as db:
            db.execute("INSERT OR REPLACE INTO readers (root, step, owner, expires)"
                       " VALUES (?,?,?,?)", (root, step, owner, expires))

    def release_reader(self, root: str, step: int, owner: str) -> None:
        with self._tx() as db:
            db.execute("DELETE FROM readers WHERE root=? AND step=? AND owner=?",
                       (root, step, owner))

    def in_use(self, root: str, now: float) -> frozenset[int]:
        rows = self._rows("SELECT DISTINCT step FROM readers WHERE root=? AND expires>=?",
                          (root, now))
        return frozenset(int(r["step"]) for r in rows)

    def set_root_error(self, root: str, error: str, now: float) -> None:
        with self._tx() as db:
            self._set_error(db, root, error, now)

    @staticmethod
    def _set_error(db: sqlite3.Connection, root: str, error: str, now: float) -> None:
        db.execute("INSERT INTO roots (name, last_error, last_error_at) VALUES (?,?,?)"
                   " ON CONFLICT(name) DO UPDATE SET last_error=excluded.last_error,"
                   " last_error_at=excluded.last_error_at", (root, error, now))

    # -- reads -------------------------------------------------------------------------------

    def checkpoints(self, root: str) -> list[CheckpointRecord]:
        rows = self._rows("SELECT * FROM checkpoints WHERE root=? AND superseded=0 ORDER BY step",
                          (root,))
        return [record_of(r) for r in rows]

    def checkpoint(self, root: str, step: int) -> CheckpointRecord | None:
        rows = self._rows("SELECT * FROM checkpoints WHERE root=? AND step=? AND superseded=0",
                          (root, step))
        return record_of(rows[0]) if rows else None

    def status(self, root: str, step: int) -> Status | None:
        rows = self._rows("SELECT * FROM checkpoints WHERE root=? AND step=? AND superseded=0",
                          (root, step))
        return status_of(rows[0]) if rows else None

    def files(self, checkpoint_id: int) -> list[FileRecord]:
        rows = self._rows("SELECT path, size, hash, hash_alg FROM files WHERE checkpoint_id=?"
                          " ORDER BY path", (checkpoint_id,))
        return [FileRecord(r["path"], int(r["size"]), r["hash"], r["hash_alg"]) for r in rows]

    def latest(self, root: str, tier: Tier = Tier.ANY) -> CheckpointRecord | None:
        where = {
            Tier.ANY: "(local IN ('present','compressed') OR remote='uploaded')",
            Tier.LOCAL: "local IN ('present','compressed')",
            Tier.REMOTE: "remote='uploaded'",
        }[tier]
        rows = self._rows(
            f"SELECT * FROM checkpoints WHERE root=? AND superseded=0 AND state='valid'"  # noqa: S608
            f" AND {where} ORDER BY step DESC LIMIT 1", (root,))
        return record_of(rows[0]) if rows else None

    def best(self, root: str, metric: str, mode: str) -> CheckpointRecord | None:
        if not metric:
            return None
        candidates = [
            c for c in self.checkpoints(root)
            if c.state is State.VALID and metric in c.metrics
            and (c.local is not Local.PRUNED or c.remote is Remote.UPLOADED)
        ]
        if not candidates:
            return None
        sign = 1.0 if mode == "min" else -1.0
        # Ties go to the newer step: it carries more training.
        return min(candidates, key=lambda c: (sign * c.metrics[metric], -c.step))

    def counts(self, root: str) -> dict[str, int]:
        rows = self._rows("SELECT state, COUNT(*) AS n FROM checkpoints WHERE root=?"
                          " AND superseded=0 GROUP BY state", (root,))
        counts = {s.value: 0 for s in State}
        counts.update({r["state"]: int(r["n"]) for r in rows})
        return counts

    def queue_length(self, root: str) -> int:
        """Checkpoints with a stage due (validation, a copy, an upload)."""
        rows = self._rows("SELECT COUNT(*) AS n FROM checkpoints WHERE root=? AND superseded=0"
                          " AND stage IS NOT NULL", (root,))
        return int(rows[0]["n"])

    def in_flight(self, now: float) -> list[dict[str, Any]]:
        rows = self._rows("SELECT root, step, lease_stage FROM checkpoints"
                          " WHERE lease_owner IS NOT NULL AND lease_expires>=? AND superseded=0",
                          (now,))
        return [{"root": r["root"], "step": int(r["step"]), "stage": r["lease_stage"]}
                for r in rows]

    def root_info(self, root: str) -> dict[str, Any]:
        rows = self._rows("SELECT latest_step, latest_doc, last_error FROM roots WHERE name=?",
                          (root,))
        if not rows:
            return {"latest_step": None, "latest_doc": "", "last_error": ""}
        return {"latest_step": rows[0]["latest_step"], "latest_doc": rows[0]["latest_doc"],
                "last_error": rows[0]["last_error"]}

    def set_published_latest(self, root: str, step: int | None, doc: str = "") -> None:
        with self._tx() as db:
            db.execute("INSERT INTO roots (name, latest_step, latest_doc) VALUES (?,?,?)"
                       " ON CONFLICT(name) DO UPDATE SET latest_step=excluded.latest_step,"
                       " latest_doc=excluded.latest_doc", (root, step, doc))

    def roots(self) -> list[str]:
        return [r["root"] for r in self._rows("SELECT DISTINCT root FROM checkpoints")]


def _found_fields(f: Found, metrics: dict[str, float], now: float) -> dict[str, Any]:
    c = f.candidate
    return {"layout": c.layout, "path": c.path, "files": json.dumps(list(c.files)),
            "expected": expected_json(c), "metrics": json.dumps(metrics),
            "fingerprint": f.fingerprint, "completed": now if c.complete else None, "bytes": 0}
