"""The composition root: builds the store, the services and the API from a Config and wires
them; owns the state-dir lock, signals, startup recovery, reload and graceful stop. Whether the
whole can make progress is `service.health`'s to say.

Decides nothing about checkpoints and runs no loop of its own besides the main thread's
signal/watchdog beat: every other thread is a service under the supervisor.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import threading
import time
from collections.abc import Mapping
from pathlib import Path

from ckptd.api.documents import ApiContext
from ckptd.api.server import UnixHttpServer
from ckptd.backends import BackendCache
from ckptd.clock import SYSTEM, Clock
from ckptd.config import Config, RootConfig, check_installed, load_config, needs_restart
from ckptd.errors import ConfigError
from ckptd.lifecycle.changes import Changes
from ckptd.lifecycle.policy import policy_of
from ckptd.log import get_logger
from ckptd.service import recovery, sdnotify
from ckptd.service.discovery import BOUND_S as DISCOVER_S
from ckptd.service.discovery import Discovery
from ckptd.service.effects import Effects
from ckptd.service.globs import GlobRoots
from ckptd.service.health import Health
from ckptd.service.lease import Leases
from ckptd.service.memory import MemoryService
from ckptd.service.metrics import Metrics, MetricsServer
from ckptd.service.observe import SafeTimes, root_samples, summary
from ckptd.service.persist import PersistService
from ckptd.service.recovery import StateDirLock
from ckptd.service.retention import RUN_BOUND_S as RETENTION_S
from ckptd.service.retention import RetentionService
from ckptd.service.scan import Scanner
from ckptd.service.supervisor import Call, Supervisor
from ckptd.service.workers import Workers
from ckptd.stages.sending import big
from ckptd.store import Store

STOP_GRACE_S, CANCEL_WAIT_S = 20.0, 5.0  # in-flight stages finish, then are cancelled
STATUS_EVERY_S = 10.0


class Daemon:
    def __init__(self, config: Config, config_path: Path | None = None,
                 store_factory: type[Store] = Store, backends: BackendCache | None = None,
                 stage_bounds: Mapping[str, float] | None = None, clock: Clock = SYSTEM,
                 env: Mapping[str, str] | None = None) -> None:
        """`backends` gives each root its backend (a BackendCache by default); `stage_bounds`
        how long a stage call may go without progress before it is stuck (stage -> seconds;
        `workers.STAGE_BOUNDS_S` for the others); `clock` is the one every service reads time
        from (lease, scan, discovery, workers, retention, persist, effects, recovery, the
        supervisor's restarts and call board, the metrics, the API); `env` the environment a
        reload reads `CKPTD_<KEY>` overrides from (the process's unless given)."""
        self.clock = clock
        self.env = env
        self.config = config  # what the services act on: `given` with its globs expanded
        self.given = config  # the config as read from the file
        self.globs = GlobRoots(lambda: self.given, lambda: self.config,
                               functools.partial(self._apply, event="glob_roots_changed"),
                               lambda: self.config.daemon.scan_interval)
        self.config_path = config_path
        self.log = get_logger()
        self.lock = StateDirLock(config.daemon.state_dir)
        self._store_factory = store_factory
        self.changes = Changes()
        self.metrics = Metrics(clock=clock)
        self.backends = backends if backends is not None else BackendCache()
        self._stage_bounds = stage_bounds
        self.supervisor = Supervisor(on_crash=lambda name: self.metrics.error(f"service:{name}"),
                                     on_stuck=self._stuck, clock=clock)
        self._stop = threading.Event()
        self.signals = recovery.SignalInbox(self._stop)
        self.notifier = sdnotify.Notifier.from_env(
            unset=True, on_error=lambda m: self.log.warning("sd_notify_failed", error=m))
        self.watchdog = sdnotify.ProgressWatchdog.from_env(self.notifier)
        self.server: UnixHttpServer | None = None
        self.metrics_tcp: MetricsServer | None = None

    def roots(self) -> dict[str, RootConfig]:
        return {r.name: r for r in self.config.roots}

    # -- wiring ------------------------------------------------------------------------------

    def start(self) -> None:
        """Lock, recover, build and start every service, bind the socket. Raises StateLocked
        when another daemon holds the state dir."""
        self.lock.acquire()
        self.config = cfg = self.globs.expand(self.given)
        self.store = store = self._store_factory(cfg.daemon.state_dir / "state.db")
        store.set_policies({r.name: policy_of(r) for r in cfg.roots})
        nets = threading.RLock()  # pins, readers' holds and every delete read the nets under it
        recovery.recover(store, cfg, nets, self.clock)
        # The socket before the roots: an unusable socket dir stops the start (exit 78)
        # before this daemon takes any root's lease.
        sock, self._socket_inherited = recovery.listen_socket(cfg.daemon)
        # Services see only the roots whose lease this daemon holds (the rest stand by).
        self.leases = leases = Leases(store, self.roots, lambda: self.config.daemon.node_id,
                                      lambda: self.config.daemon.lease_timeout, self._retake,
                                      self.clock)
        acting = leases.acting
        self.retention = RetentionService(store, acting, self.backends.get,
                                          node=cfg.daemon.node_id, calls=self.supervisor.calls,
                                          nets=nets,
                                          bound_s=(self._stage_bounds or {}).get(
                                              "retention", RETENTION_S), clock=self.clock)
        self.scanner = Scanner(store, acting, lambda: self.config.daemon.scan_interval,
                               cfg.daemon.polling, self.metrics, self.retention.exclusive,
                               may_adopt=leases.fresh, clock=self.clock)
        self.workers = Workers(store, acting, cfg.daemon.workers, self.scanner.wake,
                               self.backends.get, self.metrics, nets=self.retention.nets,
                               node=cfg.daemon.node_id,
                               calls=self.supervisor.calls, bounds=self._stage_bounds,
                               clock=self.clock)
        self.discovery = Discovery(store, acting, self.backends.get, self.metrics,
                                   calls=self.supervisor.calls, bound_s=(
                                       self._stage_bounds or {}).get("discover", DISCOVER_S),
                                   clock=self.clock)
        self.effects = Effects(store, acting, self.changes, self.workers, self.retention,
                               self.scanner, self.retention.nets, self.backends.get,
                               clock=self.clock)
        self.metrics.set_samples(lambda: root_samples(store, self.roots(), self.retention,
                                                      leases.holds, self.clock.time()))
        self.metrics.set_roots(self.roots())
        self.metrics.set_health(lambda: (self.ctx.state() == "degraded",
                                         self.supervisor.stuck()))
        store.set_on_commit(SafeTimes(store, self.metrics, self.clock, self.effects))
        self.scanner.set_roots(self.roots())
        leases.tick()  # takes what is free, then scans and publishes only those
        self.memory = MemoryService(lambda: self.config, self.roots,
                                    lambda peer, what: self.persist.check_peer(peer, what),
                                    self.clock)
        self.persist = PersistService(store, self.roots, self.scanner.wake,
                                      lambda: self.config.daemon.socket,
                                      lambda: self.config.daemon.socket_group,
                                      calls=self.supervisor.calls, nets=self.retention.nets,
                                      clock=self.clock, keep=self.memory.keep)
        self.memory.start_peers(cfg.daemon.node_id, self.backends.get)
        self.metrics.set_memory(self.memory.held)
        self.ctx = ApiContext(store, self.roots, self.changes, self.scanner, self.workers,
                              self.retention, self.discovery, self.supervisor, self.metrics,
                              leases, self.persist, clock=self.clock, memory=self.memory)
        self.server = UnixHttpServer(sock, self.ctx)
        self.health = Health(self.supervisor, self.workers, self.scanner, store, self.ctx,
                             lambda: self.config.daemon.scan_interval, STOP_GRACE_S)
        self._add_services()
        self.supervisor.start()
        self.health.watch_scan()
        self.log.info("daemon_ready", socket=str(cfg.daemon.socket), roots=sorted(self.roots()),
                      pid=os.getpid(), socket_activated=self._socket_inherited)
        self.notifier.ready(status=self.summary())

    def _retake(self, gained: set[str]) -> None:
        """The roots this daemon acts on changed: scan them, publish and announce new ones."""
        self.scanner.scan_all()
        for root in (r for n, r in self.leases.acting().items() if n in gained):
            self.effects.publish(root)
            self.retention.announce_adopted(root)
        for service in (self.workers, self.discovery, self.retention):
            service.wake()

    def _add_services(self) -> None:
        sup, server = self.supervisor, self.server
        assert server is not None
        sup.add("api", lambda stop: server.serve_forever(poll_interval=0.1),
                halt=server.shutdown)
        address = self.config.metrics.address
        if address is not None:  # a bad address fails the start here (exit 78)
            tcp = self.metrics_tcp = self.metrics.serve_tcp(address)
            sup.add("metrics", lambda stop: tcp.serve_forever(), halt=tcp.shutdown)
        sup.add("lease", self.leases.run, halt=self.leases.wake)
        sup.add("globs", self.globs.run, halt=self.globs.wake)
        sup.add("watch", self.scanner.watch)
        sup.add("scan", self.scanner.run, halt=self.scanner.wake)
        sup.add("discovery", self.discovery.run, halt=self.discovery.wake)
        sup.add("retention", self.retention.run, halt=self.retention.wake)
        sup.add("persist", self.persist.run)
        sup.add("memory", self.memory.run, halt=self.memory.wake)
        for name in self.workers.names:
            sup.add(name, functools.partial(self.workers.run, name), halt=self.workers.wake)

    def run(self) -> int:
        """Serve until SIGTERM/SIGINT; then stop gracefully. Returns the exit code."""
        self.signals.install()
        self.start()
        last_status = 0.0
        while not self._stop.wait(1.0):
            self._handle_signals()
            self.health.check_state()
            self.watchdog.beat(self.health.healthy())
            if time.monotonic() - last_status >= STATUS_EVERY_S:
                last_status = time.monotonic()
                self.notifier.status(self.summary())
        self._handle_signals()
        self.stop()
        return 0

    def _handle_signals(self) -> None:
        for signum in self.signals.drain():
            if signum == signal.SIGHUP:
                self.reload()
            elif signum == signal.SIGUSR1:
                self.workers.flush()
            else:
                self.log.info("daemon_stopping", signal=signal.Signals(signum).name)

    def _stuck(self, call: Call, stuck: bool) -> None:
        """A call went past its bound (or moved again): set its item aside."""
        self.workers.set_aside(call, stuck)

    def summary(self) -> str:
        return summary(self.store, list(self.roots()))

    # -- reload ------------------------------------------------------------------------------

    def reload(self) -> bool:
        """Re-read and validate the config; a bad one is refused and the old one keeps running.
        Roots added, removed or changed take effect without losing state or in-flight work;
        failed stages are retried at once (the operator may have fixed their cause)."""
        self.notifier.reloading()
        ok = False
        try:
            if self.config_path is None:
                raise ConfigError("the daemon was not started from a config file")
            new = load_config(self.config_path, env=self.env)
            check_installed(new, str(self.config_path))
            with self.globs.locked():
                self.given = new
                self._apply(self.globs.expand(new))
            ok = True
        except ConfigError as exc:
            self.log.error("config_reload_rejected", error=str(exc))
        except Exception as exc:  # broad: a bad reload never takes the daemon down
            self.log.error("config_reload_rejected", error=f"{type(exc).__name__}: {exc}")
        finally:
            self.metrics.reloaded(ok, self.clock.time())
            self.notifier.ready(status=self.summary())
        return ok

    def _apply(self, new: Config, event: str = "config_reloaded") -> None:
        """Act on `new` (a reload, or a glob entry's roots that came or went): a root gone is
        let go (its rows, copies and remote kept), a new one scanned, leased and listed."""
        old = self.config
        for key in needs_restart(old, new):
            self.log.warning("config_needs_restart", key=key)
        old_roots = {r.name for r in old.roots}
        self.config = new
        self.metrics.set_roots(self.roots())  # a root gone is dropped, a new one starts at 0
        self.store.set_policies({r.name: policy_of(r) for r in new.roots})
        self.scanner.set_roots(self.roots())
        self.health.watch_scan()
        if event == "config_reloaded":
            self.store.retry_now()
        self.log.info(event, roots=sorted(self.roots()),
                      added=sorted(set(self.roots()) - old_roots),
                      removed=sorted(old_roots - set(self.roots())))
        for service in (self.leases, self.scanner, self.workers, self.discovery):
            service.wake()

    def stop(self, grace: float = STOP_GRACE_S) -> None:
        self.notifier.stopping()
        self.ctx.stopping.set()
        self._stop.set()
        sup = self.supervisor
        sup.stop("globs", "scan", "watch", "discovery", "retention")
        # Async saves already handed over finish within the grace (the trainer may be gone).
        self.persist.grace = grace
        finished = sup.stop("persist", *self.workers.names, timeout=grace)
        if not finished:  # past the grace: read passes end at their next chunk, cleaned up
            self.workers.cancel()
            finished = sup.stop("persist", *self.workers.names, timeout=CANCEL_WAIT_S)
        if not finished:
            self.log.warning("daemon_stop_incomplete",
                             message="in-flight stages left to resume after restart")
        big.stop_all()  # sends whose upload never came: no thread outlives the daemon
        sup.stop("lease", "api", *(["metrics"] if self.metrics_tcp is not None else []))
        sup.stop_watch()
        self.leases.release()
        if self.metrics_tcp is not None:
            self.metrics_tcp.close()
        assert self.server is not None
        self.server.server_close()
        if not self._socket_inherited:  # an inherited socket belongs to systemd's unit
            with contextlib.suppress(OSError):
                os.unlink(self.config.daemon.socket)
        if finished:
            self.store.close()
        self.lock.release()
        self.log.info("daemon_stopped")
