"""What the socket API answers from: `ApiContext` reads the store and the daemon's parts (as
`ckptd.api.seams` describes them) into the JSON documents of docs/CLI.md. The HTTP side is
`ckptd.api.server`.
"""

from __future__ import annotations

import shutil
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from ckptd import __version__
from ckptd.api import checks
from ckptd.api.seams import (
    Discovery,
    Memory,
    MetricsText,
    NoMemory,
    NoPersist,
    NoRootLeases,
    Persist,
    Retention,
    RootLeases,
    Scan,
    Services,
    Workers,
)
from ckptd.client import read_latest_file
from ckptd.clock import SYSTEM, Clock
from ckptd.config import RootConfig
from ckptd.errors import HttpError
from ckptd.lifecycle import answers
from ckptd.lifecycle.changes import Changes
from ckptd.log import get_logger
from ckptd.model import CheckpointRecord, Local, Remote, State, Tier
from ckptd.store import Store
from ckptd.store.pins import write_pins


class ApiContext:
    """Everything a request handler may touch: the store, and the daemon's services."""

    def __init__(self, store: Store, roots: Callable[[], Mapping[str, RootConfig]],
                 changes: Changes, scan: Scan, workers: Workers, retention: Retention,
                 discovery: Discovery, services: Services, metrics: MetricsText,
                 leases: RootLeases | None = None, persist: Persist | None = None,
                 clock: Clock = SYSTEM, memory: Memory | None = None) -> None:
        """`clock`: the daemon's, which readers' holds and registrations are timed by."""
        self.clock = clock
        self.store = store
        self.roots = roots
        self.changes = changes
        self.scan = scan
        self.workers = workers
        self.retention = retention
        self.discovery = discovery
        self.services = services
        self.metrics = metrics
        self.leases: RootLeases = leases if leases is not None else NoRootLeases()
        self.persist: Persist = persist if persist is not None else NoPersist()
        self.memory: Memory = memory if memory is not None else NoMemory()
        self.started = clock.monotonic()
        self.stopping = threading.Event()
        self.problem: str | None = None  # why the daemon stopped acting (set by the daemon)

    def uptime(self) -> float:
        return round(self.clock.monotonic() - self.started, 3)

    def root(self, name: str) -> RootConfig:
        root = self.roots().get(name)
        if root is None:
            raise HttpError(404, "no_root", f"no root named {name!r} in the config")
        return root

    # -- views -------------------------------------------------------------------------------

    def state(self) -> str:
        """ok, degraded (a service crashed and is being restarted, a root cannot act) or
        stopping."""
        if self.stopping.is_set():
            return "stopping"
        fine = self.services.alive() and self.problem is None and not self.not_acting()
        return "ok" if fine else "degraded"

    def not_acting(self) -> list[dict[str, str]]:
        """The configured roots that cannot act, each with why (`RootLeases.problem`)."""
        out = []
        for name in self.roots():
            why = self.leases.problem(name)
            if why is not None:
                out.append({"root": name, "problem": why})
        return out

    def health(self) -> dict[str, Any]:
        return {"status": self.state(), "version": __version__, "uptime_s": self.uptime(),
                "services": self.services.health(), "problem": self.problem,
                "roots_not_acting": self.not_acting()}

    def status(self) -> dict[str, Any]:
        roots = [self.root_status(r) for r in self.roots().values()]
        return {"status": self.state(), "version": __version__, "uptime_s": self.uptime(),
                "scans": self.scan.scans, "roots": roots,
                "in_flight": self.workers.in_flight() + self.persist.in_flight(),
                "flushing": [{"root": r, "step": s}
                             for r, s in self.workers.flushing().items()],
                "services": self.services.health(), "problem": self.problem,
                "memory": self.memory.status_json()}

    def root_status(self, root: RootConfig) -> dict[str, Any]:
        info = self.store.root_info(root.name)
        latest = self.store.latest(root.name)
        best = self.store.best(root.name, root.metric, root.metric_mode)
        return {
            "name": root.name, "path": str(root.path),
            "latest": latest.step if latest else None,
            "best": best.step if best else None,
            "counts": self.store.counts(root.name),
            "queue": self.store.queue_length(root.name),
            "disk_free_bytes": disk_free(root.path),
            "last_error": info["last_error"] or None,
            "last_error_at": _rfc3339(info["last_error_at"]) if info["last_error"] else None,
            "preflight": self.retention.health_json(root.name),
            "adopted": self.retention.adopted_json(root),
            "unrecognised": self.scan.unrecognised(root.name)[:100],
            "bad_remote": self.discovery.bad_remote(root.name),
            "holder": self.leases.holder_json(root.name),
            "acting": self.leases.holds(root.name),
            "not_acting": self.leases.problem(root.name),
            "uncommitted": (self.workers.uncommitted(root.name, root.nodes) if root.multi_node
                            else None),
        }

    def acting(self, root: RootConfig) -> None:
        """Refuse a change to a root another daemon acts on (this one stands by)."""
        if not self.leases.holds(root.name):
            h = self.leases.holder_json(root.name)
            who = (f"the daemon of node {h['node']!r} (pid {h['pid']} on {h['host']})"
                   if h else "another daemon, or none yet")
            raise HttpError(409, "standby", f"root {root.name!r} is acted on by {who}; this"
                            " daemon stands by (see `ckptd status`): run this there")

    def listing(self, root: RootConfig) -> dict[str, Any]:
        self.discovery.request(root.name)
        rows = self.store.checkpoints(root.name)
        bad = self.discovery.bad_remote(root.name)
        if not root.multi_node:
            return {"root": root.name, "checkpoints": [c.as_json() for c in rows],
                    "bad_remote": bad}
        return {"root": root.name, "checkpoints": [
            {**c.as_json(), "nodes": self.workers.part_states(root, c)} for c in rows],
            "bad_remote": bad}

    def latest(self, root: RootConfig, tier: Tier) -> dict[str, Any]:
        if not self.leases.holds(root.name):
            return self._published_latest(root, tier)
        rec = self.store.latest(root.name, tier)
        if rec is None:
            raise HttpError(404, "no_checkpoint", f"root {root.name!r} has no valid checkpoint"
                            f" in tier {tier.value!r}")
        return latest_json(root, rec)


    def _published_latest(self, root: RootConfig, tier: Tier) -> dict[str, Any]:
        """A standby answers what the acting daemon published beside the root."""
        doc = read_latest_file(root.path)
        if doc is None or not _published_in(doc, tier):
            raise HttpError(404, "no_checkpoint", f"root {root.name!r} has no valid checkpoint"
                            f" in tier {tier.value!r} (as published by the daemon acting on"
                            " it; this one stands by)")
        return {"root": root.name, "step": doc["step"], "path": doc["path"], "state": "valid",
                "local": str(doc.get("local", "")), "remote": str(doc.get("remote", "")),
                "layout": str(doc.get("layout", "")), "metrics": {},
                "holder": self.leases.holder_json(root.name)}

    def set_pin(self, root: str, step: str, pinned: bool) -> dict[str, Any]:
        """Pin or unpin a step (HttpError 404/409), keeping the pins file beside the root."""
        r = self.root(root)
        self.acting(r)
        n = checks.step(step)
        rec = self.store.checkpoint(r.name, n)
        if pinned and rec is not None and not answers.in_tier(rec, Tier.ANY):
            raise HttpError(409, "gone", f"step {n} of {r.name!r} has no copy left to keep")
        with self.retention.nets:
            done = self.store.set_pinned(r.name, n, pinned)
            if not done:
                raise HttpError(404, "no_checkpoint", f"root {r.name!r} has no step {n}")
            beside = self._keep_pins_beside(r)
        get_logger().info("checkpoint_pinned" if pinned else "checkpoint_unpinned",
                          root=r.name, step=n, kept_beside_root=beside)
        self.changes.notify()
        return {"root": r.name, "step": n, "pinned": pinned, "kept_beside_root": beside}

    def _keep_pins_beside(self, r: RootConfig) -> bool:
        """The root's pins file follows the store, so a lost state database keeps them."""
        try:
            write_pins(r.path, self.store.pinned_steps(r.name))
        except OSError as exc:
            get_logger().warning("pins_write_failed", root=r.name, error=str(exc))
            return False
        return True


@dataclass(frozen=True)
class _Published:
    step: int
    state: State
    local: Local
    remote: Remote


def _published_in(doc: dict[str, Any], tier: Tier) -> bool:
    """Whether the step latest.json names (the acting daemon's latest of any tier, so also
    the latest of each tier it is in) has a copy in `tier`, by `answers.in_tier`."""
    try:
        rec = _Published(int(doc["step"]), State.VALID, Local(doc.get("local", "")),
                         Remote(doc.get("remote", "")))
    except (KeyError, TypeError, ValueError):
        return tier is Tier.ANY  # an older document without the copies: any tier only
    return answers.in_tier(rec, tier)


def latest_json(root: RootConfig, rec: CheckpointRecord) -> dict[str, Any]:
    return {"root": root.name, "step": rec.step, "path": str(root.path / rec.path),
            "state": str(rec.state), "local": str(rec.local), "remote": str(rec.remote),
            "layout": rec.layout, "metrics": rec.metrics}


def _rfc3339(t: float | None) -> str | None:
    return None if t is None else datetime.fromtimestamp(t, UTC).isoformat(timespec="seconds")


def disk_free(path: Path) -> int | None:
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None
