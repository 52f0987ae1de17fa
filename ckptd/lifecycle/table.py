"""The checkpoint lifecycle as data: statuses, events, effects and one pure transition table.

Owns which (status, event) pairs are allowed, what each leads to and which consequences follow,
and which stage a checkpoint needs next. Pure: imports only `ckptd.model`; no I/O, clock or SQL.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace
from enum import StrEnum

from ckptd.errors import Signal
from ckptd.model import Local, Reason, Remote, State


@dataclass(frozen=True, order=True)
class Status:
    """Where one checkpoint stands: the three words users see, and whether ckptd holds a
    verified local compressed copy of it (the input of the upload stage)."""

    state: State
    local: Local
    remote: Remote
    copy: bool = False

    def __str__(self) -> str:
        return f"{self.state}/{self.local}/{self.remote}" + ("+copy" if self.copy else "")


class Row(StrEnum):
    """What happens to the row itself, besides its status."""

    NEW = "new"  # no row yet (the source of a first sighting)
    KEEP = "keep"  # the row moves to the transition's status
    SUPERSEDE = "supersede"  # a later save replaces it: kept as history, never acted on again
    DELETE = "delete"  # forgotten (a pending save that vanished: nothing worth keeping)


class Event(StrEnum):
    """Everything that can happen to a checkpoint, named by who observes it."""

    FOUND_PENDING = "found_pending"  # scan: files of a save that is not complete yet
    FOUND_COMPLETE = "found_complete"  # scan: the save is complete by its layout's rule
    GAVE_UP = "gave_up"  # scan: incomplete, and nothing changed for the root's pending_timeout
    RESAVED = "resaved"  # scan: a known step holds a different save now
    VANISHED = "vanished"  # scan: the files are gone (or a delete was caught halfway)
    REAPPEARED = "reappeared"  # scan: the very same files are back (a scan raced a rename)
    REGISTERED = "registered"  # api: a client registered the save (metrics, paths)
    VALIDATED = "validated"  # validate stage: every check passed, files fsynced
    REJECTED = "rejected"  # validate stage: a check failed (reason recorded)
    DAMAGED = "damaged"  # a later read pass proved a once-valid checkpoint damaged
    COPY_MADE = "copy_made"  # validate/compress stage: the local compressed copy is installed
    COPY_LOST = "copy_lost"  # upload stage: the copy is missing or not this save's content
    COPY_DROPPED = "copy_dropped"  # after upload: the copy is not needed locally any more
    UPLOAD_STARTED = "upload_started"  # upload stage claimed
    UPLOADED = "uploaded"  # upload stage: manifest committed, every object verified
    REMOTE_FOUND = "remote_found"  # discovery: committed remotely, unknown here
    REMOTE_LOST = "remote_lost"  # discovery: a step recorded uploaded has no manifest any more
    PRUNED_LOCAL = "pruned_local"  # retention deleted the local copy
    COMPRESSED_LOCAL = "compressed_local"  # retention keeps only the compressed copy locally
    COMPRESS_UNDONE = "compress_undone"  # compress-in-place failed: the originals stay
    PRUNED_REMOTE = "pruned_remote"  # retention deleted the remote copy


class Effect(StrEnum):
    """Consequences performed after the transition commits, by `service.effects` only."""

    PUBLISH = "publish"  # recompute latest; rewrite <root>/.ckptd/latest.json if it differs
    NOTIFY = "notify"  # wake long-polls (`wait`) and status watchers
    WAKE_WORKERS = "wake_workers"  # a stage may have become due
    WAKE_RETENTION = "wake_retention"  # the retention plan may have changed
    WAKE_SCAN = "wake_scan"  # look at the root again soon
    REMOVE_COPY = "remove_copy"  # delete the local compressed copy's files
    RELEASE_COPY = "release_copy"  # drop the copy unless retention keeps compressed copies
    # This save of the step will never commit (superseded before any upload began, or judged
    # damaged): the objects it sent ahead go to the executor (`discard_early`).
    DISCARD_EARLY = "discard_early"


class Stage(StrEnum):
    VALIDATE = "validate"
    COMPRESS = "compress"
    UPLOAD = "upload"


# Claim order: the resume point moves first, then copies, then uploads.
STAGE_PRIORITY = {Stage.VALIDATE: 0, Stage.COMPRESS: 1, Stage.UPLOAD: 2}


@dataclass(frozen=True)
class Policy:
    """What a root asks of its checkpoints beyond validation (a slice of its config)."""

    uploads: bool = False
    keeps_copies: bool = False  # retention.local.compress_older
    # A multi-node root: a step is latest only once committed (remote uploaded).
    committed_only: bool = False

    @property
    def wants_copy(self) -> bool:
        return self.uploads or self.keeps_copies

    @property
    def sends_early(self) -> bool:
        """Objects go to the bucket while validation reads the files (`stages.sending.early`): only
        where a single node uploads; a multi-node step's parts are the upload stage's."""
        return self.uploads and not self.committed_only


@dataclass(frozen=True)
class Transition:
    row: Row
    to: Status | None  # None with Row.DELETE / Row.SUPERSEDE
    effects: frozenset[Effect]


@dataclass(frozen=True)
class Refusal:
    reason: str


Outcome = Transition | Refusal


class Refused(Signal):
    """A (status, event) pair the table refuses; the caller records nothing."""

    def __init__(self, source: Status | None, event: Event, reason: str) -> None:
        super().__init__(f"{event} refused from {source or 'new'}: {reason}")
        self.source, self.event, self.reason = source, event, reason


NEW: Status | None = None  # the source of events that create a row

PENDING = Status(State.PENDING, Local.PRESENT, Remote.NONE)
COMPLETE = Status(State.COMPLETE, Local.PRESENT, Remote.NONE)

_CHANGED = frozenset({Effect.PUBLISH, Effect.NOTIFY, Effect.WAKE_WORKERS})
_JUDGED = frozenset({Effect.PUBLISH, Effect.NOTIFY, Effect.WAKE_WORKERS, Effect.WAKE_RETENTION})


def _valid_status(s: Status) -> bool:
    """The invariants every stored status keeps."""
    if s.state is State.PENDING:
        return s == PENDING  # a pending save that vanishes is forgotten, not kept as pruned
    if s.state is State.COMPLETE:
        return s.remote is Remote.NONE and not s.copy and s.local is not Local.COMPRESSED
    if s.copy or s.local is Local.COMPRESSED:
        # Only a valid checkpoint has a compressed copy; compressed in place means the copy
        # is all there is locally.
        return s.state is State.VALID and s.copy
    if s.state is State.INVALID:
        return s.remote is Remote.NONE  # never uploaded; damage found later ends an upload
    return True


# Every status a stored row may have.
STATUSES: tuple[Status, ...] = tuple(
    s for s in (Status(st, lo, re, cp) for st, lo, re, cp in
                itertools.product(State, Local, Remote, (False, True)))
    if _valid_status(s))


def _rule(s: Status | None, e: Event) -> Outcome:  # noqa: C901 - one case per event, flat
    """The definition of the table: what event `e` does to a checkpoint in status `s`."""
    if s is None:
        return _from_new(e)
    if e is Event.REGISTERED:
        # Metrics and paths only: the status stays; the scan decides what the files are.
        return Transition(Row.KEEP, s, frozenset({Effect.NOTIFY, Effect.WAKE_SCAN}))
    if s.state is State.PENDING:
        return _from_pending(s, e)
    if e is Event.RESAVED:
        # A new save at a known step is a new save, whatever became of the old one. What the
        # old one sent ahead of a commit goes (the store keeps it for an upload under way:
        # that one commits, and is replaced, or fails alone).
        uncommitted = s.remote in (Remote.NONE, Remote.UPLOADING)
        early = {Effect.DISCARD_EARLY} if uncommitted else set()
        return Transition(Row.SUPERSEDE, None, _JUDGED | early)
    if e is Event.VANISHED:
        if s.local is not Local.PRESENT:
            return Refusal("its local files are already gone or live in ckptd's own objects")
        return _to(s, local=Local.PRUNED, effects=_JUDGED)
    if e is Event.REAPPEARED:
        if s.local is not Local.PRUNED:
            return Refusal("only a checkpoint recorded gone can reappear")
        return _to(s, local=Local.PRESENT)
    if s.state is State.COMPLETE:
        return _from_complete(s, e)
    if s.state is State.INVALID:
        if e is Event.PRUNED_LOCAL and s.local is Local.PRESENT:
            return _to(s, local=Local.PRUNED)
        return Refusal("an invalid checkpoint is never copied, uploaded or judged again")
    return _from_valid(s, e)


def _from_new(e: Event) -> Outcome:
    if e is Event.FOUND_PENDING:
        return Transition(Row.NEW, PENDING, frozenset({Effect.NOTIFY}))
    if e is Event.FOUND_COMPLETE:
        return Transition(Row.NEW, COMPLETE, _CHANGED)
    if e is Event.REMOTE_FOUND:
        return Transition(Row.NEW, Status(State.VALID, Local.PRUNED, Remote.UPLOADED), _JUDGED)
    if e is Event.REGISTERED:
        return Refusal("no checkpoint yet: the registration waits for the scan")
    return Refusal("no such checkpoint")


def _from_pending(s: Status, e: Event) -> Outcome:
    if e is Event.FOUND_PENDING:
        return Transition(Row.KEEP, s, frozenset())
    if e is Event.FOUND_COMPLETE:
        return Transition(Row.KEEP, COMPLETE, _CHANGED)
    if e is Event.VANISHED:
        return Transition(Row.DELETE, None, frozenset({Effect.NOTIFY}))
    if e is Event.GAVE_UP:
        return Transition(Row.KEEP, Status(State.INVALID, Local.PRESENT, Remote.NONE), _JUDGED)
    if e is Event.RESAVED:
        return Refusal("a pending save is re-read as it grows, not superseded")
    return Refusal("not complete yet: nothing may act on it")


def _from_complete(s: Status, e: Event) -> Outcome:
    if s.local is not Local.PRESENT:
        return Refusal("its files went before it was validated")
    if e is Event.VALIDATED:
        return _to(s, state=State.VALID, effects=_JUDGED)
    if e is Event.REJECTED:
        return _to(s, state=State.INVALID, effects=_JUDGED)
    return Refusal("not validated yet")


def _from_valid(s: Status, e: Event) -> Outcome:  # noqa: C901 - one case per event, flat
    pending_upload = s.remote in (Remote.NONE, Remote.UPLOADING)
    if e is Event.DAMAGED:
        if s.local is not Local.PRESENT or s.copy or not pending_upload:
            return Refusal("damage is found by a read pass over the originals before the copy")
        return _to(s, state=State.INVALID, remote=Remote.NONE,
                   effects=_JUDGED | {Effect.DISCARD_EARLY})
    if e is Event.COPY_MADE:
        if s.copy or s.local is not Local.PRESENT:
            return Refusal("a copy is made from the originals, once")
        return _to(s, copy=True, effects=_JUDGED)
    if e is Event.COPY_LOST:
        if not s.copy:
            return Refusal("no copy recorded")
        if s.local is Local.COMPRESSED:  # it was the only local copy
            remote = Remote.NONE if s.remote is Remote.UPLOADING else s.remote
            return _to(s, local=Local.PRUNED, remote=remote, copy=False, effects=_JUDGED)
        return _to(s, copy=False)
    if e is Event.COPY_DROPPED:
        if not s.copy or s.local is Local.COMPRESSED or s.remote is not Remote.UPLOADED:
            return Refusal("only a copy made for an upload that is done is dropped")
        return _to(s, copy=False, effects=frozenset({Effect.NOTIFY}))
    if e is Event.UPLOAD_STARTED:
        if not s.copy or not pending_upload:
            return Refusal("an upload sends a local compressed copy, once")
        return _to(s, remote=Remote.UPLOADING, effects=frozenset({Effect.NOTIFY}))
    if e is Event.UPLOADED:
        if not s.copy or not pending_upload:
            return Refusal("only an upload in progress can finish")
        effects = _JUDGED | {Effect.RELEASE_COPY}
        return _to(s, remote=Remote.UPLOADED, effects=effects)
    if e is Event.REMOTE_LOST:
        if s.remote is not Remote.UPLOADED:
            return Refusal("not recorded as uploaded")
        return _to(s, remote=Remote.NONE, effects=_JUDGED)
    if e is Event.PRUNED_LOCAL:
        if s.local is Local.PRUNED:
            return Refusal("already pruned locally")
        effects = _JUDGED | ({Effect.REMOVE_COPY} if s.copy else set())
        remote = Remote.NONE if s.remote is Remote.UPLOADING else s.remote
        return _to(s, local=Local.PRUNED, remote=remote, copy=False, effects=effects)
    if e is Event.COMPRESSED_LOCAL:
        if s.local is not Local.PRESENT or not s.copy:
            return Refusal("compressing in place needs the originals and a verified copy")
        return _to(s, local=Local.COMPRESSED)
    if e is Event.COMPRESS_UNDONE:
        if s.local is not Local.COMPRESSED:
            return Refusal("not compressed in place")
        return _to(s, local=Local.PRESENT)
    if e is Event.PRUNED_REMOTE:
        if s.remote is not Remote.UPLOADED:
            return Refusal("no verified remote copy to prune")
        return _to(s, remote=Remote.PRUNED)
    return Refusal("already validated")


def _to(s: Status, effects: frozenset[Effect] = _JUDGED, **change: object) -> Transition:
    return Transition(Row.KEEP, replace(s, **change), effects)  # type: ignore[arg-type]


# The table itself: every (status, event) pair, each a transition or an explicit refusal.
TABLE: dict[tuple[Status | None, Event], Outcome] = {
    (s, e): _rule(s, e) for s in (NEW, *STATUSES) for e in Event
}


def transition(source: Status | None, event: Event) -> Transition:
    """The transition for `event` from `source` (None: no row yet). Raises Refused."""
    outcome = TABLE[(source, event)]
    if isinstance(outcome, Refusal):
        raise Refused(source, event, outcome.reason)
    return outcome


def allowed(source: Status | None, event: Event) -> bool:
    return isinstance(TABLE[(source, event)], Transition)


@dataclass(frozen=True)
class Sighting:
    """What one scan saw of a step, compared with the checkpoint the store holds for it."""

    complete: bool
    same_save: bool  # the same member files, sizes and mtimes at the same path
    fewer_files: bool  # strictly a subset of the recorded member files
    same_path: bool
    fresh: bool = False  # some member file was written after the checkpoint was last changed


def classify(s: Status | None, seen: Sighting) -> Event | None:
    """The event a scan's sighting of a step means (None: nothing happened)."""
    if s is None or s.state is State.PENDING:
        return Event.FOUND_COMPLETE if seen.complete else Event.FOUND_PENDING
    if seen.same_save:
        return Event.REAPPEARED if s.local is Local.PRUNED else None
    if s.local is not Local.PRESENT and not seen.complete:
        # Its files are gone on purpose (pruned, or replaced by a compressed copy); what is
        # left is e.g. a stale registration. Only a complete new save supersedes it.
        return None
    if seen.fewer_files:
        # Members only disappeared: a deletion caught halfway, even if what is left looks
        # complete. The checkpoint is going, not being re-saved. Once it is gone, a save of
        # fewer files written since is a new save; untouched leftovers are not.
        if s.local is Local.PRESENT:
            return Event.VANISHED
        return Event.RESAVED if seen.fresh and seen.complete else None
    if s.local is Local.COMPRESSED and not seen.same_path:
        return None  # another layout's view of the step, not a new save of it
    return Event.RESAVED


@dataclass(frozen=True)
class Stall:
    """A pending save as one scan saw it: seconds since its files last changed, and whether a
    member is short of the size its layout promises (`Candidate.truncated`; else one is
    missing)."""

    idle: float
    truncated: bool


def gives_up(s: Status | None, stall: Stall, timeout: float) -> Reason | None:
    """The reason `Event.GAVE_UP` judges a save invalid with, once it has stayed incomplete
    `timeout` seconds after its last change (the root's `pending_timeout`); None while the
    table does not allow it or the save may still complete."""
    if s is None or not allowed(s, Event.GAVE_UP) or stall.idle < timeout:
        return None
    return Reason.TRUNCATED if stall.truncated else Reason.MISSING_FILE


def next_stage(s: Status, policy: Policy) -> Stage | None:
    """The stage a checkpoint in status `s` needs next under its root's policy, if any."""
    if s.state is State.COMPLETE and s.local is Local.PRESENT:
        return Stage.VALIDATE
    if s.state is not State.VALID or s.remote not in (Remote.NONE, Remote.UPLOADING):
        return None
    if not s.copy:
        return Stage.COMPRESS if policy.wants_copy and s.local is Local.PRESENT else None
    return Stage.UPLOAD if policy.uploads else None


def _change(source: Status | None, t: Transition) -> str:
    if t.row is not Row.KEEP:
        return {Row.NEW: "new row", Row.SUPERSEDE: "superseded (a new row follows)",
                Row.DELETE: "row forgotten"}[t.row]
    assert t.to is not None
    if source is None:
        return f"new row: {t.to}"
    diffs = [f"{name} → {getattr(t.to, name)}" for name in ("state", "local", "remote")
             if getattr(source, name) != getattr(t.to, name)]
    if source.copy != t.to.copy:
        diffs.append("copy made" if t.to.copy else "copy gone")
    return ", ".join(diffs) or "status unchanged"


def as_markdown() -> str:
    """The table as docs/DESIGN.md shows it: per event, each distinct change with how many
    statuses allow it and the effects, then the distinct refusals."""
    lines = ["| event | change | from (statuses) | effects | refused from (statuses): why |",
             "|---|---|---|---|---|"]
    for e in Event:
        changes: dict[tuple[str, frozenset[Effect]], int] = {}
        refusals: dict[str, int] = {}
        for s in (NEW, *STATUSES):
            out = TABLE[(s, e)]
            if isinstance(out, Refusal):
                refusals[out.reason] = refusals.get(out.reason, 0) + 1
            else:
                key = (_change(s, out), out.effects)
                changes[key] = changes.get(key, 0) + 1
        refused = "; ".join(f"{n}: {why}" for why, n in sorted(refusals.items()))
        for i, ((change, effects), n) in enumerate(sorted(changes.items(),
                                                          key=lambda kv: kv[0][0])):
            names = ", ".join(sorted(x.value for x in effects)) or "–"
            lines.append(f"| `{e}` | {change} | {n} | {names} | {refused if i == 0 else ''} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(as_markdown(), end="")
