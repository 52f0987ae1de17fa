"""The state store: one SQLite file (WAL), the checkpoints' statuses, the transition log,
workers' claims and readers' holds: the single source of truth of the daemon. No SQL lives
outside `ckptd.store`.

`Store` is assembled from its parts: reads (queries), core (transactions and the one way a
status changes), sync (what a scan records), intents (the API's registrations, pins and
readers' holds), events (retention's, the effects' and discovery's events), roots (a root's
last error and published latest) and work (claims and stage outcomes).
"""

from __future__ import annotations

from ckptd.store.events import Events
from ckptd.store.intents import Intents
from ckptd.store.roots import Roots
from ckptd.store.sync import Sync
from ckptd.store.work import PERMANENT_RETRY_S, RETRY_BASE_S, RETRY_MAX_S, Work

__all__ = ["PERMANENT_RETRY_S", "RETRY_BASE_S", "RETRY_MAX_S", "Store"]


class Store(Sync, Intents, Events, Roots, Work):
    """The state store of one daemon."""
