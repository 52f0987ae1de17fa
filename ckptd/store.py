"""The state store: SQLite (WAL) schema, migrations, state transitions and work leases.

The single source of truth of the daemon. Every write goes through a transition method here;
no SQL lives anywhere else. Knows nothing of files, layouts or stages beyond their outcomes.
"""

from __future__ import annotations

import json
import sqlite3
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckptd.manifest import Manifest, StoredFile
from ckptd.model import (
    Candidate,
    CheckpointRecord,
    FileRecord,
    Local,
    Remote,
    State,
    Tier,
    ValidationResult,
)

# Each entry upgrades the schema from version i to i+1 (PRAGMA user_version).
MIGRATIONS: tuple[str, ...] = (
    """
    CREATE TABLE checkpoints (
        id INTEGER PRIMARY KEY,
        root TEXT NOT NULL,
        step INTEGER NOT NULL,
        layout TEXT NOT NULL,
        path TEXT NOT NULL,
        files TEXT NOT NULL DEFAULT '[]',
        expected TEXT NOT NULL DEFAULT '{}',
        state TEXT NOT NULL,
        local TEXT NOT NULL DEFAULT 'present',
        remote TEXT NOT NULL DEFAULT 'none',
        bytes INTEGER NOT NULL DEFAULT 0,
        stored_bytes INTEGER NOT NULL DEFAULT 0,
        metrics TEXT NOT NULL DEFAULT '{}',
        reason TEXT NOT NULL DEFAULT '',
        message TEXT NOT NULL DEFAULT '',
        waiting_for TEXT NOT NULL DEFAULT '',
        pinned INTEGER NOT NULL DEFAULT 0,
        superseded INTEGER NOT NULL DEFAULT 0,
        created REAL NOT NULL,
        completed REAL,
        validated REAL,
        fingerprint TEXT NOT NULL DEFAULT '',
        validated_fingerprint TEXT NOT NULL DEFAULT '',
        lease_owner TEXT,
        lease_stage TEXT,
        lease_expires REAL,
        attempts INTEGER NOT NULL DEFAULT 0,
        next_attempt REAL NOT NULL DEFAULT 0
    );
    CREATE UNIQUE INDEX checkpoints_current ON checkpoints(root, step) WHERE superseded = 0;
    CREATE INDEX checkpoints_state ON checkpoints(state, superseded);
    CREATE TABLE files (
        checkpoint_id INTEGER NOT NULL REFERENCES checkpoints(id) ON DELETE CASCADE,
        path TEXT NOT NULL,
        size INTEGER NOT NULL,
        hash TEXT NOT NULL,
        hash_alg TEXT NOT NULL,
        codec TEXT NOT NULL DEFAULT '',
        stored_size INTEGER,
        key TEXT NOT NULL DEFAULT '',
        PRIMARY KEY (checkpoint_id, path)
    );
    CREATE TABLE registrations (
        root TEXT NOT NULL,
        step INTEGER NOT NULL,
        paths TEXT NOT NULL DEFAULT '[]',
        metrics TEXT NOT NULL DEFAULT '{}',
        created REAL NOT NULL,
        PRIMARY KEY (root, step)
    );
    CREATE TABLE roots (
        name TEXT PRIMARY KEY,
        latest_step INTEGER,
        last_error TEXT NOT NULL DEFAULT '',
        last_error_at REAL
    );
    """,
    # 2: local compressed copies, upload bookkeeping, crash-safe prune, readers' leases.
    """
    ALTER TABLE checkpoints ADD COLUMN copy TEXT NOT NULL DEFAULT '';
    ALTER TABLE checkpoints ADD COLUMN trash_path TEXT NOT NULL DEFAULT '';
    ALTER TABLE checkpoints ADD COLUMN uploaded REAL;
    CREATE TABLE readers (
        root TEXT NOT NULL,
        step INTEGER NOT NULL,
        owner TEXT NOT NULL,
        expires REAL NOT NULL,
        PRIMARY KEY (root, step, owner)
    );
    """,
)

STAGE_VALIDATE = "validate"
STAGE_COMPRESS = "compress"
STAGE_UPLOAD = "upload"
# Backoff between attempts of a stage that failed for a transient cause.
RETRY_BASE_S = 2.0
RETRY_MAX_S = 300.0
PERMANENT_RETRY_S = 3600.0


@dataclass(frozen=True)
class Found:
    """A candidate from a scan with the fingerprint of its member files at scan time."""

    candidate: Candidate
    fingerprint: str


@dataclass(frozen=True)
class Job:
    """A unit of claimed work: one stage of one checkpoint, held under a lease."""

    checkpoint: CheckpointRecord
    stage: str
    files: tuple[str, ...]
    expected_sizes: dict[str, int]
    min_sizes: dict[str, int]
    invalid_reason: str
    invalid_message: str
    opaque: tuple[str, ...] = ()
    owner: str = ""  # the lease token of this claim: every outcome is recorded under it


@dataclass(frozen=True)
class SyncChange:
    """What a reconcile did to one step, for logging (`event` is the log event name)."""

    event: str
    step: int
    layout: str
    path: str
    detail: str = ""


class Store:
    """Thread-safe facade over one SQLite file. One connection, serialized by a lock."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.RLock()
        self._db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
        self._db.row_factory = sqlite3.Row
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.execute("PRAGMA foreign_keys=ON")
        self._db.execute("PRAGMA busy_timeout=5000")
        self._migrate()

    def close(self) -> None:
        with self._lock:
            self._db.close()

    @property
    def schema_version(self) -> int:
        return int(self._db.execute("PRAGMA user_version").fetchone()[0])

    def _migrate(self) -> None:
        with self._lock:
            version = self.schema_version
            if version > len(MIGRATIONS):
                raise RuntimeError(
                    f"state database {self.path} has schema {version}, newer than this ckptd "
                    f"({len(MIGRATIONS)}); upgrade ckptd or point state_dir elsewhere"
                )
            for i in range(version, len(MIGRATIONS)):
                # One script per step: the schema change and the version bump commit together.
                self._db.executescript(
                    f"BEGIN IMMEDIATE; {MIGRATIONS[i]}; PRAGMA user_version = {i + 1}; COMMIT;"
                )

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            if not self._db.in_transaction:
                self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            else:
                if self._db.in_transaction:
                    self._db.execute("COMMIT")

    def _rows(self, sql: str, args: Sequence[Any] = ()) -> list[sqlite3.Row]:
        with self._lock:
            return list(self._db.execute(sql, args).fetchall())

    # -- reconcile with a scan -------------------------------------------------------------

    def sync_root(self, root: str, found: Sequence[Found], now: float,
                  unreadable: frozenset[str] = frozenset()) -> list[SyncChange]:
        """Reconcile the rows of `root` with one scan's candidates. Returns what changed.
        Rows at, under or above an `unreadable` directory are never marked vanished: an
        unreadable directory is not a deleted checkpoint."""
        changes: list[SyncChange] = []
        with self._tx() as db:
            regs = self._registration_metrics(root)
            for f in _one_per_step(found):
                change = self._sync_one(db, root, f, regs.get(f.candidate.step, {}), now)
                if change:
                    changes.append(change)
            seen = {f.candidate.step for f in found}
            changes.extend(self._sync_gone(db, root, seen, unreadable))
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
            self._insert(db, root, f, metrics, now, pinned=False)
            return SyncChange("checkpoint_discovered", c.step, c.layout, c.path,
                              "complete" if c.complete else c.waiting_for)
        state = State(row["state"])
        if state is State.PENDING:
            return self._advance_pending(db, row, f, metrics, now)
        if row["fingerprint"] == f.fingerprint and row["path"] == c.path:
            if row["local"] == Local.PRUNED.value:
                # Seen again with identical files: a scan raced a rename, nothing was lost.
                db.execute("UPDATE checkpoints SET local='present' WHERE id=?", (row["id"],))
                return SyncChange("checkpoint_reappeared", c.step, c.layout, c.path)
            return None
        if row["local"] != Local.PRESENT.value and not c.complete:
            # Its files are gone on purpose (pruned, or replaced by a compressed copy); what
            # remains is e.g. a stale registration. Only a complete new save supersedes it.
            return None
        if set(c.files) < set(json.loads(row["files"])):
            # Members only disappeared (a deletion caught halfway, even if what is left looks
            # complete): the checkpoint is going, not being re-saved. It is no longer here, but
            # its history (pins, the remote copy) stays with the row. A real re-save with fewer
            # files is picked up by the next scan, as a new save over a gone one.
            self._gone(db, row["root"], row["id"], row["step"])
            return SyncChange("checkpoint_vanished", c.step, c.layout, c.path, "partly deleted")
        if row["local"] == Local.COMPRESSED.value and row["path"] != c.path:
            return None
        # Same step, different files: a re-save. The later one wins; keep the earlier as history.
        db.execute("UPDATE checkpoints SET superseded=1, lease_owner=NULL WHERE id=?", (row["id"],))
        self._insert(db, root, f, metrics, now, pinned=bool(row["pinned"]))
        return SyncChange("checkpoint_superseded", c.step, c.layout, c.path,
                          f"previous {row['layout']} at {row['path']} ({row['state']})")

    def _advance_pending(self, db: sqlite3.Connection, row: sqlite3.Row, f: Found,
                         metrics: dict[str, float], now: float) -> SyncChange | None:
        c = f.candidate
        state = State.COMPLETE if c.complete else State.PENDING
        db.execute(
            "UPDATE checkpoints SET layout=?, path=?, files=?, expected=?, state=?, metrics=?,"
            " waiting_for=?, fingerprint=?, completed=?, bytes=? WHERE id=?",
            (c.layout, c.path, json.dumps(list(c.files)), _expected_json(c), state.value,
             json.dumps(metrics), c.waiting_for, f.fingerprint,
             now if c.complete else None, 0, row["id"]),
        )
        if c.complete:
            return SyncChange("checkpoint_complete", c.step, c.layout, c.path)
        return None

    def _insert(self, db: sqlite3.Connection, root: str, f: Found, metrics: dict[str, float],
                now: float, pinned: bool) -> None:
        c = f.candidate
        state = State.COMPLETE if c.complete else State.PENDING
        db.execute(
            "INSERT INTO checkpoints (root, step, layout, path, files, expected, state, metrics,"
            " waiting_for, created, completed, fingerprint, pinned)"
            " VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?)",
            (root, c.step, c.layout, c.path, json.dumps(list(c.files)), _expected_json(c),
             state.value, json.dumps(metrics), c.waiting_for, now,
             now if c.complete else None, f.fingerprint, int(pinned)),
        )

    def _sync_gone(self, db: sqlite3.Connection, root: str, seen: set[int],
                   unreadable: frozenset[str] = frozenset()) -> list[SyncChange]:
        changes = []
        rows = db.execute(
            "SELECT id, step, state, layout, path, local FROM checkpoints"
            " WHERE root=? AND superseded=0 AND local='present'", (root,)
        ).fetchall()
        for r in rows:
            if r["step"] in seen or _overlaps(r["path"], unreadable):
                continue
            if r["state"] == State.PENDING.value:
                # Never complete and now gone (renamed or abandoned): nothing worth keeping.
                db.execute("DELETE FROM checkpoints WHERE id=?", (r["id"],))
                continue
            self._gone(db, root, r["id"], r["step"])
            changes.append(SyncChange("checkpoint_vanished", r["step"], r["layout"], r["path"]))
        return changes

    @staticmethod
    def _gone(db: sqlite3.Connection, root: str, cid: int, step: int) -> None:
        db.execute("UPDATE checkpoints SET local='pruned', lease_owner=NULL WHERE id=?", (cid,))
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
            if metrics:
                row = db.execute("SELECT id, metrics FROM checkpoints WHERE root=? AND step=?"
                                 " AND superseded=0", (root, step)).fetchone()
                if row is not None:
                    m = {**json.loads(row["metrics"]), **metrics}
                    db.execute("UPDATE checkpoints SET metrics=? WHERE id=?",
                               (json.dumps(m), row["id"]))

    def registrations(self, root: str) -> dict[int, tuple[str, ...]]:
        rows = self._rows("SELECT step, paths FROM registrations WHERE root=?", (root,))
        return {int(r["step"]): tuple(json.loads(r["paths"])) for r in rows}

    def set_pinned(self, root: str, step: int, pinned: bool) -> bool:
        with self._tx() as db:
            cur = db.execute("UPDATE checkpoints SET pinned=? WHERE root=? AND step=?"
                             " AND superseded=0", (int(pinned), root, step))
            return cur.rowcount > 0

    # -- work claiming -----------------------------------------------------------------------

    def claim(self, owner: str, now: float, lease_s: float,
              upload_roots: frozenset[str] = frozenset(),
              copy_roots: frozenset[str] = frozenset(),
              only: frozenset[tuple[str, int]] | None = None) -> Job | None:
        """Claim the next piece of work: validation first (newest step first, so the resume
        point moves soonest), then a missing compressed copy, then an upload.
        `upload_roots` upload; `copy_roots` keep local compressed copies."""
        needs_copy = upload_roots | copy_roots
        # A flush restricts claims to its steps (everything else yields until they are up).
        only_sql = "" if only is None else " AND (" + (" OR ".join(
            "(root=? AND step=?)" for _ in only) or "0") + ")"
        only_args: tuple[Any, ...] = () if only is None else tuple(x for t in only for x in t)
        with self._tx() as db:
            for stage, where, args in (
                # Validation never yields to a flush: the resume point must keep moving.
                (STAGE_VALIDATE, "state='complete' AND local='present'", ()),
                (STAGE_COMPRESS, "state='valid' AND local='present' AND copy=''"
                 f" AND remote IN ('none','uploading') AND root IN ({_qs(needs_copy)})",
                 tuple(needs_copy)),
                (STAGE_UPLOAD, "state='valid' AND copy='ready' AND remote IN ('none','uploading')"
                 f" AND root IN ({_qs(upload_roots)})", tuple(upload_roots)),
            ):
                restrict, extra = ("", ()) if stage == STAGE_VALIDATE else (only_sql, only_args)
                row = db.execute(
                    f"SELECT * FROM checkpoints WHERE superseded=0 AND {where}{restrict}"  # noqa: S608
                    " AND next_attempt<=? AND (lease_owner IS NULL OR lease_expires<?)"
                    " ORDER BY step DESC LIMIT 1", (*args, *extra, now, now)).fetchone()
                if row is not None:
                    return self._lease(db, row, stage, owner, now + lease_s)
        return None

    def _lease(self, db: sqlite3.Connection, row: sqlite3.Row, stage: str, owner: str,
               expires: float) -> Job:
        db.execute("UPDATE checkpoints SET lease_owner=?, lease_stage=?, lease_expires=?"
                   " WHERE id=?", (owner, stage, expires, row["id"]))
        if stage == STAGE_UPLOAD and row["remote"] == "none":
            db.execute("UPDATE checkpoints SET remote='uploading' WHERE id=?", (row["id"],))
        expected = json.loads(row["expected"])
        return Job(
            checkpoint=_record(row), stage=stage,
            files=tuple(json.loads(row["files"])),
            expected_sizes={k: int(v) for k, v in expected.get("sizes", {}).items()},
            min_sizes={k: int(v) for k, v in expected.get("min", {}).items()},
            invalid_reason=expected.get("invalid_reason", ""),
            invalid_message=expected.get("invalid_message", ""),
            opaque=tuple(expected.get("opaque", ())),
            owner=owner,
        )

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

    def finish_validation(self, job: Job, owner: str, fingerprint: str,
                          result: ValidationResult, now: float,
                          stored: Sequence[StoredFile] = (), size_on_disk: int = 0) -> bool:
        """Record a validation outcome. False (and nothing written) when the lease was lost or
        the files changed since the job was claimed (a re-save: the next scan supersedes)."""
        cid = job.checkpoint.id
        with self._tx() as db:
            row = db.execute("SELECT * FROM checkpoints WHERE id=?", (cid,)).fetchone()
            if row is None or row["superseded"] or row["lease_owner"] != owner:
                return False
            if row["fingerprint"] != fingerprint:
                db.execute("UPDATE checkpoints SET lease_owner=NULL WHERE id=?", (cid,))
                return False
            state = State.VALID if result.valid else State.INVALID
            metrics = {**result.metrics, **json.loads(row["metrics"])}
            # An invalid result may stop before hashing every file: then report what is on disk.
            total = sum(f.size for f in result.files) if result.valid else max(
                size_on_disk, sum(f.size for f in result.files))
            db.execute(
                "UPDATE checkpoints SET state=?, reason=?, message=?, validated=?,"
                " validated_fingerprint=?, metrics=?, bytes=?, lease_owner=NULL,"
                " lease_stage=NULL, lease_expires=NULL, attempts=0 WHERE id=?",
                (state.value, result.reason, result.message, now, fingerprint,
                 json.dumps(metrics), total, cid),
            )
            db.execute("DELETE FROM files WHERE checkpoint_id=?", (cid,))
            db.executemany(
                "INSERT INTO files (checkpoint_id, path, size, hash, hash_alg) VALUES (?,?,?,?,?)",
                [(cid, f.path, f.size, f.hash, f.hash_alg) for f in result.files],
            )
            if result.valid and stored:
                self._record_copy(db, cid, stored)
            return True

    @staticmethod
    def _record_copy(db: sqlite3.Connection, cid: int, stored: Sequence[StoredFile]) -> None:
        db.executemany("UPDATE files SET codec=?, stored_size=?, key=? WHERE checkpoint_id=?"
                       " AND path=?", [(f.codec, f.stored_size, f.key, cid, f.path)
                                       for f in stored])
        db.execute("UPDATE checkpoints SET copy='ready', stored_bytes=? WHERE id=?",
                   (sum(f.stored_size for f in stored), cid))

    def invalidate(self, job: Job, owner: str, reason: str, message: str) -> bool:
        """A valid checkpoint turned out damaged on a later read: invalid from now on."""
        with self._tx() as db:
            if not self._holds(db, job, owner):
                return False
            db.execute("UPDATE checkpoints SET state='invalid', reason=?, message=? WHERE id=?",
                       (reason, message, job.checkpoint.id))
            self._unlease(db, job.checkpoint.id)
            return True

    def finish_compress(self, job: Job, owner: str, stored: Sequence[StoredFile]) -> bool:
        """Record a compressed copy made after validation (e.g. upload enabled later)."""
        with self._tx() as db:
            if not self._holds(db, job, owner):
                return False
            self._record_copy(db, job.checkpoint.id, stored)
            self._unlease(db, job.checkpoint.id)
            return True

    def finish_upload(self, job: Job, owner: str, now: float) -> bool:
        """The step's manifest is committed remotely and every object verified."""
        with self._tx() as db:
            if not self._holds(db, job, owner):
                return False
            db.execute("UPDATE checkpoints SET remote='uploaded', uploaded=?, attempts=0"
                       " WHERE id=?", (now, job.checkpoint.id))
            self._unlease(db, job.checkpoint.id)
            return True

    @staticmethod
    def _holds(db: sqlite3.Connection, job: Job, owner: str) -> bool:
        row = db.execute("SELECT lease_owner, superseded FROM checkpoints WHERE id=?",
                         (job.checkpoint.id,)).fetchone()
        return row is not None and not row["superseded"] and row["lease_owner"] == owner

    @staticmethod
    def _unlease(db: sqlite3.Connection, cid: int) -> None:
        db.execute("UPDATE checkpoints SET lease_owner=NULL, lease_stage=NULL,"
                   " lease_expires=NULL WHERE id=?", (cid,))

    def members(self, checkpoint_id: int) -> tuple[str, ...]:
        """Root-relative member files as the layout reported them."""
        rows = self._rows("SELECT files FROM checkpoints WHERE id=?", (checkpoint_id,))
        return tuple(json.loads(rows[0]["files"])) if rows else ()

    def stored_files(self, checkpoint_id: int) -> list[StoredFile]:
        rows = self._rows("SELECT * FROM files WHERE checkpoint_id=? ORDER BY path",
                          (checkpoint_id,))
        return [StoredFile(r["path"], int(r["size"]), r["hash"], r["hash_alg"], r["codec"],
                           int(r["stored_size"] or 0), r["key"]) for r in rows]

    # -- pruning and copies ------------------------------------------------------------------

    def set_local(self, root: str, step: int, local: Local, trash_path: str = "") -> None:
        """Record a local change made by pruning (`trash_path` while a delete is half done)."""
        with self._tx() as db:
            db.execute("UPDATE checkpoints SET local=?, trash_path=? WHERE root=? AND step=?"
                       " AND superseded=0", (local.value, trash_path, root, step))
            if local is Local.PRUNED:
                db.execute("DELETE FROM registrations WHERE root=? AND step=?", (root, step))

    def set_trash(self, root: str, step: int, trash_path: str) -> None:
        with self._tx() as db:
            db.execute("UPDATE checkpoints SET trash_path=? WHERE root=? AND step=?"
                       " AND superseded=0", (trash_path, root, step))

    def set_remote(self, root: str, step: int, remote: Remote) -> None:
        with self._tx() as db:
            db.execute("UPDATE checkpoints SET remote=? WHERE root=? AND step=? AND superseded=0",
                       (remote.value, root, step))

    def drop_copy(self, root: str, step: int) -> None:
        with self._tx() as db:
            db.execute("UPDATE checkpoints SET copy='' WHERE root=? AND step=? AND superseded=0",
                       (root, step))

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

    def copy_lost(self, job: Job, owner: str) -> None:
        """The job's row's compressed copy is missing or not its content. A present row gets it
        rebuilt by the compress stage; for a compressed row it was the only local copy."""
        with self._tx() as db:
            if not self._holds(db, job, owner):
                return
            db.execute("UPDATE checkpoints SET copy='', local=CASE local WHEN 'compressed'"
                       " THEN 'pruned' ELSE local END, remote=CASE WHEN local='compressed'"
                       " AND remote='uploading' THEN 'none' ELSE remote END WHERE id=?",
                       (job.checkpoint.id,))

    def has_copy(self, root: str, step: int) -> bool:
        rows = self._rows("SELECT copy FROM checkpoints WHERE root=? AND step=? AND superseded=0",
                          (root, step))
        return bool(rows) and rows[0]["copy"] == "ready"

    def add_remote_only(self, root: str, manifest: Manifest, now: float) -> bool:
        """A step committed remotely that this store does not know (a fresh node, a lost
        state dir): recorded as valid, uploaded, not present locally. False if known."""
        with self._tx() as db:
            row = db.execute("SELECT id, remote FROM checkpoints WHERE root=? AND step=?"
                             " AND superseded=0", (root, manifest.step)).fetchone()
            if row is not None:
                return False
            cur = db.execute(
                "INSERT INTO checkpoints (root, step, layout, path, files, state, local, remote,"
                " bytes, stored_bytes, metrics, created, completed, validated, uploaded)"
                " VALUES (?,?,?,?,?,'valid','pruned','uploaded',?,?,?,?,?,?,?)",
                (root, manifest.step, manifest.layout, f"step-{manifest.step}",
                 json.dumps([f.path for f in manifest.files]), manifest.size,
                 manifest.stored_size, json.dumps(manifest.metrics), now, now, now, now))
            cid = cur.lastrowid
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

    def fail_attempt(self, job: Job, owner: str, error: str, now: float,
                     permanent: bool = False) -> float:
        """A stage failed: back off and retry later (an hour for a permanent cause, such as
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
        return [_record(r) for r in rows]

    def checkpoint(self, root: str, step: int) -> CheckpointRecord | None:
        rows = self._rows("SELECT * FROM checkpoints WHERE root=? AND step=? AND superseded=0",
                          (root, step))
        return _record(rows[0]) if rows else None

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
        return _record(rows[0]) if rows else None

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

    def queue_length(self, root: str, uploads: bool = False) -> int:
        """Checkpoints waiting for a stage: validation, and (when `uploads`) their upload."""
        upload = " OR (state='valid' AND remote IN ('none','uploading'))" if uploads else ""
        rows = self._rows("SELECT COUNT(*) AS n FROM checkpoints WHERE root=? AND superseded=0"
                          f" AND ((state='complete' AND local='present'){upload})",  # noqa: S608
                          (root,))
        return int(rows[0]["n"])

    def in_flight(self, now: float) -> list[dict[str, Any]]:
        rows = self._rows("SELECT root, step, lease_stage, files FROM checkpoints"
                          " WHERE lease_owner IS NOT NULL AND lease_expires>=? AND superseded=0",
                          (now,))
        return [{"root": r["root"], "step": int(r["step"]), "stage": r["lease_stage"]}
                for r in rows]

    def root_info(self, root: str) -> dict[str, Any]:
        rows = self._rows("SELECT latest_step, last_error FROM roots WHERE name=?", (root,))
        if not rows:
            return {"latest_step": None, "last_error": ""}
        return {"latest_step": rows[0]["latest_step"], "last_error": rows[0]["last_error"]}

    def set_published_latest(self, root: str, step: int | None) -> None:
        with self._tx() as db:
            db.execute("INSERT INTO roots (name, latest_step) VALUES (?,?) ON CONFLICT(name)"
                       " DO UPDATE SET latest_step=excluded.latest_step", (root, step))

    def roots(self) -> list[str]:
        return [r["root"] for r in self._rows("SELECT DISTINCT root FROM checkpoints")]


def _overlaps(path: str, dirs: frozenset[str]) -> bool:
    """Is `path` at, under or above one of `dirs` ("" is the root: everything overlaps)?"""
    return any(d == "" or path == d or path.startswith(d + "/") or d.startswith(path + "/")
               for d in dirs)


def _one_per_step(found: Sequence[Found]) -> list[Found]:
    """Two candidates of one step in a scan: the later-written one wins (layouts return the
    earlier first); acting on both would make them supersede each other on every scan."""
    by_step: dict[int, Found] = {}
    for f in found:
        by_step[f.candidate.step] = f
    return list(by_step.values())


def _qs(items: frozenset[str]) -> str:
    """Placeholders for an IN (...) list; never empty (SQLite refuses `IN ()`)."""
    return ",".join("?" * len(items)) or "NULL"


def _expected_json(c: Candidate) -> str:
    return json.dumps({"sizes": c.expected_sizes, "min": c.min_sizes,
                       "invalid_reason": c.invalid_reason,
                       "invalid_message": c.invalid_message, "opaque": list(c.opaque)})


def _record(r: sqlite3.Row) -> CheckpointRecord:
    return CheckpointRecord(
        id=int(r["id"]), root=r["root"], step=int(r["step"]), layout=r["layout"],
        path=r["path"], state=State(r["state"]), local=Local(r["local"]),
        remote=Remote(r["remote"]), bytes=int(r["bytes"]), stored_bytes=int(r["stored_bytes"]),
        metrics=json.loads(r["metrics"]), reason=r["reason"], message=r["message"],
        pinned=bool(r["pinned"]), created=float(r["created"]),
        completed=None if r["completed"] is None else float(r["completed"]),
        fingerprint=r["fingerprint"],
    )
