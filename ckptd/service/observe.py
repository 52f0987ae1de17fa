"""What the metrics collector reads at each scrape: each root's facts from the store.

Reads only; owns no state. Metric names and the exposition live in `ckptd.service.metrics`.
"""

from __future__ import annotations

import shutil
from collections.abc import Mapping
from typing import Protocol

from ckptd.config import RootConfig
from ckptd.model import Tier
from ckptd.service.metrics import RootSample
from ckptd.store import Store


class Health(Protocol):
    def health(self, root: str) -> object: ...


def root_samples(store: Store, roots: Mapping[str, RootConfig],
                 retention: Health) -> list[RootSample]:
    return [_sample(store, root, retention) for root in roots.values()]


def _sample(store: Store, root: RootConfig, retention: Health) -> RootSample:
    records = store.checkpoints(root.name)
    latest = store.latest(root.name)
    remote = store.latest(root.name, Tier.REMOTE)
    newest = max((r.step for r in records), default=None)
    since = None
    if root.upload.enabled and newest is not None:
        # Steps saved since the newest remote-verified one: the data a node loss would cost.
        since = newest - remote.step if remote else newest
    raw = sum(r.bytes for r in records if r.stored_bytes)
    stored = sum(r.stored_bytes for r in records if r.stored_bytes)
    health = retention.health(root.name)
    return RootSample(
        root=root.name, counts=store.counts(root.name), queue=store.queue_length(root.name),
        disk_free=_disk_free(root), latest=latest.step if latest else None,
        steps_since_remote=since,
        preflight_warning=bool(health is not None and not getattr(health, "preflight_ok", True)),
        ratio=stored / raw if raw else None)


def _disk_free(root: RootConfig) -> int | None:
    try:
        return shutil.disk_usage(root.path).free
    except OSError:
        return None


def summary(store: Store, names: list[str]) -> str:
    """One line for systemd's STATUS=: each root's latest step and queue."""
    parts = [f"{name} latest {rec.step if rec else '-'} queue {store.queue_length(name)}"
             for name in names for rec in [store.latest(name)]]
    return "; ".join(parts) or "no roots"
