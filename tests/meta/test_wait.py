"""support.wait.wait_until, the one wait every test uses: it returns the first truthy value,
and a timeout names what was awaited, the last value seen and the caller's detail."""

from __future__ import annotations

import itertools

import pytest
from support.wait import WaitTimeout, wait_until


def test_returns_the_first_truthy_value() -> None:
    counter = itertools.count()
    assert wait_until(lambda: next(counter) >= 3 and "done", 5, "three calls",
                      interval=0.001) == "done"


def test_a_timeout_names_what_the_last_value_and_the_detail() -> None:
    with pytest.raises(WaitTimeout) as info:
        wait_until(lambda: [], 0.05, "a non-empty list", interval=0.01,
                   detail=lambda: "log tail here")
    text = str(info.value)
    assert "a non-empty list" in text and "last value: []" in text and "log tail here" in text
    assert isinstance(info.value, AssertionError)  # pytest reports it as a failed check


def test_an_error_in_the_predicate_is_raised_at_once() -> None:
    def broken() -> bool:
        raise KeyError("state")

    with pytest.raises(KeyError):
        wait_until(broken, 30, "never")
