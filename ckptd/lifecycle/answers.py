"""The domain answers, each decided here once: a tier's latest checkpoint, the best by a metric,
whether a step's remote copy is committed. Pure functions of plain records and a
`committed_only` flag; no I/O, no clock, nothing of ckptd but `ckptd.model`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Literal, Protocol, TypeVar

from ckptd.model import Local, Remote, State, Tier

MetricMode = Literal["min", "max"]

# A local copy ckptd can restore from: the original files, or the compressed copy in place.
ON_DISK = (Local.PRESENT, Local.COMPRESSED)


class Facts(Protocol):
    """What every answer reads of a checkpoint (a store record, a planner view)."""

    @property
    def step(self) -> int: ...
    @property
    def state(self) -> State: ...
    @property
    def local(self) -> Local: ...
    @property
    def remote(self) -> Remote: ...


R = TypeVar("R", bound=Facts)


def is_committed(r: Facts) -> bool:
    """Its remote copy is committed: the upload stage verified every object, then wrote the
    step's MANIFEST.json (`ckptd.remote.keys` reads that), so committed is also verified."""
    return r.remote is Remote.UPLOADED


def in_tier(r: Facts, tier: Tier) -> bool:
    """A copy of it can be had in `tier` (ANY: on disk or committed remotely)."""
    on_disk = r.local in ON_DISK
    return {Tier.ANY: on_disk or is_committed(r), Tier.LOCAL: on_disk,
            Tier.REMOTE: is_committed(r)}[tier]


def counts(r: Facts, tier: Tier, committed_only: bool) -> bool:
    """Whether `r` may be answered as latest or best of `tier`: valid, with a copy there, and
    committed when the root is multi-node (`committed_only`: no single node's disk holds a
    step whole before its commit)."""
    return (r.state is State.VALID and in_tier(r, tier)
            and (is_committed(r) or not committed_only))


def latest(records: Iterable[R], tier: Tier, committed_only: bool) -> R | None:
    """The newest step that `counts` in `tier`, or None."""
    return max((r for r in records if counts(r, tier, committed_only)),
               key=lambda r: r.step, default=None)


def ranked(records: Iterable[R], score: Callable[[R], float | None], mode: MetricMode,
           committed_only: bool, tier: Tier = Tier.ANY) -> list[R]:
    """The records that `count` and have a finite `score`, best first (lowest for "min");
    a tie goes to the newer step: it carries more training."""
    if mode not in ("min", "max"):
        raise ValueError(f"metric_mode must be 'min' or 'max', not {mode!r}")
    sign = 1.0 if mode == "min" else -1.0
    scored = [(sign * m, -r.step, r) for r in records
              if counts(r, tier, committed_only) and (m := finite(score(r))) is not None]
    scored.sort(key=lambda t: (t[0], t[1]))
    return [r for _, _, r in scored]


def best(records: Iterable[R], score: Callable[[R], float | None], mode: MetricMode,
         committed_only: bool) -> R | None:
    """The root's best checkpoint by `score` among every one with a copy anywhere, or None."""
    order = ranked(records, score, mode, committed_only)
    return order[0] if order else None


def finite(value: float | None) -> float | None:
    """A metric as ranked: NaN, infinities and non-numbers count as absent."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None
