"""The domain answers, each decided here once: a tier's latest checkpoint, the best by a metric,
the newest of a set of steps, whether a step's remote copy is committed, and what still needs
a local compressed copy. Pure functions of plain records and flags; no I/O, no clock, nothing
of ckptd but `ckptd.model`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol, TypeVar

from ckptd.model import Local, MetricMode, Remote, State, Tier

# A local copy ckptd can restore from: the original files, or the compressed copy in place.
ON_DISK = (Local.PRESENT, Local.COMPRESSED)


class Placed(Protocol):
    """Where a checkpoint's copies are (a store record, a planner view, a lifecycle status)."""

    @property
    def local(self) -> Local: ...
    @property
    def remote(self) -> Remote: ...


class Facts(Placed, Protocol):
    """What every answer reads of a checkpoint (a store record, a planner view)."""

    @property
    def step(self) -> int: ...
    @property
    def state(self) -> State: ...


R = TypeVar("R", bound=Facts)


# The remote status of a committed step (the store's word for it).
COMMITTED = Remote.UPLOADED


def is_committed(r: Placed) -> bool:
    """Its remote copy is committed: the upload stage verified every object, then wrote the
    step's MANIFEST.json (`ckptd.remote.keys` reads that), so committed is also verified."""
    return r.remote is COMMITTED


def was_committed(r: Placed) -> bool:
    """Its remote copy is committed, or was until retention pruned it: the upload is done."""
    return is_committed(r) or r.remote is Remote.PRUNED


def in_tier(r: Placed, tier: Tier) -> bool:
    """A copy of it can be had in `tier` (ANY: on disk or committed remotely)."""
    on_disk = r.local in ON_DISK
    return {Tier.ANY: on_disk or is_committed(r), Tier.LOCAL: on_disk,
            Tier.REMOTE: is_committed(r)}[tier]


@dataclass(frozen=True)
class Where:
    """Where a checkpoint's copies are, as a document (the API's answer, latest.json) says."""

    local: Local
    remote: Remote


def where_of(doc: Mapping[str, object]) -> Where:
    """The `local` and `remote` words of a document; a word this version does not know reads
    as no copy there."""
    local, remote = str(doc.get("local")), str(doc.get("remote"))
    return Where(Local(local) if local in Local.__members__.values() else Local.PRUNED,
                 Remote(remote) if remote in Remote.__members__.values() else Remote.NONE)


def copy_needed_by(r: Placed, keeps_copies: bool) -> tuple[str, ...]:
    """What still needs a checkpoint's local compressed copy. Beside the originals on disk:
    "not_uploaded" (the upload, until the remote copy is committed) and "compress_older"
    (retention may yet keep the copy instead of the originals). Compressed in place, the copy
    is the checkpoint's local copy ("local"); with the originals gone, nothing: it goes with
    them. Empty: the copy may go."""
    if r.local is Local.COMPRESSED:
        return ("local",)
    if r.local is not Local.PRESENT:
        return ()
    return tuple(why for hit, why in ((not is_committed(r), "not_uploaded"),
                                      (keeps_copies, "compress_older")) if hit)


def newest(steps: Iterable[int], usable: Callable[[int], bool] = lambda _n: True
           ) -> int | None:
    """The highest of `steps` that is `usable`, or None. Tried from the top down, so a costly
    check (a remote read) runs only until one passes."""
    for n in sorted(set(steps), reverse=True):
        if usable(n):
            return n
    return None


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
