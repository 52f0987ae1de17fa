"""`ckptd.integrations` against the real frameworks (Lightning 2.6, transformers 5.23, DCP on
torch 2.13), a real daemon and a `file://` remote, each driven by the snippet of
docs/INTEGRATIONS.md that shows it (`scripts/integration_snippet.py` runs it as a user would):
saves registered with their metric, the end of training waiting for the upload, the
preemption flush on SIGTERM, and a fresh node (no daemon, an empty root) resuming from the
bucket exactly where the run left off."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from fw import clean_env, finish, result_json, run_ranks, start_ranks
from support.config import write_layout
from support.wait import wait_until

SNIPPET = "integration_snippet.py"


def daemon_env(d: Any, **extra: str) -> dict[str, str]:
    return {"CKPTD_SOCKET": str(d.socket), "CKPTD_CONFIG": str(d.config), **extra}


def fresh_node(d: Any, root: Path) -> None:
    """What a new node sees: no daemon answering, nothing in the root, only the bucket."""
    d.stop()
    shutil.rmtree(root)
    root.mkdir()


def lightning(root: Path, to: Path, max_steps: int, timeout: int = 60) -> list[str]:
    return ["lightning", json.dumps([
        ["/data/ckpt/pl-run", str(root)], ["every_n_train_steps=500", "every_n_train_steps=5"],
        ["max_steps=100_000", f"max_steps={max_steps}"], ["/scratch/resume", str(to)],
        ["timeout=300", f"timeout={timeout}"]])]


def hf(to: Path) -> list[str]:
    return ["hf", json.dumps([["/scratch/resume", str(to)], ["timeout=300", "timeout=60"]])]


def dcp(root: Path) -> list[str]:
    return ["dcp", json.dumps([["/data/ckpt/titan", str(root)], ["step % 500", "step % 3"]])]


def test_importing_the_integrations_imports_no_framework() -> None:
    probe = ("import sys, ckptd.integrations; print(sorted(m for m in ('lightning', "
             "'transformers', 'torch', 'ckptd.restore', 'ckptd.config') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          timeout=60, env=clean_env())
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_lightning_callback_registers_waits_for_the_upload_and_resumes_from_the_bucket(
        inproc_daemon: Any, tmp_path: Path) -> None:
    d = inproc_daemon(roots=[{"name": "pl-run", "path": tmp_path / "run",
                              "upload": {"url": f"file://{tmp_path / 'remote'}"}}])
    root, name = d.roots["pl-run"], "epoch=0-step=10.ckpt"
    first = result_json(run_ranks(SNIPPET, lightning(root, tmp_path / "r0", 10),
                                  **daemon_env(d))[0])
    assert first["resumed_from"] is None and first["registered"] == [5, 10], first
    rec = d.client.checkpoint("pl-run", 10)  # asked at once: on_train_end waited for it
    assert rec is not None and rec["remote"] == "uploaded", rec
    assert rec["path"] == name and set(rec["metrics"]) == {"train_loss"}, rec
    kept = tmp_path / "kept"
    kept.mkdir()
    shutil.copy2(root / name, kept / name)

    fresh_node(d, root)
    to = tmp_path / "resume"
    resumed = result_json(run_ranks(SNIPPET, lightning(root, to, 15), **daemon_env(d))[0])
    assert resumed["resumed_from"] == str(to / name), resumed
    assert resumed["global_step"] == 15 and resumed["steps_run"] == 5, resumed
    original = result_json(run_ranks("lightning_train.py", [str(tmp_path / "c"), "15",
                                                            "--resume", str(kept / name)])[0])
    assert resumed["digest"] == original["digest"]


def test_lightning_callback_flushes_the_newest_save_when_lightning_stops_on_sigterm(
        inproc_daemon: Any, tmp_path: Path) -> None:
    d = inproc_daemon(roots=[{"name": "pl-run", "path": tmp_path / "run",
                              "upload": {"url": f"file://{tmp_path / 'remote'}"}}])
    root = d.roots["pl-run"]
    procs = start_ranks(SNIPPET, lightning(root, tmp_path / "r0", 100_000),
                        **daemon_env(d, CKPTD_TEST_STEP_SLEEP="0.05"))
    wait_until(lambda: (root / "epoch=0-step=10.ckpt").exists(), 180, "two saves")
    procs[0].send_signal(signal.SIGTERM)
    out = result_json(finish(procs)[0])
    assert out["stopped"] and out["flushed"] is True, out
    assert out["global_step"] < 100_000 and max(out["registered"]) >= 10, out
    rec = d.client.checkpoint("pl-run", max(out["registered"]))  # uploaded before the exit
    assert rec is not None and rec["remote"] == "uploaded", rec
    assert d.events("flush_requested")


def test_hf_callback_saves_and_flushes_on_sigterm_and_a_fresh_node_resumes_from_the_bucket(
        inproc_daemon: Any, tmp_path: Path) -> None:
    d = inproc_daemon(roots=[{"name": "hf-run", "path": tmp_path / "run",
                              "upload": {"url": f"file://{tmp_path / 'remote'}"}}])
    root = d.roots["hf-run"]
    env = daemon_env(d, CKPTD_TEST_OUT=str(root), CKPTD_TEST_STEP_SLEEP="0.05")
    procs = start_ranks(SNIPPET, hf(tmp_path / "r0"), CKPTD_TEST_MAX_STEPS="100000", **env)
    wait_until(lambda: (root / "checkpoint-5" / "trainer_state.json").exists(), 180, "a save")
    procs[0].send_signal(signal.SIGTERM)
    text = finish(procs)[0]
    out = result_json(text)
    n = out["global_step"]
    assert 5 < n < 100_000 and out["registered"][-1] == n and out["flushed"] is True, text
    assert (root / f"checkpoint-{n}" / "trainer_state.json").exists()  # saved on the signal
    rec = d.client.checkpoint("hf-run", n)  # uploaded before the exit
    assert rec is not None and rec["remote"] == "uploaded", rec
    five = d.client.checkpoint("hf-run", 5)
    assert five is not None and "loss" in five["metrics"], five
    assert d.events("flush_requested")

    fresh_node(d, root)
    to = tmp_path / "resume"
    env["CKPTD_TEST_STEP_SLEEP"] = "0"
    resumed = result_json(run_ranks(SNIPPET, hf(to), CKPTD_TEST_MAX_STEPS=str(n + 3),
                                    **env)[0])
    assert (to / f"checkpoint-{n}" / "trainer_state.json").is_file()
    assert resumed["global_step"] == n + 3 and resumed["steps_run"] == 3, resumed


def test_a_torchtitan_style_loop_resumes_from_the_bucket_through_the_storage_reader(
        inproc_daemon: Any, tmp_path: Path, short_dir: Path) -> None:
    d = inproc_daemon(roots=[{"name": "titan", "path": tmp_path / "run",
                              "upload": {"url": f"file://{tmp_path / 'remote'}"}}])
    root = d.roots["titan"]
    first = result_json(run_ranks(SNIPPET, dcp(root), CKPTD_TEST_MAX_STEPS="6",
                                  **daemon_env(d))[0], prefix='{"global_step"')
    assert first["first_step"] == 1 and first["global_step"] == 6, first  # nothing to resume
    assert d.wait_for("titan", 6, "valid", timeout=60)["layout"] == "dcp"
    assert d.client.wait("titan", 6, until="uploaded", timeout=60)

    fresh_node(d, root)
    resumed = result_json(run_ranks(SNIPPET, dcp(root), CKPTD_TEST_MAX_STEPS="9",
                                    **daemon_env(d))[0])
    assert resumed["first_step"] == 7 and resumed["global_step"] == 9, resumed
    # read from the bucket, nothing staged: the root holds only the save made after
    assert sorted(p.name for p in root.iterdir() if p.name != ".ckptd") == ["step-9"]

    # The same 9 steps without a stop, beside an empty bucket and no daemon: the same weights.
    alone = write_layout(tmp_path / "alone", short_dir / "none.sock", roots=[
        {"name": "titan", "upload": {"url": f"file://{tmp_path / 'empty'}"}}])
    whole = result_json(run_ranks(SNIPPET, dcp(alone.roots["titan"]),
                                  CKPTD_TEST_MAX_STEPS="9", CKPTD_SOCKET=str(alone.socket),
                                  CKPTD_CONFIG=str(alone.config))[0])
    assert whole["first_step"] == 1 and whole["digest"] == resumed["digest"], whole
