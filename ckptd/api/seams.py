"""What the socket API needs of the daemon's parts, as protocols the services satisfy, and the
stand-ins used where a part is absent (a bare context in tests, a daemon without async saves).
Holds no state and no logic of its own.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from contextlib import AbstractContextManager
from typing import Any, Protocol

from ckptd.config import RootConfig
from ckptd.errors import HttpError


class Wakeable(Protocol):
    def wake(self) -> None: ...


class Scan(Wakeable, Protocol):
    scans: int

    def unrecognised(self, root: str) -> list[str]: ...


class Workers(Protocol):
    def flush(self) -> dict[str, int]: ...
    def flushing(self) -> dict[str, int]: ...
    def in_flight(self) -> list[dict[str, Any]]: ...
    def part_states(self, root: RootConfig, rec: Any) -> dict[str, str]: ...
    def uncommitted(self, root: str, nodes: int) -> list[dict[str, Any]]: ...


class Retention(Protocol):
    # Held by retention while it deletes locally: a pin or a reader's hold waits for the
    # deletes to end, so the safety nets a run checked are never out of date while it acts.
    # Scans take another lock: a slow scan never holds up a pin.
    nets: Any

    def plan_json(self, root: RootConfig) -> dict[str, Any]: ...
    def apply_now(self, root: RootConfig) -> list[dict[str, Any]]: ...
    def adopted_json(self, root: RootConfig) -> dict[str, Any] | None: ...
    def health_json(self, name: str) -> dict[str, Any] | None: ...


class Discovery(Protocol):
    def request(self, name: str, wait_s: float = ...) -> None: ...
    def bad_remote(self, name: str) -> list[dict[str, str]]: ...


class Services(Protocol):
    def alive(self) -> bool: ...
    def health(self) -> list[dict[str, Any]]: ...


class MetricsText(Protocol):
    def render(self) -> str: ...


class RootLeases(Protocol):
    """Which roots this daemon acts on: whose root lease (`<root>/.ckptd/lease.json`) it
    holds, and who holds each (`ckptd.service.lease.Leases`)."""

    def holds(self, name: str) -> bool: ...
    def holder_json(self, name: str) -> dict[str, Any] | None: ...
    def problem(self, name: str) -> str | None:
        """Why the root cannot act (its lease cannot be looked at, taken or renewed: the root
        missing or unopenable, `.ckptd` a link); None when it acts or stands by."""
        ...


class Persist(Protocol):
    def accept(self, fd: int, body: Any, peer: tuple[int, int, int]) -> dict[str, Any]: ...
    def outcome(self, job_id: str, timeout: float) -> dict[str, Any] | None: ...
    def in_flight(self) -> list[dict[str, Any]]: ...


class NoPersist:
    """No persist service (a bare context in tests): async saves are refused, the trainer
    writes in-process."""

    def accept(self, fd: int, body: Any, peer: tuple[int, int, int]) -> dict[str, Any]:
        os.close(fd)
        raise HttpError(503, "no_persist", "this daemon takes no async saves")

    def outcome(self, job_id: str, timeout: float) -> dict[str, Any] | None:
        return None

    def in_flight(self) -> list[dict[str, Any]]:
        return []


class Memory(Protocol):
    def open(self, root: str, step: int, rank: int, peer: tuple[int, int, int]
             ) -> AbstractContextManager[tuple[dict[str, Any], list[int]]]:
        """The state a load of `rank` at `step` reads from memory: the answer's document and
        the descriptors that go with it (closed on the way out); HttpError 404 naming each
        tier and why it cannot serve the step."""
        ...

    def status_json(self) -> dict[str, Any]: ...


class NoMemory:
    """No memory service (a bare context in tests): nothing is kept."""

    @contextlib.contextmanager
    def open(self, root: str, step: int, rank: int, peer: tuple[int, int, int]
             ) -> Iterator[tuple[dict[str, Any], list[int]]]:
        raise HttpError(404, "not_in_memory", "this daemon keeps no state in memory")
        yield {}, []  # pragma: no cover

    def status_json(self) -> dict[str, Any]:
        return {"own_bytes": 0, "peer_bytes": 0, "roots": []}


class NoRootLeases:
    """No root lease service (a bare context in tests): every root is this daemon's."""

    def holds(self, name: str) -> bool:
        return True

    def holder_json(self, name: str) -> dict[str, Any] | None:
        return None

    def problem(self, name: str) -> str | None:
        return None
