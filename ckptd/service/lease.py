"""The lease service: one daemon acts on a root at a time (see `ckptd.cluster.lease` for the
files and the rule). Looks at every root's lease every few seconds, takes a free or stale one,
renews its own, and stands by where another daemon holds the root.

Owns each root's lease state (the files are `lease_files`). Who holds a root is the pure
`judge`'s decision; decided here is only what it is handed and what follows for this daemon:
whether a holder on this machine is alive (`holder_alive`: its pid, and for this very process
a token of its own), and that this daemon acts only while its last renewal is younger than half
the timeout (`holds`). Reads time only from the clock it is given. The daemon gives the other
services only the roots this one holds (`acting`), so a standby root is never scanned,
validated, uploaded, pruned, or has its latest.json written by this daemon.
"""
from __future__ import annotations

import os
import secrets
import socket
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from ckptd.clock import SYSTEM, Clock
from ckptd.cluster.lease import (
    LEASE_FILE,
    MAX_GENERATION,
    Holder,
    Judgement,
    Me,
    Seen,
    Verdict,
    claim_name,
    judge,
    same_machine,
)
from ckptd.config import RootConfig
from ckptd.log import get_logger
from ckptd.model import CKPTD_DIR, RootError
from ckptd.service.lease_files import (
    LeaseProblem,
    drop_claims_below,
    look,
    open_dir,
    retire_claims,
    top_claim,
    write_lease,
)
from ckptd.store import Store

__all__ = ["LeaseProblem", "Leases", "boot_id", "holder_alive", "pid_alive"]


def boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()[:64]
    except OSError:
        return ""


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process: alive
    return True


# The tokens of this process's lease services: a lease.json naming this process with any
# other token was not written by it (forged), and no live holder stands behind it.
_PROCESS_TOKENS: set[str] = set()


def holder_alive(holder: Holder) -> bool:
    """Whether the holder (on this machine, this boot) is alive: its pid is, and where the pid
    is this very process, the token is one of its own lease services'."""
    if holder.pid == os.getpid():
        return holder.token in _PROCESS_TOKENS
    return pid_alive(holder.pid)


@dataclass
class _RootLease:
    path: Path  # the root's path when this lease was looked at: a reload may change it
    key: tuple[Any, ...] | None = None
    changed_at: float = 0.0  # monotonic: when `key` last changed
    gen: int = 0  # the generation we hold; 0 = none
    renewed_ok: float = -1e18  # monotonic: our last successful renewal
    holder: Holder | None = None  # the last holder seen (ours or not)
    fresh: bool = False  # taken as generation 1 of a root no ckptd had held
    problem: str | None = None
    verdict: Verdict | None = None


class Leases:
    """Every configured root's lease, as this daemon sees it; the `lease` service."""

    def __init__(self, store: Store, roots: Callable[[], Mapping[str, RootConfig]],
                 node: Callable[[], str], timeout: Callable[[], float],
                 on_change: Callable[[set[str]], None] = lambda gained: None,
                 clock: Clock = SYSTEM) -> None:
        self.store = store
        self.clock = clock
        self.roots = roots
        self.node = node
        self.timeout = timeout
        self.on_change = on_change
        self.me = Me(token=secrets.token_hex(16), host=socket.gethostname(), boot=boot_id())
        _PROCESS_TOKENS.add(self.me.token)
        self._lock = threading.Lock()
        self._state: dict[str, _RootLease] = {}
        self._wake = threading.Event()
        self.log = get_logger()

    # -- what the other services ask -----------------------------------------------------------

    def interval(self) -> float:
        return min(5.0, max(0.25, self.timeout() / 6))

    def holds(self, name: str) -> bool:
        """Act on `name` only while this is True: our lease on the root's configured path,
        renewed within half the timeout (well before any standby may judge it stale)."""
        root = self.roots().get(name)
        return root is not None and self._holds(root)

    def _holds(self, root: RootConfig) -> bool:
        with self._lock:
            st = self._state.get(root.name)
            return (st is not None and st.gen > 0 and st.path == root.path
                    and self.clock.monotonic() - st.renewed_ok < self.timeout() / 2)

    def acting(self) -> dict[str, RootConfig]:
        """The configured roots this daemon acts on now."""
        return {n: r for n, r in self.roots().items() if self._holds(r)}

    def fresh(self, name: str) -> bool:
        """This daemon took the root as the first ckptd ever to hold it: what its first scan
        finds was there before ckptd (adopted)."""
        with self._lock:
            st = self._state.get(name)
            return st is not None and st.fresh

    def holder_json(self, name: str) -> dict[str, Any] | None:
        """`{"node", "pid", "host", "since", "this_daemon"}` of the daemon acting on the root,
        as last seen; None when none does. `this_daemon` only while this daemon acts on it (a
        lease it can no longer renew, the root gone say, is not claimed as acting)."""
        acting = self.holds(name)
        with self._lock:
            st = self._state.get(name)
            h = st.holder if st is not None else None
            if st is None or h is None or h.released or st.verdict is Verdict.TAKE:
                return None
            ours = acting and h.token == self.me.token
            return {"node": h.node, "pid": h.pid, "host": h.host,
                    "since": datetime.fromtimestamp(h.since, UTC).isoformat(timespec="seconds"),
                    "this_daemon": ours}

    def problem(self, name: str) -> str | None:
        with self._lock:
            st = self._state.get(name)
            return st.problem if st is not None else None

    # -- the service ---------------------------------------------------------------------------

    def wake(self) -> None:
        self._wake.set()

    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            self.tick()
            self._wake.wait(self.interval())
            self._wake.clear()

    def tick(self) -> None:
        """One look at every root's lease: take, renew or stand by. Calls `on_change` with the
        roots newly held when the set of roots this daemon acts on changed."""
        roots = self.roots()
        before = set(self.acting())
        self._let_go(roots)
        for root in roots.values():
            try:
                self._tick_root(root)
            except LeaseProblem as exc:
                self._problem(root, str(exc), exc.kind)
            except OSError as exc:  # the lease files changed under us in a way not foreseen
                self._problem(root, f"lease: {root.path / CKPTD_DIR}: {exc.strerror or exc}")
        after = set(self.acting())
        if after != before:
            self.on_change(after - before)

    def release(self) -> None:
        """A clean stop: mark every lease we hold released, so a standby takes over at once."""
        with self._lock:
            held = list(self._state.items())
        for name, st in held:
            self._release(name, st)

    def _let_go(self, roots: Mapping[str, RootConfig]) -> None:
        """Roots a reload removed, or moved to another path: release what we held there, so
        another daemon takes it at once instead of after `lease_timeout`."""
        with self._lock:
            gone = [(n, st) for n, st in self._state.items()
                    if n not in roots or roots[n].path != st.path]
            for name, _ in gone:
                del self._state[name]
        for name, st in gone:
            self._release(name, st)

    def _release(self, name: str, st: _RootLease) -> None:
        with self._lock:
            doc = replace(st.holder, released=True) if st.gen > 0 and st.holder else None
            st.gen = 0
        if doc is None:
            return
        try:
            dfd = open_dir(st.path, create=False)
            try:
                top, token = top_claim(dfd)
                if top == doc.gen and token == self.me.token:
                    write_lease(dfd, doc)
            finally:
                os.close(dfd)
            self.log.info("lease_released", root=name, gen=doc.gen)
        except (OSError, LeaseProblem) as exc:
            self.log.warning("lease_release_failed", root=name, error=str(exc))

    # -- one root ------------------------------------------------------------------------------

    def _tick_root(self, root: RootConfig) -> None:
        now = self.clock.monotonic()
        timeout = self.timeout()
        with self._lock:
            st = self._state.setdefault(root.name, _RootLease(root.path, changed_at=now))
        dfd = open_dir(root.path, create=True)
        ok = True
        try:
            seen = look(dfd)
            if seen.key != st.key:
                st.key, st.changed_at = seen.key, now
            alive = (holder_alive(seen.holder) if seen.holder is not None
                     and same_machine(self.me, seen.holder) else None)
            j = judge(self.me, seen, st.changed_at, now, timeout, alive)
            if j.verdict is Verdict.TAKE:
                j = self._take(dfd, root, st, seen, j, now)
            elif j.verdict is Verdict.HOLD:
                ok = self._renew(dfd, root, st, seen, now)
            else:
                self._stand_by(root, st, seen)
            st.verdict = j.verdict
        finally:
            os.close(dfd)
        if ok and st.problem is not None:
            st.problem = None
            self.store.clear_root_error(root.name, RootError.LEASE, RootError.ROOT_MISSING)

    def _take(self, dfd: int, root: RootConfig, st: _RootLease, seen: Seen, why: Judgement,
              now: float) -> Judgement:
        gen = seen.top + 1
        if gen >= MAX_GENERATION:
            # The last generation there can be (only a claim written by hand gets there): it is
            # stale like any other, so it is retired and numbering starts again. Renaming it
            # away succeeds for one taker only; the others look again.
            if not retire_claims(dfd, seen.top):
                return Judgement(Verdict.STANDBY, "another daemon took it first")
            self.log.warning("lease_claims_retired", root=root.name, top=seen.top,
                             message="a claim of the last generation there can be, not"
                                     " renewed: retired, generations start again at 1")
            gen = 1
        doc = Holder(gen=gen, token=self.me.token, node=self.node(), pid=os.getpid(),
                     host=self.me.host, boot=self.me.boot, since=self.clock.time())
        try:
            fd = os.open(claim_name(gen), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                         | os.O_CLOEXEC, 0o644, dir_fd=dfd)
        except FileExistsError:  # another daemon claimed it first: look again next tick
            return Judgement(Verdict.STANDBY, "another daemon took it first")
        except OSError as exc:
            raise LeaseProblem(f"lease: cannot create {root.path / CKPTD_DIR / claim_name(gen)}:"
                               f" {exc.strerror}; ckptd acts on a root only while it holds"
                               " its lease (make the root writable by the ckptd user)") from exc
        try:
            os.write(fd, self.me.token.encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        if top_claim(dfd)[0] != gen:  # we looked long ago: someone has since claimed higher
            return Judgement(Verdict.STANDBY, "another daemon took it first")
        try:
            write_lease(dfd, doc)
            os.fsync(dfd)
        except OSError as exc:
            raise LeaseProblem(f"lease: cannot write {root.path / CKPTD_DIR / LEASE_FILE}:"
                               f" {exc.strerror}") from exc
        previous = seen.holder
        with self._lock:
            st.gen, st.holder, st.renewed_ok = gen, doc, now
            st.fresh = seen.top == 0 and previous is None
        drop_claims_below(dfd, gen)
        self.log.info("lease_acquired", root=root.name, gen=gen, why=why.why,
                      previous=_who(previous) if previous else None)
        return Judgement(Verdict.HOLD, why.why)

    def _renew(self, dfd: int, root: RootConfig, st: _RootLease, seen: Seen, now: float) -> bool:
        doc = st.holder if st.gen == seen.top and st.holder is not None else None
        if doc is None:  # ours by the claim, but this daemon lost track: write it again
            if top_claim(dfd) != (seen.top, self.me.token):  # claimed past us since the look
                self._stand_by(root, st, seen)
                return True
            doc = Holder(gen=seen.top, token=self.me.token, node=self.node(), pid=os.getpid(),
                         host=self.me.host, boot=self.me.boot, since=self.clock.time())
        try:
            if seen.holder == doc:
                os.utime(LEASE_FILE, dir_fd=dfd, follow_symlinks=False)
            else:
                write_lease(dfd, doc)
        except OSError as exc:
            self._problem(root, f"lease: cannot renew {root.path / CKPTD_DIR / LEASE_FILE}:"
                                f" {exc.strerror}")
            return False
        with self._lock:
            st.gen, st.holder, st.renewed_ok = seen.top, doc, now
        return True

    def _stand_by(self, root: RootConfig, st: _RootLease, seen: Seen) -> None:
        was_ours = st.gen > 0
        changed = seen.holder is not None and (st.holder is None
                                               or st.holder.token != seen.holder.token)
        with self._lock:
            st.gen = 0
            st.holder = seen.holder
        if was_ours:
            self.log.warning("lease_lost", root=root.name,
                             holder=_who(seen.holder) if seen.holder else None)
        elif changed and seen.holder is not None:
            self.log.info("lease_standby", root=root.name, holder=_who(seen.holder),
                          message="another daemon acts on this root; this one stands by")

    def _problem(self, root: RootConfig, message: str,
                 kind: RootError = RootError.LEASE) -> None:
        with self._lock:
            st = self._state.setdefault(root.name,
                                        _RootLease(root.path, changed_at=self.clock.monotonic()))
            first = st.problem != message
            st.problem = message
        if first:
            self.log.error("lease_failed", root=root.name, error=message)
            self.store.set_root_error(root.name, kind, message, self.clock.time())


def _who(h: Holder) -> str:
    return f"{h.node} (pid {h.pid} on {h.host})"
