"""The memory service (docs/MEMORY.md): serves a restarted trainer's state from memory (the arenas
this daemon kept, else a copy a peer holds for this node), answers peers over TCP, and sends
the kept state to [memory] replicas peers at idle priority.

Owns the kept arenas (`memory.own`), the replicas held for peers and the peer server; decides
which tier serves a load of one step (never which step: the loader chose it). Never deletes a
checkpoint file and never reads the store.
"""

from __future__ import annotations

import contextlib
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
        kept = self._own(root, step, rank, why)
        if kept is None and self.peers is not None:
            kept = self.peers.fetch(cfg, step, rank, why)
            for k in kept or ():
                self.own.keep(k)
        if kept is None:
            raise HttpError(404, "not_in_memory", "; ".join(why))
        doc = {"root": root, "step": step, "rank": rank, "source": kept[0].source,
               "arenas": [k.json() for k in kept]}
        with self.own.handed(kept) as fds:
            yield doc, fds
        self.log.info("memory_served", root=root, step=step, rank=rank, source=kept[0].source)

    def _own(self, root: str, step: int, rank: int, why: list[str]) -> list[Kept] | None:
        if not self.config().memory.keep:
            why.append("memory: memory.keep is false")
            return None
        try:
            return self.own.lookup(root, step, rank)
        except NotFound as exc:
            why.append(f"memory: {exc}")
            return None

    # -- the persist service's hook ---------------------------------------------------------

    def kept(self, kept: Kept) -> None:
        """A save's arena was kept: send it to the peers soon."""
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
        lower_priority()
        try:
            while not stop.is_set():
                self._wake.wait(5.0)
                self._wake.clear()
                if self.peers is not None and not stop.is_set():
                    self.peers.replicate(self.own.all(), stop)
        finally:
            if stop.is_set():
                if self.peers is not None:
                    self.peers.close()
                self.own.forget()

    def wake(self) -> None:
        self._wake.set()
