"""Trust at the edges of the daemon: nothing a client sends yields a 500 or a wrong delete, the
socket path never unlinks someone's file, a NaN never becomes a metric. Each against the real
daemon (in-process, real socket, real SQLite) or the real `ckptd run`."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import structlog
from support import Harness, raw, wait_until
from support.config import render_config
from writers import save_torch

from ckptd.client import Client
from ckptd.config import parse_config
from ckptd.lifecycle.table import Event
from ckptd.model import Candidate, FileRecord, Local, ValidationResult
from ckptd.service.retention import RetentionService
from ckptd.store import Found, Store


@pytest.fixture
def h(tmp_path: Path, short_dir: Path) -> Any:
    harness = Harness(tmp_path, short_dir)
    harness.daemon.start()
    try:
        yield harness
    finally:
        harness.daemon.stop(grace=5)


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


def test_retention_never_deletes_past_a_checkpoints_own_files(tmp_path: Path) -> None:
    """Two rows that hold one file (a directory checkpoint holding a file another step
    registered): deleting the older would delete part of the newer. The shared-files net
    refuses it; the planner asked for it (keep_last = 1)."""
    root = tmp_path / "r"
    (root / "step-300").mkdir(parents=True)
    for name in ("model.pt", "meta.pt"):
        save_torch(root / "step-300" / name)
    cfg = parse_config({"daemon": {"state_dir": str(tmp_path / "state"),
                                   "socket": str(tmp_path / "s")},
                        "roots": [{"name": "r", "path": str(root), "retention": {
                            "local": {"keep_last": 1, "keep_best": 0, "min_free": "0"}}}]},
                       tmp_path)
    store = Store(tmp_path / "state.db")
    found = [Found(Candidate("registered", 5, "step-300/model.pt", ("step-300/model.pt",),
                             True), "a"),
             Found(Candidate("dcp", 300, "step-300", ("step-300/meta.pt", "step-300/model.pt"),
                             True), "b")]
    store.sync_root("r", found, 1.0)
    for _ in found:
        job = store.claim("w", 2.0, 60)
        assert job is not None
        res = ValidationResult(True, files=tuple(FileRecord(f, 1, "h", "x") for f in job.files))
        assert store.finish_validation(job, "w", job.checkpoint.fingerprint, res, 2.0)
    svc = RetentionService(store, lambda: {"r": cfg.roots[0]}, lambda r: None)
    stop = threading.Event()
    loop = threading.Thread(target=svc.run, args=(stop,))
    loop.start()
    try:
        outcomes = [o.as_json() for o in svc.run_now("r", timeout=30)]
    finally:
        stop.set()
        svc.wake()
        loop.join(10)
    (five,) = [o for o in outcomes if o["step"] == 5]
    assert five["action"] == "refused" and "shared_files" in five["reason"], outcomes
    assert (root / "step-300" / "model.pt").exists()
    assert store.status("r", 300).local is Local.PRESENT  # type: ignore[union-attr]


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


def test_the_socket_path_never_unlinks_a_regular_file(tmp_path: Path, short_dir: Path) -> None:
    precious = short_dir / "model.pt"
    precious.write_bytes(b"weights")
    cfg = tmp_path / "c.toml"
    cfg.write_text(render_config({"state_dir": str(tmp_path / "state"),
                                  "socket": str(precious)},
                                 [{"name": "r", "path": str(tmp_path / "ckpt")}]))
    done = subprocess.run([sys.executable, "-m", "ckptd", "run", "--config", str(cfg)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 78, done.stderr
    assert precious.read_bytes() == b"weights"
    assert "not a socket" in done.stderr and "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


def test_the_table_refuses_what_retention_did_not_do(h: Harness) -> None:
    save_torch(h.root / "model_step_2.pt")
    assert h.client.wait("r", 2, until="valid", timeout=30)
    assert not h.daemon.store.record("r", 2, Event.PRUNED_REMOTE)  # never uploaded
    wait_until(lambda: h.daemon.store.status("r", 2) is not None, what="a row")


# -- the state database ----------------------------------------------------------------------


@pytest.mark.parametrize("content", [b"", b"this is not a database" * 100,
                                     b"SQLite format 3\x00" + b"\xff" * 4000])
def test_a_corrupt_or_truncated_state_db_is_refused_in_one_line(tmp_path: Path, short_dir: Path,
                                                                 content: bytes) -> None:
    state = tmp_path / "state"
    state.mkdir()
    (state / "state.db").write_bytes(content)
    cfg = tmp_path / "c.toml"
    cfg.write_text(render_config({"state_dir": str(state), "socket": str(short_dir / "s")},
                                 [{"name": "r", "path": str(tmp_path / "ckpt")}]))
    done = subprocess.run([sys.executable, "-m", "ckptd", "run", "--config", str(cfg)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 78, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr
    assert str(state / "state.db") in done.stderr
    assert (state / "state.db").read_bytes() == content  # never "repaired" into an empty one


def test_a_state_db_deleted_while_running_stops_all_acting(h: Harness) -> None:
    save_torch(h.root / "model_step_1.pt")
    assert h.client.wait("r", 1, until="valid", timeout=30)
    h.daemon.store.path.unlink()
    h.daemon.health.check_state()  # the main loop's beat, run now
    health = h.client.health()
    assert health is not None and health["status"] == "degraded"
    assert "was deleted" in health["problem"]
    assert not h.daemon.health.healthy()  # the watchdog is not fed: systemd restarts the daemon
    stopped = {s["name"] for s in health["services"] if s["state"] == "stopped"}
    assert {"scan", "retention", "worker-0"} <= stopped  # their threads have ended
    scans = h.client.status()["scans"]  # type: ignore[index]
    save_torch(h.root / "model_step_2.pt")  # nothing acts any more, woken or not
    h.daemon.scanner.wake()
    assert h.client.latest("r")["step"] == 1  # type: ignore[index]
    assert h.client.status()["scans"] == scans  # type: ignore[index]


def test_pins_survive_the_loss_of_the_state_db(tmp_path: Path, short_dir: Path) -> None:
    h = Harness(tmp_path, short_dir, retention={"local": {"keep_last": 1, "keep_best": 0}})
    h.daemon.start()
    try:
        save_torch(h.root / "model_step_1.pt")
        assert h.client.wait("r", 1, until="valid", timeout=30)
        assert h.client.pin("r", 1)
        assert json.loads((h.root / ".ckptd" / "pins.json").read_text())["steps"] == [1]
    finally:
        h.daemon.stop(grace=5)
    (tmp_path / "state" / "state.db").unlink()
    for extra in (tmp_path / "state").glob("state.db-*"):
        extra.unlink()
    h2 = Harness(tmp_path, short_dir, retention={"local": {"keep_last": 1, "keep_best": 0}})
    h2.daemon.start()
    try:
        save_torch(h2.root / "model_step_2.pt")
        save_torch(h2.root / "model_step_3.pt")
        assert h2.client.wait("r", 3, until="valid", timeout=30)
        assert h2.client.wait("r", 1, until="valid", timeout=30)
        rec = h2.daemon.store.checkpoint("r", 1)
        assert rec is not None and rec.pinned
        h2.daemon.retention.apply_now(h2.daemon.roots()["r"])
        assert (h2.root / "model_step_1.pt").exists()  # keep_last = 1, but pinned
    finally:
        h2.daemon.stop(grace=5)


def test_a_pin_right_after_a_register_holds(h: Harness) -> None:
    """From the moment `register` returns, the step exists for a pin."""
    assert h.client.register("r", 500, paths=["model_step_500.pt"])
    assert h.client.pin("r", 500)
    save_torch(h.root / "model_step_500.pt")
    assert h.client.wait("r", 500, until="valid", timeout=30)
    rec = h.daemon.store.checkpoint("r", 500)
    assert rec is not None and rec.pinned


# -- availability ------------------------------------------------------------------------------


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


# -- config ------------------------------------------------------------------------------------


def test_a_deeply_nested_config_on_reload_keeps_the_old_one(h: Harness) -> None:
    h.config_path.write_text(h.config_path.read_text() + "x = " + "[" * 5000 + "]" * 5000 + "\n")
    assert not h.daemon.reload()
    assert h.client.health()["status"] == "ok"  # type: ignore[index]
    save_torch(h.root / "model_step_3.pt")
    assert h.client.wait("r", 3, until="valid", timeout=30)


@pytest.mark.parametrize(("key", "value", "says"), [
    ("workers", 100000000, "daemon.workers"),
    ("workers", 1e8, "daemon.workers"),
    ("scan_interval", "99999999999999d", "daemon.scan_interval"),
])
def test_numbers_in_the_config_are_bounded(tmp_path: Path, key: str, value: Any,
                                           says: str) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text(render_config({"state_dir": str(tmp_path / "s"), key: value},
                                 [{"name": "r", "path": str(tmp_path / "ckpt")}]))
    done = subprocess.run([sys.executable, "-m", "ckptd", "config", "check", str(cfg)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 78 and says in done.stderr, done.stderr


@pytest.mark.parametrize(("listen", "ok"), [
    ("127.0.0.1:9464", True), ("[::1]:9464", True), (":9464", True), ("localhost:9464", True),
    ("9464", False), ("127.0.0.1:", False), ("127.0.0.1:99999", False), ("1.2.3.4.5:80", False),
    ("host name:80", False), ("metrics.example:80", False), ("127.0.0.1:\u0661", False),
])
def test_metrics_listen_is_checked_as_run_uses_it(tmp_path: Path, listen: str,
                                                  ok: bool) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text(render_config({"state_dir": str(tmp_path / "s")},
                                 [{"name": "r", "path": str(tmp_path / "ckpt")}])
                   + f'\n[metrics]\nlisten = "{listen}"\n')
    done = subprocess.run([sys.executable, "-m", "ckptd", "config", "check", str(cfg)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == (0 if ok else 78), done.stderr
    if not ok:
        assert "metrics.listen" in done.stderr


def test_a_taken_metrics_port_is_one_line_and_exit_78(tmp_path: Path, short_dir: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        cfg = tmp_path / "c.toml"
        cfg.write_text(render_config({"state_dir": str(tmp_path / "s"),
                                      "socket": str(short_dir / "s.sock")},
                                     [{"name": "r", "path": str(tmp_path / "ckpt")}])
                       + f'\n[metrics]\nlisten = "127.0.0.1:{port}"\n')
        done = subprocess.run([sys.executable, "-m", "ckptd", "run", "--config", str(cfg)],
                              capture_output=True, text=True, timeout=60)
    assert done.returncode == 78, done.stderr
    assert "metrics.listen" in done.stderr and "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("name", ["pdb.run", "timeit.timeit", "_posixsubprocess.fork_exec",
                                  "os.system", "builtins.eval", "subprocess.Popen",
                                  "multiprocessing.Process", "signal.signal", "pty.spawn",
                                  "torch.load", "deepspeed.Thing.__reduce__"])
def test_a_code_running_trusted_global_is_refused(tmp_path: Path, name: str) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text(render_config({"state_dir": str(tmp_path / "s")},
                                 [{"name": "r", "path": str(tmp_path / "ckpt"),
                                   "trusted_globals": [name]}]))
    done = subprocess.run([sys.executable, "-m", "ckptd", "config", "check", str(cfg)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 78 and "never trusted" in done.stderr, done.stderr


# -- steps ---------------------------------------------------------------------------------------


def test_a_huge_step_or_foreign_digits_never_stall_a_root(h: Harness) -> None:
    """A file named with a step of 2^63 or more, or with Arabic-Indic digits, is unrecognised
    (listed in status); the root's real checkpoints carry on."""
    save_torch(h.root / f"model_step_{2**63}.pt")
    save_torch(h.root / "model_step_\u0661\u0662.pt")
    (h.root / "step-99999999999999999999999").mkdir()
    save_torch(h.root / "model_step_7.pt")
    assert h.client.wait("r", 7, until="valid", timeout=30)
    status, doc = h.client.request("GET", "/v1/roots/r/checkpoints")
    steps = [c["step"] for c in doc["checkpoints"]]
    assert steps == [7]
    root = h.client.status()["roots"][0]  # type: ignore[index]
    assert f"model_step_{2**63}.pt" in root["unrecognised"]
    assert root["last_error"] is None


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
