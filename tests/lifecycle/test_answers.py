"""The domain answers (`ckptd.lifecycle.answers`): latest, best, committed, as tables of plain
records; and the store's answers agreeing with them on a real SQLite store.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from ckptd.lifecycle import answers
from ckptd.lifecycle.answers import MetricMode
from ckptd.lifecycle.table import STATUSES, Event, Policy, Status
from ckptd.model import Candidate, FileRecord, Local, Remote, State, Tier, ValidationResult
from ckptd.remote.manifest import Manifest, StoredFile
from ckptd.store import Found, Store

V, P, BAD = State.VALID, State.PENDING, State.INVALID
PRESENT, COMPRESSED, PRUNED = Local.PRESENT, Local.COMPRESSED, Local.PRUNED
NONE, UPLOADING, UPLOADED, GONE = Remote.NONE, Remote.UPLOADING, Remote.UPLOADED, Remote.PRUNED


@dataclass(frozen=True)
class Rec:
    step: int
    state: State = V
    local: Local = PRESENT
    remote: Remote = NONE
    metrics: dict[str, float] = field(default_factory=dict)


def loss(r: Rec) -> float | None:
    return r.metrics.get("loss")


def steps(rs: list[Rec] | None) -> list[int] | None:
    return None if rs is None else [r.step for r in rs]


# -- committed and tiers -----------------------------------------------------------------------


@pytest.mark.parametrize("remote,committed", [
    (NONE, False), (UPLOADING, False), (UPLOADED, True), (GONE, False)])
def test_committed_is_an_uploaded_remote_copy(remote: Remote, committed: bool) -> None:
    assert answers.is_committed(Rec(1, remote=remote)) is committed


@pytest.mark.parametrize("local,remote,any_,local_,remote_", [
    (PRESENT, NONE, True, True, False),
    (COMPRESSED, NONE, True, True, False),
    (PRUNED, NONE, False, False, False),
    (PRUNED, UPLOADING, False, False, False),
    (PRUNED, UPLOADED, True, False, True),
    (PRESENT, UPLOADED, True, True, True),
    (PRUNED, GONE, False, False, False),
])
def test_tiers(local: Local, remote: Remote, any_: bool, local_: bool, remote_: bool) -> None:
    r = Rec(1, local=local, remote=remote)
    assert [answers.in_tier(r, t) for t in (Tier.ANY, Tier.LOCAL, Tier.REMOTE)] == [
        any_, local_, remote_]


# -- latest ------------------------------------------------------------------------------------

MIXED = [
    Rec(100, remote=UPLOADED),
    Rec(200, local=PRUNED, remote=UPLOADED),
    Rec(300, local=COMPRESSED),
    Rec(400, state=BAD),
    Rec(500, state=P),
    Rec(600, local=PRUNED, remote=UPLOADING),
    Rec(50, local=PRUNED, remote=GONE),
]


@pytest.mark.parametrize("records,tier,committed_only,expected", [
    ([], Tier.ANY, False, None),
    (MIXED, Tier.ANY, False, 300),
    (MIXED, Tier.LOCAL, False, 300),
    (MIXED, Tier.REMOTE, False, 200),
    (MIXED, Tier.ANY, True, 200),  # multi-node: only a committed step is latest
    (MIXED, Tier.LOCAL, True, 100),  # ... and on disk
    (MIXED, Tier.REMOTE, True, 200),
    ([Rec(7, state=BAD), Rec(8, state=P)], Tier.ANY, False, None),
    ([Rec(9, local=PRUNED, remote=UPLOADING)], Tier.ANY, False, None),
    ([Rec(3), Rec(1), Rec(2)], Tier.LOCAL, False, 3),  # any order in
])
def test_latest(records: list[Rec], tier: Tier, committed_only: bool,
                expected: int | None) -> None:
    got = answers.latest(records, tier, committed_only)
    assert (got.step if got else None) == expected


# -- best --------------------------------------------------------------------------------------


def m(step: int, value: float, **kw: object) -> Rec:
    return Rec(step, metrics={"loss": value}, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("records,mode,committed_only,expected", [
    ([], "min", False, []),
    ([m(1, 0.5), m(2, 0.3), m(3, 0.4)], "min", False, [2, 3, 1]),
    ([m(1, 0.5), m(2, 0.3), m(3, 0.4)], "max", False, [1, 3, 2]),
    ([m(1, 0.3), m(2, 0.3)], "min", False, [2, 1]),  # a tie: the newer step first
    ([m(1, 0.3), m(2, 0.3)], "max", False, [2, 1]),
    ([m(1, math.nan), m(2, math.inf), m(3, -math.inf), m(4, 0.9)], "min", False, [4]),
    ([Rec(1), m(2, 0.9)], "min", False, [2]),  # no metric: not ranked
    ([m(1, 0.1, state=BAD), m(2, 0.2, state=P), m(3, 0.3)], "min", False, [3]),
    ([m(1, 0.1, local=PRUNED, remote=GONE), m(2, 0.2, local=PRUNED, remote=UPLOADING),
      m(3, 0.3, local=PRUNED, remote=UPLOADED), m(4, 0.4, local=COMPRESSED)],
     "min", False, [3, 4]),  # only a step with a copy somewhere
    ([m(1, 0.1), m(2, 0.2, remote=UPLOADED)], "min", True, [2]),  # multi-node: committed
])
def test_ranked_and_best(records: list[Rec], mode: MetricMode, committed_only: bool,
                         expected: list[int]) -> None:
    assert steps(answers.ranked(records, loss, mode, committed_only)) == expected
    got = answers.best(records, loss, mode, committed_only)
    assert (got.step if got else None) == (expected[0] if expected else None)


def test_ranked_within_a_tier() -> None:
    records = [m(1, 0.1, local=PRUNED, remote=UPLOADED), m(2, 0.2), m(3, 0.3, remote=UPLOADED)]
    assert steps(answers.ranked(records, loss, "min", False, Tier.LOCAL)) == [2, 3]
    assert steps(answers.ranked(records, loss, "min", False, Tier.REMOTE)) == [1, 3]


def test_a_bad_mode_is_refused() -> None:
    with pytest.raises(ValueError, match="metric_mode"):
        answers.ranked([], loss, "median", False)  # type: ignore[arg-type]


@pytest.mark.parametrize("value,expected", [
    (1, 1.0), (0.5, 0.5), (math.nan, None), (math.inf, None), (None, None), (True, None),
    ("0.5", None)])
def test_finite(value: object, expected: float | None) -> None:
    assert answers.finite(value) == expected  # type: ignore[arg-type]


# -- the store answers with the same functions ---------------------------------------------------


def _store_with_every_status(tmp_path: Path) -> Store:
    """A real store whose root 'r' holds a step in each status a row reaches through the
    table: on disk, compressed, invalid, pending, uploading, uploaded, pruned either side,
    and one known only remotely."""
    store = Store(tmp_path / "state.db")
    cands = [Candidate("single", s, f"{s}.pt", (f"{s}.pt",), s != 5,
                       metrics={"loss": 1.0 / s}) for s in range(1, 10)]
    store.sync_root("r", [Found(c, "fp") for c in cands], 1.0)
    while (job := store.claim("v", 2.0, 60)) is not None:
        f = job.files[0]
        res = ValidationResult(job.checkpoint.step != 4, "crc_mismatch", "",
                               files=(FileRecord(f, 5, "h", "xxh3-128"),))
        stored = [StoredFile(f, 5, "h", "xxh3-128", "zstd", 3, f + ".zst")]
        assert store.finish_validation(job, "v", job.checkpoint.fingerprint, res, 2.0, stored)
    store.set_policies({"r": Policy(uploads=True)})
    for s in (1, 2, 6, 7):
        job = store.claim("u", 3.0, 60, only=frozenset({("r", s)}))
        assert job is not None and job.stage == "upload"
        if s != 6:  # step 6 stays uploading
            assert store.finish_upload(job, "u", 3.0)
    for s, event in ((1, Event.PRUNED_LOCAL), (3, Event.COMPRESSED_LOCAL),
                     (7, Event.PRUNED_REMOTE), (7, Event.PRUNED_LOCAL)):
        assert store.record("r", s, event), (s, event)
    files = (StoredFile("x.pt", 5, "h", "xxh3-128", "zstd", 3, "x.pt.zst"),)
    assert store.add_remote_only("r", Manifest("r", 20, "single", files,
                                               metrics={"loss": 0.01}), 4.0)
    return store


def test_the_store_answers_with_these_functions(tmp_path: Path) -> None:
    store = _store_with_every_status(tmp_path)
    records = store.checkpoints("r")
    seen = {(r.state, r.local, r.remote) for r in records}
    assert {(V, PRUNED, UPLOADED), (V, COMPRESSED, NONE), (BAD, PRESENT, NONE),
            (P, PRESENT, NONE), (V, PRESENT, UPLOADING), (V, PRESENT, UPLOADED),
            (V, PRUNED, GONE), (V, PRESENT, NONE)} <= seen, seen
    for committed_only in (False, True):
        store.set_policies({"r": Policy(uploads=True, committed_only=committed_only)})
        modes: tuple[MetricMode, ...] = ("min", "max")
        for tier, mode in itertools.product(Tier, modes):
            want = answers.latest(records, tier, committed_only)
            assert store.latest("r", tier) == want, (tier, committed_only)
            best = answers.best(records, lambda r: r.metrics.get("loss"), mode, committed_only)
            assert store.best("r", "loss", mode) == best, (mode, committed_only)
    store.close()


@pytest.mark.parametrize("remote_only", [0, 1, 8, 9, 72, 73, 100])
def test_the_stores_latest_reads_back_past_newer_rows(tmp_path: Path, remote_only: int) -> None:
    """Steps known only remotely, newer than the one on disk: the store asks its rows a page
    at a time, newest first, and still finds the local tier's latest behind all of them."""
    store = Store(tmp_path / "state.db")
    store.sync_root("r", [Found(Candidate("single", 1, "1.pt", ("1.pt",), True), "fp")], 1.0)
    job = store.claim("v", 2.0, 60)
    assert job is not None
    assert store.finish_validation(job, "v", job.checkpoint.fingerprint, ValidationResult(
        True, files=(FileRecord("1.pt", 5, "h", "xxh3-128"),)), 2.0)
    files = (StoredFile("x.pt", 5, "h", "xxh3-128", "zstd", 3, "x.pt.zst"),)
    for s in range(2, 2 + remote_only):
        assert store.add_remote_only("r", Manifest("r", s, "single", files), 3.0)
    records = store.checkpoints("r")
    for tier in Tier:
        assert store.latest("r", tier) == answers.latest(records, tier, False)
    latest_local = store.latest("r", Tier.LOCAL)
    assert latest_local is not None and latest_local.step == 1
    store.close()


# -- one rule each: the other places ask these ------------------------------------------------

@pytest.mark.parametrize("status", STATUSES, ids=str)
def test_store_prefilter_is_in_tier_any(status: Status) -> None:
    """The store's SQL pre-filter keeps exactly the valid rows `in_tier(ANY)` says have a
    copy: for every status a row may have."""
    import sqlite3

    from ckptd.store.reads import ANSWERABLE

    db = sqlite3.connect(":memory:")
    db.execute("CREATE TABLE c (state TEXT, local TEXT, remote TEXT)")
    db.execute("INSERT INTO c VALUES (?,?,?)", (status.state, status.local, status.remote))
    kept = bool(db.execute(f"SELECT COUNT(*) FROM c WHERE {ANSWERABLE}").fetchone()[0])  # noqa: S608
    assert kept == (status.state is V and answers.in_tier(status, Tier.ANY))


@pytest.mark.parametrize(("local", "remote", "keeps", "needed"), [
    (PRESENT, NONE, False, ("not_uploaded",)), (PRESENT, UPLOADING, False, ("not_uploaded",)),
    (PRESENT, UPLOADED, False, ()), (PRESENT, UPLOADED, True, ("compress_older",)),
    (PRESENT, GONE, True, ("not_uploaded", "compress_older")),
    (COMPRESSED, UPLOADED, False, ("local",)), (PRUNED, NONE, True, ()),
])
def test_copy_needed_by(local: Local, remote: Remote, keeps: bool,
                        needed: tuple[str, ...]) -> None:
    assert answers.copy_needed_by(Rec(1, local=local, remote=remote), keeps) == needed


@pytest.mark.parametrize("status", [s for s in STATUSES if s.copy], ids=str)
@pytest.mark.parametrize("keeps", [False, True])
def test_planner_releases_a_copy_by_the_one_rule(status: Status, keeps: bool) -> None:
    """The retention plan deletes a copy exactly where `answers.copy_needed_by` (the rule the
    effects apply after an upload) names nothing that needs it (no reader holds it here)."""
    from ckptd.retention import planner

    v = planner.CheckpointView(step=1, state=status.state, local=status.local,
                               remote=status.remote, completed=0.0, bytes=1, copy=True)
    d = planner._copy_decision(v, planner.Action.KEEP, keeps)
    needed = answers.copy_needed_by(status, keeps)
    assert (d.action is planner.Action.DELETE) == (not needed)
    if status.local is PRESENT:
        assert tuple(str(t) for t in d.tags) == (needed or ("released",))


@pytest.mark.parametrize(("steps_", "usable", "want"), [
    ([], None, None), ([3, 1, 2], None, 3), ([3, 1, 2], {1, 2}, 2), ([5, 5, 4], {4}, 4),
    ([2, 1], set(), None),
])
def test_newest(steps_: list[int], usable: set[int] | None, want: int | None) -> None:
    if usable is None:
        assert answers.newest(steps_) == want
    else:
        assert answers.newest(steps_, usable.__contains__) == want


def test_newest_asks_from_the_top_only_until_one_passes() -> None:
    asked: list[int] = []
    assert answers.newest([1, 4, 2, 3], lambda n: asked.append(n) or n <= 3) == 3
    assert asked == [4, 3]


@pytest.mark.parametrize(("doc", "local", "remote"), [
    ({"local": "present", "remote": "uploaded"}, PRESENT, UPLOADED),
    ({"local": "compressed"}, COMPRESSED, NONE),
    ({"local": ["x"], "remote": "later"}, PRUNED, NONE),
])
def test_where_of_a_document(doc: dict[str, object], local: Local, remote: Remote) -> None:
    assert answers.where_of(doc) == answers.Where(local, remote)


@pytest.mark.parametrize("remote", list(Remote))
def test_committed_and_was_committed(remote: Remote) -> None:
    r = Rec(1, remote=remote)
    assert answers.is_committed(r) == (remote is UPLOADED)
    assert answers.was_committed(r) == (remote in (UPLOADED, GONE))
    assert answers.is_committed(answers.where_of({"remote": remote.value})) == (remote is UPLOADED)
