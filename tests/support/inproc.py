"""A ckptd Daemon inside the test process on its real Unix socket, and pipeline-level access to
a real Store, real roots and real checkpoint files. The only test code that touches ckptd's
daemon internals: anything beyond Daemon(config, path), start/stop/reload and read-only `store`
queries (the workers' flush, the scanner's wake) goes through a method here."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

from ckptd.backends import BackendCache
from ckptd.client import Client
from ckptd.clock import SYSTEM, Clock
from ckptd.config import Config, RootConfig, load_config
from ckptd.daemon import Daemon
from ckptd.lifecycle.policy import policy_of
from ckptd.service.metrics import Metrics
from ckptd.service.workers import Workers
from ckptd.store import Found, Store
from ckptd.watch.scanner import OpenFiles, RootScanner
from support.config import Layout
from support.proc import wait_for_state
from support.wait import wait_until


class InProcessDaemon:
    """`Daemon(load_config(path), path)` started in this process; stopped in a finally by the
    fixture that made it. Its log events land in `events_log` (structlog, captured)."""

    def __init__(self, layout: Layout, events_log: list[dict[str, Any]],
                 clock: Clock = SYSTEM) -> None:
        self.layout = layout
        self.clock = clock  # what its services read the time from
        self._events = events_log
        self._daemon: Daemon | None = None

    # -- what it was started with -----------------------------------------------------------

    @property
    def config(self) -> Path:
        return self.layout.config

    @property
    def socket(self) -> Path:
        return self.layout.socket

    @property
    def state_dir(self) -> Path:
        return self.layout.state_dir

    @property
    def roots(self) -> dict[str, Path]:
        return self.layout.roots

    @property
    def client(self) -> Client:
        return Client(self.socket, timeout=10.0, strict=True)

    # -- life --------------------------------------------------------------------------------

    def start(self) -> InProcessDaemon:
        assert self._daemon is None, "already running"
        # A daemon in the test process stands for a daemon process of its own: the CKPTD_*
        # variables a test sets are the client's side (a socket that answers nobody, a node),
        # so it reads its config file alone, at start and on reload (tests/config/
        # test_config_env.py runs `ckptd run` to see the variables override it).
        env = {k: v for k, v in os.environ.items() if not k.startswith("CKPTD_")}
        daemon = Daemon(load_config(self.config, env=env), self.config, clock=self.clock,
                        env=env)
        try:
            daemon.start()
        except BaseException:
            daemon.stop(grace=5.0)
            raise
        self._daemon = daemon
        return self

    def stop(self, grace: float | None = None) -> None:
        """A graceful stop, as SIGTERM gives (idempotent); `grace` shortens the time in-flight
        stages get to finish."""
        daemon, self._daemon = self._daemon, None
        if daemon is not None:
            if grace is None:
                daemon.stop()
            else:
                daemon.stop(grace=grace)

    def restart(self) -> InProcessDaemon:
        self.stop()
        return self.start()

    @property
    def running(self) -> bool:
        return self._daemon is not None

    def _d(self) -> Daemon:
        assert self._daemon is not None, "the daemon is not running"
        return self._daemon

    # -- what signals do to a process, called directly ----------------------------------------

    def reload(self) -> bool:
        """What SIGHUP does: re-read the config file; False when it was refused."""
        return self._d().reload()

    def request_flush(self) -> dict[str, int]:
        """What SIGUSR1 does: the newest valid step of each uploading root goes first."""
        return self._d().workers.flush()

    def wake_scan(self) -> None:
        self._d().scanner.wake()

    def wake_lease(self) -> None:
        """A look at every root's lease now (after a test moved the clock, say)."""
        self._d().leases.wake()

    def list_remote(self, root: str, timeout: float = 60.0) -> None:
        """A fresh listing of `root`'s remote by the daemon's discovery thread, waited for. A
        client's `ls` waits for one at most REQUEST_WAIT_S, then answers from the store: on a
        loaded machine the listing can come after a test has moved the clock again."""
        self._d().discovery.request(root, wait_s=timeout)

    @property
    def store(self) -> Store:
        """The daemon's store, for read-only queries."""
        store = self._d().store
        assert store is not None
        return store

    # -- observing ----------------------------------------------------------------------------

    def events(self, name: str) -> list[dict[str, Any]]:
        return [e for e in list(self._events) if e.get("event") == name]

    def log_text(self) -> str:
        return "\n".join(json.dumps(e, default=str) for e in list(self._events))

    def wait_for(self, root: str, step: int, state: str = "valid", timeout: float = 30.0
                 ) -> dict[str, Any]:
        """Poll the API until `step` of `root` is in `state` (any terminal state returns)."""
        return wait_for_state(Client(self.socket, timeout=5.0), root, step, state, timeout,
                              self.log_text)

    def wait_event(self, name: str, timeout: float = 15.0, count: int = 1
                   ) -> list[dict[str, Any]]:
        """The events named `name`, once there are at least `count` of them."""
        def enough() -> list[dict[str, Any]] | None:
            found = self.events(name)
            return found if len(found) >= count else None

        return wait_until(enough, timeout, f"{count} {name} event(s)",
                          detail=lambda: self.log_text()[-4000:])


class StoreBench:
    """Pipeline-level access without a daemon: a Store on a real SQLite file, the roots of a
    rendered config, and scans run in the test thread. Stages run on a Pipeline started on
    demand (`drain`), so what a test checks is the store's answer after real stage work."""

    def __init__(self, layout: Layout) -> None:
        self.layout = layout
        self.config: Config = load_config(layout.config)
        self.store = Store(layout.state_dir / "state.db")
        self._scanners: dict[str, RootScanner] = {}
        self._workers: Workers | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def root(self, name: str = "r1") -> RootConfig:
        return {r.name: r for r in self.config.roots}[name]

    def scan(self, name: str = "r1", now: float | None = None) -> list[Any]:
        """One scan of a root into the store; the changes it recorded."""
        root = self.root(name)
        scanner = self._scanners.get(name)
        if scanner is None:
            scanner = RootScanner(name, root.path, root.layout, root.options, OpenFiles())
            self._scanners[name] = scanner
        now = time.time() if now is None else now
        _, found = scanner.scan(now, self.store.registrations(name))
        return self.store.sync_root(name, [Found(c, fp) for c, fp in found], now,
                                    unreadable=frozenset(scanner.unreadable))

    def drain(self, name: str = "r1", timeout: float = 30.0) -> None:
        """Run a stage worker until nothing of `name` has a stage due."""
        if self._workers is None:
            roots = {r.name: r for r in self.config.roots}
            self.store.set_policies({n: policy_of(r) for n, r in roots.items()})
            self._workers = Workers(self.store, lambda: roots, 1, lambda: None,
                                    BackendCache().get, Metrics(process=False),
                                    nets=threading.RLock())
            self._thread = threading.Thread(target=self._workers.run,
                                            args=("worker-0", self._stop), daemon=True)
            self._thread.start()
        self._workers.wake()
        wait_until(lambda: self.store.queue_length(name) == 0 and not self._workers.inflight,
                   timeout, f"{name}'s queue to drain")

    def close(self) -> None:
        self._stop.set()
        if self._workers is not None and self._thread is not None:
            self._workers.wake()
            self._thread.join(10.0)
        self.store.close()
