"""The lifecycle table: every (status, event) pair is a transition or an explicit refusal, every
status is reachable and keeps its invariants, and the store persists exactly what it decides."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from ckptd.lifecycle.table import (
    COMPLETE,
    NEW,
    PENDING,
    STATUSES,
    TABLE,
    Effect,
    Event,
    Policy,
    Refusal,
    Refused,
    Row,
    Sighting,
    Stage,
    Stall,
    Status,
    Transition,
    as_markdown,
    classify,
    gives_up,
    next_stage,
    transition,
)
from ckptd.model import Candidate, FileRecord, Local, Reason, Remote, State, ValidationResult
from ckptd.remote.manifest import StoredFile
from ckptd.store import Found, Store

SOURCES = (NEW, *STATUSES)
ALL_COMBOS = [Status(*c) for c in itertools.product(State, Local, Remote, (False, True))]


def S(state: str, local: str = "present", remote: str = "none", copy: bool = False) -> Status:
    return Status(State(state), Local(local), Remote(remote), copy)


@pytest.mark.parametrize(("source", "event"), list(itertools.product(SOURCES, Event)),
                         ids=lambda x: str(x) if x is not None else "new")
def test_every_pair_is_a_transition_or_an_explicit_refusal(source: Status | None,
                                                           event: Event) -> None:
    outcome = TABLE[(source, event)]
    if isinstance(outcome, Refusal):
        assert outcome.reason  # a refusal says why
        with pytest.raises(Refused):
            transition(source, event)
        return
    assert isinstance(outcome, Transition)
    if outcome.row in (Row.KEEP, Row.NEW):
        assert outcome.to in STATUSES  # never leads outside the invariants
    else:
        assert outcome.to is None
    assert (outcome.row is Row.NEW) == (source is None)


def test_the_table_covers_exactly_the_statuses_and_events() -> None:
    assert set(TABLE) == set(itertools.product(SOURCES, Event))
    assert len(STATUSES) < len(ALL_COMBOS)  # the invariants rule some combinations out
    assert PENDING in STATUSES and COMPLETE in STATUSES


def test_every_status_is_reachable_from_a_first_sighting() -> None:
    seen: set[Status] = set()
    frontier: list[Status | None] = [NEW]
    while frontier:
        source = frontier.pop()
        for e in Event:
            out = TABLE[(source, e)]
            if isinstance(out, Transition) and out.to is not None and out.to not in seen:
                seen.add(out.to)
                frontier.append(out.to)
    assert seen == set(STATUSES)


@pytest.mark.parametrize("source", [s for s in STATUSES if s.state is not State.PENDING],
                         ids=str)
def test_a_resave_supersedes_from_every_judged_status(source: Status) -> None:
    """compressed, uploading, pruned, invalid, remote-only: a new save is a new save."""
    t = transition(source, Event.RESAVED)
    assert t.row is Row.SUPERSEDE and Effect.PUBLISH in t.effects


def test_a_pending_save_is_re_read_not_superseded() -> None:
    assert transition(PENDING, Event.FOUND_PENDING).to == PENDING
    assert transition(PENDING, Event.FOUND_COMPLETE).to == COMPLETE
    assert transition(PENDING, Event.VANISHED).row is Row.DELETE
    with pytest.raises(Refused):
        transition(PENDING, Event.RESAVED)


@pytest.mark.parametrize("source", STATUSES, ids=str)
def test_invalid_never_becomes_valid_nor_uploaded(source: Status) -> None:
    if source.state is not State.INVALID:
        return
    for e in Event:
        out = TABLE[(source, e)]
        if isinstance(out, Transition) and out.to is not None:
            assert out.to.state is State.INVALID
            assert out.to.remote is Remote.NONE and not out.to.copy


@pytest.mark.parametrize("source", STATUSES, ids=str)
def test_only_an_upload_of_a_copy_reaches_uploaded(source: Status) -> None:
    for e in Event:
        out = TABLE[(source, e)]
        if (isinstance(out, Transition) and out.to is not None
                and out.to.remote is Remote.UPLOADED and source.remote is not Remote.UPLOADED):
            assert e is Event.UPLOADED and source.copy


@pytest.mark.parametrize("source", STATUSES, ids=str)
def test_a_compressed_copy_is_never_silently_lost(source: Status) -> None:
    """Leaving `compressed` without its copy happens only when it is lost or pruned."""
    if source.local is not Local.COMPRESSED:
        return
    for e in Event:
        out = TABLE[(source, e)]
        if isinstance(out, Transition) and out.to is not None and not out.to.copy:
            assert e in (Event.COPY_LOST, Event.PRUNED_LOCAL)


def test_removing_a_copy_is_an_effect_of_exactly_the_transitions_that_drop_it() -> None:
    for (source, e), out in TABLE.items():
        if not isinstance(out, Transition) or out.to is None or source is None:
            continue
        if Effect.REMOVE_COPY in out.effects:
            assert source.copy and not out.to.copy and e is Event.PRUNED_LOCAL
        if Effect.RELEASE_COPY in out.effects:
            assert e is Event.UPLOADED


@pytest.mark.parametrize(("status", "policy", "stage"), [
    (PENDING, Policy(True, True), None),
    (COMPLETE, Policy(), Stage.VALIDATE),
    (S("complete", "pruned"), Policy(True), None),
    (S("valid"), Policy(), None),
    (S("valid"), Policy(uploads=True), Stage.COMPRESS),
    (S("valid"), Policy(keeps_copies=True), Stage.COMPRESS),
    (S("valid", copy=True), Policy(keeps_copies=True), None),
    (S("valid", copy=True), Policy(uploads=True), Stage.UPLOAD),
    (S("valid", remote="uploading", copy=True), Policy(uploads=True), Stage.UPLOAD),
    (S("valid", remote="uploaded", copy=True), Policy(uploads=True), None),
    (S("valid", "compressed", copy=True), Policy(uploads=True), Stage.UPLOAD),
    (S("valid", "pruned", copy=True), Policy(uploads=True), Stage.UPLOAD),
    (S("valid", "pruned"), Policy(uploads=True), None),
    (S("invalid"), Policy(True, True), None),
])
def test_next_stage(status: Status, policy: Policy, stage: Stage | None) -> None:
    assert next_stage(status, policy) is stage


def _seen(complete: bool = True, same: bool = False, fewer: bool = False,
          same_path: bool = True, fresh: bool = False) -> Sighting:
    return Sighting(complete=complete, same_save=same, fewer_files=fewer, same_path=same_path,
                    fresh=fresh)


@pytest.mark.parametrize(("status", "seen", "event"), [
    (NEW, _seen(False), Event.FOUND_PENDING),
    (NEW, _seen(), Event.FOUND_COMPLETE),
    (PENDING, _seen(), Event.FOUND_COMPLETE),
    (S("valid"), _seen(same=True), None),
    (S("valid", "pruned", "uploaded"), _seen(same=True), Event.REAPPEARED),
    (S("valid"), _seen(), Event.RESAVED),
    (S("valid", "compressed", copy=True), _seen(), Event.RESAVED),
    (S("valid", "compressed", copy=True), _seen(same_path=False), None),
    (S("valid", "pruned", "uploaded"), _seen(False), None),  # a stale registration
    (S("valid"), _seen(False, fewer=True), Event.VANISHED),  # rm -rf caught halfway
    (S("valid", "pruned"), _seen(fewer=True), None),  # untouched leftovers of a delete
    (S("valid", "pruned"), _seen(fewer=True, fresh=True), Event.RESAVED),  # a new, smaller save
    (S("valid", "pruned"), _seen(False, fewer=True, fresh=True), None),  # not complete yet
    (S("invalid"), _seen(), Event.RESAVED),
])
def test_classify_a_scan_sighting(status: Status | None, seen: Sighting,
                                  event: Event | None) -> None:
    assert classify(status, seen) is event


def test_design_doc_shows_the_table_as_it_is() -> None:
    doc = (Path(__file__).parents[2] / "docs" / "DESIGN.md").read_text()
    assert as_markdown() in doc, "regenerate: python -m ckptd.lifecycle.table > table.md"


# -- the store persists what the table decides ------------------------------------------------


def _valid_with_copy(store: Store, step: int, now: float = 2.0) -> None:
    files = (f"step-{step}/a.pt",)
    store.sync_root("r", [Found(Candidate("native", step, f"step-{step}", files, True),
                                f"fp{step}")], now)
    job = store.claim("w", now, 60)
    assert job is not None
    res = ValidationResult(True, files=(FileRecord(files[0], 5, "h", "xxh3-128"),))
    copy = [StoredFile(files[0], 5, "h", "xxh3-128", "zstd", 3, files[0] + ".zst")]
    assert store.finish_validation(job, "w", job.checkpoint.fingerprint, res, now, stored=copy)


def test_resave_of_a_compressed_step_supersedes_it(tmp_path: Path) -> None:
    """A re-save of a step kept only as a compressed copy once killed the scan thread."""
    applied = []
    store = Store(tmp_path / "s.db", on_commit=applied.extend)
    _valid_with_copy(store, 4)
    assert store.record("r", 4, Event.COMPRESSED_LOCAL)
    files = ("step-4/a.pt", "step-4/b.pt")
    ch = store.sync_root("r", [Found(Candidate("native", 4, "step-4", files, True), "new")], 5.0)
    assert [c.event for c in ch] == ["checkpoint_superseded"]
    assert store.status("r", 4) == COMPLETE
    assert [a.event for a in applied][-2:] == [Event.RESAVED, Event.FOUND_COMPLETE]
    log = store.transitions("r", 4)
    assert [e for e, _, _ in log] == ["found_complete", "validated", "copy_made",
                                      "compressed_local", "resaved", "found_complete"]


def test_a_refused_event_writes_nothing_and_hooks_nothing(tmp_path: Path) -> None:
    applied = []
    store = Store(tmp_path / "s.db", on_commit=applied.extend)
    store.sync_root("r", [Found(Candidate("single", 1, "a.pt", ("a.pt",), True), "fp")], 1.0)
    before = (store.status("r", 1), len(applied), store.transitions("r", 1))
    assert not store.record("r", 1, Event.UPLOADED)  # not even validated
    assert not store.record("r", 1, Event.PRUNED_REMOTE)
    assert (store.status("r", 1), len(applied), store.transitions("r", 1)) == before


def test_the_hook_runs_after_commit_with_the_table_effects(tmp_path: Path) -> None:
    seen: list[tuple[Event, Status | None, bool]] = []
    store = Store(tmp_path / "s.db")

    def hook(applied: object) -> None:
        for a in applied:  # type: ignore[attr-defined]
            # after commit: a fresh read already sees the new status
            seen.append((a.event, store.status(a.root, a.step), Effect.PUBLISH in a.effects))

    store.set_on_commit(hook)
    _valid_with_copy(store, 7)
    assert seen[-2:] == [(Event.VALIDATED, S("valid", copy=True), True),
                         (Event.COPY_MADE, S("valid", copy=True), True)]


def test_policies_decide_the_stage_and_a_reload_recomputes_it(tmp_path: Path) -> None:
    store = Store(tmp_path / "s.db")
    _valid_with_copy(store, 3)
    assert store.claim("w", 3.0, 60) is None and store.queue_length("r") == 0
    store.set_policies({"r": Policy(uploads=True)})
    assert store.queue_length("r") == 1
    job = store.claim("w", 3.0, 60)
    assert job is not None and job.stage == "upload"
    assert store.status("r", 3) == S("valid", remote="uploading", copy=True)


@pytest.mark.parametrize("source", SOURCES, ids=str)
def test_giving_up_is_the_tables_gave_up(source: Status | None) -> None:
    """A stalled save is given up exactly where the table allows GAVE_UP, once the timeout has
    passed, with the reason its typed cause names."""
    late, early = Stall(idle=10.0, truncated=False), Stall(idle=9.9, truncated=True)
    assert gives_up(source, early, 10.0) is None
    allowed = source is not None and isinstance(TABLE[(source, Event.GAVE_UP)], Transition)
    assert gives_up(source, late, 10.0) == (Reason.MISSING_FILE if allowed else None)
    short = Stall(idle=10.0, truncated=True)
    assert gives_up(source, short, 10.0) == (Reason.TRUNCATED if allowed else None)


@pytest.mark.parametrize(("uploads", "multi_node", "early"),
                         [(False, False, False), (True, False, True), (True, True, False),
                          (False, True, False)])
def test_sending_early_is_the_policys(uploads: bool, multi_node: bool, early: bool) -> None:
    """Whether validation sends objects ahead of the upload: one rule, read from the config in
    one place (the validate runner and the validate job both ask it)."""
    from ckptd.config import RootConfig
    from ckptd.lifecycle.policy import policy_of

    root = RootConfig.model_validate({
        "name": "r", "path": "/nonexistent", "nodes": 2 if multi_node else 1,
        **({"upload": {"url": "file:///nonexistent"}} if uploads else {})})
    policy = policy_of(root)
    assert (policy.uploads, policy.committed_only) == (uploads, multi_node)
    assert policy.sends_early is early
