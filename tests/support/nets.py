"""Fixed nets for the executor's unit tests: the guards a test states, handed out under a lock of
the test's own (`executor.Nets`), so each entry point is tried against one net at a time."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from ckptd.retention.nets import Guards


class FixedNets:
    """`held()` takes `lock` and yields `guards`; `on_read` (if given) runs right after, inside
    the lock, as the place a test forces another caller's act between the reading and the
    delete."""

    def __init__(self, guards: Guards, lock: Any = None,
                 on_read: Callable[[], object] | None = None) -> None:
        self.guards = guards
        self.lock = lock if lock is not None else threading.RLock()
        self.on_read = on_read
        self.reads = 0

    @contextmanager
    def held(self) -> Iterator[Guards]:
        with self.lock:
            self.reads += 1
            if self.on_read is not None:
                self.on_read()
            yield self.guards


def fixed(guards: Guards, **kw: Any) -> FixedNets:
    return FixedNets(guards, **kw)


def no_nets() -> FixedNets:
    return FixedNets(Guards(latest_step=None, best_step=None, pinned=frozenset(),
                            in_use=frozenset(), committed=frozenset(),
                            upload_configured=False))
