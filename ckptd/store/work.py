"""Work in the state store: a worker's *claim* on the stage a row has due (it expires unless
renewed), and recording a stage's outcome as lifecycle events (or a failure, with its backoff).
Claims only: a root's *lease* is `ckptd.cluster.lease`'s, a reader's *hold* is `Intents.hold`.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Callable, Collection, Sequence
from typing import Any

from ckptd.lifecycle.table import (
    STAGE_PRIORITY,
    Event,
    Refused,
    Stage,
)
from ckptd.model import Remote, RootError, ValidationResult
from ckptd.remote.manifest import StoredFile
from ckptd.store.core import Core
from ckptd.store.rows import (
    Job,
    job_of,
    metrics_json,
    status_of,
)

# Backoff between attempts of a stage that failed.
RETRY_BASE_S = 2.0
RETRY_MAX_S = 300.0
# A permanent cause (refused credentials) waits for a person; capped so a fix is picked up.
PERMANENT_RETRY_S = 600.0


class Work(Core):
    """Claims and outcomes."""


    def claim(self, owner: str, now: float, claim_s: float,
              only: frozenset[tuple[str, int]] | None = None,
              roots: Collection[str] | None = None,
              stuck: Collection[tuple[str, str]] = ()) -> Job | None:
        """Claim the next piece of work: the stage the lifecycle table left due on a row,
        validation first (newest step first, so the resume point moves soonest), then a
        missing compressed copy, then an upload. `only` (a flush) restricts copies and
        uploads to its steps; validation never yields to a flush. `roots`, when given, are
        the only roots whose work may be claimed (those this daemon acts on). `stuck`:
        (root, stage) pairs not claimed now (a call of that stage on that root is stuck). The
        claim is `owner`'s until `now + claim_s` (`renew_claim` extends it)."""
        with self._tx() as db:
            rows = db.execute(
                "SELECT * FROM checkpoints WHERE stage IS NOT NULL AND superseded=0"
                " AND next_attempt<=? AND (claim_owner IS NULL OR claim_expires<?)",
                (now, now)).fetchall()
            due = [r for r in rows if (roots is None or r["root"] in roots) and (
                only is None or r["stage"] == Stage.VALIDATE.value
                or (r["root"], int(r["step"])) in only)
                and (r["root"], r["stage"]) not in stuck]
            if not due:
                return None
            row = min(due, key=lambda r: (STAGE_PRIORITY[Stage(r["stage"])], -int(r["step"])))
            stage = Stage(row["stage"])
            db.execute("UPDATE checkpoints SET claim_owner=?, claim_stage=?, claim_expires=?"
                       " WHERE id=?", (owner, stage.value, now + claim_s, row["id"]))
            if stage is Stage.UPLOAD and row["remote"] == Remote.NONE.value:
                self._apply(db, row, Event.UPLOAD_STARTED, now)
                row = db.execute("SELECT * FROM checkpoints WHERE id=?", (row["id"],)).fetchone()
            return job_of(row, stage, owner)

    def renew_claim(self, checkpoint_id: int, owner: str, now: float, claim_s: float) -> bool:
        """Extend `owner`'s claim on the row; False when it is no longer theirs."""
        with self._tx() as db:
            cur = db.execute("UPDATE checkpoints SET claim_expires=? WHERE id=? AND claim_owner=?"
                             " AND superseded=0", (now + claim_s, checkpoint_id, owner))
            return cur.rowcount > 0

    def release_claims(self) -> int:
        """Drop every claim (startup: only one daemon holds the state dir, so all are stale)."""
        with self._tx() as db:
            return db.execute("UPDATE checkpoints SET claim_owner=NULL, claim_stage=NULL,"
                              " claim_expires=NULL WHERE claim_owner IS NOT NULL").rowcount

    def _held(self, db: sqlite3.Connection, job: Job, owner: str) -> sqlite3.Row | None:
        row: sqlite3.Row | None = db.execute("SELECT * FROM checkpoints WHERE id=?",
                                             (job.checkpoint.id,)).fetchone()
        if row is None or row["superseded"] or row["claim_owner"] != owner:
            return None
        return row

    def _outcome(self, job: Job, owner: str, events: Sequence[Event], now: float,
                 before: Callable[[sqlite3.Connection, sqlite3.Row], None] | None = None,
                 **fields: Any) -> bool:
        """Record a stage's outcome as lifecycle events (the first carries `fields`) and
        release the claim. False when the claim is lost or the table refuses (the row moved
        on meanwhile): then nothing of the outcome is written."""
        with self._tx() as db:
            row = self._held(db, job, owner)
            if row is None:
                return False
            ok = self._atomically(db, lambda: self._apply_all(db, row, events, now, before,
                                                              fields))
            self._release_claim(db, job.checkpoint.id)
            return ok

    def _apply_all(self, db: sqlite3.Connection, row: sqlite3.Row, events: Sequence[Event],
                   now: float, before: Callable[[sqlite3.Connection, sqlite3.Row], None] | None,
                   fields: dict[str, Any]) -> None:
        if before is not None:
            before(db, row)
        for i, event in enumerate(events):
            self._apply(db, row, event, now, **(fields if i == 0 else {}))
            row = db.execute("SELECT * FROM checkpoints WHERE id=?", (row["id"],)).fetchone()

    def finish_validation(self, job: Job, owner: str, fingerprint: str,
                          result: ValidationResult, now: float,
                          stored: Sequence[StoredFile] = (), size_on_disk: int = 0) -> bool:
        """Record a validation outcome. False (and nothing written) when the claim was lost or
        the files changed since the job was claimed (a re-save: the next scan supersedes)."""
        row = self._rows("SELECT fingerprint, metrics FROM checkpoints WHERE id=?",
                         (job.checkpoint.id,))
        if not row or row[0]["fingerprint"] != fingerprint:
            self.defer(job, owner, 0.0, now)
            return False
        metrics = metrics_json(result.metrics, json.loads(row[0]["metrics"]))
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
                             message=result.message, metrics=metrics,
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
        claim stays for the failure to be recorded."""
        with self._tx() as db:
            row = self._held(db, job, owner)
            if row is not None:
                self._atomically(db, lambda: self._apply(db, row, Event.COPY_LOST, now))

    def fail_attempt(self, job: Job, owner: str, error: str, now: float,
                     permanent: bool = False) -> float:
        """A stage failed: back off and retry later (longer for a permanent cause, such as
        refused credentials, which only a person can fix; the error shows in status)."""
        with self._tx() as db:
            row = db.execute("SELECT attempts, root FROM checkpoints WHERE id=? AND claim_owner=?",
                             (job.checkpoint.id, owner)).fetchone()
            if row is None:
                return 0.0
            attempts = int(row["attempts"]) + 1
            delay = float(min(RETRY_MAX_S, RETRY_BASE_S * 2 ** (attempts - 1)))
            if permanent:
                delay = PERMANENT_RETRY_S
            db.execute("UPDATE checkpoints SET attempts=?, next_attempt=?, claim_owner=NULL,"
                       " claim_stage=NULL, claim_expires=NULL WHERE id=?",
                       (attempts, now + delay, job.checkpoint.id))
            self._set_error(db, row["root"], RootError.of_stage(job.stage), error, now)
            return delay

    def defer(self, job: Job, owner: str, delay: float, now: float) -> None:
        """Give the job back without an outcome; nobody claims it for `delay` seconds."""
        with self._tx() as db:
            db.execute("UPDATE checkpoints SET next_attempt=?, claim_owner=NULL, claim_stage=NULL,"
                       " claim_expires=NULL WHERE id=? AND claim_owner=?",
                       (now + delay, job.checkpoint.id, owner))

    def retry_now(self, root: str | None = None) -> int:
        """Forget every backoff (a reload: the operator may have fixed the cause)."""
        with self._tx() as db:
            where, args = ("", ()) if root is None else (" AND root=?", (root,))
            return db.execute("UPDATE checkpoints SET next_attempt=0 WHERE superseded=0"  # noqa: S608
                              f" AND next_attempt>0{where}", args).rowcount
