"""The one way tests wait for something: poll a predicate until it holds, else fail naming what
was awaited and the last value seen. Never sleeps longer than it must."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


class WaitTimeout(AssertionError):
    """`wait_until` ran out of time; the message says what and the last value seen."""


def wait_until(predicate: Callable[[], T], timeout: float = 30.0, what: str = "",
               interval: float = 0.05, detail: Callable[[], str] | None = None) -> T:
    """Call `predicate` until it returns something truthy and return that value.

    On timeout raise WaitTimeout naming `what` (the predicate's name when empty), the last
    value seen and `detail()` (a daemon log tail, say). An exception from the predicate is
    not swallowed: a broken check fails at once instead of after the timeout."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        last = predicate()
        if last:
            return last
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
