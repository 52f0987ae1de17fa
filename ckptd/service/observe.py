"""What the metrics read of the store: each root's facts at each scrape (`root_samples`), and
after each commit the time a save took to become safe remotely (`SafeTimes`).

Reads only; owns no state. Metric names and the exposition live in `ckptd.service.metrics`.
"""

from __future__ import annotations

import shutil
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

from ckptd.clock import Clock
from ckptd.config import RootConfig
from ckptd.lifecycle import answers
from ckptd.lifecycle.table import Event
from ckptd.log import get_logger
from ckptd.model import CheckpointRecord, State, Tier
from ckptd.service.metrics import Metrics, RootSample
from ckptd.store import Applied, Store


class Health(Protocol):
    def health(self, root: str) -> object: ...


def root_samples(store: Store, roots: Mapping[str, RootConfig], retention: Health,
                 held: Callable[[str], bool], now: float) -> list[RootSample]:
    """`held(name)`: this daemon acts on the root (its lease); `now`: wall time."""
    return [_sample(store, root, retention, held(root.name), now) for root in roots.values()]


def _sample(store: Store, root: RootConfig, retention: Health, held: bool,
            now: float) -> RootSample:
    records = store.checkpoints(root.name)
    latest = store.latest(root.name)
    remote = store.latest(root.name, Tier.REMOTE)
    since = None
    if root.upload.enabled:
        # Valid steps since the newest remote-verified one: what a node loss would cost (none
        # before the first valid step). A newer step still pending or invalid is not one (the
        # gauge's help says "valid").
        since = 0 if latest is None else latest.step - remote.step if remote else latest.step
    raw = sum(r.bytes for r in records if r.stored_bytes)
    stored = sum(r.stored_bytes for r in records if r.stored_bytes)
    health = retention.health(root.name)
    usage = _disk_usage(root)
    # A root another daemon acts on is not followed by this store: its waiting steps would
    # seem to wait for ever.
    unsafe = _unsafe_s(store, root.name, records, remote, now) if (
        root.upload.enabled and held) else None
    return RootSample(
        root=root.name, counts=store.counts(root.name), queue=store.queue_length(root.name),
        disk_free=usage.free if usage else None, latest=latest.step if latest else None,
        steps_since_remote=since,
        preflight_warning=bool(health is not None and not getattr(health, "preflight_ok", True)),
        ratio=stored / raw if raw else None,
        newest_committed=answers.newest(r.step for r in records if answers.is_committed(r)),
        remote_latest=remote.step if remote else None, unsafe_s=unsafe, held=held,
        min_free=root.retention.local.min_free.required(usage.total) if usage else None,
        saved=raw - stored,  # 0 while nothing is compressed: none saved
        invalid=Counter(r.reason for r in records if r.state is State.INVALID))


def _unsafe_s(store: Store, root: str, records: Sequence[CheckpointRecord],
              remote: CheckpointRecord | None, now: float) -> float:
    """Seconds since the oldest valid step newer than the remote's latest became valid; 0
    when none waits. Only steps with a local copy wait: one without can never be uploaded."""
    floor = remote.step if remote else -1
    waiting = [r for r in records if r.state is State.VALID and r.step > floor
               and r.local in answers.ON_DISK]
    if not waiting:
        return 0.0
    oldest = min(waiting, key=lambda r: r.step)
    valid_at = store.reached(root, Event.VALIDATED, floor).get(oldest.step)
    if valid_at is None:  # its log rows trimmed away: it was complete no later than valid
        valid_at = oldest.completed if oldest.completed is not None else oldest.created
    return max(0.0, now - valid_at)


class _Usage(Protocol):
    @property
    def free(self) -> int: ...
    @property
    def total(self) -> int: ...


def _disk_usage(root: RootConfig) -> _Usage | None:
    try:
        return shutil.disk_usage(root.path)
    except OSError:
        return None


class SafeTimes:
    """The store's commit hook in front of `then` (the effects): each save that became
    remote-verified in the batch is observed in `ckptd_time_to_safe_seconds`, from the time it
    was found complete (its row's `completed`; a step only found remotely has none and is not
    observed). A failure here is logged and never keeps the batch from `then`."""

    def __init__(self, store: Store, metrics: Metrics, clock: Clock,
                 then: Callable[[Sequence[Applied]], None]) -> None:
        self.store = store
        self.metrics = metrics
        self.clock = clock
        self.then = then
        self.log = get_logger()

    def __call__(self, applied: Sequence[Applied]) -> None:
        try:
            self._observe(applied)
        except Exception as exc:  # a metric must never cost a transition its effects
            self.log.warning("metric_failed", metric="ckptd_time_to_safe_seconds",
                             error=str(exc))
        self.then(applied)

    def _observe(self, applied: Sequence[Applied]) -> None:
        for a in applied:
            if (a.target is None or not answers.is_committed(a.target)
                    or (a.source is not None and answers.is_committed(a.source))):
                continue
            rec = self.store.checkpoint(a.root, a.step)
            if rec is not None and rec.completed is not None:
                self.metrics.observe_safe(a.root, self.clock.time() - rec.completed)


def summary(store: Store, names: list[str]) -> str:
    """One line for systemd's STATUS=: each root's latest step and queue."""
    parts = [f"{name} latest {rec.step if rec else '-'} queue {store.queue_length(name)}"
             for name in names for rec in [store.latest(name)]]
    return "; ".join(parts) or "no roots"
