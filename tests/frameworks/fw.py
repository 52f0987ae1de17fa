"""Helpers for the real-framework suite: run a framework's own training script (one process
per rank, gloo on loopback), kill it mid-save, and check what ckptd made of the result: valid
and uploaded, restored byte for byte, resumed from by the framework's own loader."""

from __future__ import annotations

import contextlib
import filecmp
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from support.ports import rendezvous_port

from ckptd.service.lease import pid_alive

SCRIPTS = Path(__file__).resolve().parent / "scripts"


def clean_env(**extra: str) -> dict[str, str]:
    """The environment a framework script runs in: no ckptd socket or config of the caller's,
    one thread, CPU only, nothing from the network."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPTD_")}
    env.update(OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", HF_HUB_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1", WANDB_DISABLED="true",
               JAX_PLATFORMS="cpu", TOKENIZERS_PARALLELISM="false", **extra)
    return env


class Rank(subprocess.Popen[bytes]):
    """One rank's process: the leader of its own session (so every process it leaves behind,
    orphans included, can be found by its group), its output going to a file rather than a
    pipe (a helper it leaves alive can never hold a test waiting for end of output)."""

    def __init__(self, argv: list[str], env: dict[str, str]) -> None:
        self.log = tempfile.TemporaryFile()  # noqa: SIM115 - closed by output()
        super().__init__(argv, env=env, stdout=self.log, stderr=subprocess.STDOUT,
                         stdin=subprocess.DEVNULL, start_new_session=True)
        LIVE.append(self)

    def output(self) -> str:
        """What the rank printed (stdout and stderr); it must have ended."""
        self.log.seek(0)
        return self.log.read().decode(errors="replace")


LIVE: list[Rank] = []  # ranks started by the current test; `reap()` ends what they left


def start_ranks(script: str, args: list[str], world: int = 1, **env: str) -> list[Rank]:
    """`scripts/<script>` once per rank with torchrun's variables (RANK, WORLD_SIZE, ...)."""
    base = clean_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(rendezvous_port()),
                     WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world), **env)
    return [Rank([sys.executable, str(SCRIPTS / script), *args],
                 {**base, "RANK": str(r), "LOCAL_RANK": str(r)})
            for r in range(world)]


def finish(procs: list[Rank], timeout: float = 300.0) -> list[str]:
    """Wait for every rank; their outputs. A rank that failed fails the test with its output."""
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            kill_tree(procs)
    outs = [p.output() for p in procs]
    codes = [p.returncode for p in procs]
    assert codes == [0] * len(procs), f"ranks exited {codes}:\n" + "\n---\n".join(outs)
    return outs


def run_ranks(script: str, args: list[str], world: int = 1, timeout: float = 300.0,
              **env: str) -> list[str]:
    return finish(start_ranks(script, args, world, **env), timeout)


def _await(procs: list[Rank], cond: Callable[[], bool],
           timeout: float) -> None:
    """Poll `cond()` every 2 ms until it holds; fail if it never does or the ranks end first."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("the condition to kill on never came")
        if all(p.poll() is not None for p in procs):
            outs = [p.output() for p in procs]
            raise AssertionError("the ranks ended before the kill:\n" + "\n".join(outs))
        time.sleep(0.002)


def result_json(out: str, prefix: str = '{"global_step"') -> dict[str, Any]:
    """The one JSON line a rank script printed (starting with `prefix`) among its logs."""
    (line,) = [ln for ln in out.splitlines() if ln.startswith(prefix)]
    return json.loads(line)  # type: ignore[no-any-return]


def kill_when(procs: list[Rank], cond: Callable[[], bool],
              timeout: float = 120.0) -> None:
    """SIGKILL every rank the moment `cond()` holds (a save begun, its commit not yet made)."""
    try:
        _await(procs, cond, timeout)
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
        for p in procs:
            p.wait()


def restore(config: Path, root: str, step: int | str, to: Path, *extra: str) -> str:
    """`ckptd restore ROOT STEP --to DIR` (no daemon needed); its output."""
    done = subprocess.run([sys.executable, "-m", "ckptd", "restore", root, str(step), "--to",
                           str(to), "--config", str(config), *extra], capture_output=True,
                          text=True, timeout=300, env=clean_env())
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout + done.stderr


def same_files(a: Path, b: Path, files: list[str]) -> None:
    """Every file in `files` (relative) is byte-identical under `a` and `b`."""
    assert files
    for rel in files:
        assert (b / rel).is_file(), f"{rel} missing from {b}"
        assert filecmp.cmp(a / rel, b / rel, shallow=False), f"{rel} differs"


def files_of(daemon: Any, root: str, step: int) -> list[str]:
    """The files (relative to the root) of one checkpoint, as the daemon recorded them."""
    rec = daemon.store.checkpoint(root, step)
    assert rec is not None, f"no step {step} in {root}"
    return [f.path for f in daemon.store.files(rec.id)]


def descendants(pids: list[int]) -> list[int]:
    """Every live process below `pids` (their children, and theirs), read from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue  # gone since the listing
        ppid = int(stat.rsplit(")", 1)[1].split()[1])  # the name may hold spaces and ")"
        children.setdefault(ppid, []).append(int(entry))
    found: list[int] = []
    todo = list(pids)
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def kill_tree(procs: list[Rank]) -> None:
    """SIGKILL each rank with every process below it (writer processes it forked, helpers it
    spawned) and every process left in its session's group (an orphan whose parent already
    exited). The tree is stopped first, so nothing forks or is orphaned between finding it and
    killing it; then each rank is waited for."""
    ranks = [p.pid for p in procs]
    for pid in ranks:  # each rank leads its own group (start_new_session)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGSTOP)
    tree: set[int] = set()
    while True:
        found = set(ranks) | set(descendants(ranks))
        for pid in found - tree:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)
        if found <= tree:
            break
        tree |= found
    for pid in tree:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    for pid in ranks:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)
    for p in procs:
        p.wait()


def reap() -> None:
    """End whatever the current test's ranks left running (by their groups) and forget them."""
    while LIVE:
        p = LIVE.pop()
        if p.returncode is None or not pid_alive(p.pid):
            # Not reaped yet, its pid is still ours; reaped and no process has the pid, the
            # group (if any is left) is the rank's. A live process with a reaped rank's pid
            # is another process that got the pid again: its group is not ours to kill.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGKILL)
        if p.poll() is None:
            p.kill()
        p.wait()
        p.log.close()


def kill_tree_when(procs: list[Rank], cond: Callable[[], bool],
                   timeout: float = 120.0) -> None:
    """As `kill_when`, but what a lost node or a cancelled job does: each rank dies with every
    process below it (see `kill_tree`)."""
    try:
        _await(procs, cond, timeout)
    finally:
        kill_tree(procs)


def verify(path: Path) -> tuple[int, dict[str, Any]]:
    """`ckptd verify PATH --json` (no daemon, default config): exit code and document."""
    done = subprocess.run([sys.executable, "-m", "ckptd", "verify", str(path), "--json"],
                          capture_output=True, text=True, timeout=120, env=clean_env())
    assert done.stdout, done.stderr
    return done.returncode, json.loads(done.stdout)


def observe_until_done(procs: list[Rank], probe: Callable[[], Any],
                       interval: float = 0.05, timeout: float = 300.0) -> list[Any]:
    """`probe()`'s answers, taken every `interval` while any rank still runs (and once more
    after): what a daemon made of a save while it was being written."""
    seen = []
    deadline = time.monotonic() + timeout
    while any(p.poll() is None for p in procs):
        assert time.monotonic() < deadline, "the ranks did not finish"
        seen.append(probe())
        time.sleep(interval)
    seen.append(probe())
    return seen
