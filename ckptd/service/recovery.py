"""Start-up: the state-dir lock, recovery, and the daemon's listening socket.

Owns what a restart after a crash cleans up: every work claim dropped (one daemon per state dir),
ckptd's own temp files (a `file://` remote's too) and staging dirs; and the pins kept beside
each root. Checkpoint bytes go only through the retention executor: deletes half done in the
trash (`purge_trash`) and compressed copies whose transition to "no copy" committed before
their files went (`release_copy`, behind its nets). Never removes anything that is not
ckptd's own, nor a copy the store does not know.
"""

from __future__ import annotations

import fcntl
import os
import signal
import socket
import threading
from collections.abc import Iterable
from contextlib import AbstractContextManager
from pathlib import Path
from types import FrameType
from typing import IO, Any

from ckptd import fileio
from ckptd.api.door import bind_socket
from ckptd.backends import LocalBackend, make_backend
from ckptd.clock import SYSTEM, Clock
from ckptd.config import Config, DaemonConfig, RootConfig
from ckptd.copies import store as copies
from ckptd.errors import ConfigError, StateLocked
from ckptd.log import get_logger
from ckptd.model import CKPTD_DIR, Local
from ckptd.retention import executor, trash, views
from ckptd.service import sdnotify
from ckptd.store import Store
from ckptd.store.pins import read_pins

# A put rewrites its temp file's mtime as it writes; one untouched this long was left by a
# crash, here or on another node sharing the remote directory.
STALE_PUT_S = 3600.0


def recover(store: Store, cfg: Config, nets: AbstractContextManager[Any],
            clock: Clock = SYSTEM) -> None:
    """Start-up: pins from beside the roots, claims, temps, the trash, released copies.
    `nets`: the lock pins and readers' holds take (the retention service's); `clock`: what
    a temp file's age and the readers' holds are judged by."""
    for r in cfg.roots:  # pins kept beside the root outlive a lost state database
        store.set_root_pins(r.name, read_pins(r.path))
    released = store.release_claims()
    removed = 0
    for d in [cfg.daemon.state_dir] + [r.path / CKPTD_DIR for r in cfg.roots]:
        removed += remove_stale_temps(d)
    removed += remove_stale_put_temps(cfg.roots, clock.time())
    purged = orphans = 0
    for r in cfg.roots:
        if r.path.is_dir():
            # Deletes interrupted between the rename into the trash and the removal.
            purged += trash.purge_trash(trash.trash_dir_for(r.path), r.path)
            removed += copies.remove_stale_staging(r.path)
            orphans += _remove_released_copies(store, r, nets, clock)
    get_logger().info("daemon_recovered", leases_released=released, temp_files_removed=removed,
                      trash_purged=purged, released_copies_removed=orphans)


def _remove_released_copies(store: Store, root: RootConfig,
                            nets: AbstractContextManager[Any], clock: Clock) -> int:
    n = 0
    for step in copies.local_steps(root.path):
        status = store.status(root.name, step)
        if status is not None and not status.copy and status.local is not Local.COMPRESSED:
            target = views.copy_target(step, status.local, status.remote)
            out = executor.release_copy(root.path, target, views.StoreNets(
                store, root, nets, clock.time), root=root.name)
            n += out.action == "deleted"
    return n


def remove_stale_temps(directory: os.PathLike[str]) -> int:
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


def remove_stale_put_temps(roots: Iterable[RootConfig], now: float) -> int:
    """Temp files of `file://` puts a crash interrupted, in each root's remote directory,
    through its backend (only its own temp names, never outside it). An object store keeps
    none: an unfinished multipart upload is never an object."""
    n = 0
    for url in dict.fromkeys(r.upload.url for r in roots if r.upload.url.startswith("file:")):
        backend = make_backend(url)
        if not isinstance(backend, LocalBackend):
            continue
        try:
            n += backend.remove_stale_temp(STALE_PUT_S, now)
        except OSError as exc:  # an unreachable remote must not stop the start-up
            get_logger().warning("remote_temp_cleanup_failed", url=backend.url, error=str(exc))
    return n


def listen_socket(cfg: DaemonConfig) -> tuple[socket.socket, bool]:
    """The inherited socket under socket activation (LISTEN_FDS), else our own; and whether
    it was inherited (then it belongs to systemd's unit and is never unlinked)."""
    inherited = sdnotify.unix_listener(sdnotify.listen_fds())
    if inherited is None:
        return bind_socket(cfg.socket, cfg.socket_group), False
    name = inherited.getsockname()
    if str(name) != str(cfg.socket):
        get_logger().warning("socket_mismatch", inherited=str(name), configured=str(cfg.socket))
    return inherited, True


class StateDirLock:
    """An exclusive flock on `<state_dir>/ckptd.lock`: one daemon per state dir."""

    def __init__(self, state_dir: Path) -> None:
        self.state_dir = state_dir
        self.path = state_dir / "ckptd.lock"
        self._fh: IO[str] | None = None

    def acquire(self) -> None:
        try:
            self.state_dir.mkdir(parents=True, exist_ok=True)
            fh = open(self.path, "a+")  # noqa: SIM115 - held for the daemon's lifetime
        except OSError as exc:
            raise ConfigError(f"daemon.state_dir = {str(self.state_dir)!r}: cannot use it:"
                              f" {exc.strerror or exc}") from None
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


class SignalInbox:
    """Signals recorded by their handlers, handled later by the main loop: logging or locking
    inside a handler can deadlock when the signal lands while the main thread holds the same
    lock. SIGTERM and SIGINT also set `stop` at once."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1)

    def __init__(self, stop: threading.Event) -> None:
        self._stop = stop
        self._got: list[int] = []

    def install(self) -> None:
        for sig in self.SIGNALS:
            signal.signal(sig, self._record)

    def _record(self, signum: int, frame: FrameType | None) -> None:
        self._got.append(signum)
        if signum in (signal.SIGTERM, signal.SIGINT):
            self._stop.set()

    def drain(self) -> list[int]:
        """The signals received since the last drain, oldest first."""
        out = self._got[:]
        del self._got[:len(out)]
        return out
