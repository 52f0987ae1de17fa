"""What every integration shares, framework-free: registering a finished save, the
preemption flush with a bounded wait for this root's upload, and finding the checkpoint to
resume from (the daemon's latest, else the newest committed step in the bucket, restored into
a directory). Talks to the daemon only through `ckptd.client`; reads the bucket through
`ckptd.restore` only when a restore is needed (its imports come in then, not before)."""

from __future__ import annotations

import logging
import math
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckptd.client import Client, ClientError, DaemonUnavailable

log = logging.getLogger("ckptd.integrations")


def finite_metrics(values: dict[str, Any]) -> dict[str, float]:
    """The values that are finite numbers (a tensor of one element counts), as floats: what a
    registration may carry."""
    out: dict[str, float] = {}
    for key, value in values.items():
        try:
            number = float(value.item() if hasattr(value, "item") else value)
        except (TypeError, ValueError, RuntimeError):
            continue
        if math.isfinite(number):
            out[str(key)] = number
    return out


def register(client: Client, root: str, step: int, path: str | os.PathLike[str] | None,
             metrics: dict[str, Any] | None = None) -> bool:
    """Tell the daemon the save of `step` finished: at `path` (a file or directory inside the
    root, which then makes the step), or with no path where the root's layout recognises the
    save by itself and the registration only brings the metrics. False (logged by the
    client) when the daemon did not take it."""
    paths = None if path is None else [str(Path(path).absolute())]
    return client.register(root, int(step), paths=paths,
                           metrics=finite_metrics(metrics or {}) or None)


def flush_and_wait(client: Client, root: str, timeout: float,
                   step: int | None = None) -> bool | None:
    """The preemption flush (`POST /v1/flush`: the newest valid step of every uploading root is
    uploaded first), then wait, at most `timeout` seconds in all, for `root`'s step the flush
    chose and for `step` (the newest save this process made, which may not have been valid
    yet) to be uploaded. True when they are, False when one is not (time out, upload failed,
    daemon not reached), None when there was nothing to wait for. Never raises."""
    deadline = time.monotonic() + max(0.0, timeout)
    try:
        doc = client.request_json("POST", "/v1/flush")
    except ClientError as exc:
        log.warning("ckptd flush failed: %s", exc)
        return False
    steps = {int(t["step"]) for t in doc.get("flushing", []) if t.get("root") == root}
    if step is not None:
        steps.add(int(step))
    if not steps:
        return None
    done = True
    for n in sorted(steps, reverse=True):
        done = wait_uploaded(client, root, n, max(0.0, deadline - time.monotonic())) and done
    return done


def wait_uploaded(client: Client, root: str, step: int | None, timeout: float,
                  until: str = "uploaded") -> bool:
    """Wait at most `timeout` seconds for `step` of `root` to reach `until` ("uploaded" or
    "valid"); True when it does, and at once when there is no step to wait for. Never
    raises: a failure is a logged warning and False."""
    if step is None:
        return True
    try:
        done = client.wait(root, step, until=until, timeout=timeout)
    except ClientError as exc:  # a strict client
        log.warning("ckptd wait for %s step %s failed: %s", root, step, exc)
        return False
    if not done:
        log.warning("ckptd: %s step %s not %s (waited up to %gs)", root, step, until, timeout)
    return done


@dataclass(frozen=True)
class Resume:
    """The checkpoint to resume from: its step, the path a framework loads (a file or a
    directory) and whether it was restored (from a local compressed copy or the bucket)."""

    step: int
    path: Path
    restored: bool


def resume(root: str, *, to: str | os.PathLike[str] | None = None,
           config: str | os.PathLike[str] | None = None, client: Client | None = None,
           root_dir: str | os.PathLike[str] | None = None) -> Resume | None:
    """The checkpoint of `root` to resume from, or None when there is none to resume from.

    The daemon's latest (else `<root_dir>/.ckptd/latest.json`) when its files are on this
    node; else that step, or with no answer the newest committed step in the bucket, restored
    into `to` (default: a new temporary directory) from the remote named by the config
    (`config`, else found as the daemon finds its own). None only when the daemon (or
    latest.json) says the root has no valid step and the bucket has none either. Raises
    `DaemonUnavailable` when the daemon cannot answer and no config names a bucket to ask, so
    a job never silently starts again from step 0."""
    client = client or Client()
    unreachable: DaemonUnavailable | None = None
    try:
        info = client.latest(root, root_dir=root_dir)
    except DaemonUnavailable as exc:
        info, unreachable = None, exc
    if info is not None:
        path = Path(str(info["path"]))
        if info.get("local") == "present" and path.exists():
            return Resume(int(info["step"]), path, False)
    return _restored(root, info, to, config, unreachable)


def _restored(root: str, info: dict[str, Any] | None, to: str | os.PathLike[str] | None,
              config: str | os.PathLike[str] | None,
              unreachable: DaemonUnavailable | None) -> Resume | None:
    from ckptd.config import find_config, load_config
    from ckptd.errors import NotFound
    from ckptd.fetch.source import StepArg
    from ckptd.restore.files import restore

    found = find_config(config)
    if found is None or not found.is_file():
        if unreachable is not None or info is not None:
            raise DaemonUnavailable(0, "unreachable", "no config names the bucket to restore"
                                    f" {root!r} from (pass config=, or set CKPTD_CONFIG)"
                                    + (f"; {unreachable.message}" if unreachable else ""))
        return None  # the daemon's word: no valid step, and no bucket to ask
    cfg = load_config(found)
    where = Path(to) if to is not None else Path(tempfile.mkdtemp(prefix="ckptd-resume-"))
    step: StepArg = int(info["step"]) if info is not None else "latest"
    try:
        n, paths = restore(cfg, root, step, where)
    except NotFound:
        if info is not None:
            raise
        if unreachable is not None and not cfg.root(root).upload.url:
            raise unreachable from None  # no bucket to say there is none
        return None  # neither the daemon, latest.json nor the bucket has a step
    if info is not None:
        anchor = Path(str(info["path"])).relative_to(cfg.root(root).path)
    else:
        rels = [p.relative_to(where).as_posix() for p in paths]
        anchor = Path(rels[0] if len(rels) == 1 else os.path.commonpath(rels))
    log.info("ckptd: %s step %s restored into %s", root, n, where)
    return Resume(n, where / anchor, True)


class SignalLatch:
    """Remembers that one of `signals` arrived (a preemption notice), for the training loop to
    act on at its next step; a Python handler that was there before is still called. Installed
    only from the main thread (where Python runs signal handlers); a no-op elsewhere."""

    def __init__(self, signals: tuple[int, ...]) -> None:
        self.signals = signals
        self.fired: int | None = None
        self._before: dict[int, Any] = {}

    def install(self) -> None:
        import signal
        import threading

        if threading.current_thread() is not threading.main_thread():
            return
        for sig in self.signals:
            self._before[sig] = signal.getsignal(sig)
            signal.signal(sig, self._on)

    def _on(self, signum: int, frame: Any) -> None:
        self.fired = signum
        before = self._before.get(signum)
        if callable(before):
            before(signum, frame)

    def uninstall(self) -> None:
        import signal

        for sig, before in self._before.items():
            if signal.getsignal(sig) == self._on:
                signal.signal(sig, before if before is not None else signal.SIG_DFL)
        self._before.clear()
