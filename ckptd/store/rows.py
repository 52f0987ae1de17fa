"""Plain types the store hands out (Found, Job, Applied, SyncChange) and row conversions.

Owns the mapping between SQLite rows and ckptd's types; holds no connection and no SQL.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ckptd import inputs
from ckptd.errors import BadInput
from ckptd.lifecycle.table import Effect, Event, Stage, Status
from ckptd.model import Candidate, CheckpointRecord, Local, RankFiles, Remote, State


@dataclass(frozen=True)
class Found:
    """A candidate from a scan with the fingerprint of its member files at scan time."""

    candidate: Candidate
    fingerprint: str
    newest_mtime: float = 0.0  # of its member files at scan time (wall seconds)


@dataclass(frozen=True)
class Job:
    """A unit of claimed work: one stage of one checkpoint, under a claim that expires."""

    checkpoint: CheckpointRecord
    stage: Stage
    files: tuple[str, ...]
    expected_sizes: dict[str, int]
    min_sizes: dict[str, int]
    invalid_reason: str
    invalid_message: str
    opaque: tuple[str, ...] = ()
    owner: str = ""  # the token of this claim: every outcome is recorded under it
    rank_files: tuple[RankFiles, ...] = ()


@dataclass(frozen=True)
class SyncChange:
    """What a reconcile did to one step, for logging (`event` is the log event name)."""

    event: str
    step: int
    layout: str
    path: str
    detail: str = ""


@dataclass(frozen=True)
class Applied:
    """One committed transition, handed to the effects hook after its transaction commits."""

    root: str
    step: int
    event: Event
    source: Status | None
    target: Status | None
    effects: frozenset[Effect]


def status_of(r: sqlite3.Row) -> Status:
    return Status(State(r["state"]), Local(r["local"]), Remote(r["remote"]), r["copy"] == "ready")


# The columns `record_of` and `status_of` read: a read that answers records selects these,
# not `*`, which would copy each row's member list (hundreds of KB for a 10,000-file step) out
# of SQLite for every status, listing, latest or metrics read.
RECORD_COLUMNS = ("id, root, step, layout, path, state, local, remote, copy, bytes,"
                  " stored_bytes, metrics, reason, message, pinned, created, completed,"
                  " fingerprint, adopted")


def record_of(r: sqlite3.Row) -> CheckpointRecord:
    return CheckpointRecord(
        id=int(r["id"]), root=r["root"], step=int(r["step"]), layout=r["layout"],
        path=r["path"], state=State(r["state"]), local=Local(r["local"]),
        remote=Remote(r["remote"]), bytes=int(r["bytes"]), stored_bytes=int(r["stored_bytes"]),
        metrics=json.loads(r["metrics"]), reason=r["reason"], message=r["message"],
        pinned=bool(r["pinned"]), created=float(r["created"]),
        completed=None if r["completed"] is None else float(r["completed"]),
        fingerprint=r["fingerprint"], adopted=bool(r["adopted"]),
    )


def job_of(r: sqlite3.Row, stage: Stage, owner: str) -> Job:
    expected = json.loads(r["expected"])
    return Job(
        checkpoint=record_of(r), stage=stage,
        files=tuple(json.loads(r["files"])),
        expected_sizes={k: int(v) for k, v in expected.get("sizes", {}).items()},
        min_sizes={k: int(v) for k, v in expected.get("min", {}).items()},
        invalid_reason=expected.get("invalid_reason", ""),
        invalid_message=expected.get("invalid_message", ""),
        opaque=tuple(expected.get("opaque", ())),
        owner=owner,
        rank_files=tuple(RankFiles(*r) for r in expected.get("ranks", ())),
    )


def expected_json(c: Candidate) -> str:
    return json.dumps({"sizes": c.expected_sizes, "min": c.min_sizes,
                       "invalid_reason": c.invalid_reason,
                       "invalid_message": c.invalid_message, "opaque": list(c.opaque),
                       "ranks": [[r.source, r.key, r.prefix, r.suffix] for r in c.rank_files]})


def metrics_json(*sources: dict[str, Any]) -> str:
    """Merge metric maps (later wins) into strict JSON: a value that is not a finite number
    (a NaN loss in trainer_state.json, an integer of 400 digits) is dropped, never stored as
    `NaN` nor ranked as best."""
    merged: dict[str, float] = {}
    for source in sources:
        for k, v in source.items():
            try:  # an integer past a float's range (10^400) is no metric either, never a crash
                merged[str(k)] = inputs.check_float(v, "a metric")
            except BadInput:
                merged.pop(str(k), None)
    return json.dumps(merged, allow_nan=False)


def overlaps(path: str, dirs: frozenset[str]) -> bool:
    """Is `path` at, under or above one of `dirs` ("" is the root: everything overlaps)?"""
    return any(d == "" or path == d or path.startswith(d + "/") or d.startswith(path + "/")
               for d in dirs)


def one_per_step(found: Sequence[Found]) -> list[Found]:
    """Two candidates of one step in a scan: the later-written one wins (layouts return the
    earlier first); acting on both would make them supersede each other on every scan."""
    by_step: dict[int, Found] = {}
    for f in found:
        by_step[f.candidate.step] = f
    return list(by_step.values())
