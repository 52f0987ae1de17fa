"""The one way tests wait for something: poll a predicate until it holds, else fail naming what
was awaited and the last value seen. Never sleeps longer than it must."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


class WaitTimeout(AssertionError):
    """`wait_until` ran out of time; the message says what and the last value seen."""


def wait_until(predicate: Callable[[], T | None], timeout: float = 30.0, what: str = "",
               interval: float = 0.05, detail: Callable[[], str] | None = None) -> T:
    """Call `predicate` until it returns something truthy and return that value.

    On timeout raise WaitTimeout naming `what` (the predicate's name when empty), the last
    value seen and `detail()` (a daemon log tail, say). An exception from the predicate is
    not swallowed: a broken check fails at once instead of after the timeout."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        value = predicate()
        if value:
            return value
        last = value
        left = deadline - time.monotonic()
        if left <= 0:
            break
        time.sleep(min(interval, left))
    name = what or getattr(predicate, "__name__", repr(predicate))
    extra = ""
    if detail is not None:
        try:
            extra = "\n" + detail()
        except Exception as exc:  # the report must not hide the timeout itself
            extra = f"\n(detail unavailable: {exc})"
    raise WaitTimeout(f"timed out after {timeout}s waiting for {name}; last value: {last!r}"
                      f"{extra}")


def wait_scans(client: Any, n: int = 2, settle: float = 0.0, timeout: float = 30.0,
               wake: Callable[[], None] | None = None) -> int:
    """Wait until the daemon behind `client` has finished `n` more full scans than now, at least
    two of them (so at least one whole scan) begun `settle` seconds or more from now: what a
    "never happens" assertion waits for before it looks. Returns the scan count reached.

    The count is `scans` in /v1/status. A scan under way when this is called counts as one,
    hence two: the second began after the call. `wake` (an in-process daemon's `wake_scan`)
    is called at each look: the scans come back to back, as a burst of file events makes them."""
    def scans() -> int:
        doc = client.status()
        assert doc is not None, "the daemon did not answer /v1/status"
        return int(doc["scans"])

    start = scans()
    past = time.monotonic() + settle
    base: list[int] = [start] if settle <= 0 else []

    def done() -> int | None:
        if wake is not None:
            wake()
        count = scans()
        if not base and time.monotonic() >= past:
            base.append(count)
        return count if base and count >= max(start + n, base[0] + 2) else None

    return wait_until(done, timeout, f"{n} more scans, {settle}s on", interval=0.02)
