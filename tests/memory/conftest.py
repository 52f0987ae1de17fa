"""The memory tests' fixtures: a real peer server on 127.0.0.1 (`peer`)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from peerkit import Peer


@pytest.fixture
def peer() -> Iterator[Peer]:
    p = Peer()
    yield p
    p.server.close()
