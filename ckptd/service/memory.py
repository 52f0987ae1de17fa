"""The memory service (docs/MEMORY.md): serves a restarted trainer's state from memory (the arenas
this daemon kept, else a copy a peer holds for this node), answers peers over TCP, and sends
the kept state to [memory] replicas peers at low priority (nice 19).

Owns the kept arenas (`memory.own`), the replicas held for peers and the peer server; decides
which tier serves a load of one step (never which step: the loader chose it). Never deletes a
checkpoint file and never reads the store.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from ckptd.clock import SYSTEM, Clock
from ckptd.config import Config, RootConfig
from ckptd.errors import ConfigError, HttpError, NotFound
from ckptd.log import get_logger
from ckptd.memory.own import Kept, OwnArenas
from ckptd.service.workers import lower_priority

CheckPeer = Callable[[tuple[int, int, int], str], None]
LOOK_EVERY_S = 2.0  # the replication loop's pace when nothing wakes it


class MemoryService:
    """`open` for the socket API, `status_json` and `held` for status and metrics, `kept`
    for the persist service; `run` (supervised) replicates and serves peers."""

    def __init__(self, config: Callable[[], Config], roots: Callable[[], Mapping[str, RootConfig]],
                 check_peer: CheckPeer, clock: Clock = SYSTEM) -> None:
        self.config, self.roots, self.check_peer = config, roots, check_peer
        self.clock = clock
        self.own = OwnArenas(clock)
        self.peers: Any = None  # the peer side (`memory.replicate.Peers`), when configured
        self._wake = threading.Event()
        self._fetching = threading.Lock()
        self.log = get_logger()

    def start_peers(self, node: str, backend_for: Callable[[RootConfig], Any]) -> None:
        """Take part among the peers when [memory] has a secret: serve them (with a listen
        address) and send to or fetch from them. ConfigError for a secret that cannot be read
        or an address that cannot be bound."""
        cfg = self.config().memory
        if not cfg.secret_file:
            return
        from ckptd.memory.replicate import Peers

        peers = Peers(cfg, node, self.roots, backend_for, self.clock)
        try:
            peers.start()
        except OSError as exc:
            peers.close()
            raise ConfigError(f"memory.listen = {cfg.listen!r}: {exc.strerror or exc}") from None
        self.peers = peers
        self.log.info("memory_peers_ready", node=node, address=peers.address,
                      replicas=cfg.replicas)

    # -- the socket API ---------------------------------------------------------------------

    @contextlib.contextmanager
    def open(self, root: str, step: int, rank: int, peer: tuple[int, int, int]
             ) -> Iterator[tuple[dict[str, Any], list[int]]]:
        self.check_peer(peer, "be handed a kept state")
        cfg = self.roots().get(root)
        if cfg is None:
            raise HttpError(404, "no_root", f"no root named {root!r} in the config")
        why: list[str] = []
        with contextlib.ExitStack() as stack:
            found = None
            if not self.config().memory.keep:
                why.append("memory: memory.keep is false")
            else:
                try:
                    found = stack.enter_context(self.own.lookup(root, step, rank))
                except NotFound as exc:
                    why.append(f"memory: {exc}")
                if found is None and self.peers is not None:
                    with self._fetching:  # one fetch at a time: a rank that waited for
                        # another's fetch (rank 0's state is every rank's) finds it kept
                        missing = self.own.missing(root, step, rank)
                        if not missing or self._from_peers(cfg, step, missing, why):
                            try:
                                found = stack.enter_context(self.own.lookup(root, step, rank))
                            except NotFound as exc:  # replaced by a save meanwhile
                                why.append(f"peers: {exc}")
            if found is None:
                raise HttpError(404, "not_in_memory", "; ".join(why))
            yield self._answer(root, step, rank, found)

    def _answer(self, root: str, step: int, rank: int, found: list[tuple[Kept, int]]
                ) -> tuple[dict[str, Any], list[int]]:
        source = found[0][0].source
        self.log.info("memory_served", root=root, step=step, rank=rank, source=source)
        return ({"root": root, "step": step, "rank": rank, "source": source,
                 "arenas": [k.json() for k, _ in found]}, [fd for _, fd in found])

    def _from_peers(self, cfg: RootConfig, step: int, ranks: list[int], why: list[str]
                    ) -> bool:
        """Fetch `ranks`' states from a peer and keep them (never over a newer step's);
        False (why said) when not all could be."""
        try:
            fetched = self.peers.fetch(cfg, step, ranks, why)
        except Exception as exc:  # broad: the peer tier failing is a tier skipped, not a 500
            self.log.error("memory_peers_failed", root=cfg.name, step=step, ranks=ranks,
                           error=f"{type(exc).__name__}: {exc}", exc_info=True)
            why.append(f"peers: {type(exc).__name__}: {exc}")
            return False
        for k in fetched or ():
            self.own.keep(k, over_newer=False)
        return fetched is not None

    # -- the persist service's hook ---------------------------------------------------------

    def keep(self, kept: Kept) -> None:
        """A save's arena was written: keep it for a restart (its descriptor is now this
        service's) and send it to the peers soon; let it go when [memory] keep is false."""
        if not self.config().memory.keep or kept.root not in self.roots():
            os.close(kept.fd)
            return
        self.own.keep(kept)
        self.log.info("memory_kept", root=kept.root, step=kept.step, rank=kept.rank,
                      bytes=kept.nbytes)
        self._wake.set()

    # -- status and metrics -----------------------------------------------------------------

    def status_json(self) -> dict[str, Any]:
        roots = []
        for name in self.roots():
            own = self.own.held_bytes(name)
            peer = self.peers.held_bytes(name) if self.peers is not None else 0
            roots.append({"name": name, "own_bytes": own, "peer_bytes": peer,
                          "held_by": self.peers.held_by(name) if self.peers is not None else [],
                          "holding_for": (self.peers.holding_for(name)
                                          if self.peers is not None else [])})
        return {"own_bytes": sum(r["own_bytes"] for r in roots),
                "peer_bytes": sum(r["peer_bytes"] for r in roots), "roots": roots}

    def held(self) -> list[tuple[str, int, int]]:
        """(root, own bytes, peer bytes) per root, for `ckptd_memory_held_bytes`."""
        return [(r["name"], r["own_bytes"], r["peer_bytes"])
                for r in self.status_json()["roots"]]

    # -- supervision ------------------------------------------------------------------------

    def run(self, stop: threading.Event) -> None:
        """Replicate what was kept, as it is kept, until stop; then let every state go."""
        # nice, not SCHED_IDLE: a trainer that keeps every core busy would starve SCHED_IDLE
        # sending outright (measured: no replica at all while a CPU-bound loop ran); at
        # nice 19 it takes a small share and the replica still arrives
        lower_priority(idle=False, nice=19)
        try:
            while not stop.is_set():
                self._wake.clear()
                for gone in {k.root for k in self.own.all()} - set(self.roots()):
                    self.own.forget(gone)  # a root that left the config: its states go too
                if self.peers is not None:
                    for gone in self.peers.replicas.roots() - set(self.roots()):
                        self.peers.replicas.drop(gone)  # and what peers gave us of it
                if not self.config().memory.keep:
                    self.own.forget()  # keep = false since a reload
                if self.peers is not None:
                    with self.own.borrowed() as pairs:
                        self.peers.replicate(pairs, stop)
                self._wake.wait(LOOK_EVERY_S)
        finally:
            if stop.is_set():
                if self.peers is not None:
                    self.peers.close()
                self.own.forget()

    def wake(self) -> None:
        self._wake.set()
