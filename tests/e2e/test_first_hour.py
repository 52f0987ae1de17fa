"""What a new user meets first: the config is found the way the daemon finds its own, so a
resume on a fresh node needs no undocumented variable, and every command says which it used."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support import Harness, wait_scans, wait_until
from support.config import render_config
from writers import save_torch

from ckptd.cli.render import render_status


def test_restore_on_a_fresh_node_finds_ckptd_toml_in_the_working_dir(tmp_path: Path,
                                                                     short_dir: Path) -> None:
    h = Harness(tmp_path / "node1", short_dir, uploads=True)
    save_torch(h.root / "model_step_9.pt")
    h.daemon.start()
    try:
        assert h.client.wait("r", 9, until="uploaded", timeout=60)
    finally:
        h.daemon.stop(grace=5)
    fresh = tmp_path / "node2"
    fresh.mkdir()
    (fresh / "ckptd.toml").write_text(h.config_path.read_text())
    env = {k: v for k, v in os.environ.items() if k != "CKPTD_CONFIG"}
    done = subprocess.run([sys.executable, "-m", "ckptd", "restore", "r", "latest", "--to",
                           str(fresh / "resume")], cwd=fresh, env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert f"config {fresh / 'ckptd.toml'}" in done.stderr
    assert (fresh / "resume" / "model_step_9.pt").read_bytes() == (
        h.root / "model_step_9.pt").read_bytes()


def test_ls_into_a_closed_pipe_is_quiet(tmp_path: Path, short_dir: Path) -> None:
    """`ckptd ls r | head`: the reader is gone before ckptd writes; no traceback."""
    h = Harness(tmp_path, short_dir)
    save_torch(h.root / "model_step_1.pt")
    h.daemon.start()
    try:
        for _ in range(3):
            proc = subprocess.Popen([sys.executable, "-m", "ckptd", "ls", "r", "--socket",
                                     str(h.daemon.config.daemon.socket)],
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            assert proc.stdout is not None and proc.stderr is not None
            proc.stdout.close()  # the reader leaves at once
            err = proc.stderr.read().decode()
            assert proc.wait(60) == 0, err
            assert "Traceback" not in err and "BrokenPipe" not in err
    finally:
        h.daemon.stop(grace=5)


def test_run_honours_socket_on_its_command_line(tmp_path: Path, short_dir: Path) -> None:
    import signal

    from support.config import render_config

    from ckptd.client import Client

    cfg = tmp_path / "c.toml"
    cfg.write_text(render_config({"state_dir": str(tmp_path / "s"),
                                  "socket": str(short_dir / "from-config.sock")},
                                 [{"name": "r", "path": str(tmp_path / "ckpt")}]))
    sock = short_dir / "from-cli.sock"
    proc = subprocess.Popen([sys.executable, "-m", "ckptd", "run", "--config", str(cfg),
                             "--socket", str(sock)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    try:
        wait_until(lambda: Client(sock, timeout=2).health(), timeout=60, what="the daemon")
        assert not (short_dir / "from-config.sock").exists()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)


def test_last_error_has_a_time_and_clears_when_the_cause_is_gone(tmp_path: Path,
                                                                 short_dir: Path) -> None:
    h = Harness(tmp_path, short_dir, upload={"url": "file:///proc/ckptd-not-writable"})
    save_torch(h.root / "model_step_4.pt")
    h.daemon.start()
    try:
        root = wait_until(lambda: next((r for r in h.client.status()["roots"]  # type: ignore[index]
                                        if (r["last_error"] or "").startswith("upload")), None),
                          timeout=30, what="the upload error")
        assert root["last_error_at"] and root["last_error_at"].endswith("+00:00")
        h.root_cfg["upload"] = {"url": f"file://{tmp_path / 'remote'}"}
        h.write_config()
        assert h.daemon.reload()
        assert h.client.wait("r", 4, until="uploaded", timeout=30)
        wait_until(lambda: h.client.status()["roots"][0]["last_error"] is None,  # type: ignore[index]
                   what="the error cleared")
    finally:
        h.daemon.stop(grace=5)


def test_a_pin_on_a_step_with_no_copy_left_is_refused(tmp_path: Path, short_dir: Path) -> None:
    h = Harness(tmp_path, short_dir)
    save_torch(h.root / "model_step_1.pt")
    h.daemon.start()
    try:
        assert h.client.wait("r", 1, until="valid", timeout=30)
        (h.root / "model_step_1.pt").unlink()
        h.daemon.scanner.scan_all()
        status, doc = h.client.request("PUT", "/v1/roots/r/checkpoints/1/pin")
        assert status == 409 and doc["error"] == "gone", doc
    finally:
        h.daemon.stop(grace=5)


def test_a_failed_restore_leaves_no_partial_files(tmp_path: Path, short_dir: Path) -> None:
    """The second object of a step is damaged in the remote: the restore fails on it, and the
    target holds nothing of the step (not even the first file, restored fine)."""
    h = Harness(tmp_path / "node", short_dir, uploads=True)
    d = h.root / "checkpoint-5"
    d.mkdir(parents=True)
    save_torch(d / "pytorch_model.bin")
    save_torch(d / "optimizer.pt")
    (d / "trainer_state.json").write_text('{"global_step": 5}')
    h.daemon.start()
    try:
        assert h.client.wait("r", 5, until="uploaded", timeout=60)
    finally:
        h.daemon.stop(grace=5)
    objects = sorted(p for p in (tmp_path / "node" / "remote").rglob("*")
                     if p.is_file() and "MANIFEST" not in p.name and p.parent.name != "r")
    victim = [p for p in objects if "trainer_state" in p.name or "pytorch_model" in p.name][-1]
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    for target in (tmp_path / "new-dir", tmp_path / "existing"):
        if target.name == "existing":
            target.mkdir()
            (target / "keep.txt").write_text("mine")
        done = subprocess.run([sys.executable, "-m", "ckptd", "restore", "r", "5", "--to",
                               str(target), "--config", str(h.config_path)],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode != 0, done.stdout
        if target.name == "new-dir":
            assert not target.exists()
        else:
            assert sorted(p.name for p in target.rglob("*")) == ["keep.txt"]


def test_a_failed_save_leaves_no_tmp_dir(tmp_path: Path) -> None:
    import pytest
    import torch

    import ckptd.torch as ct

    class Broken(torch.optim.SGD):
        def state_dict(self) -> dict[str, object]:
            raise RuntimeError("state_dict failed midway")

    model = torch.nn.Linear(4, 4)
    with pytest.raises(RuntimeError, match="midway"):
        ct.save(tmp_path, 3, model=model, optimizer=Broken(model.parameters(), lr=0.1),
                register=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    ct.save(tmp_path, 3, model=model, register=False)  # and the next save goes through
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-3"]


def test_a_save_that_can_never_complete_becomes_invalid_after_its_deadline(
        tmp_path: Path, short_dir: Path) -> None:
    """A registered file that never appears: after pending_timeout it is invalid
    (missing_file), visible in ls, instead of pending forever."""
    h = Harness(tmp_path, short_dir, pending_timeout="1s")
    h.daemon.start()
    try:
        assert h.client.register("r", 12, paths=["never_written_step_12.pt"])
        rec = wait_until(lambda: (c := h.daemon.store.checkpoint("r", 12)) is not None
                         and c.state.value == "invalid" and c, timeout=30,
                         what="step 12 given up")
        assert rec.reason == "missing_file" and "never_written_step_12.pt" in rec.message
        status, doc = h.client.request("GET", "/v1/roots/r/checkpoints/12")
        assert doc["state"] == "invalid" and doc["reason"] == "missing_file"
    finally:
        h.daemon.stop(grace=5)


def test_a_new_save_of_a_gone_step_with_fewer_files_is_a_new_save(tmp_path: Path,
                                                                   short_dir: Path) -> None:
    """Step 5 (an HF dir of three files) is deleted; a new save of step 5 with two files is
    picked up and validated. Untouched leftovers of a half-done delete are not (below)."""
    import shutil
    import time

    h = Harness(tmp_path, short_dir, settle="200ms")
    d = h.root / "checkpoint-5"
    d.mkdir()
    save_torch(d / "pytorch_model.bin")
    save_torch(d / "optimizer.pt")
    (d / "trainer_state.json").write_text('{"global_step": 5}')
    h.daemon.start()
    try:
        assert h.client.wait("r", 5, until="valid", timeout=30)
        first = h.daemon.store.checkpoint("r", 5)
        assert first is not None
        # a half-done delete: the optimizer goes; the rest (untouched) must not be a new save
        (d / "optimizer.pt").unlink()
        wait_until(lambda: h.daemon.store.checkpoint("r", 5).local.value == "pruned",
                   what="step 5 gone")
        wait_scans(h.client, settle=0.5, wake=h.daemon.scanner.wake)  # past the 200ms settle
        assert h.daemon.store.checkpoint("r", 5).id == first.id  # leftovers: not a save
        # the user deletes the rest and saves step 5 anew, with two files
        shutil.rmtree(d)
        d.mkdir()
        time.sleep(0.05)  # file mtimes are coarse: the new save's fall after the delete seen
        save_torch(d / "pytorch_model.bin")
        (d / "trainer_state.json").write_text('{"global_step": 5}')
        rec = wait_until(lambda: (c := h.daemon.store.checkpoint("r", 5)) is not None
                         and c.id != first.id and c.state.value == "valid" and c, timeout=30,
                         what="the new save of step 5 valid")
        assert rec.local.value == "present"
    finally:
        h.daemon.stop(grace=5)


def test_names_that_look_like_checkpoints_but_match_no_pattern_are_listed(
        tmp_path: Path, short_dir: Path) -> None:
    """`ckpt-200.pt` and `final.pt` are listed as unrecognised (and never touched);
    `epoch_3.pt` is step 3 by the documented `_N.` rule; a checkpoint dir's own files are not
    listed."""
    h = Harness(tmp_path, short_dir)
    h.daemon.start()
    try:
        for name in ("ckpt-200.pt", "final.pt", "epoch_3.pt"):
            save_torch(h.root / name)
        (h.root / "checkpoint-5").mkdir()
        save_torch(h.root / "checkpoint-5" / "pytorch_model.bin")
        (h.root / "checkpoint-5" / "trainer_state.json").write_text('{"global_step": 5}')
        assert h.client.wait("r", 3, until="valid", timeout=30)
        doc = h.client.status()
        assert doc is not None
        (root,) = doc["roots"]
        assert root["unrecognised"] == ["ckpt-200.pt", "final.pt"]
        assert "unrecognised" in render_status(doc) and "ckpt-200.pt" in render_status(doc)
        assert (h.root / "ckpt-200.pt").exists() and (h.root / "final.pt").exists()
    finally:
        h.daemon.stop(grace=5)


@pytest.mark.parametrize("which", ["state_dir", "socket"])
def test_an_unusable_state_or_socket_dir_is_one_line_and_exit_78(tmp_path: Path,
                                                                 short_dir: Path,
                                                                 which: str) -> None:
    """systemd does not restart on 78: the operator reads one line naming the key and fixes
    it. No root is touched (no lease taken) before the daemon knows it can start."""
    blocker = short_dir / "a-file"
    blocker.write_text("x")
    root = tmp_path / "ckpt"
    root.mkdir()
    keys = {"state_dir": str(tmp_path / "state"), "socket": str(short_dir / "s.sock")}
    keys[which] = str(blocker / ("state" if which == "state_dir" else "s.sock"))
    cfg = tmp_path / "c.toml"
    cfg.write_text(render_config(keys, [{"name": "r", "path": str(root)}]))
    done = subprocess.run([sys.executable, "-m", "ckptd", "run", "--config", str(cfg)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 78, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and f"daemon.{which}" in lines[0] and "Traceback" not in lines[0]
    assert not (root / ".ckptd").exists()


def _wait_cli(sock: Path, *args: str) -> tuple[int, str, float]:
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "ckptd", "wait", *args, "--socket", str(sock)],
                          capture_output=True, text=True, timeout=120)
    assert "Traceback" not in done.stderr, done.stderr
    return done.returncode, done.stdout + done.stderr, time.monotonic() - started


def test_wait_answers_at_once_for_a_root_that_does_not_exist_and_for_timeout_0(
        tmp_path: Path, short_dir: Path) -> None:
    """`ckptd wait` on a misspelt root says so at once instead of waiting out --timeout;
    `--timeout 0` asks once ("is it valid now?"); with no daemon it says none answered."""
    h = Harness(tmp_path, short_dir)
    sock = h.daemon.config.daemon.socket
    rc, out, _ = _wait_cli(sock, "r", "1", "--timeout", "0")
    assert rc == 69 and "did not answer" in out, out  # nothing there: not "not valid after 0s"
    save_torch(h.root / "model_step_1.pt")
    h.daemon.start()
    try:
        assert h.client.wait("r", 1, until="valid", timeout=30)
        rc, out, took = _wait_cli(sock, "no-such-root", "1", "--timeout", "60")
        assert rc == 1 and "no-such-root" in out and took < 20, (rc, out, took)
        rc, out, _ = _wait_cli(sock, "r", "1", "--timeout", "0")
        assert rc == 0 and "r step 1 valid" in out, out
        assert h.client.wait("r", 1, timeout=float("nan")) and h.client.wait("r", 1, timeout=-5)
        rc, out, _ = _wait_cli(sock, "r", "2", "--timeout", "0")
        assert rc == 1 and "not valid after 0s" in out, out
        for bad in ("-1", "nan", "inf", "1e20"):
            rc, out, _ = _wait_cli(sock, "r", "1", "--timeout", bad)
            assert rc == 2 and "--timeout must be" in out, (bad, out)
    finally:
        h.daemon.stop(grace=5)
