"""Which node of a multi-node root acts alone for it: the coordinator of a committed step, the
node holding that step's commit record. Pure: the caller reads the manifest.
"""

from __future__ import annotations

from collections.abc import Iterable


def coordinates(node: str, nodes: Iterable[tuple[str, str, str]]) -> bool:
    """Whether `node` coordinated the committed step whose manifest names `nodes` (node,
    attempt, commit record): remote retention of a multi-node root is made by the coordinator
    of its newest committed step only, so two nodes never delete the same steps."""
    return any(n == node and record for n, _attempt, record in nodes)
