"""Lightning: `CkptdCallback` registers every file `ModelCheckpoint` writes with the daemon
(with the monitored metric), waits for the newest one's upload when training ends and flushes
when Lightning stops on SIGTERM; `resume_path` gives `Trainer.fit(ckpt_path=...)` the
checkpoint to resume from. Lightning is imported when this module is, never by
`ckptd.integrations`; nothing of the daemon is imported."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.plugins.io import CheckpointIO

from ckptd.client import Client
from ckptd.integrations.common import flush_and_wait, register, resume, wait_uploaded

log = logging.getLogger("ckptd.integrations")


class CkptdCallback(Callback):  # type: ignore[misc]
    """`Trainer(callbacks=[ModelCheckpoint(dirpath=ROOT_DIR, ...), CkptdCallback("run1")])`.

    Each checkpoint file written through the trainer (rank 0's, once it is whole) is
    registered as a save of the trainer's global step, with the monitored metric of every
    `ModelCheckpoint` (and `metrics`, names of logged values) when finite. A `last` copy
    (`save_last=True`), rewritten in place at every save, is not registered; nor is a second
    file of a step already registered. At the end of training it waits up to `timeout`
    seconds for the newest registered step to reach `until` ("uploaded" or "valid"). When
    Lightning stops on SIGTERM (its `SIGTERMException`), it asks the daemon for the preemption
    flush and waits up to `timeout` for this root's step to be uploaded. Never raises into the
    training loop (a daemon not reached is a logged warning)."""

    def __init__(self, root: str, *, client: Client | None = None, timeout: float = 600.0,
                 until: str = "uploaded", metrics: tuple[str, ...] = ()) -> None:
        self.root = root
        self.client = client or Client()
        self.timeout = timeout
        self.until = until
        self.metrics = metrics
        self.registered: dict[int, str] = {}  # step -> the file registered for it
        self.flushed: bool | None = None  # the preemption flush's outcome, once it ran
        self._trainer: Any = None

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self._trainer = trainer
        io = trainer.strategy.checkpoint_io
        if not isinstance(io, _Registering):
            trainer.strategy.checkpoint_io = _Registering(io, self)

    def saved(self, path: str | os.PathLike[str], checkpoint: dict[str, Any]) -> None:
        """A checkpoint file was written whole at `path`: register it."""
        trainer = self._trainer
        step = int(checkpoint.get("global_step", trainer.global_step))
        if step in self.registered or self._is_last_copy(trainer, Path(path)):
            return
        if register(self.client, self.root, step, path, self._metric_values(trainer)):
            self.registered[step] = str(path)

    def _is_last_copy(self, trainer: Any, path: Path) -> bool:
        names = {cb.CHECKPOINT_NAME_LAST for cb in trainer.checkpoint_callbacks
                 if isinstance(cb, ModelCheckpoint)}
        return any(path.stem == n or path.stem.startswith(f"{n}-v") for n in names)

    def _metric_values(self, trainer: Any) -> dict[str, Any]:
        names = {cb.monitor for cb in trainer.checkpoint_callbacks
                 if isinstance(cb, ModelCheckpoint) and cb.monitor} | set(self.metrics)
        logged = trainer.callback_metrics
        return {n: logged[n] for n in sorted(names) if n in logged}

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if trainer.is_global_zero and self.registered:
            wait_uploaded(self.client, self.root, max(self.registered), self.timeout,
                          self.until)

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        from lightning.pytorch.utilities.exceptions import SIGTERMException

        preempted = isinstance(exception, SIGTERMException) or trainer.received_sigterm
        if preempted and trainer.is_global_zero:
            log.info("ckptd: SIGTERM: flushing %s", self.root)
            self.flushed = flush_and_wait(self.client, self.root, self.timeout,
                                          max(self.registered, default=None))


class _Registering(CheckpointIO):  # type: ignore[misc]
    """The strategy's checkpoint I/O, unchanged, telling the callback of each whole save."""

    def __init__(self, inner: Any, callback: CkptdCallback) -> None:
        self.inner = inner
        self.callback = callback

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any,
                        storage_options: Any = None) -> None:
        self.inner.save_checkpoint(checkpoint, path, storage_options=storage_options)
        self.callback.saved(path, checkpoint)

    def load_checkpoint(self, path: Any, *args: Any, **kwargs: Any) -> Any:
        return self.inner.load_checkpoint(path, *args, **kwargs)

    def remove_checkpoint(self, path: Any) -> None:
        self.inner.remove_checkpoint(path)

    def teardown(self) -> None:
        self.inner.teardown()


def resume_path(root: str, *, to: str | os.PathLike[str] | None = None,
                config: str | os.PathLike[str] | None = None, client: Client | None = None,
                root_dir: str | os.PathLike[str] | None = None) -> str | None:
    """The `.ckpt` file for `Trainer.fit(model, ckpt_path=...)`: the daemon's latest step,
    restored from the bucket into `to` when this node has none of its files (see
    `ckptd.integrations.resume`); None when there is nothing to resume from."""
    found = resume(root, to=to, config=config, client=client, root_dir=root_dir)
    return None if found is None else str(found.path)
