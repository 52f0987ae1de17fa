"""A running stage's progress: the bytes it has read, hashed or sent (status, and the beat on
the call board that tells a working stage from a stuck one), and the stop that ends it early
(`StageCancelled`). Knows nothing of the store or of which stage it counts for.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ckptd.errors import Interrupt


class StageCancelled(Interrupt):
    """A stop past its grace period ends a read pass early. A BaseException, so the stage's
    own error handling never records it as a failure; the stage's cleanup (a Stager's abort,
    which removes its staging dir) still runs."""


class Progress:
    """A read-pass sink that counts the bytes a stage has processed."""

    def __init__(self, root: str, step: int, stage: str, total: int,
                 tick: Callable[[], Any], cancelled: Callable[[], bool] = lambda: False
                 ) -> None:
        self.root, self.step, self.stage, self.total = root, step, stage, total
        self.done = 0
        self._tick = tick
        self._cancelled = cancelled

    def update(self, offset: int, chunk: memoryview) -> None:
        if self._cancelled():
            raise StageCancelled(f"{self.stage} of step {self.step} cancelled by stop")
        self.done += len(chunk)
        self._tick()

    def finish(self, total: int) -> None:
        self._tick()

    def advance(self, n: int) -> None:
        """Byte-count progress from stages that are not read passes (upload)."""
        self.done += n
        self._tick()

    def as_json(self) -> dict[str, Any]:
        return {"root": self.root, "step": self.step, "stage": self.stage,
                "done_bytes": self.done, "total_bytes": self.total}
