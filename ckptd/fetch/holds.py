"""A reader's hold on a remote step while it is read: through the daemon where one answers for
the root, else a hold object in the bucket that remote retention honours while it is fresh.
Owns the hold object's key, its format, the freshness rule and the renewal thread; deletes
only its own hold object, and (for retention) hold objects that are no longer fresh.
"""

from __future__ import annotations

import json
import logging
import os
import re
import secrets
import socket as _socket
import threading
import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from ckptd.backends.base import Backend
from ckptd.errors import StorageError

log = logging.getLogger("ckptd")

HOLDS_DIR = "_holds"
# A hold object keeps its step for this long after its last write, by the store's clock as
# its listing shows it; the reader rewrites it every RENEW_S. The body is for people only:
# nothing in it is read, so no value in it can stretch a hold.
HOLD_TTL_S = 300.0
RENEW_S = HOLD_TTL_S / 5
# Retention lists at most this many objects under `<root>/_holds/`: past it, no remote step
# of the root is deleted in that run (a hold among the rest cannot be ruled out), and the
# stale ones listed are removed, so left-overs of crashed readers cannot block it for long.
MAX_HOLD_OBJECTS = 4096
MAX_OWNER = 64
_OWNER = re.compile(r"[A-Za-z0-9_-]{1,64}")
_KEY = re.compile(r"step-(0|[1-9][0-9]{0,18})\.([A-Za-z0-9_-]{1,64})\.json")


def hold_key(root_name: str, step: int, owner: str) -> str:
    """`<root>/_holds/step-<N>.<owner>.json`; owner: 1 to 64 of [A-Za-z0-9_-]."""
    if not _OWNER.fullmatch(owner):
        raise ValueError(f"hold owner {owner!r}: 1 to {MAX_OWNER} of [A-Za-z0-9_-]")
    return f"{root_name}/{HOLDS_DIR}/step-{int(step)}.{owner}.json"


def parse_hold_key(root_name: str, key: str) -> tuple[int, str] | None:
    """(step, owner) of a hold object's key, or None for any other key."""
    head = f"{root_name}/{HOLDS_DIR}/"
    if not key.startswith(head):
        return None
    match = _KEY.fullmatch(key[len(head):])
    if match is None or int(match.group(1)) >= 1 << 63:
        return None
    return int(match.group(1)), match.group(2)


def is_fresh(mtime: float, now: float) -> bool:
    """Whether a hold object written at `mtime` still holds at `now`: written at most
    HOLD_TTL_S ago, and not more than that in the future (a clock or an mtime set far ahead
    never holds a step beyond the cap)."""
    return now - HOLD_TTL_S <= mtime <= now + HOLD_TTL_S


# --- what remote retention reads ------------------------------------------------------------


@dataclass(frozen=True)
class BucketHolds:
    """The hold objects of a root as retention sees them: `steps` fresh holds keep; with
    `over_cap` every step counts as held; `stale` are the keys no longer fresh."""

    steps: frozenset[int]
    over_cap: bool
    stale: tuple[str, ...]

    def held(self, step: int) -> bool:
        return self.over_cap or step in self.steps


def read_holds(backend: Backend, root_name: str, now: float) -> BucketHolds:
    """The root's hold objects: one listing of `<root>/_holds/`, at most MAX_HOLD_OBJECTS
    entries read; no object's body is read. Keys that are not hold objects are ignored."""
    steps: set[int] = set()
    stale: list[str] = []
    for n, meta in enumerate(_listing(backend, root_name)):
        if n >= MAX_HOLD_OBJECTS:
            return BucketHolds(frozenset(steps), True, tuple(stale))
        parsed = parse_hold_key(root_name, meta.key)
        if parsed is None:
            continue
        if is_fresh(meta.mtime, now):
            steps.add(parsed[0])
        else:
            stale.append(meta.key)
    return BucketHolds(frozenset(steps), False, tuple(stale))


def _listing(backend: Backend, root_name: str) -> Iterator[Any]:
    return iter(backend.list(f"{root_name}/{HOLDS_DIR}"))


def sweep_stale(backend: Backend, root_name: str, keys: tuple[str, ...]) -> int:
    """Remove hold objects that are no longer fresh (they hold nothing); returns how many.
    Only keys of hold objects of `root_name` are touched."""
    done = 0
    for key in keys:
        if parse_hold_key(root_name, key) is not None:
            backend.delete(key)
            done += 1
    return done


# --- the reader's side ----------------------------------------------------------------------


def new_owner() -> str:
    """An owner id for one read: host, pid and a random tag, in hold-key characters."""
    host = re.sub(r"[^A-Za-z0-9_-]", "_", _socket.gethostname())[:32] or "host"
    return f"{host}-{os.getpid()}-{secrets.token_hex(4)}"


class ReaderHold:
    """A hold on one step for as long as it is read; `close()` (or leaving the `with`)
    ends it. Taken through the daemon at `socket` (the client's default where None) when it
    takes it, else as a hold object in the bucket, created create-only (with `backend` None,
    a read of the local copy: the daemon only, none without one); renewed every RENEW_S
    on a thread this object owns. `how` says which: "daemon", "bucket", or "none" when neither
    could be taken (read-only credentials): the read goes on without one, and a step deleted
    under it fails the read with NotFound naming the object."""

    def __init__(self, backend: Backend | None, root_name: str, step: int, *,
                 socket: str | None = None, daemon: bool = True,
                 renew_s: float = RENEW_S) -> None:
        self.root, self.step = root_name, int(step)
        self.owner = new_owner()
        self.key = hold_key(root_name, self.step, self.owner)
        self._held = _Held(backend, root_name, self.step, self.owner, self.key, renew_s)
        if not (daemon and self._held.by_daemon(socket)) and backend is not None:
            self._held.by_bucket()
        self.how = self._held.how
        # A reader dropped without close (DCP never closes its reader) ends its hold when it
        # is collected, or at exit; the renewal thread keeps only `_held` alive, not this.
        self._finalizer = weakref.finalize(self, self._held.end)
        self._held.start()

    def close(self) -> None:
        self._finalizer()

    def __enter__(self) -> ReaderHold:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Held:
    """The hold itself, its renewal thread and its release."""

    def __init__(self, backend: Backend | None, root: str, step: int, owner: str, key: str,
                 renew_s: float) -> None:
        self.backend, self.root, self.step, self.owner, self.key = backend, root, step, owner, key
        self.renew_s = min(max(renew_s, 0.01), RENEW_S)
        self.how = "none"
        self._daemon: Any = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def by_daemon(self, socket: str | None) -> bool:
        from ckptd.client import Client, ClientError

        client = Client(socket, timeout=10.0, strict=True)  # a hold may wait for a prune
        hold = client.hold(self.root, self.step, ttl=HOLD_TTL_S, owner=self.owner)
        try:
            hold.__enter__()
        except ClientError as exc:
            if exc.status:  # reached, and refused (unknown step, a standby): the bucket
                log.info("ckptd refused a hold on %s step %s (%s)",
                         self.root, self.step, exc)
            return False
        self._daemon, self.how = hold, "daemon"
        return True

    def by_bucket(self) -> None:
        assert self.backend is not None
        try:
            self.backend.put(self.key, self._body(), create_only=True)
        except (StorageError, OSError) as exc:
            log.warning("no hold on %s step %s could be taken (%s): it is read without one;"
                        " if retention deletes it meanwhile, the read fails", self.root,
                        self.step, exc)
            return
        self.how = "bucket"

    def _body(self) -> bytes:
        doc = {"root": self.root, "step": self.step, "owner": self.owner,
               "written": time.time(), "ttl_s": HOLD_TTL_S}
        return json.dumps(doc).encode() + b"\n"

    def start(self) -> None:
        if self.how != "none":
            self._thread = threading.Thread(target=self._renew, daemon=True, name="ckptd-hold")
            self._thread.start()

    def _renew(self) -> None:
        while not self._stop.wait(self.renew_s):
            try:
                if self.how == "daemon":
                    self._daemon.__enter__()
                elif self.backend is not None:  # overwritten: swept as stale, it comes back
                    self.backend.put(self.key, self._body())
            except Exception as exc:  # the read goes on; the next round tries again
                log.warning("renewing the hold on %s step %s failed: %s", self.root,
                            self.step, exc)

    def end(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        try:
            if self.how == "bucket" and self.backend is not None:
                self.backend.delete(self.key)
            elif self.how == "daemon":
                self._daemon.__exit__(None, None, None)
        except Exception as exc:  # it expires on its own
            log.warning("releasing the hold %s failed: %s", self.key, exc)


def daemon_socket(config: str | os.PathLike[str] | None, remote: str | None) -> str | None:
    """The socket of the daemon whose config the read uses (None: the client's default)."""
    if remote:
        return None
    try:
        from ckptd.config import find_config, load_config

        path = find_config(config)
        return None if path is None else str(load_config(path).daemon.socket)
    except Exception:  # the read itself reports a bad config
        return None
