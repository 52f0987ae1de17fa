"""The store's record reads (a step, a root's list, latest, best: what every status, listing
and metrics request asks) select the columns a record is made of, never a row's member list,
which for a 10,000-file step is hundreds of KB copied out of SQLite per read."""

from __future__ import annotations

from pathlib import Path

from ckptd.lifecycle.table import Policy
from ckptd.model import Candidate, FileRecord, State, Tier, ValidationResult
from ckptd.store import Found, Store
from ckptd.store.rows import RECORD_COLUMNS

FILES = 5000


def _many_file_store(tmp_path: Path) -> Store:
    store = Store(tmp_path / "state.db")
    store.set_policies({"r": Policy()})
    files = tuple(f"step-7/__0_{i}.distcp" for i in range(FILES))
    store.sync_root("r", [Found(Candidate("dcp", 7, "step-7", files, True,
                                          metrics={"loss": 1.5}), "fp")], 1.0)
    job = store.claim("me", 2.0, 60)
    assert job is not None and len(job.files) == FILES  # the work claim still gets them
    res = ValidationResult(True, files=tuple(FileRecord(f, 5, "h", "xxh3-128") for f in files))
    assert store.finish_validation(job, "me", job.checkpoint.fingerprint, res, 3.0)
    return store


def test_record_reads_never_select_member_lists(tmp_path: Path) -> None:
    store = _many_file_store(tmp_path)
    seen: list[str] = []
    store._db.set_trace_callback(seen.append)  # the store's own connection: what it asks
    try:
        rec = store.checkpoint("r", 7)
        listed = store.checkpoints("r")
        latest = store.latest("r", Tier.ANY)
        best = store.best("r", "loss", "min")
        status = store.status("r", 7)
    finally:
        store._db.set_trace_callback(None)
    assert rec is not None and rec.state is State.VALID and rec.metrics == {"loss": 1.5}
    assert listed == [rec] and latest == rec and best == rec
    assert status is not None and status.state is State.VALID
    reads = [s for s in seen if "FROM checkpoints" in s]
    assert reads, seen
    for sql in reads:
        assert "SELECT *" not in sql and "files" not in sql.split("FROM")[0], sql
    assert "files" not in RECORD_COLUMNS and "expected" not in RECORD_COLUMNS



def _sync_reads(store: Store, found: list[Found]) -> tuple[list[str], list[str]]:
    seen: list[str] = []
    store._db.set_trace_callback(seen.append)
    try:
        changes = store.sync_root("r", found, 5.0)
    finally:
        store._db.set_trace_callback(None)
    return [s for s in seen if "FROM checkpoints" in s], [ch.event for ch in changes]


def test_a_rescan_of_an_unchanged_step_never_reads_its_member_list(tmp_path: Path) -> None:
    """Every scan reconciles every kept step: one whose fingerprint is the row's (the digest of
    its member paths, sizes and mtimes) needs no member list, so a scan's cost does not grow
    with the files the root's earlier steps hold."""
    store = _many_file_store(tmp_path)
    files = tuple(f"step-7/__0_{i}.distcp" for i in range(FILES))
    same = Found(Candidate("dcp", 7, "step-7", files, True, metrics={"loss": 1.5}), "fp")
    reads, events = _sync_reads(store, [same])
    assert reads and events == []
    for sql in reads:
        assert "SELECT *" not in sql and "files" not in sql.split("FROM")[0], sql
    assert store.checkpoint("r", 7).state is State.VALID  # type: ignore[union-attr]


def test_a_step_with_fewer_files_is_still_seen_partly_deleted(tmp_path: Path) -> None:
    """A changed fingerprint reads the member list: fewer files than recorded is a partly
    deleted checkpoint, as before."""
    store = _many_file_store(tmp_path)
    fewer = tuple(f"step-7/__0_{i}.distcp" for i in range(FILES - 1))
    found = Found(Candidate("dcp", 7, "step-7", fewer, True, metrics={"loss": 1.5}), "fp2")
    reads, events = _sync_reads(store, [found])
    assert any("SELECT files" in sql for sql in reads), reads
    assert events == ["checkpoint_vanished"]
