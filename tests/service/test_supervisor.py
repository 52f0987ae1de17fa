"""Supervised services: a service that raises is logged with its traceback, restarted with
backoff and visible in health; the watchdog's "alive" holds only while every service runs.
The daemon test injects a real fault through a Store subclass (same protocol, no mocks)."""

from __future__ import annotations

import re
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import structlog
from support import wait_until
from support.clock import FakeClock
from support.config import render_config
from writers import save_torch

from ckptd.client import Client
from ckptd.config import load_config
from ckptd.daemon import Daemon
from ckptd.service.supervisor import HEALTHY_AFTER_S, Supervisor
from ckptd.store import Store


def test_a_crashing_service_is_logged_restarted_and_reported() -> None:
    runs: list[int] = []

    def flaky(stop: threading.Event) -> None:
        runs.append(1)
        if len(runs) <= 2:
            raise ValueError(f"boom {len(runs)}")
        stop.wait()

    crashed: list[str] = []
    sup = Supervisor(on_crash=crashed.append, backoff_base=0.01)
    sup.add("flaky", flaky)
    with structlog.testing.capture_logs() as logs:
        sup.start()
        wait_until(lambda: len(runs) >= 3, what="the third start")
        wait_until(sup.alive, what="the service back up")
    events = [e for e in logs if e["event"] == "service_crashed"]
    assert [e["error"] for e in events] == ["ValueError: boom 1", "ValueError: boom 2"]
    assert "Traceback" in events[0]["traceback"] and "flaky" in events[0]["traceback"]
    assert events[1]["restart_in_s"] > events[0]["restart_in_s"]  # backoff grows
    (h,) = sup.health()
    assert h["name"] == "flaky" and h["state"] == "running" and h["restarts"] == 2
    assert h["last_error"] == "ValueError: boom 2"
    assert crashed == ["flaky", "flaky"]
    assert sup.stop(timeout=5)
    assert sup.health()[0]["state"] == "stopped"


def test_not_alive_while_a_service_waits_to_restart() -> None:
    def dies(stop: threading.Event) -> None:
        raise RuntimeError("down")

    sup = Supervisor(backoff_base=5.0)
    sup.add("ok", lambda stop: stop.wait())
    sup.add("dies", dies)
    sup.start()
    wait_until(lambda: sup.health()[1]["state"] == "restarting", what="a crash")
    assert not sup.alive()
    assert sup.stop(timeout=5)  # a service in backoff stops at once


def test_a_service_that_returns_unasked_is_restarted() -> None:
    runs: list[int] = []

    def quits(stop: threading.Event) -> None:
        runs.append(1)
        if len(runs) > 1:
            stop.wait()

    sup = Supervisor(backoff_base=0.01)
    sup.add("quits", quits)
    sup.start()
    wait_until(lambda: len(runs) >= 2, what="a restart")
    assert sup.health()[0]["last_error"] == "RuntimeError: service returned without being stopped"
    sup.stop(timeout=5)


def test_halt_unblocks_a_blocking_service() -> None:
    gate = threading.Event()
    sup = Supervisor()
    sup.add("blocked", lambda stop: gate.wait(), halt=gate.set)
    sup.start()
    assert sup.stop(timeout=5)


class ClaimFailsOnce(Store):
    """A store whose first claim raises, as a SQLite error inside a worker would."""

    failed = threading.Event()

    def claim(self, owner: str, now: float, claim_s: float, *args: Any, **kwargs: Any) -> Any:
        if not ClaimFailsOnce.failed.is_set():
            ClaimFailsOnce.failed.set()
            raise OSError("disk I/O error (injected)")
        return super().claim(owner, now, claim_s, *args, **kwargs)


@pytest.fixture
def daemon_with_faulty_store(tmp_path: Path, short_dir: Path) -> Any:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    cfg_path = tmp_path / "ckptd.toml"
    cfg_path.write_text(render_config(
        {"state_dir": str(tmp_path / "state"), "socket": str(short_dir / "s.sock"),
         "scan_interval": "1s", "workers": 1},
        [{"name": "r", "path": str(ckpt), "settle": "200ms"}]))
    ClaimFailsOnce.failed.clear()
    d = Daemon(load_config(cfg_path), cfg_path, store_factory=ClaimFailsOnce)
    d.supervisor._base = 0.05  # noqa: SLF001 - restart quickly in the test
    d.start()
    try:
        yield d, ckpt
    finally:
        d.stop(grace=5)


def test_daemon_worker_crash_is_restarted_and_shown_in_health(daemon_with_faulty_store: Any
                                                             ) -> None:
    d, ckpt = daemon_with_faulty_store
    c = Client(d.config.daemon.socket, strict=True)
    wait_until(ClaimFailsOnce.failed.is_set, what="the injected fault")
    health = wait_until(lambda: next(
        (s for s in c.health()["services"] if s["name"] == "worker-0" and s["restarts"]), None),
        what="the restart in health")
    assert health["last_error"] == "OSError: disk I/O error (injected)"
    shown = subprocess.run([sys.executable, "-m", "ckptd", "status", "--socket",
                            str(d.config.daemon.socket)], capture_output=True, text=True,
                           timeout=60)
    assert shown.returncode == 0, shown.stderr
    # shown while it waits to restart ("(restarting)") or after it is back up
    assert re.search(r"service worker-0( \(restarting\))?: restarted 1x, last error:"
                     r" OSError: disk I/O error", shown.stdout), shown.stdout
    # the restarted worker does its job: a checkpoint still becomes valid
    save_torch(ckpt / "model_step_5.pt")
    wait_until(lambda: (c.latest("r") or {}).get("step") == 5, timeout=30,
               what="step 5 valid after the restart")
    assert c.health()["status"] == "ok"


def test_a_call_quiet_past_its_bound_is_stuck_named_and_reported_once() -> None:
    """The call board: a call that beats (or whose progress counter moves) is not stuck; one
    quiet past its bound is, at once: `alive` is False, its service shows `stuck` naming the
    stage and item, `on_stuck` is told once, then again when the call ends."""
    told: list[tuple[str, int, bool]] = []
    sup = Supervisor(on_stuck=lambda c, stuck: told.append((c.stage, c.step, stuck)))
    release = threading.Event()
    sup.add("worker-0", lambda stop: release.wait())
    sup.start()
    try:
        wait_until(sup.alive, what="the service up")
        written = [0]
        sup.calls.begin("worker-0", "upload", "r", 7, bound_s=0.3)
        sup.calls.begin("persist-ab", "persist", "r", 8, bound_s=0.3,
                        progress=lambda: written[0])
        for _ in range(5):  # both make progress: neither is stuck
            sup.calls.beat("worker-0")
            written[0] += 1
            release.wait(0.1)
            assert not sup.calls.stuck() and sup.alive()
        stuck = wait_until(lambda: {c.who for c in sup.calls.stuck()} == {"worker-0", "persist-ab"}
                           and sup.health(), what="both stuck")
        assert not sup.alive() and sup.running()
        w0 = next(s for s in stuck if s["name"] == "worker-0")
        assert w0["state"] == "stuck"
        assert {k: w0["stuck"][k] for k in ("stage", "root", "step", "bound_s")} == {
            "stage": "upload", "root": "r", "step": 7, "bound_s": 0.3}
        assert next(s for s in stuck if s["name"] == "persist-ab")["stuck"]["step"] == 8
        wait_until(lambda: sorted(told) == [("persist", 8, True), ("upload", 7, True)],
                   what="on_stuck told once each")
        sup.calls.end("worker-0")
        sup.calls.end("persist-ab")
        wait_until(lambda: len(told) == 4, what="resumed reported")
        assert sup.alive() and told.count(("upload", 7, False)) == 1
    finally:
        release.set()
        sup.stop(timeout=5)


def test_the_backoff_starts_over_once_a_service_ran_long_enough_on_the_supervisors_clock(
        ) -> None:
    """The restart backoff doubles while a service keeps crashing, and starts over once it ran
    HEALTHY_AFTER_S since its last start: a minute on the supervisor's clock, not a minute of
    waiting. The crash time shown in health is that clock's too."""
    clock = FakeClock()
    runs: list[int] = []

    def crashes(stop: threading.Event) -> None:
        runs.append(1)
        if len(runs) == 3:
            clock.advance(HEALTHY_AFTER_S + 1)  # the third start runs "a minute" first
        if len(runs) <= 3:
            raise ValueError(f"boom {len(runs)}")
        stop.wait()

    sup = Supervisor(backoff_base=0.004, clock=clock)
    sup.add("crashes", crashes)
    with structlog.testing.capture_logs() as logs:
        sup.start()
        wait_until(lambda: len(runs) >= 4, what="the fourth start")
    try:
        delays = [e["restart_in_s"] for e in logs if e["event"] == "service_crashed"]
        assert delays == [0.004, 0.008, 0.004]
        assert sup.health()[0]["last_crash"] == clock.time()
    finally:
        assert sup.stop(timeout=5)


def test_a_call_is_stuck_by_the_boards_clock_without_waiting() -> None:
    """A call's bound is measured on the supervisor's clock: quiet just under its bound it is
    not stuck; a moment past, it is, and the report says for how long it was quiet."""
    clock = FakeClock()
    told: list[tuple[str, bool]] = []
    sup = Supervisor(on_stuck=lambda c, stuck: told.append((c.who, stuck)), clock=clock)
    sup.calls.begin("worker-0", "validate", "r", 3, bound_s=300.0)
    assert sup.calls.busy("worker-0").since == clock.time()  # type: ignore[union-attr]
    clock.advance(299.0)
    sup.check_calls()
    assert not sup.stuck() and told == []
    sup.calls.beat("worker-0")  # progress: the quiet starts over
    clock.advance(299.0)
    assert not sup.stuck()
    clock.advance(2.0)
    sup.check_calls()
    assert told == [("worker-0", True)]
    (entry,) = sup.health()
    assert entry["name"] == "worker-0" and entry["stuck"]["quiet_s"] == 301.0
    sup.calls.end("worker-0")
    sup.check_calls()
    assert told == [("worker-0", True), ("worker-0", False)]
