"""End to end: a real daemon on a real Unix socket over real torch-written checkpoints. The
daemon runs in the test process (`inproc_daemon`) unless a test is about the process itself
(exit codes, signals, kill -9), which gets a `ckptd run` subprocess (`daemon_factory`)."""

from __future__ import annotations

import json
import os
import select
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from support.ckpts import flip_byte, save_single, tiny_state
from support.config import SETTLE_S
from support.wait import wait_scans, wait_until
from support.wire import cli, http

from ckptd.client import Client, ClientError


def test_single_files_latest_skips_corrupt_and_truncated(inproc_daemon: Any) -> None:
    d = inproc_daemon()
    root = d.roots["r1"]
    save_single(root, 10)
    assert d.wait_for("r1", 10)["state"] == "valid"
    flip_byte(save_single(root, 20))
    p30 = save_single(root, 30)
    with open(p30, "r+b") as f:
        f.truncate(os.path.getsize(p30) - 100)
    (root / "model_step_40.pt").write_bytes(b"")
    bad = d.wait_for("r1", 20)
    assert bad["reason"] == "crc_mismatch"
    assert bad["bytes"] == (root / "model_step_20.pt").stat().st_size  # its size, even invalid
    assert d.wait_for("r1", 30)["state"] == "invalid"
    assert d.wait_for("r1", 40)["state"] == "invalid"
    latest = d.client.latest("r1")
    assert latest is not None and latest["step"] == 10
    assert latest["path"] == str(root / "model_step_10.pt")
    doc = json.loads((root / ".ckptd" / "latest.json").read_text())
    assert doc["step"] == 10 and doc["path"] == latest["path"]


def test_dcp_complete_and_missing_metadata(inproc_daemon: Any) -> None:
    import torch.distributed.checkpoint as dcp

    d = inproc_daemon()
    root = d.roots["r1"]
    dcp.save(tiny_state(1), checkpoint_id=str(root / "step-100"))
    dcp.save(tiny_state(2), checkpoint_id=str(root / "step-200"))
    (root / "step-200" / ".metadata").unlink()
    assert d.wait_for("r1", 100)["layout"] == "dcp"
    wait_scans(d.client, settle=SETTLE_S, wake=d.wake_scan)
    rec = d.client.checkpoint("r1", 200)
    assert rec is None or rec["state"] == "pending"
    assert d.client.latest("r1")["step"] == 100  # type: ignore[index]


def test_split_and_ranked_layouts(inproc_daemon: Any) -> None:
    d = inproc_daemon()
    root = d.roots["r1"]
    st = tiny_state(3)
    torch.save({"step": 5}, root / "step_5_meta.pt")
    torch.save(st["model"], root / "step_5_model.pt")
    torch.save(st["optimizer"], root / "step_5_optim.pt")
    torch.save(st["model"], root / "model_7.pt")
    (root / "meta_7.json").write_text(json.dumps({"step": 7, "world_size": 2}))
    torch.save(st["optimizer"], root / "optim_7_rank0.pt")  # rank 1 missing
    assert d.wait_for("r1", 5)["layout"] == "split"
    wait_scans(d.client, settle=SETTLE_S, wake=d.wake_scan)
    assert d.client.checkpoint("r1", 7)["state"] == "pending"  # type: ignore[index]
    torch.save(st["optimizer"], root / "optim_7_rank1.pt")
    assert d.wait_for("r1", 7)["layout"] == "ranked"
    assert d.client.latest("r1")["step"] == 7  # type: ignore[index]


def test_registered_with_paths_and_metrics(inproc_daemon: Any) -> None:
    d = inproc_daemon(roots=[{"name": "r1", "metric": "val_loss"}])
    root = d.roots["r1"]
    (root / "run").mkdir()
    torch.save(tiny_state(1), root / "run" / "weights.pt")
    (root / "run" / "notes.json").write_text("{}")
    c = d.client
    assert c.register("r1", 3, paths=[str(root / "run")], metrics={"val_loss": 0.5})
    rec = d.wait_for("r1", 3)
    assert rec["state"] == "valid" and rec["layout"] == "registered"
    assert rec["metrics"] == {"val_loss": 0.5}
    assert c.status()["roots"][0]["best"] == 3  # type: ignore[index]


def test_unsafe_pickle_never_runs(inproc_daemon: Any, tmp_path: Path) -> None:
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self) -> Any:
            return (os.system, (f"touch {marker}",))

    d = inproc_daemon()
    torch.save({"x": Evil()}, d.roots["r1"] / "model_step_1.pt")
    rec = d.wait_for("r1", 1)
    assert rec["state"] == "invalid" and rec["reason"] == "unsafe_pickle"
    assert not marker.exists()


def test_symlink_out_of_root_is_refused(inproc_daemon: Any, tmp_path: Path) -> None:
    outside = tmp_path / "outside.pt"
    torch.save(tiny_state(1), outside)
    d = inproc_daemon()
    root = d.roots["r1"]
    (root / "model_step_9.pt").symlink_to(outside)
    rec = d.wait_for("r1", 9)
    assert rec["state"] == "invalid" and rec["reason"] == "unsafe_path"
    assert outside.exists()


def test_api_errors(inproc_daemon: Any) -> None:
    d = inproc_daemon()
    s = d.socket
    post = "POST /v1/roots/r1/checkpoints HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
    assert http(s, (post + "Content-Length: 5\r\n\r\n{bad}").encode())[0] == 400
    body = json.dumps({"step": -1}).encode()
    assert http(s, (post + f"Content-Length: {len(body)}\r\n\r\n").encode() + body)[0] == 400
    body = json.dumps({"step": 1, "paths": ["/etc/passwd"]}).encode()
    status, err = http(s, (post + f"Content-Length: {len(body)}\r\n\r\n").encode() + body)
    assert status == 422 and err["error"] == "outside_root"
    assert http(s, (post + "Content-Length: -5\r\n\r\n").encode())[0] == 400
    # refused on the declared length, before the body is read
    assert http(s, (post + f"Content-Length: {1024 * 1024 + 1}\r\n\r\n").encode())[0] == 413
    status, err = http(s, b"GET /v1/roots/nope/checkpoints HTTP/1.1\r\nHost: x\r\n"
                          b"Connection: close\r\n\r\n")
    assert status == 404 and set(err) == {"error", "message"}
    c = Client(s, strict=True)
    with pytest.raises(ClientError) as e:
        c.request_json("GET", "/v1/roots/r1/checkpoints/1/wait?until=uploaded")
    assert e.value.status == 409
    status, _ = c.request("GET", "/v1/roots/r1/checkpoints/1/wait?until=valid&timeout=0.3")
    assert status == 408
    assert c.request("GET", "/v1/roots/r1/latest")[0] == 404
    assert c.request("GET", "/v1/roots/r1/checkpoints/abc")[0] == 400


def test_wait_long_poll_and_pins(inproc_daemon: Any) -> None:
    d = inproc_daemon()
    c = d.client
    t0 = time.monotonic()
    save_single(d.roots["r1"], 4)
    assert c.wait("r1", 4, until="valid", timeout=20)
    assert time.monotonic() - t0 < 20
    flip_byte(save_single(d.roots["r1"], 5))
    status, body = c.request("GET", "/v1/roots/r1/checkpoints/5/wait?until=valid&timeout=20")
    assert status == 409 and body["error"] == "invalid"
    assert c.pin("r1", 4)
    assert c.checkpoint("r1", 4)["pinned"] is True  # type: ignore[index]
    assert c.unpin("r1", 4)
    assert c.checkpoint("r1", 4)["pinned"] is False  # type: ignore[index]
    with pytest.raises(ClientError):
        c.pin("r1", 99)


def test_socket_mode_and_single_instance(inproc_daemon: Any) -> None:
    d = inproc_daemon()
    assert stat.S_IMODE(os.stat(d.socket).st_mode) == 0o660
    second = subprocess.run([sys.executable, "-m", "ckptd", "run", "--config", str(d.config)],
                            capture_output=True, text=True, timeout=60)
    assert second.returncode == 75, second.stderr
    assert "another ckptd" in second.stderr
    assert d.client.health()["status"] == "ok"  # type: ignore[index]


def test_kill9_mid_validation_then_restart_same_answer(daemon_factory: Any) -> None:
    d = daemon_factory()
    root = d.roots["r1"]
    save_single(root, 1)
    d.wait_for("r1", 1)
    big = root / "model_step_2.pt"
    torch.save({"w": torch.randn(64, 1024, 1024)}, big)  # 256 MiB: validation takes a while
    flip_byte(save_single(root, 3))

    def validating_2() -> bool:
        st = Client(d.socket, timeout=2).status() or {}
        return any(w["step"] == 2 for w in st.get("in_flight", []))

    wait_until(validating_2, 30, "step 2 in flight", interval=0.01,
               detail=lambda: d.log_text()[-3000:])
    d.kill9()
    d.start()
    assert d.wait_for("r1", 2, timeout=60)["state"] == "valid"
    assert d.wait_for("r1", 3)["state"] == "invalid"
    assert d.client.latest("r1")["step"] == 2  # type: ignore[index]
    # a clean stop then restart keeps the same answer
    assert d.stop() == 0
    d.start()
    assert [c["state"] for c in d.client.checkpoints("r1")] == ["valid", "valid", "invalid"]


def test_the_daemon_process_does_not_load_torch(daemon_factory: Any) -> None:
    # torch costs a process ~100 MiB resident once imported: the daemon validates torch files
    # without it (deep validation loads them in a child: test_validate).
    d = daemon_factory()
    save_single(d.roots["r1"], 1)
    assert d.wait_for("r1", 1)["state"] == "valid"
    assert d.proc is not None
    maps = Path(f"/proc/{d.proc.pid}/maps").read_text()
    assert "libtorch" not in maps and "/torch/" not in maps


def test_resave_same_step_supersedes(inproc_daemon: Any) -> None:
    d = inproc_daemon()
    root = d.roots["r1"]
    p = save_single(root, 8)
    first = d.wait_for("r1", 8)
    assert first["state"] == "valid"
    torch.save(tiny_state(99, n=32), p)  # re-save of the same step

    def resaved() -> dict[str, Any] | None:
        rec = d.client.checkpoint("r1", 8)
        return rec if rec and rec["state"] == "valid" and rec["bytes"] != first["bytes"] else None

    wait_until(resaved, 20, "the re-save of step 8 valid", detail=lambda: d.log_text()[-3000:])
    assert d.events("checkpoint_superseded")


def test_client_falls_back_to_latest_json(inproc_daemon: Any) -> None:
    d = inproc_daemon()
    save_single(d.roots["r1"], 6)
    d.wait_for("r1", 6)
    d.stop()
    c = Client(d.socket, timeout=1)
    info = c.latest("r1", root_dir=d.roots["r1"])
    assert info is not None and info["step"] == 6
    assert c.register("r1", 7) is False  # never raises into training
    with pytest.raises(ClientError):
        Client(d.socket, timeout=1, strict=True).register("r1", 7)


def test_signals_flush_then_exit_zero_and_remove_socket(daemon_factory: Any) -> None:
    """SIGUSR1 asks for a flush; SIGTERM stops the process with 0 and removes its socket."""
    d = daemon_factory()
    d.signal(signal.SIGUSR1)
    wait_until(lambda: d.events("flush_requested"), 15, "flush_requested after SIGUSR1",
               detail=lambda: d.log_text()[-3000:])
    assert d.stop(signal.SIGTERM) == 0
    assert not d.socket.exists()
    assert d.events("daemon_stopping")[-1]["signal"] == "SIGTERM"


def test_cli_commands(inproc_daemon: Any) -> None:
    d = inproc_daemon()
    root = d.roots["r1"]
    save_single(root, 11)
    d.wait_for("r1", 11)
    s = d.socket
    st = json.loads(cli("status", "--json", sock=s).stdout)
    assert set(st) == {"status", "version", "uptime_s", "scans", "roots", "in_flight",
                       "flushing", "services", "problem", "memory"}
    assert set(st["roots"][0]) >= {"name", "path", "latest", "best", "counts", "queue",
                                   "disk_free_bytes", "last_error"}
    assert "preflight" in st["roots"][0]  # the capacity warning (retention)
    ls = json.loads(cli("ls", "r1", "--json", sock=s).stdout)
    assert set(ls["checkpoints"][0]) == {"step", "state", "local", "remote", "layout", "path",
                                         "bytes", "stored_bytes", "metrics", "reason", "pinned",
                                         "adopted"}
    r = cli("--socket", str(s), "latest", "r1", "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["step"] == 11
    r = cli("latest", "r1", "--tier", "remote", "--json", sock=s)
    assert r.returncode == 1 and json.loads(r.stdout)["step"] is None
    assert cli("register", "r1", "12", "--metric", "loss=1.5", sock=s).returncode == 0
    assert cli("pin", "r1", "11", sock=s).returncode == 0
    assert cli("unpin", "r1", "11", config=d.config).returncode == 0  # socket from config
    assert cli("pin", "r1", "999", sock=s).returncode == 1
    assert cli("register", "r1", "x", sock=s).returncode == 2
    assert cli("status", sock=s).returncode == 0
    assert "valid" in cli("ls", "r1", sock=s).stdout
    d.stop()
    r = cli("status", sock=s)
    assert r.returncode == 69 and "daemon" in r.stderr


def test_retention_prunes_with_nets_and_explains(inproc_daemon: Any) -> None:
    """Retention runs by itself after each stage: keep_last=2 and the best survive, a pin
    holds, everything else goes; the dry run explains each decision."""
    d = inproc_daemon(roots=[{"name": "r1", "metric": "val_loss",
                               "retention": {"local": {"keep_last": 2, "keep_best": 1,
                                                       "min_free": "0"}}}])
    root = d.roots["r1"]
    c = d.client
    losses = {1: 0.5, 2: 0.9, 3: 0.8, 4: 0.7, 5: 0.6}
    for step, loss in losses.items():
        save_single(root, step)
        c.register("r1", step, metrics={"val_loss": loss})
        d.wait_for("r1", step)
        if step == 2:
            assert c.pin("r1", 2)

    def pruned_3() -> dict[int, str] | None:
        states = {x["step"]: x["local"] for x in c.checkpoints("r1")}  # type: ignore[union-attr]
        return states if states.get(3) == "pruned" else None

    states = wait_until(pruned_3, 20, "step 3 pruned")
    assert states == {1: "present", 2: "present", 3: "pruned", 4: "present", 5: "present"}
    assert not (root / "model_step_3.pt").exists()
    for step in (1, 2, 4, 5):
        assert (root / f"model_step_{step}.pt").exists()
    plan = json.loads(cli("prune", "r1", "--dry-run", "--json", sock=d.socket).stdout)
    by_step = {i["step"]: i for i in plan["plan"]}
    assert by_step[1]["local"] == "keep" and "local:best" in by_step[1]["reasons"]
    assert by_step[2]["local"] == "keep" and "local:pinned" in by_step[2]["reasons"]
    assert by_step[5]["local"] == "keep" and "local:latest" in by_step[5]["reasons"]
    assert 3 not in by_step or by_step[3]["local"] == "none"
    assert "STEP" in cli("prune", "r1", "--dry-run", sock=d.socket).stdout
    assert c.unpin("r1", 2)
    run = json.loads(cli("prune", "r1", "--json", sock=d.socket).stdout)
    assert (2, "deleted") in {(o["step"], o["action"]) for o in run["outcomes"]}
    assert c.latest("r1")["step"] == 5  # type: ignore[index]
    with c.hold("r1", 4) as hold:
        assert hold.held and 4 in d.store.in_use("r1", 0.0)
    assert 4 not in d.store.in_use("r1", 0.0)
    with c.lease("r1", 4) as hold:  # the deprecated name of `hold`
        assert hold.held


def test_metrics_on_the_socket_parse(inproc_daemon: Any) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    d = inproc_daemon()
    save_single(d.roots["r1"], 3)
    d.wait_for("r1", 3)
    status, text = d.client.request("GET", "/metrics")
    assert status == 200
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    valid = [s for s in fams["ckptd_checkpoints"].samples
             if s.labels == {"root": "r1", "state": "valid"}]
    assert valid and valid[0].value == 1
    stage = fams["ckptd_stage_duration_seconds"]
    assert any(s.labels.get("stage") == "validate" for s in stage.samples)
    assert any(s.value > 0 for s in fams["ckptd_bytes_read"].samples)
    latest = [s for s in fams["ckptd_latest_step"].samples if s.labels == {"root": "r1"}]
    assert latest[0].value == 3
    master, slave = os.openpty()  # --watch redraws a terminal (and refuses anything else)
    watch = subprocess.Popen([sys.executable, "-m", "ckptd", "status", "--watch", "0.2",
                              "--socket", str(d.socket)], stdout=slave, text=True)
    os.close(slave)
    screen = ""

    def redraws() -> bool:
        nonlocal screen
        if select.select([master], [], [], 0.2)[0]:
            screen += os.read(master, 65536).decode(errors="replace")
        return screen.count("ROOT") >= 2

    try:
        wait_until(redraws, 30, "two redraws of status")
    finally:
        watch.send_signal(signal.SIGINT)
        watch.wait(10)
        os.close(master)
    assert screen.count("ROOT") >= 2 and watch.returncode == 130  # until interrupted


def test_hostile_metadata_never_stops_the_scanner(inproc_daemon: Any) -> None:
    """A meta.json nested deeply enough to blow the JSON parser's stack is bad metadata for
    that checkpoint only: the root (and every other root) keeps being scanned."""
    d = inproc_daemon(roots=[{"name": "r1"}, {"name": "r2"}])
    bad = d.roots["r1"] / "step-5"
    bad.mkdir()
    (bad / "meta.json").write_text("[" * 200_000 + "]" * 200_000)
    save_single(d.roots["r1"], 6)
    save_single(d.roots["r2"], 7)
    assert d.wait_for("r1", 6)["state"] == "valid"
    assert d.wait_for("r2", 7)["state"] == "valid"
    rec = d.wait_for("r1", 5)
    assert rec["state"] == "invalid" and rec["reason"] == "bad_metadata"
    assert not d.events("scan_failed")
