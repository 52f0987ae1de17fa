"""The retention service: one thread runs every retention run, for every root, one at a time.
Owns when retention runs (after stages, on a timer, under disk pressure, on `run_now`) and who
waits for which run; a run of a root is `run.RetentionRun`'s, and it deletes nothing itself. The
objects a save that will not commit sent early are handed to it (`discard_early`) and deleted
by the executor on this thread, before the root's next run. Reads time only from the clock it
is given.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future, wait
from typing import Any

from ckptd.backends import Backend, ObjectMeta
from ckptd.clock import SYSTEM, Clock
from ckptd.config import RootConfig
from ckptd.errors import NotFound, ServiceUnavailable
from ckptd.log import get_logger
from ckptd.model import RootError
from ckptd.retention import executor, planner
from ckptd.retention.outcomes import Outcome
from ckptd.retention.report import RootHealth, adopted_json, adopted_records, health_json
from ckptd.retention.run import RetentionRun
from ckptd.retention.views import StoreNets, disk_of
from ckptd.service.supervisor import Calls
from ckptd.store import Store

TIMER_S = 60.0
POLL_S = 1.0  # how often the loop looks at free space (and at its stop event)

# `ckptd prune ROOT` waits 600 s for its answer: give up (503) before it does.
RUN_NOW_TIMEOUT_S = 540.0
# One root's run quiet for longer than this is a stuck call in health (it shows no progress of
# its own: a verify pass over a very large copy takes minutes, a stalled delete forever).
RUN_BOUND_S = 1800.0
# How long run_now waits for a loop that is not running (a restart in progress) to pick it up.
IDLE_WAIT_S = 10.0

Waiters = dict[str, list["Future[list[Outcome]]"]]
Discards = dict[str, list[tuple[int, dict[str, ObjectMeta]]]]  # root -> (step, objects sent)


class RetentionService:
    """Every retention run happens on the thread inside `run`, so two never overlap, whoever
    asked (a stage, the timer, disk pressure, `POST /v1/roots/{root}/prune` through `run_now`).

    A run's local-delete phase holds two locks: `exclusive`, which scans take (a scan never
    sees a checkpoint half moved), and `nets`, which pins and readers' holds take (none lands
    between the nets' reading and the last delete). Pins never wait on a scan: they share no
    lock (see docs/DESIGN.md for what may interleave with what).
    """

    def __init__(self, store: Store, roots: Callable[[], Mapping[str, RootConfig]],
                 backend_for: Callable[[RootConfig], Backend | None], *,
                 timer_s: float = TIMER_S, api_timeout: float = RUN_NOW_TIMEOUT_S,
                 node: str = "", calls: Calls | None = None,
                 bound_s: float = RUN_BOUND_S, nets: threading.RLock | None = None,
                 clock: Clock = SYSTEM) -> None:
        """`nets`: the lock pins, readers' holds and every executor call take (the daemon's
        one, shared with start-up recovery, the workers and the effects hook); `clock`: what
        the timer and every run's `now` are read from."""
        self.clock = clock
        self.store = store
        self.calls = calls if calls is not None else Calls(clock)
        self.bound_s = bound_s
        self.roots = roots
        self.timer_s = timer_s
        self.api_timeout = api_timeout
        self.exclusive = threading.RLock()
        self.nets = nets if nets is not None else threading.RLock()
        self.log = get_logger()
        self.backend_for = backend_for
        self._runner = RetentionRun(store, backend_for, self.exclusive, self.nets, node, clock)
        self._mutex = threading.Lock()  # guards the four fields below
        self._discards: Discards = {}
        self._wanted: set[str] = set()
        self._waiting: Waiters = {}
        self._loop_thread: int | None = None
        self._wake = threading.Event()

    # -- asking for runs ---------------------------------------------------------------------

    def request(self, root: str) -> None:
        """Run `root` soon (coalesced with other requests); returns at once."""
        with self._mutex:
            self._wanted.add(root)
        self._wake.set()

    def discard_early(self, root: str, step: int, sent: Mapping[str, ObjectMeta]) -> None:
        """A save of `step` will not commit: have the executor delete the objects it sent
        early (`sent`, each as it was put) on this service's thread, soon; returns at once."""
        with self._mutex:
            self._discards.setdefault(root, []).append((step, dict(sent)))
        self.request(root)

    def _discard(self, root: RootConfig) -> None:
        """The discards handed over for `root`, through the executor (best effort: what is
        left is a straggler; `discard_early` never raises)."""
        with self._mutex:
            todo = self._discards.pop(root.name, [])
        if not todo:
            return
        try:
            backend = self.backend_for(root)
        except Exception as exc:  # noqa: BLE001 - a bad remote: the upload stage says why
            self.log.warning("early_objects_kept", root=root.name, why=str(exc))
            return
        if backend is None:
            return
        nets = StoreNets(self.store, root, self.nets, self.clock.time)
        for step, sent in todo:
            executor.discard_early(backend, root.name, step, sent, nets=nets)

    def run_now(self, root: str, timeout: float = RUN_NOW_TIMEOUT_S) -> list[Outcome]:
        """Have the retention thread run `root` (a run that starts after this call) and return
        its outcomes. Raises what the run raised, NotFound for an unknown root, and
        ServiceUnavailable when no run of it finished within `timeout` (at most IDLE_WAIT_S
        when the loop is not running: nothing was done then)."""
        if root not in self.roots():
            raise NotFound(f"no root named {root!r}")
        fut: Future[list[Outcome]] = Future()
        with self._mutex:
            if self._loop_thread == threading.get_ident():
                raise RuntimeError("run_now on the retention thread would wait for itself")
            self._waiting.setdefault(root, []).append(fut)
            running = self._loop_thread is not None
        self._wake.set()
        first = timeout if running else min(timeout, IDLE_WAIT_S)
        if not wait([fut], first).done:
            if self._withdraw(root, fut):
                why = "is not running" if not running else f"did not get to it in {first:g}s"
                raise ServiceUnavailable(f"retention of root {root!r} was not run: the"
                                         f" retention service {why}")
            if not wait([fut], max(0.0, timeout - first)).done:
                raise ServiceUnavailable(f"retention of root {root!r} did not finish within"
                                         f" {timeout:g}s; it goes on in the background")
        return fut.result()

    def _withdraw(self, root: str, fut: Future[list[Outcome]]) -> bool:
        """Take back a run_now the loop has not picked up; False when it has."""
        with self._mutex:
            futures = self._waiting.get(root, [])
            if fut not in futures:
                return False
            futures.remove(fut)
            if not futures:
                del self._waiting[root]
            return True

    # -- the loop ----------------------------------------------------------------------------

    def run(self, stop: threading.Event) -> None:
        """Run retention until `stop` is set: every root at once, then as asked, on the timer and
        under disk pressure. One root's failed run is logged, recorded as its error and raised
        to its run_now callers; any other exception escapes (the loop is then not running)."""
        self._enter()
        try:
            next_timer = self.clock.monotonic()
            while not stop.is_set():
                self._wake.clear()
                if self.clock.monotonic() >= next_timer:
                    next_timer = self.clock.monotonic() + self.timer_s
                    self._want(self.roots())
                self._want(self._pressured())
                self._serve_all(stop)
                self._wake.wait(POLL_S)
        finally:
            self._leave(stop.is_set())

    def _enter(self) -> None:
        with self._mutex:
            if self._loop_thread is not None:
                raise RuntimeError("the retention loop is already running")
            self._loop_thread = threading.get_ident()

    def _leave(self, stopped: bool) -> None:
        with self._mutex:
            self._loop_thread = None
            # Stopped on purpose: nobody will serve them. After a crash a restart may.
            waiting, self._waiting = (self._waiting, {}) if stopped else ({}, self._waiting)
        for futures in waiting.values():
            for fut in futures:
                fut.set_exception(ServiceUnavailable("the retention service stopped"))

    def _want(self, names: Iterable[str]) -> None:
        with self._mutex:
            self._wanted.update(names)

    def _pressured(self) -> list[str]:
        """Roots whose free space is under min_free: prune now, not at the next timer."""
        out = []
        for root in self.roots().values():
            disk = disk_of(root)
            if disk is not None and disk.free_bytes < disk.min_free_bytes:
                out.append(root.name)
        return out

    def _serve_all(self, stop: threading.Event) -> None:
        """Run every root asked for, those a caller waits on first; one run serves every
        run_now of its root that was waiting when it started."""
        with self._mutex:
            waiting, self._waiting = self._waiting, {}
            wanted, self._wanted = self._wanted, set()
        order = sorted(waiting) + sorted(wanted - waiting.keys())
        served = 0
        try:
            for name in order:
                if stop.is_set():
                    return
                self._serve(name, waiting.get(name, []))
                served += 1
        finally:  # stopped, or crashed: what is left waits for the next loop (or its stop)
            self._give_back(order[served:], waiting, wanted)

    def _give_back(self, names: list[str], waiting: Waiters, wanted: set[str]) -> None:
        with self._mutex:
            for name in names:
                left = [f for f in waiting.get(name, []) if not f.done()]
                if left:
                    self._waiting.setdefault(name, [])[:0] = left
            self._wanted.update(n for n in names if n in wanted)

    def _serve(self, name: str, futures: list[Future[list[Outcome]]]) -> None:
        root = self.roots().get(name)
        if root is None:  # removed by a reload since it was asked for
            for fut in futures:
                fut.set_exception(NotFound(f"no root named {name!r}"))
            return
        try:
            # A caller waiting is `ckptd prune --apply`: the user's say-so for adopted ones.
            self.calls.begin("retention", "retention", name, None, self.bound_s)
            try:
                self._discard(root)
                outcomes = self._runner.run(root, delete_adopted=bool(futures))
            finally:
                self.calls.end("retention")
        except Exception as exc:  # one root's failure must not stop the others' retention
            try:
                self.log.error("prune_run_failed", root=name, error=str(exc), exc_info=True)
                self.store.set_root_error(name, RootError.RETENTION, f"retention: {exc}",
                                          self.clock.time())
            finally:  # even when recording fails, nobody is left waiting
                for fut in futures:
                    fut.set_exception(exc)
            return
        self.store.clear_root_error(name, RootError.RETENTION)  # a run went through again
        for fut in futures:
            fut.set_result(outcomes)

    # -- reads -------------------------------------------------------------------------------

    def plan(self, root: str, now: float | None = None) -> planner.Plan:
        """The plan as it stands (what `ckptd prune --dry-run` prints); reads only, on the
        caller's thread."""
        config = self.roots().get(root)
        if config is None:
            raise NotFound(f"no root named {root!r}")
        return self._runner.plan(config, self.clock.time() if now is None else now)

    def health(self, root: str) -> RootHealth | None:
        return self._runner.health.get(root)

    # -- what the API asks ---------------------------------------------------------------------

    def wake(self) -> None:
        self._wake.set()

    def plan_json(self, root: RootConfig) -> dict[str, Any]:
        return self.plan(root.name).as_json(root.name)

    def apply_now(self, root: RootConfig) -> list[dict[str, Any]]:
        return [o.as_json() for o in self.run_now(root.name, self.api_timeout)]

    def adopted_json(self, root: RootConfig) -> dict[str, Any] | None:
        """What retention does with the checkpoints that were there before ckptd: `held` are
        kept only because they are adopted (a `ckptd prune --apply` would delete them; an
        upload of each makes it deletable by the rules)."""
        adopted = adopted_records(self.store.checkpoints(root.name))
        return adopted_json(root.name, adopted, self.plan(root.name)) if adopted else None

    def announce_adopted(self, root: RootConfig) -> None:
        """Say at start what retention will do with the root's adopted checkpoints."""
        adopted = self.adopted_json(root)
        if adopted is not None:
            self.log.info("adopted_checkpoints", root=root.name, count=adopted["count"],
                          held=adopted["held"], message=adopted["message"])

    def health_json(self, name: str) -> dict[str, Any] | None:
        return health_json(self.health(name))

