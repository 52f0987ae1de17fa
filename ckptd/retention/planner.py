"""Retention planner: decides, per checkpoint and tier, keep / compress / delete, with reasons.

Pure: plain data in, an immutable `Plan` out; no I/O, no clock. "Latest" and "best" are
`ckptd.lifecycle.answers`'; carrying a plan out (and re-checking the safety nets) is
`ckptd.retention.executor`'s job. See docs/RETENTION.md.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Literal

from ckptd import units
from ckptd.config.schema import LocalRetention, RemoteRetention
from ckptd.errors import BadValue
from ckptd.lifecycle import answers
from ckptd.model import Local, Remote, State, Tier
from ckptd.model import MetricMode as MetricMode
from ckptd.retention.rules import RULES, newest
from ckptd.retention.rules import Context as _Ctx

TierName = Literal["local", "remote"]


class Action(StrEnum):
    """What the plan does with one tier's copy of a checkpoint."""

    KEEP = "keep"
    DELETE = "delete"
    COMPRESS = "compress"  # local only: keep just the compressed copy
    NONE = "none"  # no copy in this tier (local pruned; remote none/uploading/pruned)


class Tag(StrEnum):
    """Reason vocabulary. A reason is `<tier>:<tag>` or `<tier>:<tag>=<value>`; the keep rules'
    reasons (`keep_last=2`, ...) are their names in `ckptd.retention.rules`."""

    PENDING = "pending"  # not validated yet: never judged
    LATEST = "latest"  # newest valid checkpoint in this tier
    BEST = "best"  # best metric among every valid checkpoint still available
    PINNED = "pinned"
    IN_USE = "in_use"  # a client is reading it
    NOT_UPLOADED = "not_uploaded"  # local copy is the only verified one
    ADOPTED = "adopted"  # there before ckptd; only deleted with a remote copy or --apply
    INVALID = "invalid"  # kept because delete_invalid is off
    COMPRESS_OLDER = "compress_older"
    NOT_KEPT = "not_kept"  # no rule keeps it
    DELETE_INVALID = "delete_invalid"
    MIN_FREE = "min_free"  # deleted to bring free space back to min_free
    UPLOADING = "uploading"  # remote copy not committed yet
    RELEASED = "released"  # copy: a spare local compressed copy, its upload done
    WITH_LOCAL = "with_local"  # copy: goes with its checkpoint's local delete
    MIN_FREE_UNMET = "min_free_unmet"  # plan note: bytes still missing after every allowed delete


# Tags that min_free may never override (the nets the executor enforces again).
PROTECTED = frozenset({Tag.PENDING, Tag.LATEST, Tag.BEST, Tag.PINNED, Tag.IN_USE, Tag.NOT_UPLOADED,
                       Tag.ADOPTED})
_UNJUDGED = (State.PENDING, State.COMPLETE)


@dataclass(frozen=True)
class CheckpointView:
    """What the planner needs to know about one checkpoint (one row per step).

    `completed`: wall time it was found complete. `bytes`: what it occupies on local disk now
    (the compressed size when `local` is compressed). `metric`: the root's metric, None if absent;
    NaN/inf count as absent. `in_use`: a reader holds it (a hold).
    """

    step: int
    state: State
    local: Local
    remote: Remote
    completed: float
    bytes: int
    metric: float | None = None
    pinned: bool = False
    in_use: bool = False
    adopted: bool = False  # on disk before ckptd watched the root: kept until uploaded
    copy: bool = False  # a local compressed copy lies beside the originals (or the pruned row)


@dataclass(frozen=True)
class Disk:
    """Local filesystem of the root; `min_free_bytes` is already resolved from bytes or percent."""

    free_bytes: int
    total_bytes: int
    min_free_bytes: int

    def __post_init__(self) -> None:
        if min(self.free_bytes, self.total_bytes, self.min_free_bytes) < 0:
            raise BadValue(f"disk sizes must not be negative: {self}")


@dataclass(frozen=True)
class PlanItem:
    step: int
    local: Action
    remote: Action
    reasons: tuple[str, ...]
    # The local compressed copy beside the originals (the `copy` tier; a compressed-in-place
    # checkpoint's copy is its local copy and is decided by `local`): NONE when there is none.
    copy: Action = Action.NONE

    def as_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"step": self.step, "local": str(self.local),
                               "remote": str(self.remote)}
        if self.copy is not Action.NONE:
            doc["copy"] = str(self.copy)
        doc["reasons"] = list(self.reasons)
        return doc


@dataclass(frozen=True)
class Plan:
    """The decisions for one root, ascending by step.

    `freed_bytes`: local bytes the planned deletes free. `reclaimable_bytes`: that plus what
    min_free could still delete (feed it to `preflight`). `min_free_unmet`: free space stays
    under min_free even after every allowed delete, by `shortfall_bytes`; `notes` says so too.
    """

    items: tuple[PlanItem, ...]
    freed_bytes: int = 0
    reclaimable_bytes: int = 0
    min_free_unmet: bool = False
    shortfall_bytes: int = 0
    notes: tuple[str, ...] = ()

    def steps(self, tier: TierName, action: Action) -> tuple[int, ...]:
        """Steps whose copy in `tier` gets `action` (the executor's work list)."""
        return tuple(i.step for i in self.items if getattr(i, tier) is action)

    def as_json(self, root: str) -> dict[str, Any]:
        """The `ckptd prune ROOT --dry-run --json` document (docs/CLI.md)."""
        return {"root": root, "plan": [item.as_json() for item in self.items]}


@dataclass(frozen=True)
class Preflight:
    ok: bool
    next_save_estimate: int
    projected_free: int
    message: str


@dataclass(frozen=True)
class _Decision:
    action: Action
    tags: tuple[str, ...]  # without the tier prefix


_ABSENT = _Decision(Action.NONE, ())
_UPLOADING = _Decision(Action.NONE, (Tag.UPLOADING,))


def plan(
    checkpoints: Iterable[CheckpointView],
    local_rules: LocalRetention,
    remote_rules: RemoteRetention,
    disk: Disk,
    now: float,
    metric_mode: MetricMode = "min",
    upload_configured: bool = False,
    delete_adopted: bool = False,
    committed_only: bool = False,
) -> Plan:
    """Decide every checkpoint's local and remote copy. A copy is kept if ANY rule keeps it.

    Per tier, over the valid checkpoints in that tier: keep_last N newest; keep_best K best by
    metric (ties: newer step wins); keep_every M (step % M == 0); keep_within W (now - completed
    <= W, edge kept). Always kept: pending/complete, the tier's latest, the root's best, pinned,
    in_use. Local only: adopted copies (there before ckptd) without an uploaded remote copy,
    unless `delete_adopted` (`ckptd prune --apply`); valid copies not uploaded yet (when upload
    is configured); invalid ones
    unless delete_invalid; compress_older turns kept copies outside the newest keep_last (never
    the latest or in_use ones) into `compress`; min_free (when free < min_free) deletes the
    oldest unprotected kept copies, invalid ones first, until the projected free space reaches
    min_free. Remote considers only `uploaded` copies. Checkpoints with no copy are left out.
    "Latest" and "best" are `ckptd.lifecycle.answers`', with `committed_only` (a multi-node
    root: only committed steps are latest or best).
    """
    views = _checked(checkpoints)
    best = answers.best(views, _metric, metric_mode, committed_only)
    ctx = _Ctx(now, metric_mode, best.step if best else None, committed_only)
    local = _decide_local(views, local_rules, ctx, upload_configured, delete_adopted)
    local, freed, reclaimable, shortfall = _apply_min_free(views, local, disk)
    remote = _decide_remote(views, remote_rules, ctx)
    items = tuple(_item(v, local, remote, local_rules.compress_older)
                  for v in views if _listed(v))
    notes = (f"local:{Tag.MIN_FREE_UNMET}={shortfall}",) if shortfall else ()
    return Plan(items, freed, reclaimable, shortfall > 0, shortfall, notes)


def preflight(
    recent_sizes: Sequence[int], disk: Disk, reclaimable_bytes: int, window: int = 5
) -> Preflight:
    """Will the next save leave at least min_free, once everything reclaimable is pruned?

    The next save is estimated as the largest of the last `window` sizes (oldest first): saves
    rarely shrink, and underestimating costs a failed save while overestimating costs a warning.
    """
    estimate = max(recent_sizes[-window:], default=0) if window > 0 else 0
    projected = disk.free_bytes + reclaimable_bytes - estimate
    ok = projected >= disk.min_free_bytes
    verdict = "ok" if ok else "under min_free"
    message = (
        f"{verdict}: next save ~{_size(estimate)}; free {_size(disk.free_bytes)}"
        f" + reclaimable {_size(reclaimable_bytes)} leaves {_size(projected)}"
        f" (min_free {_size(disk.min_free_bytes)})"
    )
    return Preflight(ok, estimate, projected, message)


def _checked(checkpoints: Iterable[CheckpointView]) -> list[CheckpointView]:
    views = sorted(checkpoints, key=lambda v: v.step)
    steps = [v.step for v in views]
    if len(set(steps)) != len(steps):
        # A superseded re-save must not be planned beside its successor.
        raise BadValue("duplicate steps in retention input")
    return views


def _metric(v: CheckpointView) -> float | None:
    return v.metric


def _size(n: int) -> str:
    return units.format_size(n)


def _rule_hits(valid: list[CheckpointView], tier: Tier,
               rules: LocalRetention | RemoteRetention, ctx: _Ctx) -> dict[int, list[str]]:
    """Each registered keep rule whose setting this tier's table has, in the registry's order."""
    hits: dict[int, list[str]] = {v.step: [] for v in valid}
    for name, rule in RULES.items():
        value = getattr(rules, name) if name in type(rules).model_fields else None
        if value is None:  # not a setting of this tier, or turned off
            continue
        for v in rule.keeps(valid, tier, value, ctx):
            hits[v.step].append(rule.reason(value))
    return hits


def _safety_tags(v: CheckpointView, latest: int | None, best: int | None) -> list[str]:
    checks = (
        (v.state in _UNJUDGED, Tag.PENDING),
        (v.step == latest, Tag.LATEST),
        (v.step == best, Tag.BEST),
        (v.pinned, Tag.PINNED),
        (v.in_use, Tag.IN_USE),
    )
    return [str(tag) for hit, tag in checks if hit]


def _tier_tags(present: list[CheckpointView], tier: Tier, rules: LocalRetention | RemoteRetention,
               ctx: _Ctx) -> dict[int, list[str]]:
    """Every keep reason each copy in one tier has, before tier-specific guards."""
    valid = [v for v in present if v.state is State.VALID]
    newest = answers.latest(present, tier, ctx.committed_only)
    latest = newest.step if newest else None
    hits = _rule_hits(valid, tier, rules, ctx)
    return {v.step: _safety_tags(v, latest, ctx.best) + hits.get(v.step, []) for v in present}


def _decide_local(
    views: list[CheckpointView], rules: LocalRetention, ctx: _Ctx, upload_configured: bool,
    delete_adopted: bool = False,
) -> dict[int, _Decision]:
    present = [v for v in views if answers.in_tier(v, Tier.LOCAL)]
    tags = _tier_tags(present, Tier.LOCAL, rules, ctx)
    valid = [v for v in present if v.state is State.VALID]
    recent = {v.step for v in newest(valid, rules.keep_last)}
    out: dict[int, _Decision] = {}
    for v in present:
        keep = tags[v.step] + _local_guards(v, rules, upload_configured, delete_adopted)
        out[v.step] = _local_decision(v, keep, rules, v.step in recent)
    return out


def _local_guards(v: CheckpointView, rules: LocalRetention, upload_configured: bool,
                  delete_adopted: bool = False) -> list[str]:
    guards: list[str] = []
    if v.adopted and not answers.is_committed(v) and not delete_adopted:
        guards.append(Tag.ADOPTED)
    # Invalid data is never uploaded, so "not uploaded" must not pin it forever.
    if upload_configured and v.state is State.VALID and not answers.is_committed(v):
        guards.append(Tag.NOT_UPLOADED)
    if v.state is State.INVALID and not rules.delete_invalid:
        guards.append(Tag.INVALID)
    return guards


def _local_decision(
    v: CheckpointView, keep: list[str], rules: LocalRetention, recent: bool
) -> _Decision:
    if not keep:
        why = Tag.DELETE_INVALID if v.state is State.INVALID else Tag.NOT_KEPT
        return _Decision(Action.DELETE, (why,))
    compress = (
        rules.compress_older
        and v.local is Local.PRESENT
        and v.state is State.VALID
        and not recent
        and not {Tag.LATEST, Tag.IN_USE} & set(keep)
    )
    if compress:
        return _Decision(Action.COMPRESS, (*keep, Tag.COMPRESS_OLDER))
    return _Decision(Action.KEEP, tuple(keep))


def _decide_remote(
    views: list[CheckpointView], rules: RemoteRetention, ctx: _Ctx
) -> dict[int, _Decision]:
    present = [v for v in views if answers.in_tier(v, Tier.REMOTE)]
    tags = _tier_tags(present, Tier.REMOTE, rules, ctx)
    return {v.step: _remote_decision(v, tags[v.step]) for v in present}


def _remote_decision(v: CheckpointView, keep: list[str]) -> _Decision:
    # Invalid data is never uploaded; a copy that became invalid later waits for a human.
    if v.state is State.INVALID:
        keep = [*keep, Tag.INVALID]
    if not keep:
        return _Decision(Action.DELETE, (Tag.NOT_KEPT,))
    return _Decision(Action.KEEP, tuple(keep))


def _min_free_order(
    views: list[CheckpointView], local: dict[int, _Decision]
) -> list[CheckpointView]:
    """Copies min_free may delete: kept, unprotected; invalid ones first, then oldest first."""
    open_ = [
        v
        for v in views
        if v.step in local
        and local[v.step].action in (Action.KEEP, Action.COMPRESS)
        and not PROTECTED & set(local[v.step].tags)
    ]
    return sorted(open_, key=lambda v: (v.state is not State.INVALID, v.step))


def _apply_min_free(
    views: list[CheckpointView], local: dict[int, _Decision], disk: Disk
) -> tuple[dict[int, _Decision], int, int, int]:
    """Add min_free deletes; returns (decisions, freed, reclaimable, shortfall) in bytes."""
    deleted = [v for v in views if v.step in local and local[v.step].action is Action.DELETE]
    freed = sum(v.bytes for v in deleted)
    candidates = _min_free_order(views, local)
    reclaimable = freed + sum(v.bytes for v in candidates)
    if disk.free_bytes >= disk.min_free_bytes:
        return local, freed, reclaimable, 0
    out = dict(local)
    for v in candidates:
        if disk.free_bytes + freed >= disk.min_free_bytes:
            break
        out[v.step] = _Decision(Action.DELETE, (Tag.MIN_FREE,))
        freed += v.bytes
    return out, freed, reclaimable, max(0, disk.min_free_bytes - disk.free_bytes - freed)


def _listed(v: CheckpointView) -> bool:
    return answers.in_tier(v, Tier.ANY) or v.remote is Remote.UPLOADING


def _item(v: CheckpointView, local: dict[int, _Decision], remote: dict[int, _Decision],
          compress_older: bool = False) -> PlanItem:
    here = local.get(v.step, _ABSENT)
    there = remote.get(v.step, _UPLOADING if v.remote is Remote.UPLOADING else _ABSENT)
    spare = _copy_decision(v, here.action, compress_older)
    reasons = (tuple(f"local:{t}" for t in here.tags) + tuple(f"remote:{t}" for t in there.tags)
               + tuple(f"copy:{t}" for t in spare.tags))
    return PlanItem(v.step, here.action, there.action, reasons, spare.action)


def _copy_decision(v: CheckpointView, local: Action, compress_older: bool) -> _Decision:
    """The local compressed copy beside the originals. It is made for an upload and for
    compress_older: kept while either may still need it, released once neither does, and
    deleted with its checkpoint's local copy. What needs it is `answers.copy_needed_by`, the
    rule the effects apply after an upload (Effect.RELEASE_COPY), so a release that was
    refused then is planned again."""
    if not v.copy or v.local is Local.COMPRESSED:
        return _ABSENT
    if local is Action.DELETE or v.local is Local.PRUNED:
        return _Decision(Action.DELETE, (Tag.WITH_LOCAL,))
    keep = ([Tag.IN_USE] if v.in_use else []) + [
        Tag(why) for why in answers.copy_needed_by(v, compress_older)]
    if keep:
        return _Decision(Action.KEEP, tuple(keep))
    return _Decision(Action.DELETE, (Tag.RELEASED,))

