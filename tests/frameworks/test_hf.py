"""Hugging Face Trainer (transformers 5.23) writes the checkpoints: `checkpoint-<N>/` with
save_total_limit, trainer_state.json written last. A save killed mid-write is never valid; a
whole one is valid, uploaded, restored byte for byte, and the Trainer resumes from the
restored copy exactly as from the original."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fw import files_of, kill_when, restore, result_json, run_ranks, same_files, start_ranks
from support.config import SETTLE_S
from support.wait import wait_scans, wait_until

from ckptd.client import Client


def test_trainer_checkpoints_are_valid_uploaded_and_resumable_from_a_restore(
        inproc_daemon: Any, tmp_path: Path) -> None:
    remote = tmp_path / "remote"
    d = inproc_daemon(roots=[{"name": "hf", "path": tmp_path / "run",
                              "upload": {"url": f"file://{remote}"}}])
    root = d.roots["hf"]
    run_ranks("hf_train.py", [str(root), "15"])
    d.wait_for("hf", 15, "valid", timeout=90)
    assert d.client.wait("hf", 15, until="uploaded", timeout=90)
    assert not (root / "checkpoint-5").exists()  # save_total_limit=2: the Trainer deleted it
    assert (d.client.latest("hf") or {})["step"] == 15

    restored = tmp_path / "restored"
    restore(d.config, "hf", 15, restored)
    same_files(root, restored, files_of(d, "hf", 15))
    from_original = result_json(run_ranks("hf_train.py", [str(tmp_path / "a"), "20", "--resume",
                                                      str(root / "checkpoint-15")])[0])
    from_restore = result_json(run_ranks("hf_train.py", [str(tmp_path / "b"), "20", "--resume",
                                                     str(restored / "checkpoint-15")])[0])
    assert from_restore == from_original and from_restore["global_step"] == 20


def test_a_trainer_save_killed_mid_write_is_never_valid(inproc_daemon: Any,
                                                        tmp_path: Path) -> None:
    d = inproc_daemon(roots=[{"name": "hf", "path": tmp_path / "run"}])
    root = d.roots["hf"]
    procs = start_ranks("hf_train.py", [str(root), "5"], CKPTD_TEST_SLOW_SAVE="1")
    # The model is written, the optimizer is being written, trainer_state.json is not yet.
    kill_when(procs, lambda: (root / "checkpoint-5" / "model.safetensors").exists(),
              timeout=180)
    assert not (root / "checkpoint-5" / "trainer_state.json").exists()
    d.wake_scan()
    c = Client(d.socket)
    rec = wait_until(lambda: c.checkpoint("hf", 5), 30, "the killed save seen")
    wait_scans(c, settle=SETTLE_S)  # scans past the root's settle time: it stays incomplete
    rec = c.checkpoint("hf", 5)
    assert rec is not None and rec["state"] == "pending", rec
    assert c.latest("hf") is None
