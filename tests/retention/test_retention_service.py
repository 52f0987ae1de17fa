"""The retention service on a real SQLite store and a real file:// remote: every run happens on
its one thread, so `run_now` callers and background requests never run one root at the same
time; a failed run reaches its caller and the loop goes on; no loop means a clear error (503
through the socket API), not a hang. Overlap is measured by a Backend wrapper around
LocalBackend, not by looking inside ckptd.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import pytest
from support.clock import FakeClock
from support.passthrough import PassThrough

from ckptd.api.documents import ApiContext
from ckptd.api.door import bind_socket
from ckptd.api.server import UnixHttpServer
from ckptd.backends import Backend, LocalBackend
from ckptd.cli.main import main as cli_main
from ckptd.client import Client
from ckptd.clock import SYSTEM, Clock
from ckptd.config import RootConfig, parse_config
from ckptd.errors import InternalError, NotFound, ServiceUnavailable, TransientError
from ckptd.lifecycle.changes import Changes
from ckptd.remote.manifest import Manifest
from ckptd.retention.outcomes import Outcome
from ckptd.service.discovery import Discovery
from ckptd.service.metrics import Metrics
from ckptd.service.retention import RetentionService
from ckptd.service.scan import Scanner
from ckptd.service.supervisor import Supervisor
from ckptd.service.workers import Workers
from ckptd.store import Store

REMOTE_ONLY_STEPS = (1, 2, 3, 4, 5, 6)  # keep_last=1 remotely: 1..5 go, 6 stays
FAILED = [(s, "remote", "failed") for s in REMOTE_ONLY_STEPS[:-1]]


class OverlapRecorder(PassThrough):
    """A Backend whose deletes take a while and then fail transiently, so every run tries the
    same deletes again; it records the threads that call it and the most calls in flight."""

    def __init__(self, inner: Backend, delay: float = 0.02) -> None:
        super().__init__(inner)
        self.delay = delay
        self._lock = threading.Lock()
        self.active = self.max_active = self.deletes = 0
        self.threads: set[int] = set()

    def delete(self, key: str) -> None:
        with self._lock:
            self.active += 1
            self.deletes += 1
            self.max_active = max(self.max_active, self.active)
            self.threads.add(threading.get_ident())
        try:
            time.sleep(self.delay)
            raise TransientError(f"injected: the remote is unavailable ({key})")
        finally:
            with self._lock:
                self.active -= 1


class Setup:
    def __init__(self, tmp_path: Path) -> None:
        remote = tmp_path / "remote"
        remote.mkdir()
        (tmp_path / "r1").mkdir()
        cfg = parse_config({
            "daemon": {"state_dir": str(tmp_path / "state"), "socket": str(tmp_path / "s")},
            "roots": [{"name": "r1", "path": str(tmp_path / "r1"),
                       "upload": {"url": f"file://{remote}"},
                       "retention": {"local": {"min_free": "0"},
                                     "remote": {"keep_last": 1, "keep_best": 0,
                                                "keep_every": 0, "keep_within": ""}}}],
        }, tmp_path)
        self.roots: Mapping[str, RootConfig] = {r.name: r for r in cfg.roots}
        (tmp_path / "state").mkdir()
        self.store = Store(tmp_path / "state" / "state.db")
        for step in REMOTE_ONLY_STEPS:
            self.store.add_remote_only("r1", Manifest("r1", step, "single", ()), time.time())
        self.backend = OverlapRecorder(LocalBackend(remote))

    def service(self, backend_for: Callable[[RootConfig], Backend | None] | None = None,
                timer_s: float = 60.0, api_timeout: float = 540.0,
                clock: Clock = SYSTEM) -> RetentionService:
        return RetentionService(self.store, lambda: self.roots,
                                backend_for or (lambda root: self.backend), timer_s=timer_s,
                                api_timeout=api_timeout, clock=clock)


@pytest.fixture
def setup(tmp_path: Path) -> Iterator[Setup]:
    s = Setup(tmp_path)
    yield s
    s.store.close()


def looping(svc: RetentionService) -> tuple[threading.Thread, threading.Event]:
    stop = threading.Event()
    loop = threading.Thread(target=svc.run, args=(stop,), name="test-retention-loop")
    loop.start()
    return loop, stop


def halt(svc: RetentionService, loop: threading.Thread, stop: threading.Event) -> None:
    stop.set()
    svc.request("r1")  # wakes the loop now instead of at its next poll
    loop.join(10)


def summary(outcomes: list[Outcome]) -> list[tuple[int, str, str]]:
    return [(o.step, o.tier, o.action) for o in outcomes]


def test_run_now_callers_and_background_runs_never_overlap(setup: Setup) -> None:
    svc = setup.service(timer_s=0.05)  # the timer asks too, about every run
    loop, stop = looping(svc)
    results: dict[str, list[list[Outcome]]] = {}
    errors: list[BaseException] = []

    def caller(name: str) -> None:
        try:
            results[name] = [svc.run_now("r1", timeout=60) for _ in range(4)]
        except BaseException as exc:  # surfaced below, with the thread's name
            errors.append(exc)

    def background() -> None:
        for _ in range(30):
            svc.request("r1")
            time.sleep(0.01)

    threads = [threading.Thread(target=caller, args=(f"api-{i}",)) for i in range(2)]
    threads.append(threading.Thread(target=background))
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    halt(svc, loop, stop)

    assert not errors and not loop.is_alive()
    assert setup.backend.max_active == 1, "two retention runs of r1 deleted at the same time"
    # Every delete, the API callers' included, ran on the loop's thread.
    assert setup.backend.threads == {loop.ident}
    for runs in results.values():
        assert [summary(o) for o in runs] == [FAILED] * 4
    # Each caller's four calls needed four runs of their own (callers waiting together share one).
    assert setup.backend.deletes >= len(FAILED) * 4


def test_run_now_waits_for_a_run_that_starts_after_it(setup: Setup) -> None:
    svc = setup.service()
    loop, stop = looping(svc)
    try:
        first = svc.run_now("r1", timeout=30)
        before = setup.backend.deletes
        second = svc.run_now("r1", timeout=30)
    finally:
        halt(svc, loop, stop)
    assert summary(first) == summary(second) == FAILED
    assert setup.backend.deletes == before + len(FAILED)  # a run of its own, not the last one's


def test_run_now_without_a_loop_fails_clearly_and_does_nothing(setup: Setup) -> None:
    svc = setup.service()
    started = time.monotonic()
    with pytest.raises(ServiceUnavailable, match="not running"):
        svc.run_now("r1", timeout=0.3)
    assert time.monotonic() - started < 5
    assert setup.backend.deletes == 0
    with pytest.raises(NotFound):
        svc.run_now("nope", timeout=0.3)


def test_stop_returns_the_loop_and_later_callers_are_told(setup: Setup) -> None:
    svc = setup.service()
    loop, stop = looping(svc)
    svc.run_now("r1", timeout=30)
    halt(svc, loop, stop)
    assert not loop.is_alive()
    with pytest.raises(ServiceUnavailable):
        svc.run_now("r1", timeout=0.2)


def test_a_failed_run_reaches_its_caller_and_the_loop_goes_on(setup: Setup) -> None:
    broken = threading.Event()
    broken.set()

    def backend_for(root: RootConfig) -> Backend | None:
        if broken.is_set():
            raise RuntimeError("credentials helper crashed")
        return setup.backend

    svc = setup.service(backend_for)
    loop, stop = looping(svc)
    try:
        with pytest.raises(RuntimeError, match="credentials helper crashed"):
            svc.run_now("r1", timeout=30)
        assert "credentials helper crashed" in setup.store.root_info("r1")["last_error"]
        broken.clear()
        assert summary(svc.run_now("r1", timeout=30)) == FAILED
        assert loop.is_alive()
    finally:
        halt(svc, loop, stop)


def test_the_supervisor_runs_the_loop_on_its_own_thread(setup: Setup) -> None:
    svc = setup.service()
    sup = Supervisor()
    sup.add("retention", svc.run, halt=svc.wake)
    sup.start()
    try:
        assert summary(svc.run_now("r1", timeout=30)) == FAILED
    finally:
        assert sup.stop(timeout=10)
    threads = {t.ident: t.name for t in threading.enumerate()}
    assert "ckptd-retention" not in threads.values()
    assert setup.backend.threads and threading.get_ident() not in setup.backend.threads

def test_a_readers_hold_expires_by_the_daemons_clock(setup: Setup, short_dir: Path) -> None:
    """A reader's hold, taken through the socket API, keeps its step from the remote deletes
    until it expires on the clock the API and the retention service are given: an hour's hold
    lapses when that clock moves an hour, not after an hour of waiting."""
    clock = FakeClock()
    svc = setup.service(lambda root: setup.backend.inner, clock=clock)
    roots = lambda: setup.roots  # noqa: E731
    metrics = Metrics(process=False, clock=clock)
    ctx = ApiContext(setup.store, roots, Changes(),
                     Scanner(setup.store, roots, lambda: 30.0, False, metrics, clock=clock),
                     Workers(setup.store, roots, 0, lambda: None, lambda root: None, metrics,
                             nets=svc.nets, clock=clock),
                     svc, Discovery(setup.store, roots, lambda root: None, clock=clock),
                     Supervisor(clock=clock), metrics, clock=clock)
    server = UnixHttpServer(bind_socket(short_dir / "api.sock"), ctx)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    clock.advance(86400)  # a day on: the hold is timed by this clock, not the real one
    status, _ = Client(short_dir / "api.sock", timeout=10).request(
        "PUT", "/v1/roots/r1/checkpoints/3/hold?owner=reader-1&ttl=3600")
    assert status == 200
    loop, stop = looping(svc)

    def remote_left() -> list[int]:
        return [r.step for r in setup.store.checkpoints("r1") if r.remote.value == "uploaded"]

    try:
        svc.run_now("r1", timeout=30)  # the loop's own first run may have gone before it
        assert remote_left() == [3, 6]
        clock.advance(3601)
        svc.run_now("r1", timeout=30)
        assert remote_left() == [6]
    finally:
        halt(svc, loop, stop)
        server.shutdown()
        server.server_close()


def test_the_dry_run_plan_is_a_read_on_the_callers_thread(setup: Setup) -> None:
    svc = setup.service()  # no loop: planning does not need it
    plan = svc.plan("r1")
    assert [(i.step, str(i.remote)) for i in plan.items] == [
        (s, "delete") for s in REMOTE_ONLY_STEPS[:-1]] + [(6, "keep")]
    assert setup.backend.deletes == 0


def test_two_loops_at_once_are_refused(setup: Setup) -> None:
    svc = setup.service()
    loop, stop = looping(svc)
    try:
        svc.run_now("r1", timeout=30)  # the loop is surely inside run() now
        with pytest.raises(InternalError, match="already running"):
            svc.run(threading.Event())
    finally:
        halt(svc, loop, stop)


def test_the_api_runs_retention_on_the_retention_thread_or_answers_503(
        setup: Setup, short_dir: Path) -> None:
    svc = setup.service(api_timeout=0.3)
    roots = lambda: setup.roots  # noqa: E731
    metrics = Metrics(process=False)
    ctx = ApiContext(setup.store, roots, Changes(),
                     Scanner(setup.store, roots, lambda: 30.0, False, metrics),
                     Workers(setup.store, roots, 0, lambda: None, lambda root: None, metrics,
                             nets=svc.nets),
                     svc, Discovery(setup.store, roots, lambda root: None), Supervisor(),
                     metrics)
    server = UnixHttpServer(bind_socket(short_dir / "api.sock"), ctx)
    serving = threading.Thread(target=server.serve_forever, daemon=True)
    serving.start()
    client = Client(short_dir / "api.sock", timeout=10)
    try:
        status, doc = client.request("POST", "/v1/roots/r1/prune")
        assert (status, doc["error"]) == (503, "retention_unavailable")
        assert "not running" in doc["message"] and setup.backend.deletes == 0
        # the command line says so with exit 69 (docs/CLI.md), not 1
        assert cli_main(["prune", "r1", "--socket", str(short_dir / "api.sock")]) == 69
        loop, stop = looping(svc)
        try:
            status, doc = client.request("POST", "/v1/roots/r1/prune")
        finally:
            halt(svc, loop, stop)
        assert status == 200
        assert [(o["step"], o["action"]) for o in doc["outcomes"]] == [(s, a) for s, _, a in FAILED]
        assert setup.backend.threads == {loop.ident}
    finally:
        server.shutdown()
        server.server_close()
