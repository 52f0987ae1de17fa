"""ckptd.lifecycle.changes: the generation counter long-polls wait on. A wait returns at once
when the generation already moved, wakes on notify from another thread, and times out unchanged."""

from __future__ import annotations

import sys
import threading
import time

from support.wait import wait_until

from ckptd.lifecycle import changes
from ckptd.lifecycle.changes import Changes


def blocked_in_changes_wait(t: threading.Thread) -> bool:
    """Whether `t` is inside `threading.Condition.wait` called from `Changes.wait`."""
    frame = sys._current_frames().get(t.ident or -1)
    if (frame is None or frame.f_code.co_filename != threading.__file__
            or frame.f_code.co_name != "wait"):  # not yet queued (taking the lock, say)
        return False
    while frame is not None:
        if frame.f_code.co_name == "wait" and frame.f_code.co_filename == changes.__file__:
            return True
        frame = frame.f_back
    return False


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
    # Every waiter blocked on the condition before the notify (inside Condition.wait it has
    # queued itself under the lock notify needs, so the notify cannot be missed).
    wait_until(lambda: all(blocked_in_changes_wait(t) for t in threads), 10,
               "the waiters blocked in Changes.wait", interval=0.001)
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
