"""Lightning 2.6.6 writes the checkpoints: ModelCheckpoint every 5 steps, `save_last="link"`
(`last.ckpt` a symlink to the newest). Whole saves are valid, uploaded, restored byte for byte,
and Lightning resumes from the restored file exactly as from the original; the symlink is never
followed, nor taken for a checkpoint; a run killed mid-save leaves nothing ckptd calls valid."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fw import files_of, kill_when, restore, result_json, run_ranks, same_files, start_ranks

from ckptd.client import Client


def test_model_checkpoint_saves_are_valid_uploaded_and_resumable_from_a_restore(
        inproc_daemon: Any, tmp_path: Path) -> None:
    remote = tmp_path / "remote"
    d = inproc_daemon(roots=[{"name": "pl", "path": tmp_path / "run",
                              "upload": {"url": f"file://{remote}"}}])
    root = d.roots["pl"]
    run_ranks("lightning_train.py", [str(root), "15"])
    assert (root / "last.ckpt").is_symlink()
    d.wait_for("pl", 15, "valid", timeout=60)
    assert d.client.wait("pl", 15, until="uploaded", timeout=60)
    rec = d.client.checkpoint("pl", 15)
    assert rec is not None and rec["path"] == "epoch=0-step=15.ckpt"
    status = Client(d.socket).status()
    assert status is not None and status["roots"][0]["unrecognised"] == []

    restored = tmp_path / "restored"
    restore(d.config, "pl", 15, restored)
    same_files(root, restored, files_of(d, "pl", 15))
    name = "epoch=0-step=15.ckpt"
    from_original = result_json(run_ranks("lightning_train.py", [
        str(tmp_path / "a"), "25", "--resume", str(root / name)])[0])
    from_restore = result_json(run_ranks("lightning_train.py", [
        str(tmp_path / "b"), "25", "--resume", str(restored / name)])[0])
    assert from_restore == from_original and from_restore["global_step"] == 25


def test_a_lightning_run_killed_mid_save_leaves_nothing_valid(inproc_daemon: Any,
                                                              tmp_path: Path) -> None:
    """Lightning serialises into memory and moves the file into place (fsspec transaction):
    killed mid-save, no file of that step exists, and nothing is called valid."""
    d = inproc_daemon(roots=[{"name": "pl", "path": tmp_path / "run"}])
    root = d.roots["pl"]
    mark = tmp_path / "saving"
    procs = start_ranks("lightning_train.py", [str(root), "5"], CKPTD_TEST_SLOW_SAVE="1",
                        CKPTD_TEST_MARK=str(mark))
    kill_when(procs, mark.exists, timeout=180)
    d.wake_scan()
    assert sorted(p.name for p in root.iterdir() if not p.name.startswith(".")) == []
    assert Client(d.socket).latest("pl") is None
