"""The state store: SQLite schema and migrations (`schema`), the Store (`store`) that persists
what the lifecycle table decides, and the plain types it hands out (`rows`)."""

from ckptd.store.rows import Applied, Found, Job, SyncChange
from ckptd.store.schema import MIGRATIONS
from ckptd.store.store import PERMANENT_RETRY_S, RETRY_BASE_S, RETRY_MAX_S, Store

__all__ = ["MIGRATIONS", "PERMANENT_RETRY_S", "RETRY_BASE_S", "RETRY_MAX_S", "Applied", "Found",
           "Job", "Store", "SyncChange"]
