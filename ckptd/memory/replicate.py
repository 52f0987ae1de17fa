"""The peer side of restoring from memory (SPEC.md "Restoring from memory", tier 2): this
daemon's kept states sent, compressed with the root's codec, to [memory] replicas peers; the
replicas it holds for its peers served over TCP; and a replaced node's state fetched back from
a peer, decoded into a fresh arena and checked before it is kept.

Peers of a root are the daemons that share its name and upload url: each publishes its
address under the root's `_peers/` in the bucket (`directory`). Never deletes a checkpoint file
and never reads the store; a peer that fails is named and skipped, never waited on past
[memory] timeout.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from ckptd.backends.base import Backend
from ckptd.clock import SYSTEM, Clock
from ckptd.codec import read_threads
from ckptd.config import MemoryConfig, RootConfig
from ckptd.errors import CkptdError, InternalError
from ckptd.log import get_logger
from ckptd.memory import directory, own, proof, wire
from ckptd.memory.own import Kept, KeptFile
from ckptd.memory.peerclient import PeerClient
from ckptd.memory.peerserver import PeerServer
from ckptd.memory.replicas import Replicas

BackendFor = Callable[[RootConfig], "Backend | None"]
# This node's entry is written again this often (peers choose among entries fresher than
# STALE_S, so a node gone for good stops being sent replicas).
REPUBLISH_S = 60.0
RETRY_FIRST_S = 2.0
# A replaced node asks at most this many peers, within this many [memory] timeouts in all.
MAX_TRIED = 8
# A fetch is what a replaced node's trainer waits for: its blocks decode on every core.
DECODE_THREADS = read_threads()
FETCH_ROUNDS = 4  # a state not yet with its peers is tried again after this, doubling
STALE_S = 600.0


def machine_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


class Peers:
    """This daemon among its peers: `start` serves them (when `memory.listen` is set),
    `replicate` sends, `fetch` brings a state back."""

    def __init__(self, cfg: MemoryConfig, node: str, roots: Callable[[], Mapping[str, RootConfig]],
                 backend_for: BackendFor, clock: Clock = SYSTEM) -> None:
        self.cfg, self.node, self.roots, self.backend_for = cfg, node, roots, backend_for
        self.clock = clock
        secret = self._secret = proof.read_secret(Path(cfg.secret_file))
        self.client = PeerClient(secret, node, cfg.timeout, cfg.max_bandwidth)
        self.replicas = Replicas(cfg.cap_bytes(machine_memory()), clock)
        self.server: PeerServer | None = None
        if cfg.address is not None:
            # a proof signed before this daemon started is refused: a request recorded for the
            # daemon this one replaces cannot be replayed to it (its nonces were forgotten)
            self.server = PeerServer(cfg.address, proof.Verifier(secret, clock,
                                                                 not_before=clock.time()),
                                     self.replicas, node, timeout_s=cfg.timeout,
                                     roots=lambda: self.roots().keys())
        self._held_by: dict[str, dict[str, int]] = {}  # root -> peer node -> step it holds
        self._published: dict[str, float] = {}  # root -> when this node's entry was written
        self._tried: dict[str, set[tuple[int, int, int]]] = {}  # root -> states placed
        self._retry_at: dict[str, float] = {}  # root -> when to try placing its states again
        self._backoff: dict[str, float] = {}
        self._lock = threading.Lock()
        self.log = get_logger()

    def start(self) -> None:
        if self.server is not None:
            self.server.start()

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server.close()

    @property
    def address(self) -> str:
        """What peers dial: `memory.advertise`, else the bound listen address."""
        if self.cfg.advertise:
            return self.cfg.advertise
        if self.server is None:
            return ""
        host, port = self.server.address[:2]
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    # -- sending ----------------------------------------------------------------------------

    def replicate(self, kept: list[tuple[Kept, int]], stop: threading.Event) -> None:
        """Publish this node in each uploading root's directory and send each kept state to
        the root's chosen peers, those not sent yet."""
        for root in self.roots().values():
            backend = self.backend_for(root)
            if backend is None or stop.is_set():
                continue
            # a state whose arena moved on (the trainer's next save began) is not sent
            mine = [(k, fd) for k, fd in kept if k.root == root.name and k.whole(fd) is None]
            due = self.clock.time() - self._published.get(root.name, -1e18) >= REPUBLISH_S
            states = {(k.rank, k.step, k.generation) for k, _ in mine}
            if not due and (states <= self._tried.get(root.name, set())
                            or self.clock.time() < self._retry_at.get(root.name, 0.0)):
                continue  # each state is with its peers (or waits to be tried again), and
                # this node's entry is fresh
            try:
                entries = self._publish(backend, root)
            except CkptdError as exc:
                self.log.warning("memory_directory_failed", root=root.name, error=str(exc))
                continue
            if self.cfg.replicas <= 0:
                continue
            fresh = self.clock.time() - STALE_S
            addresses = {e.node: e.address for e in entries
                         if e.node != self.node and e.updated >= fresh}
            targets = directory.choose(sorted(addresses), self.node, self.cfg.replicas)
            for k, fd in mine:
                for peer in targets:
                    if stop.is_set():
                        return
                    if k.sent.get(peer) != (k.step, k.generation):
                        self._send(root, k, fd, peer, addresses[peer])
            placed = all(sum(k.sent.get(p) == (k.step, k.generation) for p in targets)
                         >= self.cfg.replicas for k, _ in mine)
            if placed:
                self._tried[root.name], self._backoff[root.name] = states, RETRY_FIRST_S
            else:  # too few peers yet, or a send failed: look again soon, then less often
                wait = self._backoff.get(root.name, RETRY_FIRST_S)
                self._retry_at[root.name] = self.clock.time() + wait
                self._backoff[root.name] = min(wait * 2, REPUBLISH_S)
            with contextlib.suppress(CkptdError):
                self._publish(backend, root)

    def _publish(self, backend: Backend, root: RootConfig) -> list[directory.PeerEntry]:
        with self._lock:
            held = tuple(sorted(self._held_by.get(root.name, {}).items()))
        if self.address:
            directory.publish(backend, root.name, directory.PeerEntry(
                self.node, self.address, self.clock.time(), held), self._secret)
            self._published[root.name] = self.clock.time()
        return directory.peers(backend, root.name, secret=self._secret)

    def _send(self, root: RootConfig, k: Kept, fd: int, peer: str, address: str) -> None:
        """Send `k` (read through `fd`, a duplicate of its descriptor) to `peer`."""
        head = wire.ReplicaHead(root.name, self.node, k.step, k.rank, k.world_size,
                                k.generation, tuple(wire.ReplicaFile(f.path, f.component,
                                                                     f.size, f.hash)
                                                    for f in k.files), k.head)
        started = self.clock.monotonic()
        try:
            with _mapped(fd, k.size) as view:
                offsets = {f.path: f for f in k.files}

                def raw(f: wire.ReplicaFile) -> memoryview:
                    at = offsets[f.path]
                    return view[at.offset:at.offset + at.size]

                body = wire.encode(head, raw, root.compress.codec, root.compress.level,
                                   root.compress.min_saving, key=self._secret)
                data = wire.head_bytes(head)
                answer = self.client.put_replica(address, root.name, k.rank, k.step, data,
                                                 _after_head(body, data))
        except CkptdError as exc:
            self.log.warning("memory_replica_failed", root=root.name, step=k.step, rank=k.rank,
                             peer=peer, address=address, error=str(exc))
            return
        k.sent[peer] = (k.step, k.generation)
        with self._lock:
            self._held_by.setdefault(root.name, {})[peer] = k.step
        self.log.info("memory_replicated", root=root.name, step=k.step, rank=k.rank, peer=peer,
                      bytes=k.nbytes, sent_bytes=answer.get("bytes"),
                      seconds=round(self.clock.monotonic() - started, 3))

    # -- fetching ---------------------------------------------------------------------------

    def fetch(self, root: RootConfig, step: int, ranks: list[int], why: list[str]
              ) -> list[Kept] | None:
        """The states of `ranks` at `step` (those a load needs that this daemon lacks), from
        the peers that hold this node's copy: the peers its entry names first, then the
        others listed and fresh, at most MAX_TRIED, within FETCH_ROUNDS x [memory] timeout in
        all; None (with each peer's reason in `why`) when not every rank came back whole."""
        backend = self.backend_for(root)
        if backend is None:
            why.append(f"peers: root {root.name!r} has no upload url to find its peers by")
            return None
        try:
            entries = directory.peers(backend, root.name, secret=self._secret)
        except CkptdError as exc:
            why.append(f"peers: the directory in the bucket cannot be read ({exc})")
            return None
        mine = next((e for e in entries if e.node == self.node), None)
        hinted = [n for n, _ in (mine.held_by if mine is not None else ())]
        others = {e.node: e.address for e in entries if e.node != self.node}
        fresh = {e.node for e in entries if e.updated >= self.clock.time() - STALE_S}
        order = [n for n in hinted if n in others] + sorted(
            (set(others) & fresh) - set(hinted))
        order = order[:MAX_TRIED]
        if not order:
            why.append(f"peers: no peer of {root.name!r} is listed in the bucket")
            return None
        deadline = self.clock.monotonic() + FETCH_ROUNDS * self.cfg.timeout
        got: list[Kept] = []
        try:
            for r in sorted(ranks):  # rank 0 (the model) first
                k = self._fetch_rank(root, step, r, order, others, why, deadline)
                if k is None:
                    return None
                got.append(k)
            done, got = got, []
            return done
        finally:
            for g in got:  # not every rank came back: none is kept
                with contextlib.suppress(OSError):
                    os.close(g.fd)

    def fetch_all(self, root: RootConfig, step: int, why: list[str]) -> list[Kept]:
        """Every rank's state of this node at `step` that some peer holds (`ckptd memory
        fetch`): the ranks each peer lists for this node, each fetched as a load would."""
        backend = self.backend_for(root)
        if backend is None:
            why.append(f"peers: root {root.name!r} has no upload url to find its peers by")
            return []
        entries = directory.peers(backend, root.name, secret=self._secret)
        addresses = {e.node: e.address for e in entries if e.node != self.node}
        ranks: set[int] = set()
        for peer, address in sorted(addresses.items()):
            try:
                ranks |= {int(r["rank"]) for r in self.client.index(address, root.name)
                          if r.get("step") == step}
            except CkptdError as exc:
                why.append(f"peer {peer}: {exc}")
        got = []
        for r in sorted(ranks):
            k = self._fetch_rank(root, step, r, sorted(addresses), addresses, why)
            if k is not None:
                got.append(k)
        return got

    def _fetch_rank(self, root: RootConfig, step: int, rank: int, order: list[str],
                    addresses: dict[str, str], why: list[str], deadline: float | None = None
                    ) -> Kept | None:
        for peer in order:
            if deadline is not None and self.clock.monotonic() > deadline:
                why.append(f"peers: out of time ({FETCH_ROUNDS} x memory.timeout) before"
                           f" peer {peer} was asked for rank {rank}")
                return None
            try:
                k = self._fetch_one(root, step, rank, peer, addresses[peer])
            except CkptdError as exc:
                why.append(f"peer {peer}: rank {rank}: {exc}")
                self.log.warning("memory_peer_skipped", root=root.name, step=step, rank=rank,
                                 peer=peer, error=str(exc))
                continue
            self.log.info("memory_fetched", root=root.name, step=step, rank=rank, peer=peer,
                          bytes=k.nbytes)
            k.sent[peer] = (k.step, k.generation)  # that peer holds it already
            with self._lock:
                self._held_by.setdefault(root.name, {})[peer] = step
            return k
        return None

    def _fetch_one(self, root: RootConfig, step: int, rank: int, peer: str, address: str
                   ) -> Kept:
        with self.client.open_replica(address, root.name, rank, step) as stream:
            head = wire.read_head(stream, key=self._secret)
            if (head.root, head.node, head.step, head.rank) != (root.name, self.node, step,
                                                               rank):
                raise CkptdError(f"it answered with step {head.step} of rank {head.rank} of"
                                 f" node {head.node} of {head.root!r}")
            offsets, size = own.layout([f.size for f in head.files])
            if size > machine_memory():
                raise CkptdError(f"its replica claims {size} bytes, more than this machine's"
                                 " memory")
            fd, view, mm = own.fill(size, head.generation)
            try:
                at = dict(zip((f.path for f in head.files), offsets, strict=True))
                wire.decode_files(stream, head, lambda f: view[at[f.path]:at[f.path] + f.size],
                                  threads=DECODE_THREADS)
                own.seal_persisted(mm, head.generation, size)
            except BaseException:
                os.close(fd)  # the pages go once the mapping does too
                raise
            finally:
                view.release()
                with contextlib.suppress(BufferError):  # a failed decode's traceback may still
                    mm.close()  # hold a slice: then it is unmapped when that is collected
        files = tuple(KeptFile(f.path, f.component, at[f.path], f.size, f.hash)
                      for f in head.files)
        return Kept(root.name, rank, head.world_size, step, head.generation, fd, size, files,
                    dict(head.head), source=f"{own.PEER}{peer}")

    # -- what is held -----------------------------------------------------------------------

    def held_bytes(self, root: str) -> int:
        return self.replicas.held_bytes(root)

    def held_by(self, root: str) -> list[dict[str, Any]]:
        with self._lock:
            return [{"node": n, "step": s} for n, s in sorted(self._held_by.get(root, {}).items())]

    def holding_for(self, root: str) -> list[dict[str, Any]]:
        return self.replicas.holding_for(root)


@contextlib.contextmanager
def _mapped(fd: int, size: int) -> Iterator[memoryview]:
    mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
    view = memoryview(mm)
    try:
        yield view
    finally:
        view.release()
        with contextlib.suppress(BufferError):
            mm.close()


def _after_head(body: Iterator[bytes], head: bytes) -> Iterator[bytes]:
    """The encoded body without its length-prefixed head (the client sends that itself,
    signed): from the head's checksum on."""
    first = next(body)
    if first[4:4 + len(head)] != head:
        raise InternalError("the replica's encoder did not begin with its head")
    yield first[4 + len(head):]
    yield from body
