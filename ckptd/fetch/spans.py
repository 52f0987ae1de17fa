"""Which stored bytes a ranged read of one object fetches, and when a block may decode: the
blocks' extents joined and cut into aligned spans, each fetched once on the fetch pool and
dropped after its last block; a block's decode submitted once all its spans have arrived.
Decodes nothing and checks nothing itself (`fetch.objects` does both).
"""

from __future__ import annotations

import bisect
import contextlib
import threading
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError, ThreadPoolExecutor
from typing import Any, TypeVar

from ckptd.codec.index import Block

R = TypeVar("R")
# A ranged GET of stored bytes [start, end) of the object, pinned to the version first seen.
Get = Callable[[int, int], bytes | memoryview]

# Stored bytes are fetched in spans this big, aligned to multiples of it from the object's
# start: fewer requests than one per block, and a store that keeps objects in aligned chunks
# (SeaweedFS) sends each chunk once instead of twice for ranges that straddle them.
SPAN = 8 << 20


def when_done(waits: list[tuple[int, Future[Any]]], pool: ThreadPoolExecutor,
              fn: Callable[..., R], *args: Any) -> Future[R]:
    """`fn(pieces, *args)` run on `pool` once every future in `waits` is done, `pieces` being
    their (offset, result) pairs: a decoding thread is never held waiting on a fetch. Its
    outcome (or the pool's refusal) is the future's.

    The waits' callbacks would keep the futures (and their 8 MiB of bytes) in a reference
    cycle until the cycle collector runs: the arguments are dropped as soon as they are used.
    """
    out: Future[R] = Future()
    held: list[Any] = [waits, args]
    lock = threading.Lock()

    def chain(inner: Future[R]) -> None:
        if inner.cancelled():
            out.cancel()
        elif (exc := inner.exception()) is not None:
            _settle(out.set_exception, exc)
        else:
            _settle(out.set_result, inner.result())

    def ready(_: Future[Any]) -> None:
        with lock:
            if not held or not all(f.done() for _, f in held[0]):
                return
            got, rest = held
            held.clear()
        try:
            pieces = [(at, f.result()) for at, f in got]
        except BaseException as exc:  # a fetch failed: the block fails with it
            _settle(out.set_exception, exc)
            return
        try:
            pool.submit(fn, pieces, *rest).add_done_callback(chain)
        except RuntimeError as exc:  # the pool was shut down (the read is being abandoned)
            _settle(out.set_exception, exc)

    for _, fut in waits:
        fut.add_done_callback(ready)
    return out


def _settle(how: Callable[[Any], None], value: Any) -> None:
    """Set a future's outcome unless the reader cancelled it meanwhile (it gave up)."""
    with contextlib.suppress(InvalidStateError):
        how(value)


class Spans:
    """The stored bytes the blocks of one read need: the needed blocks' extents joined where
    they touch, cut at multiples of SPAN, each piece fetched once (on the fetch pool) and
    dropped after the last block that needs it is delivered. A whole file is fetched in
    aligned SPAN pieces; a sparse read fetches only its blocks' bytes."""

    def __init__(self, blocks: list[Block], get: Get, fetcher: ThreadPoolExecutor) -> None:
        self.blocks, self.get, self.fetcher = blocks, get, fetcher
        self.pieces: list[tuple[int, int]] = []
        for run_start, run_end in _runs(blocks):
            at = run_start
            while at < run_end:
                cut = min(run_end, (at // SPAN + 1) * SPAN)
                self.pieces.append((at, cut))
                at = cut
        starts = [p[0] for p in self.pieces]
        self.uses: list[list[int]] = []
        self.last: dict[int, int] = {}
        for i, blk in enumerate(blocks):
            lo, hi = blk.stored_start, blk.stored_start + blk.stored_len
            first = bisect.bisect_right(starts, lo) - 1
            used = [k for k in range(first, len(self.pieces)) if self.pieces[k][0] < hi]
            self.uses.append(used)
            for k in used:
                self.last[k] = i
        self.futures: dict[int, Future[Any]] = {}

    def fetch(self, i: int) -> list[tuple[int, Future[Any]]]:
        for k in self.uses[i]:
            if k not in self.futures:
                start, end = self.pieces[k]
                self.futures[k] = self.fetcher.submit(self.get, start, end)
        return [(self.pieces[k][0], self.futures[k]) for k in self.uses[i]]

    def forget(self, i: int) -> None:
        for k in self.uses[i]:
            if self.last.get(k) == i:
                self.futures.pop(k, None)

    def cancel(self) -> None:
        for fut in self.futures.values():
            fut.cancel()


def _runs(blocks: list[Block]) -> list[tuple[int, int]]:
    """The stored extents of ascending blocks, joined where one ends where the next starts."""
    runs: list[tuple[int, int]] = []
    for blk in blocks:
        lo, hi = blk.stored_start, blk.stored_start + blk.stored_len
        if runs and runs[-1][1] == lo:
            runs[-1] = (runs[-1][0], hi)
        else:
            runs.append((lo, hi))
    return runs
