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

