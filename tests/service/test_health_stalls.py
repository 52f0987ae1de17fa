"""Health tells the truth: a stage call quiet past its bound shows as `degraded` in
`GET /v1/health`, `ckptd status` and the metrics at once, naming the stage and the item; the
item is set aside and the rest of the pipeline goes on; the watchdog stops being fed only when
no worker is free. A real daemon, a real file:// remote behind a wrapper that implements the
Backend protocol and blocks one step's object writes until the test lets them go."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support import wait_until
from support.config import render_config
from writers import save_torch

from ckptd.backends import BackendCache
from ckptd.client import Client
from ckptd.config import RootConfig, load_config
from ckptd.daemon import Daemon
from ckptd.remote.manifest import step_prefix
from ckptd.service import workers


class Stalling:
    """A Backend that forwards everything to `inner`, except that a put of an object of
    `step` blocks (a stalled server) until `release` is set."""

    def __init__(self, inner: Any, root: str, step: int | None) -> None:
        """`step` None: every put of the root stalls (the whole remote)."""
        self.inner = inner
        self.prefix = (step_prefix(root, step) if step is not None else root) + "/"
        self.entered = threading.Event()
        self.release = threading.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def put(self, key: str, *args: Any, **kwargs: Any) -> Any:
        if key.startswith(self.prefix) and not self.release.is_set():
            self.entered.set()
            self.release.wait(120)
        return self.inner.put(key, *args, **kwargs)


class StallingCache(BackendCache):
    """Each root's usual backend, wrapped in `Stalling` for step 1 (or for every step)."""

    def __init__(self, step: int | None = 1) -> None:
        super().__init__()
        self.step = step
        self.wrapped: dict[str, Stalling] = {}

    def get(self, root: RootConfig) -> Any:
        inner = super().get(root)
        if inner is None:
            return None
        if root.name not in self.wrapped:
            self.wrapped[root.name] = Stalling(inner, root.name, self.step)
        return self.wrapped[root.name]


@pytest.fixture
def stalled(tmp_path: Path, short_dir: Path) -> Iterator[Any]:
    def make(workers: int, bound: float = 1.0, step: int | None = 1
             ) -> tuple[Daemon, Path, Stalling]:
        ckpt = tmp_path / "ckpt"
        ckpt.mkdir()
        cfg = tmp_path / "ckptd.toml"
        cfg.write_text(render_config(
            {"state_dir": str(tmp_path / "state"), "socket": str(short_dir / "s.sock"),
             "scan_interval": "1s", "workers": workers},
            [{"name": "r", "path": str(ckpt), "settle": "200ms",
              "upload": {"url": f"file://{tmp_path / 'remote'}"}}]))
        cache = StallingCache(step)
        d = Daemon(load_config(cfg), cfg, backends=cache, stage_bounds={"upload": bound})
        made.append(d)
        d.start()
        root = d.roots()["r"]
        cache.get(root)
        return d, ckpt, cache.wrapped["r"]

    made: list[Daemon] = []
    try:
        yield make
    finally:
        for d in made:
            for w in getattr(d.backends, "wrapped", {}).values():
                w.release.set()
            d.stop(grace=5)


def _stuck_of(health: dict[str, Any]) -> list[dict[str, Any]]:
    return [s["stuck"] for s in health["services"] if s.get("stuck")]


def test_a_stuck_upload_is_degraded_named_and_set_aside(stalled: Any) -> None:
    d, ckpt, stall = stalled(workers=2)
    c = Client(d.config.daemon.socket, timeout=10, strict=True)
    save_torch(ckpt / "model_step_1.pt")
    assert stall.entered.wait(60), "the upload of step 1 never reached the stalled put"
    health = wait_until(lambda: (h := c.health()) and h["status"] == "degraded" and h,
                        timeout=30, what="health degraded")
    (stuck,) = _stuck_of(health)
    assert (stuck["stage"], stuck["root"], stuck["step"]) == ("upload", "r", 1), health
    assert stuck["bound_s"] == 1.0 and stuck["quiet_s"] > 1.0
    # `ckptd status` names the stage and the item; the metrics too.
    shown = subprocess.run([sys.executable, "-m", "ckptd", "status", "--socket",
                            str(d.config.daemon.socket)], capture_output=True, text=True,
                           timeout=60)
    assert "degraded" in shown.stdout.splitlines()[0], shown.stdout
    assert "STUCK: upload of r step 1" in shown.stdout, shown.stdout
    text = c.request_json("GET", "/metrics")
    assert "ckptd_degraded 1.0" in text
    assert any(line.startswith("ckptd_stuck_call_seconds{") and 'stage="upload"' in line
               and 'root="r"' in line and 'step="1"' in line for line in text.splitlines()), text
    # The rest goes on: a second checkpoint is validated while step 1's upload is stuck, and
    # the watchdog is still fed (a worker is free).
    save_torch(ckpt / "model_step_2.pt")
    wait_until(lambda: (c.latest("r") or {}).get("step") == 2, timeout=60,
               what="step 2 valid meanwhile")
    assert d.health.healthy()
    assert "stuck" in (c.status()["roots"][0]["last_error"] or "")
    assert not stall.release.is_set()
    # Released: step 1 and step 2 are uploaded and health is ok again.
    stall.release.set()
    for step in (1, 2):
        wait_until(lambda s=step: (c.checkpoint("r", s) or {}).get("remote") == "uploaded",
                   timeout=60, what=f"step {step} uploaded after the release")
    wait_until(lambda: c.health()["status"] == "ok", timeout=30, what="health ok again")
    assert "ckptd_degraded 0.0" in c.request_json("GET", "/metrics")


def test_the_watchdog_is_starved_only_when_no_worker_is_free(stalled: Any) -> None:
    d, ckpt, stall = stalled(workers=1)
    c = Client(d.config.daemon.socket, timeout=10, strict=True)
    save_torch(ckpt / "model_step_1.pt")
    assert stall.entered.wait(60)
    wait_until(lambda: c.health()["status"] == "degraded", timeout=30, what="degraded")
    assert not d.health.healthy()  # its only worker is stuck: the daemon cannot make progress
    stall.release.set()
    wait_until(d.health.healthy, timeout=60, what="healthy once the call moves")


def test_a_quiet_upload_holds_back_its_roots_other_uploads_before_it_is_stuck(
        stalled: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A remote that stalls every put: the first upload goes quiet (not yet past its 600 s
    bound); the root's next upload is held back instead of taking the second worker into the
    same stall, so a third checkpoint is still validated. Released, all are uploaded."""
    monkeypatch.setattr(workers, "HOLD_AFTER_S", 0.5)
    d, ckpt, stall = stalled(workers=2, bound=600.0, step=None)
    c = Client(d.config.daemon.socket, timeout=10, strict=True)
    save_torch(ckpt / "model_step_1.pt")
    assert stall.entered.wait(60)

    def quiet_upload() -> bool:  # the hold starts once an upload has been quiet that long
        now = time.monotonic()
        return any(call.stage == "upload" and call.quiet_s(now) > workers.HOLD_AFTER_S
                   for call in d.supervisor.calls.all())

    wait_until(quiet_upload, timeout=30, what="step 1's upload quiet past the hold")
    save_torch(ckpt / "model_step_2.pt")
    wait_until(lambda: (c.latest("r") or {}).get("step") == 2, timeout=60, what="step 2 valid")
    save_torch(ckpt / "model_step_3.pt")
    wait_until(lambda: (c.latest("r") or {}).get("step") == 3, timeout=60,
               what="step 3 valid: the second worker was not taken by the stalled remote")
    assert c.health()["status"] == "ok"  # quiet, not past its bound: not stuck yet
    stall.release.set()
    for step in (1, 2, 3):
        wait_until(lambda s=step: (c.checkpoint("r", s) or {}).get("remote") == "uploaded",
                   timeout=60, what=f"step {step} uploaded after the release")


class OpStalling(BackendCache):
    """Each root's usual backend, whose call `op` ("list", "delete") blocks (a store that stops
    answering it) while `stall` is set, until `release` is."""

    def __init__(self, op: str, stall: bool = True) -> None:
        super().__init__()
        self.op = op
        self.stall = threading.Event()
        if stall:
            self.stall.set()
        self.release = threading.Event()
        self.entered = threading.Event()
        self.wrapped: dict[str, Any] = {}

    def get(self, root: RootConfig) -> Any:
        inner = super().get(root)
        if inner is None:
            return None
        outer = self

        class Backend:
            def __getattr__(self, name: str) -> Any:
                call = getattr(inner, name)
                if name != outer.op:
                    return call

                def stalled(*args: Any, **kwargs: Any) -> Any:
                    if outer.stall.is_set() and not outer.release.is_set():
                        outer.entered.set()
                        outer.release.wait(120)
                    return call(*args, **kwargs)

                return stalled

        return self.wrapped.setdefault(root.name, Backend())


def test_a_stalled_listing_is_degraded_and_ls_still_answers(tmp_path: Path,
                                                            short_dir: Path) -> None:
    """Discovery lists the remote on its own thread, on the call board: a store that stops
    answering LIST shows as a stuck `discover` call naming the root, and `ckptd ls` answers
    from the store after a few seconds instead of hanging with it."""
    from ckptd.service import discovery

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    cfg = tmp_path / "ckptd.toml"
    cfg.write_text(render_config(
        {"state_dir": str(tmp_path / "state"), "socket": str(short_dir / "s.sock"),
         "scan_interval": "1s"},
        [{"name": "r", "path": str(ckpt), "settle": "200ms",
          "upload": {"url": f"file://{tmp_path / 'remote'}"}}]))
    cache = OpStalling("list", stall=False)
    d = Daemon(load_config(cfg), cfg, backends=cache, stage_bounds={"discover": 1.0})
    d.start()
    try:
        c = Client(d.config.daemon.socket, timeout=30, strict=True)
        save_torch(ckpt / "model_step_1.pt")
        assert c.wait("r", 1, until="uploaded", timeout=60)
        cache.stall.set()
        assert d.reload() is True  # every root is listed again now
        assert cache.entered.wait(30), "discovery never listed the remote"
        health = wait_until(lambda: (h := c.health()) and h["status"] == "degraded" and h,
                            timeout=30, what="health degraded")
        (stuck,) = _stuck_of(health)
        assert (stuck["stage"], stuck["root"]) == ("discover", "r"), health
        started = time.monotonic()
        listed = subprocess.run([sys.executable, "-m", "ckptd", "ls", "r", "--json", "--socket",
                                 str(d.config.daemon.socket)], capture_output=True, text=True,
                                timeout=60)
        assert listed.returncode == 0, listed.stderr
        assert [cp["step"] for cp in json.loads(listed.stdout)["checkpoints"]] == [1]
        assert time.monotonic() - started < discovery.REQUEST_WAIT_S + 15
        cache.release.set()
        wait_until(lambda: c.health()["status"] == "ok", timeout=30, what="health ok again")
    finally:
        cache.release.set()
        d.stop(grace=5)


def test_a_stalled_retention_run_is_degraded_naming_the_root(tmp_path: Path,
                                                             short_dir: Path) -> None:
    """Retention's run of a root is a call on the board: a remote delete that never returns
    shows as a stuck `retention` call naming the root; once the store answers, health is ok."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    cfg = tmp_path / "ckptd.toml"
    cfg.write_text(render_config(
        {"state_dir": str(tmp_path / "state"), "socket": str(short_dir / "s.sock"),
         "scan_interval": "1s"},
        [{"name": "r", "path": str(ckpt), "settle": "200ms",
          "upload": {"url": f"file://{tmp_path / 'remote'}"},
          "retention": {"remote": {"keep_last": 1, "keep_best": 0, "keep_every": 0,
                                   "keep_within": ""}}}]))
    cache = OpStalling("delete")
    d = Daemon(load_config(cfg), cfg, backends=cache, stage_bounds={"retention": 1.0})
    d.start()
    try:
        c = Client(d.config.daemon.socket, timeout=30, strict=True)
        for step in (1, 2):
            save_torch(ckpt / f"model_step_{step}.pt")
            assert c.wait("r", step, until="uploaded", timeout=60)
        assert cache.entered.wait(60), "remote retention never deleted step 1"
        health = wait_until(lambda: (h := c.health()) and h["status"] == "degraded" and h,
                            timeout=30, what="health degraded")
        (stuck,) = _stuck_of(health)
        assert (stuck["stage"], stuck["root"]) == ("retention", "r"), health
        cache.release.set()
        wait_until(lambda: c.health()["status"] == "ok", timeout=30, what="health ok again")
    finally:
        cache.release.set()
        d.stop(grace=5)
