"""Multi-node roots, as this daemon's workers see them (docs/MULTINODE.md): the steps whose part
is written and that wait for their commit, the nodes known to write the root, when to look
again. Memory only: a restart looks at the store's parts afresh. Decides nothing of the commit.
"""

from __future__ import annotations

import threading
from typing import Any

from ckptd.lifecycle import answers
from ckptd.model import CheckpointRecord, Tier
from ckptd.stages.multinode.parts import NotCommitted


def newest_local(records: list[CheckpointRecord]) -> CheckpointRecord | None:
    """The newest valid step on disk, committed or not (a multi-node root's latest is the
    newest committed one): `answers.latest` without `committed_only`."""
    return answers.latest(records, Tier.LOCAL, committed_only=False)


KEPT = 10_000  # committed steps remembered (their nodes, for `ls`)


class Waiting:
    """Multi-node roots: the steps waiting for their commit, with the nodes missing (for
    `status`) and each node's part state (for `ls`); how long until the next look."""

    FIRST_S = 0.5
    MOST_S = 4.0

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._steps: dict[tuple[str, int], tuple[int, list[str], dict[str, str]]] = {}
        self._known: dict[str, set[str]] = {}
        self._committed: dict[tuple[str, int], tuple[str, ...]] = {}  # the newest KEPT

    def wait(self, root: str, step: int, exc: NotCommitted) -> float:
        with self._lock:
            looks = self._steps.get((root, step), (0, [], {}))[0]
            self._steps[(root, step)] = (looks + 1, exc.missing_nodes, exc.states)
            self._known.setdefault(root, set()).update(exc.states)
        return float(min(self.MOST_S, self.FIRST_S * 2.0 ** looks))

    def done(self, root: str, step: int, nodes: tuple[str, ...]) -> None:
        """The step is committed with `nodes`' parts."""
        with self._lock:
            self._steps.pop((root, step), None)
            self._committed[(root, step)] = nodes
            self._known.setdefault(root, set()).update(nodes)
            while len(self._committed) > KEPT:
                self._committed.pop(next(iter(self._committed)))

    def committed(self, root: str, step: int) -> tuple[str, ...] | None:
        with self._lock:
            return self._committed.get((root, step))

    def known(self, root: str) -> frozenset[str]:
        """The root's nodes this daemon knows of (the caller looks up the latest commit's
        while fewer than the root's `nodes` are known, and tells `learn`)."""
        with self._lock:
            return frozenset(self._known.get(root, ()))

    def learn(self, root: str, nodes: set[str]) -> frozenset[str]:
        """Add `nodes` to the root's known nodes; all of them now."""
        with self._lock:
            have = self._known.setdefault(root, set()) | nodes
            self._known[root] = have
        return frozenset(have)

    def uncommitted(self, root: str, nodes: int) -> list[dict[str, Any]]:
        """`missing_nodes`: the known nodes with no part of the save; `unseen_nodes`: how many
        of the root's `nodes` this daemon cannot name (no part, in no commit it has seen),
        each of them missing too."""
        with self._lock:
            known = self._known.get(root, set())
            out = []
            for (r, step), (_n, missing, states) in sorted(self._steps.items()):
                if r == root:
                    # Missing at the step's last look, and nodes learned of since (from other
                    # steps) that have no part of this one.
                    gone = sorted(set(missing) | (known - set(states)))
                    seen = len(known | set(states) | set(missing))
                    out.append({"step": step, "missing_nodes": gone,
                                "unseen_nodes": max(0, nodes - seen)})
            return out

    def node_states(self, root: str, step: int) -> dict[str, str] | None:
        with self._lock:
            hit = self._steps.get((root, step))
        return dict(hit[2]) if hit else None
