"""The state store: SQLite schema and migrations (`schema`); the Store (`store`), assembled from
its queries (`reads`), its transactions and the one way a status changes (`core`), what a scan
records (`sync`), the API's registrations, pins and readers' holds (`intents`), retention's,
the effects' and discovery's events (`events`), a root's own fields (`roots`) and claims and
stage outcomes (`work`); the plain types it hands out (`rows`); and the pins kept beside each
root (`pins`)."""

from ckptd.store.rows import Applied, Found, Job, SyncChange
from ckptd.store.schema import MIGRATIONS
from ckptd.store.store import PERMANENT_RETRY_S, RETRY_BASE_S, RETRY_MAX_S, Store

__all__ = ["MIGRATIONS", "PERMANENT_RETRY_S", "RETRY_BASE_S", "RETRY_MAX_S", "Applied", "Found",
           "Job", "Store", "SyncChange"]
