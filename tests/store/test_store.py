"""The state store on a real SQLite file: migrations, the state machine, claims, holds,
latest/best."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from ckptd.errors import StateUnusable
from ckptd.lifecycle.table import Event, Policy
from ckptd.model import (
    Candidate,
    FileRecord,
    Local,
    Remote,
    RootError,
    State,
    Tier,
    ValidationResult,
)
from ckptd.remote.manifest import StoredFile
from ckptd.store import MIGRATIONS, Found, Store


def cand(step: int, complete: bool = True, files: tuple[str, ...] = ("a.pt",),
         metrics: dict[str, float] | None = None) -> Candidate:
    return Candidate("single", step, files[0], files, complete, metrics=metrics or {})


def found(step: int, fp: str = "fp", **kw: object) -> Found:
    return Found(cand(step, **kw), fp)  # type: ignore[arg-type]


def validate_ok(store: Store, valid: bool = True, now: float = 10.0, copy: bool = False) -> int:
    job = store.claim("me", now, 60)
    assert job is not None
    res = ValidationResult(valid, "" if valid else "crc_mismatch", "",
                           files=(FileRecord(job.files[0], 5, "h", "xxh3-128"),))
    stored = [StoredFile(job.files[0], 5, "h", "xxh3-128", "zstd", 3, job.files[0] + ".zst")]
    assert store.finish_validation(job, "me", job.checkpoint.fingerprint, res, now,
                                   stored=stored if copy else ())
    return job.checkpoint.step


def uploaded(store: Store, root: str, step: int, now: float = 20.0) -> None:
    """Drive a valid step with a copy through a real upload claim to `uploaded`."""
    store.set_policies({root: Policy(uploads=True)})
    job = store.claim("up", now, 60, only=frozenset({(root, step)}))
    assert job is not None and job.stage == "upload" and job.checkpoint.step == step
    assert store.finish_upload(job, "up", now)


@pytest.fixture
def store(tmp_path: Path) -> Store:
    return Store(tmp_path / "state.db")


def test_schema_version_and_wal(tmp_path: Path) -> None:
    s = Store(tmp_path / "s.db")
    assert s.schema_version == len(MIGRATIONS)
    mode = sqlite3.connect(tmp_path / "s.db").execute("PRAGMA journal_mode").fetchone()[0]
    assert mode == "wal"
    s.close()
    assert Store(tmp_path / "s.db").schema_version == len(MIGRATIONS)  # reopen: no re-run


def test_newer_schema_refused(tmp_path: Path) -> None:
    db = sqlite3.connect(tmp_path / "s.db")
    db.execute(f"PRAGMA user_version = {len(MIGRATIONS) + 1}")
    db.close()
    with pytest.raises(StateUnusable, match="newer than this ckptd"):
        Store(tmp_path / "s.db")


def test_schema_4_upgrades_work_leases_to_claims(tmp_path: Path) -> None:
    """A state database at schema 4 (work claims stored as `lease_*` columns) opens at the
    current schema with its claim, its reader's hold and its rows intact."""
    db = sqlite3.connect(tmp_path / "s.db", isolation_level=None)
    for i, script in enumerate(MIGRATIONS[:4]):
        db.executescript(f"BEGIN; {script}; PRAGMA user_version = {i + 1}; COMMIT;")
    db.execute("INSERT INTO checkpoints (root, step, layout, path, state, created, stage,"
               " lease_owner, lease_stage, lease_expires) VALUES ('r', 3, 'single', 'a.pt',"
               " 'complete', 1.0, 'validate', 'old/w0/abc', 'validate', 1e12)")
    db.execute("INSERT INTO readers (root, step, owner, expires) VALUES ('r', 3, 'job', 1e12)")
    db.close()
    s = Store(tmp_path / "s.db")
    assert s.schema_version == len(MIGRATIONS) >= 5
    cols = {r[1] for r in sqlite3.connect(tmp_path / "s.db").execute(
        "PRAGMA table_info(checkpoints)")}
    assert {"claim_owner", "claim_stage", "claim_expires"} <= cols
    assert not {c for c in cols if c.startswith("lease_")}
    assert s.in_flight(0.0) == [{"root": "r", "step": 3, "stage": "validate"}]
    assert s.claim("new", 2.0, 60) is None  # the old claim still holds until it expires
    assert s.release_claims() == 1
    job = s.claim("new", 2.0, 60)
    assert job is not None and job.checkpoint.step == 3 and job.stage == "validate"
    assert s.in_use("r", 2.0) == frozenset({3})


def test_schema_6_readers_table_becomes_holds(tmp_path: Path) -> None:
    """A state database at schema 6 (holds kept in a table named `readers`) opens at the
    current schema with its hold kept in `holds`: it still keeps its step, is renewed and
    released like one taken after the upgrade."""
    db = sqlite3.connect(tmp_path / "s.db", isolation_level=None)
    for i, script in enumerate(MIGRATIONS[:6]):
        db.executescript(f"BEGIN; {script}; PRAGMA user_version = {i + 1}; COMMIT;")
    db.execute("INSERT INTO readers (root, step, owner, expires) VALUES ('r', 3, 'job', 100.0)")
    db.close()
    s = Store(tmp_path / "s.db")
    assert s.schema_version == len(MIGRATIONS) >= 7
    names = {r[0] for r in sqlite3.connect(tmp_path / "s.db").execute(
        "SELECT name FROM sqlite_master WHERE type='table'")}
    assert "holds" in names and "readers" not in names
    assert s.in_use("r", 50.0) == frozenset({3})
    assert s.in_use("r", 150.0) == frozenset()  # expired by its own time, as before
    s.hold("r", 3, "job", 200.0)  # the same owner renews it: one row, not two
    assert s.in_use("r", 150.0) == frozenset({3})
    rows = sqlite3.connect(tmp_path / "s.db").execute("SELECT count(*) FROM holds").fetchone()
    assert rows[0] == 1
    s.release_hold("r", 3, "job")
    assert s.in_use("r", 0.0) == frozenset()



def test_root_error_is_cleared_by_its_kind_only(store: Store) -> None:
    """A root's last error is set with its kind and cleared only by that kind: a scan that
    went through never clears an upload's failure, whatever the messages say."""
    store.set_root_error("r", RootError.UPLOAD, "scan: looks like a scan's", 1.0)
    store.clear_root_error("r", RootError.SCAN, RootError.UNREADABLE, RootError.ROOT_MISSING)
    assert store.root_info("r")["last_error"] == "scan: looks like a scan's"
    store.clear_root_error("r", *RootError.cleared_by_stage("upload"))
    assert store.root_info("r")["last_error"] == ""
    assert store.root_info("r")["last_error_at"] is None
    store.set_root_error("r", RootError.of_stage("upload", stuck=True), "stuck", 2.0)
    store.clear_root_error("r", RootError.UPLOAD)
    assert store.root_info("r")["last_error"] == "stuck"
    store.clear_root_error("r", *RootError.cleared_by_stage("upload"))
    assert store.root_info("r")["last_error"] == ""


def test_failed_stage_sets_its_kind(store: Store) -> None:
    store.sync_root("r", [found(1)], 1.0)
    job = store.claim("me", 10.0, 60)
    assert job is not None
    store.fail_attempt(job, "me", "validate: OSError: boom", 10.0)
    store.clear_root_error("r", RootError.of_stage("validate", stuck=True))
    assert store.root_info("r")["last_error"] == "validate: OSError: boom"
    store.clear_root_error("r", RootError.of_stage("validate"))
    assert store.root_info("r")["last_error"] == ""


@pytest.mark.parametrize(("message", "kind"), [
    ("validate: stuck: 5 min; set aside", RootError.VALIDATE_STUCK),
    ("upload: OSError: boom", RootError.UPLOAD), ("retention: x", RootError.RETENTION),
    ("scan: x", RootError.SCAN), ("could not read ['a']", RootError.UNREADABLE),
    ("root path /x does not exist", RootError.ROOT_MISSING),
    ("lease: root path /x became a symlink", RootError.LEASE),
])
def test_schema_5_errors_get_their_kind(tmp_path: Path, message: str, kind: RootError) -> None:
    """An error recorded before kinds were kept is cleared by its kind after the upgrade."""
    db = sqlite3.connect(tmp_path / "s.db", isolation_level=None)
    for i, script in enumerate(MIGRATIONS[:5]):
        db.executescript(f"BEGIN; {script}; PRAGMA user_version = {i + 1}; COMMIT;")
    db.execute("INSERT INTO roots (name, last_error, last_error_at) VALUES ('r', ?, 1.0)",
               (message,))
    db.close()
    s = Store(tmp_path / "s.db")
    others = [k for k in RootError if k is not kind]
    s.clear_root_error("r", *others)
    assert s.root_info("r")["last_error"] == message
    s.clear_root_error("r", kind)
    assert s.root_info("r")["last_error"] == ""

def test_pending_then_complete_then_valid(store: Store) -> None:
    ch = store.sync_root("r", [found(5, complete=False)], 1.0)
    assert [c.event for c in ch] == ["checkpoint_discovered"]
    assert store.checkpoint("r", 5).state is State.PENDING  # type: ignore[union-attr]
    assert store.claim("me", 2.0, 60) is None  # pending work is never claimed
    ch = store.sync_root("r", [found(5)], 3.0)
    assert [c.event for c in ch] == ["checkpoint_complete"]
    validate_ok(store)
    rec = store.checkpoint("r", 5)
    assert rec is not None and rec.state is State.VALID and rec.bytes == 5
    assert store.latest("r").step == 5  # type: ignore[union-attr]
    assert [f.hash for f in store.files(rec.id)] == ["h"]


def test_latest_skips_invalid_and_prefers_highest(store: Store) -> None:
    store.sync_root("r", [found(1), found(2), found(3)], 1.0)
    # claim order is newest first
    for valid in (False, True, True):
        validate_ok(store, valid)
    assert [c.state for c in store.checkpoints("r")] == [State.VALID, State.VALID, State.INVALID]
    assert store.latest("r").step == 2  # type: ignore[union-attr]
    assert store.latest("r", Tier.REMOTE) is None


def test_claim_excludes_and_expires(store: Store) -> None:
    store.sync_root("r", [found(1)], 1.0)
    job = store.claim("a", 10.0, 60)
    assert job is not None
    assert store.claim("b", 20.0, 60) is None  # held
    assert store.claim("b", 71.0, 60) is not None  # expired: reclaimed
    # the old owner's result is refused: it lost the claim
    assert not store.finish_validation(job, "a", "fp", ValidationResult(True), 72.0)


def test_release_claims_on_startup(store: Store) -> None:
    store.sync_root("r", [found(1)], 1.0)
    assert store.claim("a", 10.0, 1e9) is not None
    assert store.release_claims() == 1
    assert store.claim("b", 11.0, 60) is not None


def test_resave_supersedes_and_keeps_pin(store: Store) -> None:
    store.sync_root("r", [found(7, fp="one")], 1.0)
    validate_ok(store)
    assert store.set_pinned("r", 7, True)
    ch = store.sync_root("r", [found(7, fp="two")], 5.0)
    assert [c.event for c in ch] == ["checkpoint_superseded"]
    rec = store.checkpoint("r", 7)
    assert rec is not None and rec.state is State.COMPLETE and rec.pinned
    assert store.latest("r") is None  # the re-save is not valid yet


def test_changed_files_refuse_result(store: Store) -> None:
    store.sync_root("r", [found(1, fp="one")], 1.0)
    job = store.claim("me", 2.0, 60)
    assert job is not None
    assert not store.finish_validation(job, "me", "other", ValidationResult(True), 3.0)
    assert store.checkpoint("r", 1).state is State.COMPLETE  # type: ignore[union-attr]


def test_vanished_and_reappeared(store: Store) -> None:
    store.sync_root("r", [found(1), found(2, complete=False)], 1.0)
    ch = store.sync_root("r", [], 2.0)
    assert [c.event for c in ch] == ["checkpoint_vanished"]
    assert store.checkpoint("r", 2) is None  # pending and gone: forgotten
    assert str(store.checkpoint("r", 1).local) == "pruned"  # type: ignore[union-attr]
    ch = store.sync_root("r", [found(1)], 3.0)
    assert [c.event for c in ch] == ["checkpoint_reappeared"]


def test_registration_metrics_merge_and_best(store: Store) -> None:
    store.register("r", 1, [], {"val_loss": 3.0}, 0.0)
    store.sync_root("r", [found(1), found(2, metrics={"val_loss": 1.0}), found(3)], 1.0)
    store.register("r", 3, [], {"val_loss": 2.0}, 1.5)
    for _ in range(3):
        validate_ok(store)
    assert store.checkpoint("r", 1).metrics == {"val_loss": 3.0}  # type: ignore[union-attr]
    assert store.best("r", "val_loss", "min").step == 2  # type: ignore[union-attr]
    assert store.best("r", "val_loss", "max").step == 1  # type: ignore[union-attr]
    assert store.best("r", "", "min") is None


def test_a_multi_node_roots_best_and_latest_are_committed_steps(store: Store) -> None:
    store.sync_root("r", [found(1, metrics={"val_loss": 2.0}),
                          found(2, metrics={"val_loss": 1.0})], 1.0)
    for _ in range(2):
        validate_ok(store, copy=True)
    store.set_policies({"r": Policy(uploads=True, committed_only=True)})
    assert store.best("r", "val_loss", "min") is None and store.latest("r") is None
    uploaded(store, "r", 1)
    store.set_policies({"r": Policy(uploads=True, committed_only=True)})
    assert store.best("r", "val_loss", "min").step == 1  # type: ignore[union-attr]
    assert store.latest("r").step == 1  # type: ignore[union-attr]
    store.set_policies({"r": Policy(uploads=True)})  # one node: step 2 is both
    assert store.best("r", "val_loss", "min").step == 2  # type: ignore[union-attr]


def test_backoff_after_failure(store: Store) -> None:
    store.sync_root("r", [found(1)], 1.0)
    job = store.claim("me", 10.0, 60)
    assert job is not None
    delay = store.fail_attempt(job, "me", "OSError: boom", 10.0)
    assert delay > 0
    assert store.claim("me", 10.0 + delay / 2, 60) is None
    assert store.claim("me", 10.0 + delay, 60) is not None
    assert store.root_info("r")["last_error"] == "OSError: boom"


def test_counts_and_queue(store: Store) -> None:
    store.sync_root("r", [found(1), found(2, complete=False)], 1.0)
    assert store.counts("r") == {"pending": 1, "complete": 1, "valid": 0, "invalid": 0}
    assert store.queue_length("r") == 1


def test_pending_candidate_never_supersedes_a_pruned_row(store: Store) -> None:
    """A registration outlives its files once retention prunes them: the layout then reports
    a pending candidate for that step, which must not replace the valid, uploaded row."""
    store.sync_root("r", [found(4, fp="one")], 1.0)
    validate_ok(store)
    assert store.record("r", 4, Event.PRUNED_LOCAL)
    assert store.sync_root("r", [found(4, fp="gone", complete=False)], 2.0) == []
    rec = store.checkpoint("r", 4)
    assert rec is not None and rec.state is State.VALID
    # a complete new save of the same step does supersede
    ch = store.sync_root("r", [found(4, fp="new")], 3.0)
    assert [c.event for c in ch] == ["checkpoint_superseded"]


def test_two_candidates_of_one_step_do_not_flip(store: Store) -> None:
    """model_step_5.pt and optim_step_5.pt are two single-file candidates of step 5: the
    later one wins once; rescans change nothing (no churn, no lost validation)."""
    a = Found(Candidate("single", 5, "model_step_5.pt", ("model_step_5.pt",), True), "a")
    b = Found(Candidate("single", 5, "optim_step_5.pt", ("optim_step_5.pt",), True), "b")
    store.sync_root("r", [a, b], 1.0)
    validate_ok(store)
    for t in (2.0, 3.0, 4.0):
        assert store.sync_root("r", [a, b], t) == []
    rec = store.checkpoint("r", 5)
    assert rec is not None and rec.state is State.VALID and rec.path == "optim_step_5.pt"


def test_partial_deletion_is_vanishing_not_a_resave(store: Store) -> None:
    """A scan that lands halfway through `rm -rf step-9/` sees fewer files: the row is marked
    gone, keeping its pin and remote copy, rather than replaced by a pending newcomer."""
    files = ("step-9/a.pt", "step-9/b.pt", "step-9/meta.json")
    store.sync_root("r", [Found(Candidate("native", 9, "step-9", files, True), "fp")], 1.0)
    validate_ok(store, copy=True)
    store.set_pinned("r", 9, True)
    uploaded(store, "r", 9)
    half = Found(Candidate("native", 9, "step-9", files[:1], False), "half")
    ch = store.sync_root("r", [half], 2.0)
    assert [c.event for c in ch] == ["checkpoint_vanished"]
    rec = store.checkpoint("r", 9)
    assert rec is not None and rec.state is State.VALID and rec.pinned
    assert rec.local is Local.PRUNED and rec.remote is Remote.UPLOADED
    assert store.latest("r").step == 9  # type: ignore[union-attr]  # still had remotely


def test_unreadable_walk_marks_nothing_gone(store: Store) -> None:
    store.sync_root("r", [found(1)], 1.0)
    validate_ok(store)
    assert store.sync_root("r", [], 2.0, unreadable=frozenset({""})) == []
    assert store.checkpoint("r", 1).local is Local.PRESENT  # type: ignore[union-attr]
    # an unreadable directory elsewhere does not hide a real deletion
    ch = store.sync_root("r", [], 3.0, unreadable=frozenset({"lost+found"}))
    assert [c.event for c in ch] == ["checkpoint_vanished"]


def test_flush_restricts_uploads_but_never_validation(store: Store) -> None:
    store.sync_root("r", [found(1), found(2)], 1.0)
    validate_ok(store)  # step 2 (newest first) becomes valid
    only = frozenset({("r", 7)})
    store.set_policies({"r": Policy(uploads=True)})
    job = store.claim("w", 5.0, 60, only=only)
    assert job is not None and job.stage == "validate" and job.checkpoint.step == 1


def test_claims_are_per_token(store: Store) -> None:
    store.sync_root("r", [found(1)], 1.0)
    job = store.claim("pid/w0/aaa", 2.0, 60)
    assert job is not None and job.owner == "pid/w0/aaa"
    assert not store.finish_validation(job, "pid/w1/bbb", "fp", ValidationResult(True), 3.0)
    assert store.finish_validation(job, job.owner, "fp", ValidationResult(True), 3.0)


def test_remote_replacement_only_after_our_own_superseded_upload(store: Store) -> None:
    store.sync_root("r", [found(3, fp="one")], 1.0)
    validate_ok(store, copy=True)
    assert not store.replaced_upload("r", 3)  # never re-saved: someone else's remote step
    uploaded(store, "r", 3)
    store.sync_root("r", [found(3, fp="two")], 2.0)  # a re-save of an uploaded step
    assert store.replaced_upload("r", 3)


def test_lost_copy_of_a_compressed_row_means_no_local_copy(store: Store) -> None:
    store.sync_root("r", [found(2)], 1.0)
    validate_ok(store, copy=True)
    assert store.record("r", 2, Event.COMPRESSED_LOCAL)
    assert store.claim("w", 3.0, 60) is None  # the root does not upload: nothing to do
    store.set_policies({"r": Policy(uploads=True)})
    job = store.claim("w", 3.0, 60)
    assert job is not None and job.stage == "upload"
    store.copy_lost(job, job.owner)
    rec = store.checkpoint("r", 2)
    assert rec is not None and rec.local is Local.PRUNED and rec.remote is Remote.NONE
