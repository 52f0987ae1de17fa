"""A root's own fields in the state store, beside its checkpoints: its last error (set by
whichever service failed on it, cleared when that works again) and the latest step it published.
Never touches a checkpoint's row.
"""

from __future__ import annotations

from ckptd.model import RootError
from ckptd.store.core import Core


class Roots(Core):
    """A root's last error and its published latest."""

    def set_root_error(self, root: str, kind: RootError, error: str, now: float) -> None:
        """The root's error of `kind`, shown in status until one of its kinds is cleared."""
        with self._tx() as db:
            self._set_error(db, root, kind, error, now)

    def clear_root_error(self, root: str, *kinds: RootError) -> None:
        """The cause of the root's last error is gone (the stage or scan that failed has
        since succeeded): status stops showing it, if it is of one of `kinds`."""
        with self._tx() as db:
            db.executemany("UPDATE roots SET last_error='', last_error_at=NULL,"
                           " last_error_kind='' WHERE name=? AND last_error_kind=?",
                           [(root, k.value) for k in kinds])

    def set_published_latest(self, root: str, step: int | None, doc: str = "") -> None:
        with self._tx() as db:
            db.execute("INSERT INTO roots (name, latest_step, latest_doc) VALUES (?,?,?)"
                       " ON CONFLICT(name) DO UPDATE SET latest_step=excluded.latest_step,"
                       " latest_doc=excluded.latest_doc", (root, step, doc))
