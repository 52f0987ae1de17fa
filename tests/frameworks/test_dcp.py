"""torch.distributed.checkpoint writes the checkpoints, 2 ranks over gloo: dcp.save,
dcp.async_save (thread and process) and a model sharded with FSDP2 (fully_shard). Each whole
save is valid, uploaded, restored byte for byte, and DCP loads the restored copy into equal
tensors; a save killed before its `.metadata` is never valid."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from fw import files_of, kill_when, restore, run_ranks, same_files, start_ranks

from ckptd.client import Client


@pytest.mark.parametrize("mode", ["sync", "async-thread", "async-process", "fsdp2"])
def test_a_dcp_save_is_valid_uploaded_restored_and_loads(inproc_daemon: Any, tmp_path: Path,
                                                         mode: str) -> None:
    remote = tmp_path / "remote"
    d = inproc_daemon(roots=[{"name": "dcp", "path": tmp_path / "run",
                              "upload": {"url": f"file://{remote}"}}])
    root = d.roots["dcp"]
    run_ranks("dcp_train.py", [mode, str(root / "step-3"), "3"], world=2)
    rec = d.wait_for("dcp", 3, "valid", timeout=60)
    assert rec["layout"] == "dcp"
    assert d.client.wait("dcp", 3, until="uploaded", timeout=60)
    restored = tmp_path / "restored"
    restore(d.config, "dcp", 3, restored)
    same_files(root, restored, files_of(d, "dcp", 3))
    out = run_ranks("dcp_train.py", [mode, str(restored / "step-3"), "3", "--load"], world=2)
    (line,) = [ln for ln in out[0].splitlines() if ln.startswith("{")]
    assert json.loads(line) == {"same": True, "step": 3}


def test_a_dcp_save_killed_before_its_metadata_is_never_valid(inproc_daemon: Any,
                                                              tmp_path: Path) -> None:
    d = inproc_daemon(roots=[{"name": "dcp", "path": tmp_path / "run"}])
    root = d.roots["dcp"]
    run_ranks("dcp_train.py", ["sync", str(root / "step-1"), "1"], world=2)
    d.wait_for("dcp", 1, "valid", timeout=60)
    step2 = root / "step-2"
    procs = start_ranks("dcp_train.py", ["sync", str(step2), "2", "--big"], world=2)
    kill_when(procs, lambda: any(step2.glob("__*.distcp")))
    assert not (step2 / ".metadata").exists()
    d.wake_scan()
    c = Client(d.socket)
    assert (c.latest("dcp") or {}).get("step") == 1
    rec = c.checkpoint("dcp", 2)
    assert rec is None or rec["state"] == "pending"


def test_a_dcp_save_copied_in_with_cp_r_becomes_valid(inproc_daemon: Any,
                                                      tmp_path: Path) -> None:
    """`cp -r` of a finished save into a watched root gives every file a new mtime in copy
    order (`.metadata` copied first, so older than its shards): a copy, not a re-save."""
    d = inproc_daemon(roots=[{"name": "dcp", "path": tmp_path / "run"}])
    src = tmp_path / "elsewhere" / "step-4"
    run_ranks("dcp_train.py", ["sync", str(src), "4", "--big"], world=2)
    dst = d.roots["dcp"] / "step-4"
    dst.mkdir()
    for name in sorted(p.name for p in src.iterdir()):  # as `cp -r` meets them: .metadata first
        subprocess.run(["cp", str(src / name), str(dst / name)], check=True)
        time.sleep(0.01)
    assert (dst / ".metadata").stat().st_mtime_ns < max(
        p.stat().st_mtime_ns for p in dst.glob("__*.distcp"))
    rec = d.wait_for("dcp", 4, "valid", timeout=60)
    assert rec["layout"] == "dcp"
