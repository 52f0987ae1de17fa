"""The composition root: builds store, scanners, watcher, pipeline and API from a Config.

Owns the state-dir lock, signals, startup recovery, the scan loop and graceful stop.
Decides nothing about checkpoints itself; it wires the parts that do.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import signal
import threading
import time
from pathlib import Path
from types import FrameType
from typing import IO, Any

from ckptd import fileio, sdnotify
from ckptd.api import ApiContext, RootView, UnixHttpServer, bind_socket
from ckptd.changes import Changes
from ckptd.config import Config, RootConfig, load_config
from ckptd.errors import ConfigError, StateLocked
from ckptd.log import get_logger
from ckptd.metrics import Metrics
from ckptd.model import CKPTD_DIR, Tier
from ckptd.pipeline import LatestPublisher, Pipeline
from ckptd.retention import executor
from ckptd.retention.scheduler import RetentionService, health_json
from ckptd.stages import compress
from ckptd.store import Found, Store
from ckptd.watch import EventWatcher, OpenFiles, RootScanner

STOP_GRACE_S = 20.0
DEBOUNCE_S = 0.1
# A stage worker that has read no byte for this long counts as stuck (the watchdog stops).
STALL_LIMIT_S = 300.0
STATUS_EVERY_S = 10.0


class StateDirLock:
    """An exclusive flock on `<state_dir>/ckptd.lock`: one daemon per state dir."""

    def __init__(self, state_dir: Path) -> None:
        state_dir.mkdir(parents=True, exist_ok=True)
        self.path = state_dir / "ckptd.lock"
        self._fh: IO[str] | None = None

    def acquire(self) -> None:
        fh = open(self.path, "a+")  # noqa: SIM115 - held for the daemon's lifetime
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            fh.close()
            raise StateLocked(f"another ckptd holds {self.path}; only one daemon may use a"
                              " state directory") from exc
        fh.seek(0)
        fh.truncate()
        fh.write(f"{os.getpid()}\n")
        fh.flush()
        self._fh = fh

    def release(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None


class Daemon:
    def __init__(self, config: Config, config_path: Path | None = None) -> None:
        self.config = config
        self.config_path = config_path
        self.log = get_logger()
        self.lock = StateDirLock(config.daemon.state_dir)
        self.store: Store | None = None
        self.changes = Changes()
        self._scan_wake = threading.Event()
        self._stop = threading.Event()
        self._scanners: dict[str, RootScanner] = {}
        self._pending_roots: set[str] = set()
        self._threads: list[threading.Thread] = []
        self.server: UnixHttpServer | None = None
        self.watcher: EventWatcher | None = None
        self.pipeline: Pipeline | None = None
        self.pruner: RetentionService | None = None
        self.publisher: LatestPublisher | None = None
        self._backends: dict[str, tuple[Any, Any]] = {}
        self._remote_seen: dict[str, float] = {}
        self.ctx: ApiContext | None = None
        self.ready = threading.Event()
        self.notifier = sdnotify.Notifier.from_env(
            unset=True, on_error=lambda m: self.log.warning("sd_notify_failed", error=m))
        self.watchdog = sdnotify.ProgressWatchdog.from_env(self.notifier)
        self.metrics = Metrics()
        self.metrics_server: Any = None
        self._socket_inherited = False
        self._scan_beat = time.monotonic()
        self._signals: list[int] = []  # appended by handlers, handled by the main loop

    # -- views of the config -----------------------------------------------------------------

    def _root_configs(self) -> dict[str, RootConfig]:
        return {r.name: r for r in self.config.roots}

    def backend_for(self, root: RootConfig) -> Any:
        """The root's storage backend (retries, bandwidth cap), rebuilt when its upload
        settings change; None when the root does not upload."""
        if not root.upload.enabled:
            return None
        cached = self._backends.get(root.name)
        if cached is not None and cached[0] == root.upload:
            return cached[1]
        from ckptd.backends import make_backend, wrap_backend

        up = root.upload
        backend = wrap_backend(
            make_backend(up.url, endpoint=up.endpoint, region=up.region,
                         access_key_id=up.access_key_id,
                         secret_access_key=up.secret_access_key.get_secret_value(),
                         part_size=up.part_size, concurrency=up.concurrency),
            max_bytes_per_s=up.max_bandwidth)
        self._backends[root.name] = (up, backend)
        return backend

    def refresh_remote(self, name: str, max_age: float = 15.0) -> None:
        """Learn the remote steps of a root (committed manifests) that the store does not
        know: a fresh node with an empty disk sees its root's uploaded checkpoints."""
        root = self._root_configs().get(name)
        backend = self.backend_for(root) if root is not None else None
        if root is None or backend is None or self.store is None:
            return
        if time.monotonic() - self._remote_seen.get(name, -1e9) < max_age:
            return
        from ckptd import remote

        try:
            steps = set(remote.list_steps(backend, name))
            added = 0
            for step in sorted(steps):
                if self.store.checkpoint(name, step) is None:
                    added += self.store.add_remote_only(
                        name, remote.read_manifest(backend, name, step), time.time())
            self._remote_seen[name] = time.monotonic()
        except Exception as exc:  # the remote being down must not break ls or startup
            self.log.warning("remote_list_failed", root=name, error=str(exc))
            return
        if added:
            self.log.info("remote_checkpoints_found", root=name, added=added)
            if self.publisher is not None:
                self.publisher.publish(self._root_configs()[name])
            self.changes.notify()

    def _refresh_all_remote(self) -> None:
        for r in self.config.roots:
            self.refresh_remote(r.name, 0)

    def _after_prune(self, root: RootConfig) -> None:
        if self.publisher is not None:
            self.publisher.publish(self._root_configs()[root.name])
        self.changes.notify()

    def _prune_plan(self, name: str) -> dict[str, Any]:
        assert self.pruner is not None
        return self.pruner.plan(name).as_json(name)

    def _prune_now(self, name: str) -> list[dict[str, Any]]:
        assert self.pruner is not None
        return [o.as_json() for o in self.pruner.run_now(name)]

    def _views(self) -> dict[str, RootView]:
        return {r.name: RootView(r.name, r.path, r.metric, r.metric_mode, r.upload.enabled)
                for r in self.config.roots}

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        """Lock, recover, scan every root once, bind the socket, start workers. Raises
        StateLocked when another daemon holds the state dir."""
        self.lock.acquire()
        cfg = self.config
        self.store = Store(cfg.daemon.state_dir / "state.db")
        self._recover()
        self.watcher = EventWatcher(self.wake_scan, cfg.daemon.polling,
                                    poll_interval=max(1.0, min(cfg.daemon.scan_interval, 5.0)))
        for root in cfg.roots:
            self._add_root(root)
        self.watcher.start()
        self.scan_all()
        self.publisher = publisher = LatestPublisher(self.store)
        for rt in self._root_configs().values():
            publisher.publish(rt)
        self.pruner = RetentionService(self.store, self._root_configs, self.backend_for,
                                       on_change=self._after_prune)
        self.pipeline = Pipeline(self.store, self._root_configs, self.changes, publisher,
                                 cfg.daemon.workers, on_resave=self.wake_scan,
                                 after_stage=self.pruner.request, backend_for=self.backend_for,
                                 metrics=self.metrics)
        self.ctx = ApiContext(self.store, self._views, self.changes, self.wake_scan,
                              self._in_flight)
        self.ctx.prune_plan = self._prune_plan
        self.ctx.refresh_remote = self.refresh_remote
        self.ctx.flush = self.pipeline.flush
        self.ctx.retention_lock = self.pruner.exclusive
        self.ctx.flushing = lambda: dict(self.pipeline.flushing) if self.pipeline else {}
        self.ctx.prune_now = self._prune_now
        self.ctx.root_health = lambda name: health_json(self.pruner.health(name)
                                                        if self.pruner else None)
        self.ctx.metrics_text = self._render_metrics
        sock = self._listen_socket()
        self.server = UnixHttpServer(sock, self.ctx)
        if cfg.metrics.listen:
            self.metrics_server = self.metrics.serve_tcp(cfg.metrics.listen)
        self.pipeline.start()
        self.pruner.start()
        self._spawn(self.server.serve_forever, "ckptd-api")
        self._spawn(self._refresh_all_remote, "ckptd-remote")
        self._spawn(self._scan_loop, "ckptd-scan")
        self.ready.set()
        self.log.info("daemon_ready", socket=str(cfg.daemon.socket),
                      roots=[r.name for r in cfg.roots], pid=os.getpid(),
                      socket_activated=self._socket_inherited)
        self.notifier.ready(status=self.summary())

    def _listen_socket(self) -> Any:
        """The inherited socket under socket activation (LISTEN_FDS), else our own."""
        cfg = self.config.daemon
        inherited = sdnotify.unix_listener(sdnotify.listen_fds())
        if inherited is None:
            return bind_socket(cfg.socket, cfg.socket_group)
        self._socket_inherited = True
        name = inherited.getsockname()
        if str(name) != str(cfg.socket):
            self.log.warning("socket_mismatch", inherited=str(name), configured=str(cfg.socket))
        return inherited

    def _spawn(self, fn: Any, name: str) -> None:
        t = threading.Thread(target=fn, name=name, daemon=True)
        t.start()
        self._threads.append(t)

    def _recover(self) -> None:
        assert self.store is not None
        released = self.store.release_all()
        removed = 0
        for d in [self.config.daemon.state_dir] + [r.path / CKPTD_DIR for r in self.config.roots]:
            removed += _remove_stale_temps(d)
        purged = 0
        for r in self.config.roots:
            if r.path.is_dir():
                # Deletes interrupted between the rename into the trash and the removal.
                purged += executor.purge_trash(executor.trash_dir_for(r.path), r.path)
                removed += compress.remove_stale_staging(r.path)
        self.log.info("daemon_recovered", leases_released=released, temp_files_removed=removed,
                      trash_purged=purged)

    def _add_root(self, root: RootConfig) -> None:
        opts = root.options
        old = self._scanners.get(root.name)
        # The watcher keeps feeding the OpenFiles it was given for a path: reuse it on reload.
        open_files = old.open_files if old is not None and old.path == root.path else OpenFiles()
        self._scanners[root.name] = RootScanner(root.name, root.path, root.layout, opts,
                                                open_files)
        assert self.watcher is not None
        if not self.watcher.watch(root.path, open_files):
            self.log.warning("root_missing", root=root.name, path=str(root.path))

    def run(self) -> int:
        """Serve until SIGTERM/SIGINT; then stop gracefully. Returns the exit code."""
        self._install_signals()
        self.start()
        last_status = 0.0
        while not self._stop.wait(1.0):
            self._handle_signals()
            self.watchdog.beat(self.healthy())
            if time.monotonic() - last_status >= STATUS_EVERY_S:
                last_status = time.monotonic()
                self.notifier.status(self.summary())
        self._handle_signals()
        self.stop()
        return 0

    def _install_signals(self) -> None:
        # Handlers only record the signal: logging or locking inside a handler can deadlock
        # when the signal lands while the main thread holds the same lock.
        def on_signal(signum: int, frame: FrameType | None) -> None:
            self._signals.append(signum)
            if signum in (signal.SIGTERM, signal.SIGINT):
                self._stop.set()

        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1):
            signal.signal(sig, on_signal)

    def _handle_signals(self) -> None:
        while self._signals:
            signum = self._signals.pop(0)
            if signum == signal.SIGHUP:
                self.reload()
            elif signum == signal.SIGUSR1:
                if self.pipeline is not None:
                    self.pipeline.flush()
            else:
                self.log.info("daemon_stopping", signal=signal.Signals(signum).name)

    def healthy(self) -> bool:
        """The scan loop is turning and no stage worker is stuck: what the watchdog vouches."""
        scan_ok = time.monotonic() - self._scan_beat < 2 * self.config.daemon.scan_interval + 60
        stalled = self.pipeline.stalled(time.time(), STALL_LIMIT_S) if self.pipeline else []
        if stalled:
            self.log.warning("worker_stalled", workers=stalled)
        return scan_ok and not stalled

    def summary(self) -> str:
        if self.store is None:
            return "starting"
        parts = []
        for root in self.config.roots:
            latest = self.store.latest(root.name)
            parts.append(f"{root.name} latest {latest.step if latest else '-'}"
                         f" queue {self.store.queue_length(root.name)}")
        return "; ".join(parts) or "no roots"

    # -- reload ------------------------------------------------------------------------------

    def reload(self) -> bool:
        """Re-read and validate the config; a bad one is refused and the old one keeps running.
        Roots added, removed or changed take effect without losing state or in-flight work."""
        self.notifier.reloading()
        ok = False
        try:
            if self.config_path is None:
                raise ConfigError("the daemon was not started from a config file")
            new = load_config(self.config_path)
            self._apply(new)
            ok = True
        except ConfigError as exc:
            self.log.error("config_reload_rejected", error=str(exc))
        finally:
            self.metrics.reloaded(ok, time.time())
            self.notifier.ready(status=self.summary())
        return ok

    def _apply(self, new: Config) -> None:
        old = self.config
        for key in ("state_dir", "socket", "socket_group"):
            if getattr(old.daemon, key) != getattr(new.daemon, key):
                self.log.warning("config_needs_restart", key=f"daemon.{key}")
        old_roots = {r.name: r for r in old.roots}
        new_roots = {r.name: r for r in new.roots}
        assert self.watcher is not None
        for name, r in old_roots.items():
            if name not in new_roots or new_roots[name].path != r.path:
                self.watcher.unwatch(r.path)
                self._scanners.pop(name, None)
                self.metrics.remove_root(name)
        self.config = new
        for name, r in new_roots.items():
            if name not in self._scanners or old_roots[name] != r:
                self._add_root(r)
        added = sorted(set(new_roots) - set(old_roots))
        removed = sorted(set(old_roots) - set(new_roots))
        self.log.info("config_reloaded", roots=sorted(new_roots), added=added, removed=removed)
        self.wake_scan()

    def request_stop(self) -> None:
        self._stop.set()

    def stop(self, grace: float = STOP_GRACE_S) -> None:
        self.notifier.stopping()
        if self.ctx is not None:
            self.ctx.stopping.set()
        self._stop.set()
        self._scan_wake.set()
        if self.pruner is not None:
            self.pruner.stop()
        finished = self.pipeline.stop(grace) if self.pipeline else True
        if not finished:
            self.log.warning("daemon_stop_incomplete",
                             message="in-flight stages left to resume after restart")
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            if not self._socket_inherited:  # an inherited socket belongs to systemd's unit
                try:
                    os.unlink(self.config.daemon.socket)
                except OSError:
                    pass
        if self.metrics_server is not None:
            self.metrics_server.shutdown()
        if self.watcher is not None:
            self.watcher.stop()
        if self.store is not None and finished:
            self.store.close()
        self.lock.release()
        self.log.info("daemon_stopped")

    # -- scanning ----------------------------------------------------------------------------

    def wake_scan(self) -> None:
        self._scan_wake.set()

    def _scan_loop(self) -> None:
        interval = self.config.daemon.scan_interval
        while not self._stop.is_set():
            self._scan_beat = time.monotonic()
            wait = interval
            if self._pending_roots:
                # Something is settling: look again soon instead of a full interval later.
                wait = min(interval, max(0.25, min(r.settle for r in self.config.roots) / 2))
            self._scan_wake.wait(wait)
            if self._stop.is_set():
                return
            time.sleep(DEBOUNCE_S)  # let a burst of events land before walking the tree
            self._scan_wake.clear()
            try:
                self.scan_all()
            except Exception as exc:  # a scan bug must not kill the loop
                self.metrics.error("scan")
                self.log.error("scan_failed", error=str(exc), exc_info=True)

    def scan_all(self) -> None:
        assert self.store is not None
        for root in self.config.roots:
            try:
                self._scan_root(root)
            except Exception as exc:  # one root's bad state must not stop the others' scans
                self.metrics.error("scan")
                self.store.set_root_error(root.name, f"scan: {exc}", time.time())
                self.log.error("scan_failed", root=root.name, error=str(exc), exc_info=True)
        if self.pipeline is not None:
            self.pipeline.wake()
        self.changes.notify()

    def _scan_root(self, root: RootConfig) -> None:
        assert self.store is not None and self.watcher is not None
        scanner = self._scanners[root.name]
        if not root.path.is_dir():
            self.store.set_root_error(root.name, f"root path {root.path} does not exist",
                                      time.time())
            return
        self.watcher.watch(root.path, scanner.open_files)
        with self.pruner.exclusive if self.pruner else contextlib.nullcontext():
            now = time.time()
            _, found = scanner.scan(now, self.store.registrations(root.name))
            changes = self.store.sync_root(root.name, [Found(c, fp) for c, fp in found], now,
                                           unreadable=frozenset(scanner.unreadable))
        if scanner.unreadable:
            self.store.set_root_error(root.name, f"could not read {sorted(scanner.unreadable)}"
                                      " (checkpoints there are not marked gone)", now)
        if any(not c.complete for c, _ in found):
            self._pending_roots.add(root.name)
        else:
            self._pending_roots.discard(root.name)
        for ch in changes:
            self.log.info(ch.event, root=root.name, step=ch.step, layout=ch.layout, path=ch.path,
                          detail=ch.detail or None)
        if changes and self.publisher is not None:
            # A vanished, superseded or reappeared step can move latest: keep latest.json true.
            self.publisher.publish(self._root_configs()[root.name])

    def _render_metrics(self) -> str:
        if self.store is not None:
            for root in self.config.roots:
                self._root_metrics(root)
        return self.metrics.render()

    def _root_metrics(self, root: RootConfig) -> None:
        assert self.store is not None
        records = self.store.checkpoints(root.name)
        latest = self.store.latest(root.name)
        remote = self.store.latest(root.name, Tier.REMOTE)
        newest = max((r.step for r in records), default=None)
        since = None
        if root.upload.enabled and newest is not None:
            # Steps saved since the newest remote-verified one: the data a node loss would cost.
            since = newest - remote.step if remote else newest
        raw = sum(r.bytes for r in records if r.stored_bytes)
        stored = sum(r.stored_bytes for r in records if r.stored_bytes)
        health = self.pruner.health(root.name) if self.pruner else None
        self.metrics.set_root(
            root.name, counts=self.store.counts(root.name),
            queue=self.store.queue_length(root.name, uploads=root.upload.enabled),
            disk_free=_disk_free(root.path), latest=latest.step if latest else None,
            steps_since_remote=since, preflight_warning=bool(health and not health.preflight_ok),
            ratio=stored / raw if raw else None)

    def _in_flight(self) -> list[dict[str, Any]]:
        if self.pipeline is None:
            return []
        return [p.as_json() for p in list(self.pipeline.inflight.values())]


def _disk_free(path: Path) -> int | None:
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def _remove_stale_temps(directory: Path) -> int:
    """Delete ckptd's own temp files left by a crash (never anything else)."""
    n = 0
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return 0
    for e in entries:
        if e.name.startswith(fileio.TEMP_PREFIX) and e.is_file(follow_symlinks=False):
            try:
                os.unlink(e.path)
                n += 1
            except OSError:
                pass
    return n
