"""Read-only queries of the state store: what `ls`, `status`, `latest`, retention and the
stages' callers ask. Writes nothing; `Store` (db.py) adds every write.
"""

from __future__ import annotations

import json
import sqlite3
import threading
from collections.abc import Iterator, Sequence
from typing import Any

from ckptd.lifecycle import answers
from ckptd.lifecycle.table import Event, Policy, Status
from ckptd.model import CheckpointRecord, FileRecord, MetricMode, State, Tier
from ckptd.remote.manifest import StoredFile
from ckptd.store.rows import RECORD_COLUMNS, record_of, status_of

# The highest step SQLite's INTEGER holds: "no bound" for `_answerable`.
_TOP = 2**63 - 1

# A valid row with a copy in any tier (`answers.in_tier(r, Tier.ANY)`) as SQL, made from the
# same constants, so the pre-filter and the answers cannot disagree.
ANSWERABLE = (f"state='{State.VALID.value}' AND (local IN"
              f" ({', '.join(repr(x.value) for x in answers.ON_DISK)})"
              f" OR remote='{answers.COMMITTED.value}')")


class Reads:
    """The queries; `_db` and `_lock` belong to the Store that inherits them."""

    _db: sqlite3.Connection
    _lock: threading.RLock
    _policies: dict[str, Policy]

    def _rows(self, sql: str, args: Sequence[Any] = ()) -> list[sqlite3.Row]:
        with self._lock:
            return list(self._db.execute(sql, args).fetchall())

    def transitions(self, root: str, step: int) -> list[tuple[str, str, str]]:
        """The logged (event, source, target) of every save of one step, oldest first."""
        rows = self._rows("SELECT event, source, target FROM transitions WHERE root=? AND"
                          " step=? ORDER BY id", (root, step))
        return [(r["event"], r["source"], r["target"]) for r in rows]

    def reached(self, root: str, event: Event, above: int = -1) -> dict[int, float]:
        """Step -> when the current save of each step of `root` above `above` last went
        through `event` (the transition log's wall time, so it outlives a restart). A step
        whose log rows were trimmed away is left out."""
        rows = self._rows("SELECT c.step AS step, MAX(t.at) AS at FROM transitions t"
                          " JOIN checkpoints c ON c.id = t.checkpoint_id"
                          " WHERE t.root=? AND t.step>? AND t.event=? AND c.superseded=0"
                          " GROUP BY c.step", (root, above, event.value))
        return {int(r["step"]): float(r["at"]) for r in rows}

    def registrations(self, root: str) -> dict[int, tuple[str, ...]]:
        rows = self._rows("SELECT step, paths FROM registrations WHERE root=?", (root,))
        return {int(r["step"]): tuple(json.loads(r["paths"])) for r in rows}

    def members(self, checkpoint_id: int) -> tuple[str, ...]:
        """Root-relative member files as the layout reported them."""
        text = self.member_texts([checkpoint_id]).get(checkpoint_id)
        return tuple(json.loads(text)) if text is not None else ()

    def member_texts(self, checkpoint_ids: Sequence[int]) -> dict[int, str]:
        """Each checkpoint's member list as stored, unparsed (`members` parses one), by id:
        for a caller that keeps what it derived from the lists while they read the same."""
        out: dict[int, str] = {}
        for i in range(0, len(checkpoint_ids), 500):
            chunk = list(checkpoint_ids[i:i + 500])
            sql = f"SELECT id, files FROM checkpoints WHERE id IN ({','.join('?' * len(chunk))})"
            for r in self._rows(sql, chunk):
                out[int(r["id"])] = r["files"]
        return out

    def stored_files(self, checkpoint_id: int) -> list[StoredFile]:
        rows = self._rows("SELECT * FROM files WHERE checkpoint_id=? ORDER BY path",
                          (checkpoint_id,))
        return [StoredFile(r["path"], int(r["size"]), r["hash"], r["hash_alg"], r["codec"],
                           int(r["stored_size"] or 0), r["key"]) for r in rows]

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

    def in_use(self, root: str, now: float) -> frozenset[int]:
        """Steps of `root` with at least one fresh hold (the `holds` table keeps them)."""
        rows = self._rows("SELECT DISTINCT step FROM holds WHERE root=? AND expires>=?",
                          (root, now))
        return frozenset(int(r["step"]) for r in rows)

    def checkpoints(self, root: str) -> list[CheckpointRecord]:
        rows = self._rows(f"SELECT {RECORD_COLUMNS} FROM checkpoints"  # noqa: S608
                          " WHERE root=? AND superseded=0 ORDER BY step", (root,))
        return [record_of(r) for r in rows]

    def checkpoint(self, root: str, step: int) -> CheckpointRecord | None:
        rows = self._rows(f"SELECT {RECORD_COLUMNS} FROM checkpoints"  # noqa: S608
                          " WHERE root=? AND step=? AND superseded=0", (root, step))
        return record_of(rows[0]) if rows else None

    def status(self, root: str, step: int) -> Status | None:
        rows = self._rows("SELECT state, local, remote, copy FROM checkpoints"
                          " WHERE root=? AND step=? AND superseded=0", (root, step))
        return status_of(rows[0]) if rows else None

    def files(self, checkpoint_id: int) -> list[FileRecord]:
        rows = self._rows("SELECT path, size, hash, hash_alg FROM files WHERE checkpoint_id=?"
                          " ORDER BY path", (checkpoint_id,))
        return [FileRecord(r["path"], int(r["size"]), r["hash"], r["hash_alg"]) for r in rows]

    def latest(self, root: str, tier: Tier = Tier.ANY) -> CheckpointRecord | None:
        """`answers.latest` of the root's records, under the root's policy. Asked of the
        newest rows first, a page at a time: every later page holds only older steps, so the
        first page with an answer has the answer (a root keeps every pruned step's row)."""
        committed_only = self._committed_only(root)
        for page in self._newest_first(root):
            rec = answers.latest(page, tier, committed_only)
            if rec is not None:
                return rec
        return None

    def best(self, root: str, metric: str, mode: MetricMode) -> CheckpointRecord | None:
        """`answers.best` by `metric` (None when the root has no metric)."""
        if not metric:
            return None
        return answers.best(self._answerable(root), lambda c: c.metrics.get(metric), mode,
                            self._committed_only(root))

    def _committed_only(self, root: str) -> bool:
        return self._policies.get(root, Policy()).committed_only

    def _answerable(self, root: str, below: int = _TOP, limit: int = -1) -> list[CheckpointRecord]:
        """The rows `answers` may choose from, newest first: valid ones with a copy somewhere,
        of steps up to `below`. A pre-filter only (the rows of pruned steps pile up); the
        choice is the shared function's."""
        rows = self._rows(f"SELECT {RECORD_COLUMNS} FROM checkpoints"  # noqa: S608
                          " WHERE root=? AND superseded=0"
                          f" AND {ANSWERABLE} AND step<=? ORDER BY step DESC LIMIT ?",
                          (root, below, limit))
        return [record_of(r) for r in rows]

    def _newest_first(self, root: str) -> Iterator[list[CheckpointRecord]]:
        """`_answerable` in pages of 1, 8, 64, ... rows: the usual answer costs one row."""
        below, size = _TOP, 1
        while page := self._answerable(root, below, size):
            yield page
            if len(page) < size:
                return
            below, size = page[-1].step - 1, size * 8

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
        rows = self._rows("SELECT root, step, claim_stage FROM checkpoints"
                          " WHERE claim_owner IS NOT NULL AND claim_expires>=? AND superseded=0",
                          (now,))
        return [{"root": r["root"], "step": int(r["step"]), "stage": r["claim_stage"]}
                for r in rows]

    def root_info(self, root: str) -> dict[str, Any]:
        rows = self._rows("SELECT latest_step, latest_doc, last_error, last_error_at FROM roots"
                          " WHERE name=?",
                          (root,))
        if not rows:
            return {"latest_step": None, "latest_doc": "", "last_error": "",
                    "last_error_at": None}
        return {"latest_step": rows[0]["latest_step"], "latest_doc": rows[0]["latest_doc"],
                "last_error": rows[0]["last_error"], "last_error_at": rows[0]["last_error_at"]}

    def roots(self) -> list[str]:
        return [r["root"] for r in self._rows("SELECT DISTINCT root FROM checkpoints")]

    def owners(self, root: str) -> dict[str, int]:
        """Member file -> the step of the checkpoint on disk that holds it."""
        rows = self._rows("SELECT step, files FROM checkpoints WHERE root=? AND superseded=0"
                          " AND local='present'", (root,))
        return {f: int(r["step"]) for r in rows for f in json.loads(r["files"])}
