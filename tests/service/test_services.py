"""The daemon's services in-process, on real files, a real SQLite store and a real Unix socket:
latest.json follows every field of the latest, a job whose outcome could not be recorded is
retried (not lost), a dead file watcher is replaced, a reload retries failed stages at once;
the effects hook dates latest.json by the clock it is given."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from support import Harness, wait_until
from support.clock import FakeClock
from writers import save_torch

from ckptd.config import load_config, parse_config
from ckptd.daemon import Daemon
from ckptd.lifecycle.changes import Changes
from ckptd.lifecycle.table import Policy
from ckptd.model import Candidate, ValidationResult
from ckptd.service.effects import Effects
from ckptd.store import Found, Job, Store


@pytest.fixture
def harness(tmp_path: Path, short_dir: Path, request: pytest.FixtureRequest) -> Iterator[Harness]:
    kw = dict(getattr(request, "param", {}))
    h = Harness(tmp_path, short_dir, **kw)
    h.daemon.start()
    try:
        yield h
    finally:
        h.daemon.stop(grace=5)


@pytest.mark.parametrize("harness", [{"uploads": True}], indirect=True)
def test_latest_json_follows_the_remote_field(harness: Harness, tmp_path: Path) -> None:
    """latest.json is rewritten when the latest's remote (or local) changes, not only its
    step: a job that resumes from the file alone knows the step is safe remotely."""
    h = harness
    save_torch(h.root / "model_step_3.pt")
    assert h.client.wait("r", 3, until="uploaded", timeout=30)
    doc = wait_until(h.latest_json, what="latest.json")
    assert doc["step"] == 3 and doc["remote"] == "uploaded" and doc["local"] == "present"
    latest = h.client.latest("r")
    assert latest is not None
    for key in ("step", "path", "layout", "local", "remote"):
        assert doc[key] == latest[key], key


class RecordFailsOnce(Store):
    """The first validation outcome cannot be recorded (a database error)."""

    failed = threading.Event()

    def finish_validation(self, job: Job, owner: str, fingerprint: str,
                          result: ValidationResult, now: float, stored: Any = (),
                          size_on_disk: int = 0) -> bool:
        if not RecordFailsOnce.failed.is_set():
            RecordFailsOnce.failed.set()
            raise OSError("database is locked (injected)")
        return super().finish_validation(job, owner, fingerprint, result, now, stored,
                                         size_on_disk)


@pytest.mark.parametrize("harness", [{"store_factory": RecordFailsOnce}], indirect=True)
def test_a_job_whose_outcome_raised_is_retried_not_lost(harness: Harness) -> None:
    RecordFailsOnce.failed.clear()
    h = harness
    save_torch(h.root / "model_step_8.pt")
    wait_until(RecordFailsOnce.failed.is_set, what="the injected failure")
    # the worker crashed and was restarted; the job was given back with a backoff
    wait_until(lambda: any(s["name"] == "worker-0" and s["restarts"] == 1
                           for s in h.client.health()["services"]),  # type: ignore[index]
               what="the worker restart")
    assert h.client.wait("r", 8, until="valid", timeout=30)
    # the failure was shown until the stage went through; then it is cleared
    assert h.client.status()["roots"][0]["last_error"] is None  # type: ignore[index]


def test_a_dead_watcher_is_replaced(harness: Harness) -> None:
    h = harness
    old = h.daemon.scanner.watcher
    old.stop()  # its thread ends, as if it had died
    wait_until(lambda: h.daemon.scanner.watcher is not old and h.daemon.supervisor.alive(),
               what="a new watcher")
    (watch,) = [s for s in h.client.health()["services"]  # type: ignore[index]
                if s["name"] == "watch"]
    assert watch["restarts"] == 1 and "observer" in watch["last_error"]
    save_torch(h.root / "model_step_2.pt")  # the new watcher (or the rescan) finds it
    assert h.client.wait("r", 2, until="valid", timeout=30)


@pytest.mark.parametrize("harness", [{"upload": {"url": "file:///proc/ckptd-not-writable"}}],
                         indirect=True)
def test_reload_retries_failed_uploads_at_once(harness: Harness, tmp_path: Path) -> None:
    h = harness
    save_torch(h.root / "model_step_4.pt")
    assert h.client.wait("r", 4, until="valid", timeout=30)
    wait_until(lambda: (h.client.status()["roots"][0]["last_error"] or "")  # type: ignore[index]
               .startswith("upload"), what="the failed upload")
    # the operator fixes the remote and reloads: no waiting out the backoff
    h.root_cfg["upload"] = {"url": f"file://{tmp_path / 'remote'}"}
    h.write_config()
    assert h.daemon.reload()
    assert h.client.wait("r", 4, until="uploaded", timeout=15)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_the_tcp_listener_and_the_socket_give_the_same_numbers_from_the_first_scrape(
        tmp_path: Path, short_dir: Path) -> None:
    import http.client

    from prometheus_client.parser import text_string_to_metric_families

    h = Harness(tmp_path, short_dir)
    port = _free_port()
    save_torch(h.root / "model_step_6.pt")
    cfg = h.config_path.read_text() + f'\n[metrics]\nlisten = "127.0.0.1:{port}"\n'
    h.config_path.write_text(cfg)
    h.daemon = Daemon(load_config(h.config_path), h.config_path)
    h.daemon.start()
    try:
        assert h.client.wait("r", 6, until="valid", timeout=30)

        def gauges(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
            return {(s.name, tuple(sorted(s.labels.items()))): s.value
                    for f in text_string_to_metric_families(text) for s in f.samples
                    if s.name.startswith("ckptd_") and f.type == "gauge"
                    and not s.name.startswith("ckptd_config")}

        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        conn.request("GET", "/metrics")
        tcp = gauges(conn.getresponse().read().decode())  # the first scrape of all
        conn.close()
        assert tcp[("ckptd_latest_step", (("root", "r"),))] == 6
        assert tcp[("ckptd_checkpoints", (("root", "r"), ("state", "valid")))] == 1
        status, text = h.client.request("GET", "/metrics")
        assert status == 200
        sock = gauges(text)
        disk = ("ckptd_disk_free_bytes", (("root", "r"),))
        tcp.pop(disk)  # free space moves on its own between two scrapes
        sock.pop(disk)
        assert sock == tcp
    finally:
        h.daemon.stop(grace=5)


class _Wakes:
    def __init__(self) -> None:
        self.wakes = 0

    def wake(self) -> None:
        self.wakes += 1

    def request(self, root: str) -> None:
        self.wakes += 1

    def discard_early(self, root: str, step: int, sent: object) -> None:
        raise AssertionError("nothing was sent early")


def test_the_effects_date_latest_json_by_their_clock(tmp_path: Path) -> None:
    """latest.json's `updated` is the time on the effects hook's clock when the transition's
    publish effect ran: a clock moved ten days on dates it ten days on."""
    (tmp_path / "r").mkdir()
    cfg = parse_config({"daemon": {"state_dir": str(tmp_path / "state"),
                                   "socket": str(tmp_path / "s")},
                        "roots": [{"name": "r", "path": str(tmp_path / "r")}]}, tmp_path)
    store = Store(tmp_path / "state.db")
    store.set_policies({"r": Policy()})
    clock, wakes = FakeClock(), _Wakes()
    clock.advance(10 * 86400)
    store.set_on_commit(Effects(store, lambda: {r.name: r for r in cfg.roots}, Changes(), wakes,
                                wakes, wakes, threading.RLock(), lambda _root: None,
                                clock=clock))
    store.sync_root("r", [Found(Candidate("single", 1, "a.pt", ("a.pt",), True), "fp")],
                    clock.time())
    doc = json.loads((tmp_path / "r" / ".ckptd" / "latest.json").read_text())
    assert doc["updated"] == datetime.fromtimestamp(clock.time(), UTC).isoformat(
        timespec="seconds")
    assert wakes.wakes > 0  # the same transition woke the workers
    store.close()
