"""Hugging Face Trainer: `CkptdTrainerCallback` registers each `checkpoint-<N>/` the Trainer
saves with the daemon, waits for the newest one's upload when training ends, and on a
preemption signal (SIGTERM, SIGUSR1) has the Trainer save at the next step, stop, and flush
that save to the bucket; `resume_path` gives `trainer.train(resume_from_checkpoint=...)` the
checkpoint to resume from. transformers is imported when this module is, never by
`ckptd.integrations`; nothing of the daemon is imported."""

from __future__ import annotations

import logging
import os
import signal
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from ckptd.client import Client
from ckptd.integrations.common import (
    SignalLatch,
    flush_and_wait,
    register,
    resume,
    wait_uploaded,
)

log = logging.getLogger("ckptd.integrations")
PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class CkptdTrainerCallback(TrainerCallback):  # type: ignore[misc]
    """`Trainer(..., callbacks=[CkptdTrainerCallback("hf-run")])`, the root being the
    Trainer's `output_dir`.

    Each save (`on_save`, once `trainer_state.json` is written) is registered from the main
    process as a save of the global step (no paths: the root's `hf` layout recognises the
    directory), with the newest logged values of
    `metric_for_best_model` (as `eval_<name>` too) and of `metrics`. At the end of training it
    waits up to `timeout` seconds for the newest registered step to reach `until`. On one of
    `signals` (a handler already there is still called), the Trainer saves at the end of the
    current step and stops; that save is registered and flushed (`POST /v1/flush`), waiting up
    to `timeout` for its upload. Never raises into the training loop."""

    def __init__(self, root: str, *, client: Client | None = None, timeout: float = 600.0,
                 until: str = "uploaded", metrics: tuple[str, ...] = (),
                 signals: tuple[int, ...] = PREEMPTION_SIGNALS) -> None:
        self.root = root
        self.client = client or Client()
        self.timeout = timeout
        self.until = until
        self.metrics = metrics
        self.latch = SignalLatch(signals)
        self.registered: dict[int, str] = {}
        self.preempted = False
        self.flushed: bool | None = None  # the preemption flush's outcome, once it ran

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.latch.install()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.latch.fired is not None and not self.preempted:
            log.info("ckptd: signal %s: saving step %s and stopping", self.latch.fired,
                     state.global_step)
            self.preempted = True
            control.should_save = True
            control.should_training_stop = True

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if not state.is_world_process_zero:
            return
        step = int(state.global_step)
        folder = Path(args.output_dir) / f"checkpoint-{step}"
        # No paths: the `hf` layout knows the directory and when it is whole, and checks
        # training_args.bin as the Trainer's (a path would make the step `registered`'s).
        if folder.is_dir() and step not in self.registered:
            if register(self.client, self.root, step, None, self._metric_values(args, state)):
                self.registered[step] = str(folder)
        if self.preempted and self.flushed is None:
            self.flushed = flush_and_wait(self.client, self.root, self.timeout,
                                          max(self.registered, default=None))

    def _metric_values(self, args: Any, state: Any) -> dict[str, Any]:
        names = set(self.metrics)
        best = getattr(args, "metric_for_best_model", None)
        if best:
            names |= {best, best if best.startswith("eval_") else f"eval_{best}"}
        found: dict[str, Any] = {}
        for entry in reversed(state.log_history):
            for name in names - found.keys():
                if name in entry:
                    found[name] = entry[name]
        return found

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.latch.uninstall()
        if not state.is_world_process_zero or not self.registered or self.flushed is not None:
            return
        wait_uploaded(self.client, self.root, max(self.registered), self.timeout, self.until)


def resume_path(root: str, *, to: str | os.PathLike[str] | None = None,
                config: str | os.PathLike[str] | None = None, client: Client | None = None,
                root_dir: str | os.PathLike[str] | None = None) -> str | None:
    """The `checkpoint-<N>` directory for `trainer.train(resume_from_checkpoint=...)`: the
    daemon's latest step, restored from the bucket into `to` when this node has none of its
    files (see `ckptd.integrations.resume`); None when there is nothing to resume from."""
    found = resume(root, to=to, config=config, client=client, root_dir=root_dir)
    return None if found is None else str(found.path)
