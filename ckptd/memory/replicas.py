"""The replicas this daemon holds in memory for its peers: one per (root, node, rank), the body
as received, within a byte cap that counts the uploads still arriving too.

Owns the cap and the order replicas are dropped in (oldest step first; ties: oldest received).
Never reads a replica's bytes, never does I/O, never reads the wall clock but through `clock`.
"""

from __future__ import annotations

import heapq
import itertools
import threading
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from ckptd.clock import SYSTEM, Clock
from ckptd.errors import BadValue, HttpError

Key = tuple[str, str, int]  # (root, node, rank)
# Replicas held at once, whatever their sizes: each costs some memory of its own beyond the
# bytes counted, so many tiny ones must not outgrow the cap.
MAX_REPLICAS = 100_000


@dataclass(frozen=True)
class Replica:
    """One held replica: its body's chunks (never copied), step, byte count, when received."""

    root: str
    node: str
    rank: int
    step: int
    chunks: tuple[bytes, ...]
    nbytes: int
    received: float
    seq: int  # order of arrival: the tie-break among equal steps


class Upload:
    """Room taken for one replica still arriving: `grow` before each part of the body is kept,
    `commit` once it is whole; leaving the `with` block gives back what was not committed."""

    def __init__(self, owner: Replicas, key: Key, step: int) -> None:
        self._owner, self.key, self.step = owner, key, step
        self.reserved = 0
        self.done = False

    def grow(self, n: int) -> None:
        """Take `n` more bytes of room, dropping older replicas if need be; HttpError 507
        when the room cannot be had."""
        self._owner._grow(self, n)

    def commit(self, chunks: list[bytes]) -> Replica:
        """Hold `chunks` as this replica (replacing an older or equal step's)."""
        return self._owner._commit(self, chunks)

    def close(self) -> None:
        self._owner._release(self)

    def __enter__(self) -> Upload:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


class Replicas:
    """What is held for peers, at most `max_bytes` in all (the bytes held plus the room taken
    by uploads still arriving) and at most `max_replicas` replicas. Thread-safe."""

    def __init__(self, max_bytes: int, clock: Clock = SYSTEM,
                 max_replicas: int = MAX_REPLICAS) -> None:
        if not isinstance(max_bytes, int) or max_bytes < 0:
            raise BadValue(f"max_bytes: {max_bytes!r} is not a size in bytes")
        self.max_bytes, self.max_replicas = max_bytes, max_replicas
        self._clock = clock
        self._lock = threading.Lock()
        self._held: dict[Key, Replica] = {}
        self._order: list[tuple[int, int, Key]] = []  # heap of (step, seq, key); lazy deletes
        self._held_total = 0
        self._reserved_total = 0
        self._seq = itertools.count()

    # -- taking a replica in ----------------------------------------------------------------

    def begin(self, root: str, node: str, rank: int, step: int, expect: int = 0) -> Upload:
        """Room for a replica about to arrive (`expect` bytes when known). HttpError 409 when a
        newer step is held for the same rank; 507 when it cannot fit."""
        key = (root, node, rank)
        with self._lock:
            self._not_stale(key, step)
        upload = Upload(self, key, step)
        if expect:
            try:
                upload.grow(expect)
            except HttpError:
                upload.close()
                raise
        return upload

    def put(self, root: str, node: str, rank: int, step: int, chunks: list[bytes],
            nbytes: int) -> Replica:
        """Hold a replica already whole in memory (`nbytes`: the chunks' total)."""
        if nbytes != sum(len(c) for c in chunks):
            raise BadValue(f"nbytes {nbytes} is not the chunks' total")
        with self.begin(root, node, rank, step, nbytes) as upload:
            return upload.commit(chunks)

    def _not_stale(self, key: Key, step: int) -> None:
        held = self._held.get(key)
        if held is not None and held.step > step:
            raise HttpError(409, "stale", f"step {held.step} of {key[0]!r} rank {key[2]} of"
                            f" node {key[1]!r} is held already, newer than step {step}")

    def _grow(self, upload: Upload, n: int) -> None:
        if upload.done:
            raise BadValue("this upload is over")
        with self._lock:
            want = upload.reserved + n
            if want > self.max_bytes:
                raise HttpError(507, "too_large", f"a replica of over {want - 1} bytes is"
                                f" larger than all this daemon holds for peers"
                                f" ({self.max_bytes} bytes)")
            self._make_room(n, upload.step)
            upload.reserved = want
            self._reserved_total += n

    def _make_room(self, n: int, step: int) -> None:
        """Drop held replicas, oldest step first, until `n` more bytes fit; only those of a
        step at most `step` (a newer one outlives an older arrival). Under the lock."""
        while self._held_total + self._reserved_total + n > self.max_bytes:
            victim = self._oldest()
            if victim is None or victim.step > step:
                raise HttpError(507, "full", f"no room for {n} more bytes: this daemon holds"
                                f" {self._held_total} bytes of replicas of newer steps and"
                                f" {self._reserved_total} arriving (max {self.max_bytes})")
            self._remove((victim.root, victim.node, victim.rank))

    def _make_place(self, step: int) -> None:
        """Drop the oldest replica while `max_replicas` are held (one of a step at most
        `step`), else HttpError 507. Under the lock."""
        while len(self._held) >= self.max_replicas:
            victim = self._oldest()
            if victim is None or victim.step > step:
                raise HttpError(507, "full", f"this daemon holds {len(self._held)} replicas"
                                f" of newer steps already (max {self.max_replicas})")
            self._remove((victim.root, victim.node, victim.rank))

    def _commit(self, upload: Upload, chunks: list[bytes]) -> Replica:
        nbytes = sum(len(c) for c in chunks)
        if nbytes > upload.reserved:
            upload.grow(nbytes - upload.reserved)
        if upload.done:
            raise BadValue("this upload is over")
        root, node, rank = upload.key
        with self._lock:
            self._not_stale(upload.key, upload.step)
            if upload.key not in self._held:
                self._make_place(upload.step)
            upload.done = True
            self._reserved_total -= upload.reserved
            upload.reserved = 0
            self._remove(upload.key)
            replica = Replica(root, node, rank, upload.step, tuple(chunks), nbytes,
                              self._clock.time(), next(self._seq))
            self._held[upload.key] = replica
            self._held_total += nbytes
            heapq.heappush(self._order, (replica.step, replica.seq, upload.key))
            self._compact()
        return replica

    def _release(self, upload: Upload) -> None:
        with self._lock:
            self._reserved_total -= upload.reserved
            upload.reserved = 0
            upload.done = True

    def _remove(self, key: Key) -> None:
        old = self._held.pop(key, None)
        if old is not None:
            self._held_total -= old.nbytes

    def _oldest(self) -> Replica | None:
        while self._order:
            step, seq, key = self._order[0]
            held = self._held.get(key)
            if held is not None and held.seq == seq:
                return held
            heapq.heappop(self._order)  # replaced or dropped since
        return None

    def _compact(self) -> None:
        if len(self._order) > 2 * len(self._held) + 64:
            self._order = [(r.step, r.seq, k) for k, r in self._held.items()]
            heapq.heapify(self._order)

    # -- reading ---------------------------------------------------------------------------

    def find(self, root: str, node: str, rank: int) -> Replica | None:
        """The replica held for this rank, whatever its step."""
        with self._lock:
            return self._held.get((root, node, rank))

    def get(self, root: str, node: str, rank: int, step: int) -> list[bytes] | None:
        """The body of this step's replica; None when nothing is held for the rank;
        HttpError 409 ("other_step", naming the held step) when another step is."""
        held = self.find(root, node, rank)
        if held is None:
            return None
        if held.step != step:
            raise HttpError(409, "other_step", f"step {held.step} is held for rank {rank} of"
                            f" node {node!r}, not step {step}")
        return list(held.chunks)

    def index(self, root: str, node: str) -> list[dict[str, Any]]:
        """The ranks held for `node` under `root`, by rank."""
        with self._lock:
            held = [r for (ro, no, _), r in self._held.items() if ro == root and no == node]
        return [{"rank": r.rank, "step": r.step, "bytes": r.nbytes}
                for r in sorted(held, key=lambda r: r.rank)]

    def held_bytes(self, root: str | None = None) -> int:
        """Bytes held (for `root`, or in all); room taken by uploads arriving is not counted."""
        with self._lock:
            if root is None:
                return self._held_total
            return sum(r.nbytes for (ro, _, _), r in self._held.items() if ro == root)

    def reserved_bytes(self) -> int:
        """Room taken by uploads still arriving."""
        with self._lock:
            return self._reserved_total

    def holding_for(self, root: str) -> list[dict[str, Any]]:
        """Per node held for under `root`: its newest step and the bytes held over its ranks."""
        per: dict[str, dict[str, Any]] = {}
        with self._lock:
            for (ro, node, _), r in self._held.items():
                if ro != root:
                    continue
                entry = per.setdefault(node, {"node": node, "step": r.step, "bytes": 0})
                entry["step"] = max(entry["step"], r.step)
                entry["bytes"] += r.nbytes
        return [per[n] for n in sorted(per)]

    def roots(self) -> set[str]:
        """The roots some replica is held for."""
        with self._lock:
            return {key[0] for key in self._held}

    def drop(self, root: str) -> int:
        """Forget every replica held under `root`; the bytes freed."""
        with self._lock:
            keys = [k for k in self._held if k[0] == root]
            before = self._held_total
            for key in keys:
                self._remove(key)
            self._compact()
            return before - self._held_total
