"""A root's lifecycle `Policy`, read from its config: the one place a root's settings become
what the lifecycle asks of its checkpoints (which stages, when a step counts, sending early).
Reads the config only; the rules that use the policy live in `lifecycle.table`.
"""

from __future__ import annotations

from ckptd.config import RootConfig
from ckptd.lifecycle.table import Policy


def policy_of(root: RootConfig) -> Policy:
    """What the lifecycle needs of a root's config to know which stages its checkpoints need:
    a compressed copy when it uploads or may keep copies instead of originals; on a
    multi-node root a step counts only once committed."""
    return Policy(uploads=root.upload.enabled, keeps_copies=root.retention.local.compress_older,
                  committed_only=root.multi_node)
