"""The discovery service: learns what the remote holds that the store does not know (a fresh
node, a lost state dir) and which recorded uploads are gone from it.

Owns when each uploading root's remote is listed (at start, then periodically, and on demand
before a listing, at most every few seconds). Every listing runs on the service's own thread,
on the call board (stage `discover`): a store that stalls shows as a stuck call in health, and
a client asking for a listing waits at most REQUEST_WAIT_S for it, then gets what the store
knows. Records what it finds as lifecycle events. A
remote step whose MANIFEST.json cannot be read (over its cap, not strict JSON, malformed,
refused by the store) costs only itself: it is skipped and reported (`bad_remote`, the log
event `bad_remote_item`, the gauge `ckptd_bad_inputs{kind="remote"}`), the rest are added. Reads
time only from the clock it is given.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import Any

from ckptd.backends.base import Backend, ObjectMeta
from ckptd.clock import SYSTEM, Clock
from ckptd.config import RootConfig
from ckptd.errors import CkptdError, ObjectNotFound
from ckptd.lifecycle import answers
from ckptd.lifecycle.table import Event
from ckptd.log import get_logger
from ckptd.model import RootError
from ckptd.remote import keys as remote
from ckptd.service.metrics import Metrics
from ckptd.service.supervisor import Calls
from ckptd.store import Store

INTERVAL_S = 300.0
MIN_AGE_S = 15.0
# How long `ckptd ls` waits for a fresh listing before it answers from the store.
REQUEST_WAIT_S = 5.0
# One root's listing quiet for longer than this is stuck (health says so, naming the root).
BOUND_S = 300.0
WHO = "discovery"
LOST_AFTER_S = 120.0
# Bad remote items a root's status shows (the gauge counts them all); each error cut short.
MAX_BAD_SHOWN = 20
MAX_ERROR_CHARS = 300


class Discovery:
    """Reconciles the store with each uploading root's committed remote steps."""

    def __init__(self, store: Store, roots: Callable[[], Mapping[str, RootConfig]],
                 backend_for: Callable[[RootConfig], Any],
                 metrics: Metrics | None = None, calls: Calls | None = None,
                 bound_s: float = BOUND_S, clock: Clock = SYSTEM) -> None:
        self.store = store
        self.clock = clock
        self.bound_s = bound_s
        self.calls = calls if calls is not None else Calls(clock)
        # Roots a client asked to see listed afresh, each with the event its waiters wait on.
        self._asked: dict[str, threading.Event] = {}
        self.roots = roots
        self.backend_for = backend_for
        self.metrics = metrics
        # Per root: the remote items the last listing skipped (key, error), at most
        # MAX_BAD_SHOWN of them, and how many there were.
        self._bad: dict[str, tuple[list[dict[str, str]], int]] = {}
        # Per root: bad manifests by key, with the (size, mtime, etag) they were read at.
        self._bad_seen: dict[str, dict[str, tuple[tuple[Any, ...], str]]] = {}
        self._seen: dict[str, float] = {}
        # Steps recorded uploaded but absent from the listings since (monotonic) time T.
        self._missing: dict[str, dict[int, float]] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._all = threading.Event()  # every root is to be listed at the next turn
        self.log = get_logger()

    def run(self, stop: threading.Event) -> None:
        """Every root at start, then every INTERVAL_S (or when woken by a reload); between
        those, the roots clients asked for (`request`)."""
        due = 0.0
        while not stop.is_set():
            if self.clock.monotonic() >= due or self._all.is_set():
                self._all.clear()
                due = self.clock.monotonic() + INTERVAL_S
                names, age = list(self.roots()), 0.0
            else:
                names, age = self._take_asked(), MIN_AGE_S
            for name in names:
                if stop.is_set():
                    return
                self.refresh(name, max_age=age)
                self._answer(name)
            self._wake.wait(max(0.0, due - self.clock.monotonic()))
            self._wake.clear()

    def wake(self) -> None:
        """List every root now (a reload, roots gained)."""
        self._all.set()
        self._wake.set()

    def request(self, name: str, wait_s: float = REQUEST_WAIT_S) -> None:
        """A fresh listing of `name` before a client's `ls`, unless one is younger than
        MIN_AGE_S: asked of the service's thread and waited for at most `wait_s`, so a store
        that stalls costs the client that long, never more (the listing goes on, on the board)."""
        with self._lock:
            if self.clock.monotonic() - self._seen.get(name, -1e9) < MIN_AGE_S:
                return
            done = self._asked.setdefault(name, threading.Event())
        self._wake.set()
        done.wait(wait_s)

    def _take_asked(self) -> list[str]:
        with self._lock:
            return list(self._asked)

    def _answer(self, name: str) -> None:
        with self._lock:
            done = self._asked.pop(name, None)
        if done is not None:
            done.set()

    def bad_remote(self, name: str) -> list[dict[str, str]]:
        """The root's remote items the last listing skipped: [{"key", "error"}], bounded."""
        with self._lock:
            return [dict(item) for item in self._bad.get(name, ([], 0))[0]]

    def refresh(self, name: str, max_age: float = MIN_AGE_S) -> None:
        """List the root's committed steps unless that was done in the last `max_age` s.
        The remote being down is logged and never breaks a listing or startup."""
        root = self.roots().get(name)
        backend = self.backend_for(root) if root is not None else None
        if backend is None:
            return
        with self._lock:
            if self.clock.monotonic() - self._seen.get(name, -1e9) < max_age:
                return
            self._seen[name] = self.clock.monotonic()
        uploaded = {r.step for r in self.store.checkpoints(name) if answers.is_committed(r)}
        self.calls.begin(WHO, "discover", name, None, self.bound_s)
        try:
            if root is not None and root.multi_node:
                self._probe(name, backend)
            manifests = remote.committed_manifests(backend, name)
            steps = set(manifests)
            added, bad = self._add_unknown(name, backend, manifests)
        except Exception as exc:  # broad: a down remote is a warning, not a crash
            self.log.warning("remote_list_failed", root=name, error=str(exc))
            return
        finally:
            self.calls.end(WHO)
        self._report_bad(name, bad)
        lost = self._mark_lost(name, uploaded - steps)
        if added or lost:
            self.log.info("remote_checkpoints_found", root=name, added=added, lost=lost or None)

    def _probe(self, name: str, backend: Backend) -> None:
        """A multi-node root at start: does the store enforce create-only writes? Where it
        does not, the root refuses to commit, and status says why (docs/MULTINODE.md)."""
        from ckptd.errors import PermanentError
        from ckptd.stages.multinode.parts import require_create_only

        try:
            require_create_only(backend, name)
        except PermanentError as exc:
            self.log.error("create_only_refused", root=name, error=str(exc))
            self.store.set_root_error(name, RootError.UPLOAD, f"upload: {exc}",
                                      self.clock.time())

    def _add_unknown(self, name: str, backend: Backend,
                     manifests: Mapping[int, ObjectMeta]) -> tuple[int, list[dict[str, str]]]:
        """Add the committed steps the store does not know; a manifest that cannot be read is
        skipped and returned as a bad item (one gone since the listing is simply skipped). A
        bad manifest unchanged since the last listing (key, size, mtime, etag) is not read
        again: its error stands."""
        added = 0
        bad: list[dict[str, str]] = []
        before = self._bad_seen.get(name, {})
        seen: dict[str, tuple[tuple[Any, ...], str]] = {}
        for step in sorted(manifests):
            if self.store.checkpoint(name, step) is not None:
                continue
            meta = manifests[step]
            version = (meta.size, meta.mtime, meta.etag)
            known = before.get(meta.key)
            if known is not None and known[0] == version:
                seen[meta.key] = known
                bad.append({"key": meta.key, "error": known[1]})
                continue
            try:
                manifest = remote.read_manifest(backend, name, step)
            except ObjectNotFound:
                continue
            except CkptdError as exc:
                error = str(exc)[:MAX_ERROR_CHARS]
                self.log.warning("bad_remote_item", root=name, key=meta.key, error=str(exc))
                seen[meta.key] = (version, error)
                bad.append({"key": meta.key, "error": error})
                continue
            added += self.store.add_remote_only(name, manifest, self.clock.time())
        self._bad_seen[name] = seen
        return added, bad

    def _report_bad(self, name: str, bad: list[dict[str, str]]) -> None:
        with self._lock:
            self._bad[name] = (bad[:MAX_BAD_SHOWN], len(bad))
        if self.metrics is not None:
            self.metrics.bad_inputs(name, "remote", len(bad))

    def _mark_lost(self, name: str, absent: set[int]) -> list[int]:
        """Steps recorded uploaded (before the listing began) whose manifest has been absent
        from every listing for LOST_AFTER_S: no longer had remotely. A single listing is not
        enough: retention deletes a remote step before it records the deletion."""
        now = self.clock.monotonic()
        before = self._missing.get(name, {})
        since = {step: before.get(step, now) for step in absent}
        self._missing[name] = since
        lost = sorted(step for step, t in since.items() if now - t >= LOST_AFTER_S)
        for step in lost:
            if self.store.record(name, step, Event.REMOTE_LOST, self.clock.time()):
                self.log.warning("remote_copy_lost", root=name, step=step)
        return lost
