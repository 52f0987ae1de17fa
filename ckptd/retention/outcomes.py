"""What the retention executor reports: the Outcome of one tier's copy of one step (and what a
plan's local part did, `LocalRun`), and the log event each outcome is (`checkpoint_pruned`,
`prune_refused`, `prune_failed`), with the bytes a remote delete freed. Never deletes, never
reads the nets: the executor's entry points decide, and call these to say so.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from ckptd.backends import Backend
from ckptd.errors import StorageError
from ckptd.remote.manifest import step_prefix
from ckptd.retention.nets import DeleteRefused
from ckptd.retention.planner import PlanItem

TierName = Literal["local", "remote", "copy"]  # "copy": a local compressed copy beside originals
OutcomeAction = Literal["deleted", "trashed", "refused", "deferred", "failed"]


@dataclass(frozen=True)
class Outcome:
    """What happened to one tier's copy of one step; the scheduler records it in the store."""

    step: int
    tier: TierName
    action: OutcomeAction
    reason: str
    bytes_freed: int = 0

    def as_json(self) -> dict[str, Any]:
        return {"step": self.step, "tier": self.tier, "action": self.action,
                "reason": self.reason, "bytes_freed": self.bytes_freed}


@dataclass(frozen=True)
class LocalRun:
    """What `execute_local` did (`outcomes`, in plan order; a compress item's is `deferred`:
    the report `prune --apply` answers) and the steps it leaves the caller to compress in place
    (`retention.inplace`)."""

    outcomes: list[Outcome]
    compress: tuple[int, ...]


def _tier_reasons(item: PlanItem, tier: TierName) -> str:
    return ",".join(r for r in item.reasons if r.startswith(f"{tier}:"))


def pruned(log: Any, item: PlanItem, tier: TierName, freed: int) -> Outcome:
    reason = _tier_reasons(item, tier)
    log.info("checkpoint_pruned", step=item.step, tier=tier, reason=reason, bytes_freed=freed)
    return Outcome(item.step, tier, "deleted", reason, freed)


def refused(log: Any, step: int, tier: TierName, refusal: DeleteRefused) -> Outcome:
    log.warning("prune_refused", step=step, tier=tier, reason=refusal.reason)
    return Outcome(step, tier, "refused", refusal.reason)


def failed(log: Any, step: int, tier: TierName, reason: str) -> Outcome:
    log.error("prune_failed", step=step, tier=tier, reason=reason)
    return Outcome(step, tier, "failed", reason)


def already_gone(log: Any, step: int) -> Outcome:
    """Nothing left to move: another owner's delete (through this executor) got there first,
    or the files went by hand. The delete is done; nothing failed."""
    log.info("checkpoint_pruned", step=step, tier="local", reason="already gone", bytes_freed=0)
    return Outcome(step, "local", "deleted", "already gone")


def remote_bytes(backend: Backend, root_name: str, step: int) -> int:
    """Stored size of a remote step, best effort: only a number for logs and metrics."""
    try:
        return sum(m.size for m in backend.list(step_prefix(root_name, step)))
    except StorageError:
        return 0
