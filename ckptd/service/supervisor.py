"""Runs every long-lived thread of the daemon as a supervised service.

Owns the service threads: a service that raises is logged with its traceback, reported in
health, and restarted with backoff; the watchdog is fed only while every service is up.
Knows nothing of what the services do.
"""

from __future__ import annotations

import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ckptd.log import get_logger

BACKOFF_BASE_S = 0.5
BACKOFF_MAX_S = 30.0
# A service that ran this long since its last start counts as recovered: backoff starts over.
HEALTHY_AFTER_S = 60.0

Run = Callable[[threading.Event], None]


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
    started: float = field(default_factory=time.monotonic)


class Supervisor:
    """Starts services, restarts the ones that fail, stops them in reverse order."""

    def __init__(self, on_crash: Callable[[str], None] | None = None,
                 backoff_base: float = BACKOFF_BASE_S, backoff_max: float = BACKOFF_MAX_S) -> None:
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
        for svc in chosen:
            self._stops[svc.name].set()
            if svc.halt is not None:
                try:
                    svc.halt()
                except Exception as exc:  # a halt that fails must not stop the others
                    self.log.warning("service_halt_failed", service=svc.name, error=str(exc))
        deadline = time.monotonic() + timeout
        for svc in chosen:
            if svc.thread is not None:
                svc.thread.join(max(0.0, deadline - time.monotonic()))
        return not any(s.thread is not None and s.thread.is_alive() for s in chosen)

    def _keep(self, svc: _Service) -> None:
        stop = self._stops[svc.name]
        failures = 0
        while not stop.is_set():
            svc.state, svc.started = "running", time.monotonic()
            try:
                svc.run(stop)
                if stop.is_set():
                    break
                raise RuntimeError("service returned without being stopped")
            except BaseException as exc:  # noqa: BLE001 - anything that ends a service
                if stop.is_set() and isinstance(exc, Exception):
                    break
                failures = 1 if time.monotonic() - svc.started > HEALTHY_AFTER_S else failures + 1
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
            svc.last_crash = time.time()
        self.log.error("service_crashed", service=svc.name, error=svc.last_error,
                       restart_in_s=round(delay, 3), restarts=svc.restarts,
                       traceback="".join(traceback.format_exception(exc)))
        if self._on_crash is not None:
            try:
                self._on_crash(svc.name)
            except Exception:  # noqa: BLE001 - a metrics hiccup must not stop the restart
                pass

    # -- health ------------------------------------------------------------------------------

    def alive(self) -> bool:
        """Every started service is running (none dead, none waiting to restart)."""
        return all(s.state == "running" and s.thread is not None and s.thread.is_alive()
                   for s in self._services.values() if s.thread is not None)

    def health(self) -> list[dict[str, Any]]:
        with self._lock:
            return [{"name": s.name, "state": s.state if s.thread is not None else "idle",
                     "restarts": s.restarts, "last_error": s.last_error or None,
                     "last_crash": s.last_crash} for s in self._services.values()]
