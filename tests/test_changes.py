"""ckptd.lifecycle.changes: the generation counter long-polls wait on. A wait returns at once
when the generation already moved, wakes on notify from another thread, and times out unchanged."""

from __future__ import annotations

import threading
import time

from ckptd.lifecycle.changes import Changes


def test_generation_counts_notifies() -> None:
    c = Changes()
    assert c.generation == 0
    c.notify()
    c.notify()
    assert c.generation == 2


def test_wait_returns_at_once_when_already_moved() -> None:
    c = Changes()
    seen = c.generation
    c.notify()  # a change between reading the generation and waiting is not lost
    started = time.monotonic()
    assert c.wait(seen, timeout=5.0) == 1
    assert time.monotonic() - started < 1.0


def test_wait_times_out_with_the_same_generation() -> None:
    c = Changes()
    started = time.monotonic()
    assert c.wait(c.generation, timeout=0.1) == 0
    assert time.monotonic() - started >= 0.1


def test_notify_from_another_thread_wakes_every_waiter() -> None:
    c = Changes()
    gen = c.generation
    got: list[int] = []
    ready = threading.Barrier(4)

    def waiter() -> None:
        ready.wait()
        got.append(c.wait(gen, timeout=10.0))

    threads = [threading.Thread(target=waiter) for _ in range(3)]
    for t in threads:
        t.start()
    ready.wait()
    time.sleep(0.05)  # let the waiters block on the condition before notifying
    started = time.monotonic()
    c.notify()
    for t in threads:
        t.join(10)
    assert got == [1, 1, 1]
    assert time.monotonic() - started < 5.0


def test_a_stale_generation_returns_the_current_one() -> None:
    c = Changes()
    for _ in range(3):
        c.notify()
    assert c.wait(1, timeout=0.0) == 3  # any difference counts as a change, not only +1
