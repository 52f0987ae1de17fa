"""Runs every long-lived thread of the daemon as a supervised service, and watches the calls
they make.

Owns the service threads: a service that raises is logged with its traceback, reported in
health, and restarted with backoff. Owns the call board (`Calls`): a service (or a job's own
thread) says "busy with (stage, root, step) since T" and beats while it makes progress; one
quiet past its bound is stuck, which health shows at once as degraded, naming the stage and
the item (docs/OPERATIONS.md, "Health"). Knows nothing of what the services do; judges time
only by the clock it is given (a stop's wait for threads is real time).
"""

from __future__ import annotations

import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ckptd.clock import SYSTEM, Clock
from ckptd.log import get_logger

BACKOFF_BASE_S = 0.5
BACKOFF_MAX_S = 30.0
# A service that ran this long since its last start counts as recovered: backoff starts over.
HEALTHY_AFTER_S = 60.0

# How often the supervisor looks for calls that went past their bound (and back).
WATCH_EVERY_S = 0.5

Run = Callable[[threading.Event], None]


@dataclass
class Call:
    """One call a service (or a job's thread) is in: a stage on one item, and when it last
    showed progress."""

    who: str
    stage: str
    root: str
    step: int | None  # None: a loop over every root (the scan), not one item
    bound_s: float
    since: float  # wall clock, when the call began
    beat: float  # monotonic, the last sign of progress
    progress: Callable[[], object] | None = None  # a value that moves while it works
    seen: object = None
    reported: bool = False  # on_stuck was told it is stuck

    def quiet_s(self, now: float) -> float:
        return max(0.0, now - self.beat)

    def as_json(self, now: float) -> dict[str, Any]:
        return {"stage": self.stage, "root": self.root or None, "step": self.step,
                "since": round(self.since, 3), "quiet_s": round(self.quiet_s(now), 3),
                "bound_s": self.bound_s}

    def item(self) -> str:
        return self.stage if self.step is None else f"{self.stage} of {self.root} step {self.step}"

    def words(self, now: float) -> str:
        return (f"{self.item()}: no progress for {self.quiet_s(now):.0f} s (bound"
                f" {self.bound_s:g} s)")


class Calls:
    """The call board: who is busy with what, since when, and who went quiet past its bound.
    Thread-safe; `beat` is cheap (called for every chunk a stage reads)."""

    def __init__(self, clock: Clock = SYSTEM) -> None:
        self.clock = clock
        self._lock = threading.Lock()
        self._calls: dict[str, Call] = {}

    def begin(self, who: str, stage: str, root: str, step: int | None, bound_s: float,
              progress: Callable[[], object] | None = None) -> None:
        """`who` is busy with `stage` on (root, step) from now; quiet for `bound_s` seconds
        (no `beat`, no move of `progress`) it is stuck."""
        call = Call(who, stage, root, step, bound_s, self.clock.time(), self.clock.monotonic(),
                    progress)
        with self._lock:
            self._calls[who] = call

    def beat(self, who: str) -> None:
        call = self._calls.get(who)
        if call is not None:
            call.beat = self.clock.monotonic()

    def end(self, who: str) -> None:
        with self._lock:
            self._calls.pop(who, None)

    def busy(self, who: str) -> Call | None:
        return self._calls.get(who)

    def all(self) -> list[Call]:
        """Every call in flight, progress counters read (a moved counter is a beat)."""
        now = self.clock.monotonic()
        with self._lock:
            calls = list(self._calls.values())
        for call in calls:
            if call.progress is not None:
                try:
                    seen = call.progress()
                except Exception:  # noqa: BLE001 - a counter that fails shows no progress
                    continue
                if seen != call.seen:
                    call.seen, call.beat = seen, now
        return calls

    def stuck(self) -> list[Call]:
        """The calls quiet for longer than their bound."""
        now = self.clock.monotonic()
        return [c for c in self.all() if c.quiet_s(now) > c.bound_s]


@dataclass
class _Service:
    name: str
    run: Run
    halt: Callable[[], None] | None
    thread: threading.Thread | None = None
    state: str = "starting"  # starting | running | restarting | stopped
    restarts: int = 0
    last_error: str = ""
    last_crash: float | None = None
    started: float = 0.0  # monotonic, when it last started


class Supervisor:
    """Starts services, restarts the ones that fail, stops them in reverse order."""

    def __init__(self, on_crash: Callable[[str], None] | None = None,
                 backoff_base: float = BACKOFF_BASE_S, backoff_max: float = BACKOFF_MAX_S,
                 on_stuck: Callable[[Call, bool], None] | None = None,
                 clock: Clock = SYSTEM) -> None:
        """`on_stuck(call, True)` once when a call goes past its bound, `(call, False)` when
        it moves again or ends; `clock` times the calls, the restarts and the backoff's
        start-over (the waits themselves are on the stop events)."""
        self.clock = clock
        self.calls = Calls(clock)
        self._on_stuck = on_stuck
        self._reported: dict[int, Call] = {}
        self._watcher: threading.Thread | None = None
        self._services: dict[str, _Service] = {}
        self._stop = threading.Event()
        self._stops: dict[str, threading.Event] = {}
        self._on_crash = on_crash
        self._base, self._max = backoff_base, backoff_max
        self._lock = threading.Lock()
        self.log = get_logger()

    def add(self, name: str, run: Run, halt: Callable[[], None] | None = None) -> None:
        """Register a service: `run(stop)` works until `stop` is set, then returns; `halt`
        (optional) makes a blocking `run` return (e.g. a server's shutdown)."""
        self._services[name] = _Service(name, run, halt)
        self._stops[name] = threading.Event()

    def start(self, *names: str) -> None:
        if self._watcher is None:
            self._watcher = threading.Thread(target=self._watch, daemon=True,
                                             name="ckptd-supervisor")
            self._watcher.start()
        for name in names or tuple(self._services):
            svc = self._services[name]
            if svc.thread is None:
                svc.thread = threading.Thread(target=self._keep, args=(svc,), daemon=True,
                                              name=f"ckptd-{name}")
                svc.thread.start()

    def stop(self, *names: str, timeout: float = 10.0) -> bool:
        """Stop the named services (all, newest first, when none named); True if all ended
        within `timeout` seconds."""
        chosen = [self._services[n] for n in (names or reversed(tuple(self._services)))]
        if not names:
            self._stop.set()  # the call watcher too
        for svc in chosen:
            self._stops[svc.name].set()
            if svc.halt is not None:
                try:
                    svc.halt()
                except Exception as exc:  # a halt that fails must not stop the others
                    self.log.warning("service_halt_failed", service=svc.name, error=str(exc))
        # A real wait on threads, so on the real clock (a test's clock may stand still).
        deadline = time.monotonic() + timeout
        for svc in chosen:
            if svc.thread is not None:
                svc.thread.join(max(0.0, deadline - time.monotonic()))
        return not any(s.thread is not None and s.thread.is_alive() for s in chosen)

    def stop_watch(self) -> None:
        """No more call reports (the daemon is closing what they would be written to)."""
        self._stop.set()

    def _keep(self, svc: _Service) -> None:
        stop = self._stops[svc.name]
        failures = 0
        while not stop.is_set():
            svc.state, svc.started = "running", self.clock.monotonic()
            try:
                svc.run(stop)
                if stop.is_set():
                    break
                raise RuntimeError("service returned without being stopped")
            except BaseException as exc:  # noqa: BLE001 - anything that ends a service
                if stop.is_set() and isinstance(exc, Exception):
                    break
                ran = self.clock.monotonic() - svc.started
                failures = 1 if ran > HEALTHY_AFTER_S else failures + 1
                delay = min(self._max, self._base * 2 ** (failures - 1))
                self._crashed(svc, exc, delay)
                if not isinstance(exc, Exception):
                    raise  # SystemExit / KeyboardInterrupt end the thread after reporting
                stop.wait(delay)
        svc.state = "stopped"

    def _crashed(self, svc: _Service, exc: BaseException, delay: float) -> None:
        with self._lock:
            svc.state = "restarting"
            svc.restarts += 1
            svc.last_error = f"{type(exc).__name__}: {exc}"
            svc.last_crash = self.clock.time()
        self.log.error("service_crashed", service=svc.name, error=svc.last_error,
                       restart_in_s=round(delay, 3), restarts=svc.restarts,
                       traceback="".join(traceback.format_exception(exc)))
        if self._on_crash is not None:
            try:
                self._on_crash(svc.name)
            except Exception:  # noqa: BLE001 - a metrics hiccup must not stop the restart
                pass

    # -- calls past their bound ---------------------------------------------------------------

    def _watch(self) -> None:
        """Tell `on_stuck` of each call that went past its bound (once) and of each that moved
        again or ended; log both."""
        while not self._stop.wait(WATCH_EVERY_S):
            self.check_calls()

    def stuck(self) -> list[Call]:
        """Calls past their bound, but for those of a service that is not running (stopped,
        restarting: its state says so already)."""
        return [c for c in self.calls.stuck()
                if c.who not in self._services or self._services[c.who].state == "running"]

    def check_calls(self) -> None:
        now = self.clock.monotonic()
        stuck = {id(c): c for c in self.stuck()}
        for key, call in stuck.items():
            if key not in self._reported:
                self._reported[key] = call
                self.log.error("call_stuck", who=call.who, stage=call.stage, root=call.root,
                               step=call.step, quiet_s=round(call.quiet_s(now), 1),
                               bound_s=call.bound_s)
                self._tell(call, True)
        for key in [k for k in self._reported if k not in stuck]:
            call = self._reported.pop(key)
            self.log.info("call_resumed", who=call.who, stage=call.stage, root=call.root,
                          step=call.step)
            self._tell(call, False)

    def _tell(self, call: Call, stuck: bool) -> None:
        if self._on_stuck is None:
            return
        try:
            self._on_stuck(call, stuck)
        except Exception as exc:  # noqa: BLE001 - a report that fails must not stop the watch
            self.log.warning("stuck_report_failed", who=call.who, error=str(exc))

    # -- health ------------------------------------------------------------------------------

    def running(self) -> bool:
        """Every started service is running (none dead, none waiting to restart)."""
        return all(s.state == "running" and s.thread is not None and s.thread.is_alive()
                   for s in self._services.values() if s.thread is not None)

    def alive(self) -> bool:
        """Nothing degraded: every started service is running and no call is past its bound."""
        return self.running() and not self.stuck()

    def health(self) -> list[dict[str, Any]]:
        """Each service's state ("stuck" while a call of it is past its bound, with `stuck`
        naming the stage and the item), then each stuck call of a job's own thread."""
        now = self.clock.monotonic()
        stuck = {c.who: c for c in self.stuck()}
        with self._lock:
            out = []
            for s in self._services.values():
                state = s.state if s.thread is not None else "idle"
                call = stuck.pop(s.name, None)
                entry = {"name": s.name, "state": "stuck" if call else state,
                         "restarts": s.restarts, "last_error": s.last_error or None,
                         "last_crash": s.last_crash}
                if call is not None:
                    entry["stuck"] = call.as_json(now)
                out.append(entry)
        out += [{"name": c.who, "state": "stuck", "restarts": 0, "last_error": None,
                 "last_crash": None, "stuck": c.as_json(now)} for c in stuck.values()]
        return out
