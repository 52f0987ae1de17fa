"""The real-framework suite: checkpoints written by the frameworks themselves (pinned in
requirements.txt beside this file). Run with `make test-frameworks`; `make test` leaves this
directory out (its libraries are not in the main environment)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))


@pytest.fixture(autouse=True)
def _reap_ranks() -> Iterator[None]:
    """Whatever a test's ranks left running (helpers, orphans) ends with the test."""
    import fw

    yield
    fw.reap()
