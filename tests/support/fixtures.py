"""The pytest fixtures every test file shares: a short socket dir, daemons as processes or in
the test process (`h`: a started Harness), and a Store bench. Each daemon is stopped at the
end, pass or fail."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from ckptd.clock import SYSTEM, Clock
from support.config import write_layout
from support.harness import Harness
from support.inproc import InProcessDaemon, StoreBench
from support.proc import DaemonHandle


@contextmanager
def short_tempdir() -> Iterator[Path]:
    """A short temp dir for sockets (AF_UNIX paths must stay under ~100 bytes)."""
    d = Path(tempfile.mkdtemp(prefix="ckd-", dir="/tmp"))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def short_dir() -> Iterator[Path]:
    with short_tempdir() as d:
        yield d


@contextmanager
def running_daemon(base: Path, roots: list[dict[str, Any]] | None = None,
                   **daemon_keys: Any) -> Iterator[InProcessDaemon]:
    """One in-process daemon for a block (a module-scoped fixture, say), stopped at its end."""
    with short_tempdir() as sock_dir, capture_logs() as events:
        d = InProcessDaemon(write_layout(base, sock_dir / "ckptd.sock", roots, **daemon_keys),
                            events)
        try:
            yield d.start()
        finally:
            d.stop()


@pytest.fixture
def h(tmp_path: Path, short_dir: Path) -> Any:
    """A started `Harness` (one root `r`, its daemon in the test process), stopped at the end."""
    harness = Harness(tmp_path, short_dir)
    harness.daemon.start()
    try:
        yield harness
    finally:
        harness.daemon.stop(grace=5)


@pytest.fixture
def daemon_factory(tmp_path: Path, short_dir: Path) -> Iterator[Any]:
    """Build (and later stop) `ckptd run` processes: `daemon_factory(roots=[{...}], **keys)`.
    For signals, exit codes, systemd, the CLI and kill -9; everything else runs in-process."""
    handles: list[DaemonHandle] = []

    def make(roots: list[dict[str, Any]] | None = None, start: bool = True,
             **daemon_keys: Any) -> DaemonHandle:
        layout = write_layout(tmp_path, short_dir / "ckptd.sock", roots, **daemon_keys)
        h = DaemonHandle(layout, tmp_path / "daemon.log")
        handles.append(h)
        return h.start() if start else h

    yield make
    for h in handles:
        h.stop()


@pytest.fixture
def inproc_daemon(tmp_path: Path, short_dir: Path) -> Iterator[Any]:
    """Build (and later stop) Daemons in the test process:
    `inproc_daemon(roots=[{...}], start=True, clock=SYSTEM, **daemon_keys)`."""
    made: list[InProcessDaemon] = []
    with capture_logs() as events:
        def make(roots: list[dict[str, Any]] | None = None, start: bool = True,
                 clock: Clock = SYSTEM, **daemon_keys: Any) -> InProcessDaemon:
            layout = write_layout(tmp_path, short_dir / "ckptd.sock", roots, **daemon_keys)
            d = InProcessDaemon(layout, events, clock)
            made.append(d)
            return d.start() if start else d

        try:
            yield make
        finally:
            for d in made:
                d.stop()


@pytest.fixture
def store_bench(tmp_path: Path, short_dir: Path) -> Iterator[Any]:
    """`store_bench(roots=[{...}])`: a StoreBench (real Store, real roots), closed at the end."""
    made: list[StoreBench] = []

    def make(roots: list[dict[str, Any]] | None = None, **daemon_keys: Any) -> StoreBench:
        b = StoreBench(write_layout(tmp_path, short_dir / "ckptd.sock", roots, **daemon_keys))
        made.append(b)
        return b

    try:
        yield make
    finally:
        for b in made:
            b.close()
