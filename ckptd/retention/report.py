"""What retention shows about a root: its preflight health (`RootHealth`) and the documents the
API and the start-up log give of it (preflight, the adopted checkpoints). Pure rendering of
what a run learned and of a plan: reads nothing, decides nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ckptd.model import CheckpointRecord, Local
from ckptd.retention.planner import Plan


@dataclass(frozen=True)
class RootHealth:
    """What the last retention run learned about a root (status, metrics)."""

    preflight_ok: bool
    message: str
    next_save_estimate: int
    min_free_unmet: bool


def health_json(h: RootHealth | None) -> dict[str, Any] | None:
    if h is None:
        return None
    return {"ok": h.preflight_ok, "message": h.message or None,
            "next_save_estimate_bytes": h.next_save_estimate, "min_free_unmet": h.min_free_unmet}


def adopted_records(records: Sequence[CheckpointRecord]) -> list[CheckpointRecord]:
    """The checkpoints that were there before ckptd and are still on disk."""
    return [r for r in records if r.adopted and r.local is not Local.PRUNED]


def adopted_json(root: str, adopted: Sequence[CheckpointRecord], plan: Plan) -> dict[str, Any]:
    """What retention does with the checkpoints that were there before ckptd: `held` are
    kept only because they are adopted (a `ckptd prune --apply` would delete them; an
    upload of each makes it deletable by the rules)."""
    held = sorted(i.step for i in plan.items
                  if {r for r in i.reasons if r.startswith("local:")} == {"local:adopted"})
    return {"count": len(adopted), "held": held,
            "message": (f"{len(adopted)} checkpoint(s) were there before ckptd: never"
                        " deleted locally without a verified remote copy; "
                        + (f"{len(held)} kept only for that (steps {held[:10]}); "
                           f"`ckptd prune {root} --apply` deletes them"
                           if held else "none of them would be deleted by the rules"))}
