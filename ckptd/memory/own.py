"""The arenas this node's daemon keeps for a restarted trainer (SPEC.md "Restoring from memory",
tier 1): after an async save is written, its arena's descriptor (no copy) and what the daemon
recorded of each file it wrote from it (offset, size, xxh3-128), one per (root, rank), until
that rank's next save replaces it.

Decides whether a kept state may be served (its header still says persisted, at the generation
that was written) and hands out duplicates of the descriptors; never reads a checkpoint file,
never maps an arena for longer than a header read, and never writes into one (a state fetched
from a peer is written once, by `fill`, before it is kept).
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from ckptd import arena
from ckptd.clock import SYSTEM, Clock
from ckptd.errors import Malformed, NotFound

MEMORY = "memory"  # meta["source"] of a state served from this node's daemon
PEER = "peer:"  # ... and the prefix of one fetched from a peer (`peer:<node>`)


@dataclass(frozen=True)
class KeptFile:
    path: str
    component: str
    offset: int
    size: int
    hash: str  # xxh3-128 hex of the file's bytes, as the daemon wrote (or fetched) them

    def json(self) -> dict[str, Any]:
        return {"path": self.path, "component": self.component, "offset": self.offset,
                "size": self.size, "hash": self.hash}


@dataclass
class Kept:
    """One rank's persisted state in an arena: `fd` is the daemon's own descriptor."""

    root: str
    rank: int
    world_size: int
    step: int
    generation: int
    fd: int
    size: int
    files: tuple[KeptFile, ...]
    head: dict[str, Any]
    source: str = MEMORY
    kept_at: float = 0.0
    sent: dict[str, tuple[int, int]] = field(default_factory=dict)  # peer node -> (step, gen)

    @property
    def nbytes(self) -> int:
        return sum(f.size for f in self.files)

    def whole(self, fd: int | None = None) -> str | None:
        """None when the arena (through `fd`, default the kept descriptor) still holds this
        generation persisted; else why not."""
        try:
            header = arena.read_header(os.pread(self.fd if fd is None else fd,
                                                arena.DATA_OFFSET, 0))
        except (OSError, Malformed) as exc:
            return f"its arena's header cannot be read ({exc})"
        if header.generation != self.generation or header.state is not arena.State.PERSISTED:
            return (f"its arena was reused: it holds generation {header.generation}"
                    f" {header.state.name.lower()}, not generation {self.generation} persisted"
                    " (the trainer began its next save)")
        return None

    def json(self) -> dict[str, Any]:
        return {"rank": self.rank, "generation": self.generation, "size": self.size,
                "files": [f.json() for f in self.files], "head": self.head}


class OwnArenas:
    """The kept states, by (root, rank). Thread-safe; every descriptor handed out is a dup the
    caller closes."""

    def __init__(self, clock: Clock = SYSTEM) -> None:
        self.clock = clock
        self._kept: dict[tuple[str, int], Kept] = {}
        self._lock = threading.Lock()

    def keep(self, kept: Kept, over_newer: bool = True) -> bool:
        """Keep `kept` (its fd is now this registry's), replacing the rank's earlier state;
        with `over_newer` False (a state fetched from a peer) not over a state of a newer
        step: then `kept` is let go and False returned."""
        kept.kept_at = self.clock.time()
        with self._lock:
            old = self._kept.get((kept.root, kept.rank))
            if old is not None and not over_newer and old.step > kept.step:
                old = kept  # closed below: the newer state stays
            else:
                self._kept[(kept.root, kept.rank)] = kept
        if old is not None and old.fd != kept.fd:
            _close(old.fd)
        elif old is kept:
            _close(kept.fd)
            return False
        return True

    def missing(self, root: str, step: int, rank: int) -> list[int]:
        """The ranks a load of `rank` at `step` reads (its own, rank 0's) not kept whole."""
        wanted = [rank] if rank == 0 else [rank, 0]
        with self._lock:
            kept = {r: self._kept.get((root, r)) for r in wanted}
        return [r for r, k in kept.items()
                if k is None or k.step != step or k.whole() is not None]

    @contextlib.contextmanager
    def lookup(self, root: str, step: int, rank: int) -> Iterator[list[tuple[Kept, int]]]:
        """The states a load of `rank` at `step` reads (its own, and rank 0's, which holds the
        model, when it is another rank), each with a read-only descriptor of its arena opened
        under the registry's lock (a save replacing the state meanwhile closes only the
        registry's own; a client handed it can read the arena, never write it), closed on the
        way out; NotFound saying why when any is not here whole."""
        wanted = [rank] if rank == 0 else [rank, 0]
        found: list[tuple[Kept, int]] = []
        try:
            with self._lock:
                for r in wanted:
                    kept = self._kept.get((root, r))
                    if kept is None:
                        raise NotFound(f"this node's daemon keeps no state of rank {r} of"
                                       f" {root!r}")
                    if kept.step != step:
                        raise NotFound(f"this node's daemon keeps step {kept.step} of rank {r}"
                                       f" of {root!r}, not step {step}")
                    found.append((kept, reopen_read_only(kept.fd)))
            for kept, fd in found:
                why = kept.whole(fd)
                if why is not None:
                    self.drop(kept)
                    raise NotFound(f"the kept step {step} of rank {kept.rank} of {root!r} is"
                                   f" not whole: {why}")
            yield found
        finally:
            for _, fd in found:
                _close(fd)

    @contextlib.contextmanager
    def borrowed(self) -> Iterator[list[tuple[Kept, int]]]:
        """Every kept state with a duplicate of its descriptor (taken under the lock), closed
        on the way out: what replication reads while saves may replace the states."""
        pairs: list[tuple[Kept, int]] = []
        try:
            with self._lock:
                for k in self._kept.values():
                    pairs.append((k, os.dup(k.fd)))
            yield pairs
        finally:
            for _, fd in pairs:
                _close(fd)

    def drop(self, kept: Kept) -> None:
        with self._lock:
            if self._kept.get((kept.root, kept.rank)) is not kept:
                return
            del self._kept[(kept.root, kept.rank)]
        _close(kept.fd)

    def forget(self, root: str | None = None) -> None:
        """Let go of every state kept (of `root`)."""
        with self._lock:
            gone = [k for k in self._kept.values() if root is None or k.root == root]
            for k in gone:
                del self._kept[(k.root, k.rank)]
        for k in gone:
            _close(k.fd)

    def all(self) -> list[Kept]:
        with self._lock:
            return list(self._kept.values())

    def held_bytes(self, root: str | None = None) -> int:
        return sum(k.nbytes for k in self.all() if root is None or k.root == root)


def reopen_read_only(fd: int) -> int:
    """A new descriptor of the same memfd, open for reading only."""
    return os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)


def fill(size: int, header_generation: int = 1) -> tuple[int, memoryview, Any]:
    """A new arena of `size` bytes for a state fetched from a peer: (fd, a writable view of
    it, the mapping to close). The caller writes the files, then `seal_persisted`."""
    import mmap

    fd = arena.create_memfd(size)
    try:
        mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException:
        _close(fd)
        raise
    arena.init_header(mm)
    arena.set_state(mm, arena.State.WRITING, header_generation)
    return fd, memoryview(mm), mm


def seal_persisted(mm: Any, generation: int, used: int) -> None:
    arena.set_state(mm, arena.State.PERSISTED, generation, used)


def layout(sizes: list[int]) -> tuple[list[int], int]:
    """Each file's offset in an arena (4 KiB aligned, after the header page) and its size."""
    offsets, at = [], arena.DATA_OFFSET
    for size in sizes:
        offsets.append(at)
        at = arena.aligned(at + size)
    return offsets, max(at, arena.DATA_OFFSET)


def _close(fd: int) -> None:
    with contextlib.suppress(OSError):
        os.close(fd)
