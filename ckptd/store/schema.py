"""The state database's schema: numbered migrations under PRAGMA user_version, and opening it.

Owns the SQL that creates and upgrades tables; nothing here reads or writes checkpoints.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

from ckptd.errors import StateUnusable

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
    # 2: local compressed copies, upload bookkeeping, crash-safe prune, readers' holds.
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
    # 3: the lifecycle table decides; the store records each transition and the stage it
    # leaves due. Columns nothing read are dropped; latest.json's last content is kept.
    """
    ALTER TABLE checkpoints ADD COLUMN stage TEXT;
    ALTER TABLE checkpoints DROP COLUMN waiting_for;
    ALTER TABLE checkpoints DROP COLUMN validated;
    ALTER TABLE checkpoints DROP COLUMN validated_fingerprint;
    ALTER TABLE checkpoints DROP COLUMN trash_path;
    ALTER TABLE checkpoints DROP COLUMN uploaded;
    CREATE INDEX checkpoints_stage ON checkpoints(stage) WHERE stage IS NOT NULL;
    CREATE TABLE transitions (
        id INTEGER PRIMARY KEY,
        checkpoint_id INTEGER NOT NULL,
        root TEXT NOT NULL,
        step INTEGER NOT NULL,
        event TEXT NOT NULL,
        source TEXT NOT NULL,
        target TEXT NOT NULL,
        at REAL NOT NULL
    );
    CREATE INDEX transitions_checkpoint ON transitions(root, step);
    ALTER TABLE roots ADD COLUMN latest_doc TEXT NOT NULL DEFAULT '';
    """,
    # 4: adopted checkpoints (on disk before ckptd first watched the root), and when a root's
    # first scan happened (what it found then is adopted).
    """
    ALTER TABLE checkpoints ADD COLUMN adopted INTEGER NOT NULL DEFAULT 0;
    ALTER TABLE roots ADD COLUMN first_scan REAL;
    INSERT OR IGNORE INTO roots (name) SELECT DISTINCT root FROM checkpoints;
    UPDATE roots SET first_scan = 0 WHERE name IN (SELECT DISTINCT root FROM checkpoints);
    """,
    # 5: one word per concept: a worker's right to run one stage of a row is a *claim* (a *lease*
    # is the root's, <root>/.ckptd/lease.json). Readers' holds stay in `readers` until 7.
    """
    ALTER TABLE checkpoints RENAME COLUMN lease_owner TO claim_owner;
    ALTER TABLE checkpoints RENAME COLUMN lease_stage TO claim_stage;
    ALTER TABLE checkpoints RENAME COLUMN lease_expires TO claim_expires;
    """,
    # 6: a root's last error is set and cleared by its kind (`model.RootError`); the kinds of
    # errors recorded before are read once from the words they began with.
    """
    ALTER TABLE roots ADD COLUMN last_error_kind TEXT NOT NULL DEFAULT '';
    UPDATE roots SET last_error_kind = CASE
        WHEN substr(last_error, 1, 16) = 'validate: stuck:' THEN 'validate_stuck'
        WHEN substr(last_error, 1, 16) = 'compress: stuck:' THEN 'compress_stuck'
        WHEN substr(last_error, 1, 14) = 'upload: stuck:' THEN 'upload_stuck'
        WHEN substr(last_error, 1, 9) = 'validate:' THEN 'validate'
        WHEN substr(last_error, 1, 9) = 'compress:' THEN 'compress'
        WHEN substr(last_error, 1, 7) = 'upload:' THEN 'upload'
        WHEN substr(last_error, 1, 10) = 'retention:' THEN 'retention'
        WHEN substr(last_error, 1, 5) = 'scan:' THEN 'scan'
        WHEN substr(last_error, 1, 14) = 'could not read' THEN 'unreadable'
        WHEN substr(last_error, 1, 9) = 'root path' THEN 'root_missing'
        WHEN substr(last_error, 1, 6) = 'lease:' THEN 'lease'
        ELSE '' END
    WHERE last_error != '';
    """,
    # 7: a reader's hold on a step is a *hold* in the store too: the table `readers` (created
    # at 2) is `holds`. Its only index is its primary key's, which goes with it.
    """
    ALTER TABLE readers RENAME TO holds;
    """,
)


def open_db(path: Path) -> sqlite3.Connection:
    """Connect (WAL, synchronous=FULL, foreign keys), check the file is whole and bring the
    schema up to date. A file that exists but is empty, not a database, or fails SQLite's own
    check raises StateUnusable: never silently taken for a fresh, empty state."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        existed = path.stat().st_size if path.exists() else None
    except OSError as exc:
        raise StateUnusable(f"state database {path}: {exc.strerror or exc}") from None
    if existed == 0:
        raise StateUnusable(f"state database {path} is empty (truncated?); move it aside to"
                            " start afresh (pins are kept beside each root)")
    try:
        db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
        db.row_factory = sqlite3.Row
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=FULL")
        db.execute("PRAGMA foreign_keys=ON")
        db.execute("PRAGMA busy_timeout=5000")
        if existed is not None:
            check = db.execute("PRAGMA quick_check").fetchone()[0]
            if check != "ok":
                raise sqlite3.DatabaseError(check)
        _migrate(db, path)
    except sqlite3.Error as exc:
        raise StateUnusable(f"state database {path} is not usable ({exc}); move it aside to"
                            " start afresh (pins are kept beside each root)") from None
    return db


def schema_version(db: sqlite3.Connection) -> int:
    return int(db.execute("PRAGMA user_version").fetchone()[0])


def _migrate(db: sqlite3.Connection, path: Path) -> None:
    version = schema_version(db)
    if version > len(MIGRATIONS):
        raise StateUnusable(
            f"state database {path} has schema {version}, newer than this ckptd "
            f"({len(MIGRATIONS)}); upgrade ckptd or point state_dir elsewhere"
        )
    for i in range(version, len(MIGRATIONS)):
        # One script per step: the schema change and the version bump commit together.
        db.executescript(
            f"BEGIN IMMEDIATE; {MIGRATIONS[i]}; PRAGMA user_version = {i + 1}; COMMIT;"
        )
