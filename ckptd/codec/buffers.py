"""Block buffers and zstd contexts kept between files, so each file does not pay to set them up.

Fresh multi-MiB buffers cost page faults on first touch (measured here: ~0.1 s per process for a
4 MiB-block encoder, more than coding a 40 MB file); this pool keeps at most `KEEP` idle slots
per block size and one set of zstd contexts per level and thread. It holds no file data.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Iterable

import numpy as np

from ckptd.codec.blocks import Coders
from ckptd.codec.planes import Workspace

KEEP = 2


class Slot:
    """A block buffer and the workspace its block is coded in; used by one block at a time."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.buf = bytearray(block_size)
        self.ws = Workspace()


_lock = threading.Lock()
_idle: dict[int, list[Slot]] = {}


def take(block_size: int) -> Slot:
    with _lock:
        spare = _idle.get(block_size)
        if spare:
            return spare.pop()
    return Slot(block_size)


def give(slots: Iterable[Slot]) -> None:
    with _lock:
        for slot in slots:
            spare = _idle.setdefault(slot.block_size, [])
            if len(spare) < KEEP:
                spare.append(slot)


def release() -> None:
    """Drop every idle slot (for a caller that wants the memory back now)."""
    with _lock:
        _idle.clear()


@functools.cache
def coders(level: int) -> Coders:
    """zstd contexts for `level`, one set per thread (Coders is thread-local)."""
    return Coders(level)

def same_memory(a: memoryview, b: memoryview) -> bool:
    """Whether two buffers start at the same address (a block decoded in place is handed on
    as a view of its destination: copying it onto itself is skipped). Empty ones are."""
    if not len(a) or not len(b):
        return not len(a) and not len(b)
    where = [np.frombuffer(v, dtype=np.uint8).__array_interface__["data"][0] for v in (a, b)]
    return bool(where[0] == where[1])
