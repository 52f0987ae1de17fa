"""The socket API against a real daemon (in-process, real socket, real SQLite): hostile numbers
and strings are a 400, never a 500; a registration cannot claim another checkpoint's files;
pins answer at once; bursts of clients and thousands of idle connections are served."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from typing import Any

import pytest
import structlog
from support import Harness, raw, wait_until
from writers import save_torch

from ckptd.client import Client


@pytest.mark.parametrize(("method", "path", "body"), [
    ("GET", "/v1/roots/r/checkpoints/1/wait?timeout=nan", b""),
    ("GET", "/v1/roots/r/checkpoints/1/wait?timeout=inf", b""),
    ("GET", "/v1/roots/r/checkpoints/1/wait?timeout=-1", b""),
    ("GET", "/v1/roots/r/checkpoints/1/wait?timeout=1e308", b""),
    ("GET", "/v1/roots/r/checkpoints/9223372036854775808", b""),
    ("GET", "/v1/roots/r/checkpoints/99999999999999999999999999", b""),
    ("GET", "/v1/roots/r/checkpoints/%D9%A1%D9%A2", b""),  # Arabic-Indic digits
    ("PUT", "/v1/roots/r/checkpoints/1/lease?ttl=nan&owner=a", b""),
    ("PUT", "/v1/roots/r/checkpoints/1/lease?owner=a%00b", b""),
    ("POST", "/v1/roots/r/checkpoints", b'{"step": 9223372036854775808}'),
    ("POST", "/v1/roots/r/checkpoints", b'{"step": 1, "metrics": {"loss": NaN}}'),
    ("POST", "/v1/roots/r/checkpoints", b'{"step": 1, "metrics": {"loss": Infinity}}'),
    ("POST", "/v1/roots/r/checkpoints", b'{"step": 1, "metrics": {"loss": 1e999}}'),
    ("POST", "/v1/roots/r/checkpoints", b'{"step": 1, "paths": ["a\\u0000b.pt"]}'),
    ("POST", "/v1/roots/r/checkpoints", b'{"step": 1, "paths": ["\\ud800.pt"]}'),
    ("POST", "/v1/roots/r/checkpoints", b'{"step": 1, "metrics": {"\\udfff": 1}}'),
])
def test_hostile_numbers_and_strings_get_a_400_never_a_500(h: Harness, method: str, path: str,
                                                           body: bytes) -> None:
    save_torch(h.root / "model_step_1.pt")
    t0 = time.monotonic()
    status, doc = raw(h.daemon.config.daemon.socket, method, path, body)
    assert status == 400, doc
    assert doc["error"] == "bad_field" or doc["error"] == "bad_json"
    assert time.monotonic() - t0 < 5  # no spinning on a NaN timeout
    assert h.client.health()["status"] == "ok"  # type: ignore[index]


def test_a_registration_cannot_claim_another_checkpoints_files(h: Harness) -> None:
    for step in (200, 300):
        save_torch(h.root / f"model_step_{step}.pt")
    assert h.client.wait("r", 300, until="valid", timeout=30)
    assert h.client.wait("r", 200, until="valid", timeout=30)
    status, doc = raw(h.daemon.config.daemon.socket, "POST", "/v1/roots/r/checkpoints",
                      json.dumps({"step": 5, "paths": [str(h.root / "model_step_200.pt"),
                                                       "model_step_300.pt"]}).encode())
    assert status == 409 and doc["error"] == "path_taken", doc
    assert "step 200" in doc["message"]
    assert h.client.latest("r")["step"] == 300  # type: ignore[index]


def test_a_conflicting_old_registration_never_takes_a_file_away(h: Harness) -> None:
    """A registration stored before (or past) the API's check names step 300's file: the scan
    ignores it instead of handing the file to step 5 (latest once fell from 300 to 5)."""
    save_torch(h.root / "model_step_300.pt")
    save_torch(h.root / "extra.pt")
    assert h.client.wait("r", 300, until="valid", timeout=30)
    with structlog.testing.capture_logs() as logs:
        h.daemon.store.register("r", 5, ["extra.pt", "model_step_300.pt"], {}, time.time())
        h.daemon.scanner.wake()
        wait_until(lambda: any(e["event"] == "registration_conflict" for e in logs),
                   what="the conflict noticed")
    h.daemon.scanner.scan_all()
    assert h.client.latest("r")["step"] == 300  # type: ignore[index]
    assert h.daemon.store.checkpoint("r", 5) is None


def test_a_path_longer_than_the_file_system_allows_is_refused_at_the_door(h: Harness) -> None:
    status, doc = raw(h.daemon.config.daemon.socket, "POST", "/v1/roots/r/checkpoints",
                      json.dumps({"step": 7, "paths": ["x" * 300 + ".pt"]}).encode())
    assert status == 422 and doc["error"] == "path_too_long", doc
    save_torch(h.root / "model_step_8.pt")  # and the root carries on
    assert h.client.wait("r", 8, until="valid", timeout=30)


def test_a_nan_metric_from_a_layout_is_stored_as_missing(h: Harness) -> None:
    d = h.root / "checkpoint-40"
    d.mkdir()
    save_torch(d / "pytorch_model.bin")
    (d / "trainer_state.json").write_text(
        json.dumps({"global_step": 40, "log_history": [{"step": 40, "eval_loss": float("nan"),
                                                         "loss": 1.5}]}))
    assert h.client.wait("r", 40, until="valid", timeout=30)
    status, doc = raw(h.daemon.config.daemon.socket, "GET", "/v1/roots/r/checkpoints")
    assert status == 200 and b"NaN" not in json.dumps(doc).encode()
    (rec,) = doc["checkpoints"]
    assert "eval_loss" not in rec["metrics"]


def test_a_pin_right_after_a_register_holds(h: Harness) -> None:
    """From the moment `register` returns, the step exists for a pin."""
    assert h.client.register("r", 500, paths=["model_step_500.pt"])
    assert h.client.pin("r", 500)
    save_torch(h.root / "model_step_500.pt")
    assert h.client.wait("r", 500, until="valid", timeout=30)
    rec = h.daemon.store.checkpoint("r", 500)
    assert rec is not None and rec.pinned


def test_a_burst_of_300_clients_is_answered(h: Harness) -> None:
    save_torch(h.root / "model_step_1.pt")
    assert h.client.wait("r", 1, until="valid", timeout=30)
    answers: list[Any] = []
    lock = threading.Lock()

    def one() -> None:
        got = Client(h.daemon.config.daemon.socket, timeout=30).latest("r")
        with lock:
            answers.append(got)

    threads = [threading.Thread(target=one) for _ in range(300)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(answers) == 300 and all(a is not None and a["step"] == 1 for a in answers)


def test_idle_connections_do_not_starve_the_socket(h: Harness) -> None:
    """600 connections that send nothing (more than the 512 connection threads): they are
    closed after the idle timeout, and a real client is answered meanwhile or soon after."""
    idle = []
    try:
        for _ in range(600):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(str(h.daemon.config.daemon.socket))
            idle.append(s)
        t0 = time.monotonic()
        assert Client(h.daemon.config.daemon.socket, timeout=30).health() is not None
        assert time.monotonic() - t0 < 15
    finally:
        for s in idle:
            s.close()


def test_a_pin_never_waits_on_a_scan(h: Harness) -> None:
    """A scan holds the scan lock (a huge root, a slow disk): a pin still answers at once."""
    save_torch(h.root / "model_step_2.pt")
    assert h.client.wait("r", 2, until="valid", timeout=30)
    with h.daemon.retention.exclusive:  # what a scan holds while it walks and reconciles
        t0 = time.monotonic()
        assert Client(h.daemon.config.daemon.socket, timeout=5, strict=True).pin("r", 2)
        assert time.monotonic() - t0 < 2


def test_2000_idle_connections_hold_no_thread_and_a_fresh_client_is_answered(h: Harness
                                                                             ) -> None:
    """2,000 real connections left open: 1,000 that never sent a byte and 1,000 that sent one
    request, read its answer and stayed open (keep-alive). None holds a thread; a fresh
    client (and the `ckptd latest` CLI) is answered at once, not after the idle ones."""
    import resource

    save_torch(h.root / "model_step_1.pt")
    assert h.client.wait("r", 1, until="valid", timeout=30)
    sock_path = str(h.daemon.config.daemon.socket)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 6000 if hard == resource.RLIM_INFINITY else min(hard, 6000)
    if soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    threads_before = threading.active_count()
    idle: list[socket.socket] = []
    try:
        for i in range(2000):  # keep-alive ones first, then the silent ones all at once
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(30)
            s.connect(sock_path)
            idle.append(s)
            if i < 1000:
                s.sendall(b"GET /v1/health HTTP/1.1\r\nHost: x\r\n\r\n")
                assert s.recv(65536).startswith(b"HTTP/1.1 200"), i
        t0 = time.monotonic()
        got = Client(h.daemon.config.daemon.socket, timeout=30).latest("r")
        took = time.monotonic() - t0
        assert got is not None and got["step"] == 1
        assert took < 5.0, f"a fresh client waited {took:.1f} s behind idle connections"
        assert threading.active_count() - threads_before < 100  # idle ones hold no thread
        shown = subprocess.run([sys.executable, "-m", "ckptd", "latest", "r", "--socket",
                                sock_path], capture_output=True, text=True, timeout=60)
        assert shown.returncode == 0 and "1" in shown.stdout, shown.stderr
    finally:
        for s in idle:
            s.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
