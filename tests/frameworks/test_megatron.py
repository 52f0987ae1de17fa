"""Megatron: megatron-core 0.16.1 `dist_checkpointing` (torch_dist) saves a tiny GPT with tensor
parallelism 2 on two gloo ranks, into `iter_<N:07d>/` dirs with Megatron-LM's tracker
(scripts/megatron_train.py). What ckptd makes of it: valid, uploaded, restored byte for byte
with a tracker naming the restored iteration, and resumed from by megatron-core's own loader;
a save killed before its commit, or whose tracker does not name it yet, is never valid."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import fw
import pytest
from support.config import SETTLE_S
from support.wait import wait_scans

from ckptd.formats import dcpmeta, picklescan

if importlib.util.find_spec("megatron.core") is None:
    pytest.skip("megatron-core is not installed", allow_module_level=True)

SCRIPT = "megatron_train.py"
TRACKER = "latest_checkpointed_iteration.txt"
# Megatron-LM pickles its `args` (an argparse.Namespace) into common.pt (docs/INTEGRATIONS.md).
TRUST = ["argparse.Namespace"]
# What megatron-core 0.16.1 on torch 2.13 puts in `.metadata` beyond plain DCP: every rank's
# save plan (`Metadata.all_local_plans`).
PLAN_GLOBALS = {f"torch.distributed.checkpoint.planner.{n}"
                for n in ("SavePlan", "WriteItem", "WriteItemType", "TensorWriteData")}


def iter_dir(iteration: int) -> str:
    return f"iter_{iteration:07d}"


def save(save_dir: Path, *iterations: int, tracker: bool = True) -> list[str]:
    """A 2-rank TP=2 save of each iteration in turn, as Megatron-LM's training loop does."""
    args = ["save", str(save_dir), *map(str, iterations)] + ([] if tracker else ["--no-tracker"])
    outs = fw.run_ranks(SCRIPT, args, world=2)
    assert all(f"SAVED {iterations[-1]}" in o for o in outs), outs
    return outs


def megatron_root(tmp_path: Path, remote: bool = True) -> dict[str, Any]:
    root: dict[str, Any] = {"name": "gpt", "path": str(tmp_path / "gpt"),
                            "trusted_globals": TRUST}
    if remote:
        root["upload"] = {"url": f"file://{tmp_path / 'remote'}"}
    return root


def verify(path: Path) -> tuple[int, dict[str, Any]]:
    done = subprocess.run([sys.executable, "-m", "ckptd", "verify", str(path), "--json",
                           *[a for t in TRUST for a in ("--trust", t)]],
                          capture_output=True, text=True, timeout=120, env=fw.clean_env())
    assert done.stdout, done.stderr
    return done.returncode, json.loads(done.stdout)


def assert_not_valid(d: Any, step: int, latest: int | None) -> None:
    rec = d.client.checkpoint("gpt", step)
    assert rec is None or rec["state"] in ("pending", "invalid"), rec
    got = d.client.latest("gpt")
    assert (got["step"] if got else None) == latest, got


def test_tp2_save_is_valid_uploaded_restored_and_resumed(inproc_daemon: Any,
                                                         tmp_path: Path) -> None:
    d = inproc_daemon(roots=[megatron_root(tmp_path)])
    root = d.roots["gpt"]
    save(root, 10, 20)
    assert (root / TRACKER).read_text() == "20"
    for step in (10, 20):
        rec = d.wait_for("gpt", step, timeout=60)
        assert (rec["state"], rec["layout"], rec["path"]) == ("valid", "megatron",
                                                             iter_dir(step)), rec
    assert d.client.latest("gpt")["step"] == 20  # type: ignore[index]

    # The real `.metadata`: DCP's own records plus megatron-core's save plans, all allowed.
    meta = (root / iter_dir(10) / ".metadata").read_bytes()
    found = picklescan.scan_pickle(meta, ".metadata", dcpmeta._SCAN_ALLOWED)
    assert {g for g in found if ".planner." in g} == PLAN_GLOBALS
    parsed = dcpmeta.parse_dcp_metadata(meta)
    assert sorted(parsed.references) == ["__0_0.distcp", "__0_1.distcp", "__1_0.distcp",
                                         "__1_1.distcp"]

    files = fw.files_of(d, "gpt", 10)
    assert sorted(Path(f).name for f in files) == [
        ".metadata", "__0_0.distcp", "__0_1.distcp", "__1_0.distcp", "__1_1.distcp",
        "common.pt", "metadata.json"]
    assert TRACKER not in files  # shared by every iteration: no member of one
    assert d.client.wait("gpt", 10, until="uploaded", timeout=120), d.log_text()[-3000:]

    # A fresh node: restore iteration 10 (the tracker on disk names 20) and resume from it.
    out = tmp_path / "resume"
    out.mkdir()
    fw.restore(d.config, "gpt", 10, out)
    fw.same_files(root, out, files)
    assert (out / TRACKER).read_bytes() == b"10"  # as Megatron-LM writes it
    restored = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    assert restored == sorted([*files, TRACKER])
    outs = fw.run_ranks(SCRIPT, ["load", str(out)], world=2)
    assert all("LOADED 10 " in o for o in outs), outs
    code, doc = verify(out / iter_dir(10))
    assert (code, doc["valid"], doc["layout"], doc["step"]) == (0, True, "megatron", 10), doc


def test_killed_mid_save_is_never_valid(inproc_daemon: Any, tmp_path: Path) -> None:
    d = inproc_daemon(roots=[megatron_root(tmp_path, remote=False)])
    root = d.roots["gpt"]
    save(root, 10)
    assert d.wait_for("gpt", 10, timeout=60)["state"] == "valid"

    # Iteration 20: every rank stalls before the commit; both die once a data file is there.
    killed = root / iter_dir(20)
    procs = fw.start_ranks(SCRIPT, ["save", str(root), "20", "--hold-commit", "120"], world=2)
    fw.kill_tree_when(procs, lambda: any(killed.glob("*.distcp")))
    assert [p.returncode for p in procs] == [-9, -9]
    assert not (killed / ".metadata").exists() and not (killed / "metadata.json").exists()
    assert (root / TRACKER).read_text() == "10"
    wait_scans(d.client, settle=SETTLE_S)
    assert_not_valid(d, 20, latest=10)
    code, doc = verify(killed)
    assert code == 1 and doc["valid"] is False, doc

    # The job resumes and saves iteration 30: the tracker now names a later iteration, and
    # the killed one is still not whole.
    save(root, 30)
    assert d.wait_for("gpt", 30, timeout=60)["state"] == "valid"
    assert d.client.latest("gpt")["step"] == 30  # type: ignore[index]
    wait_scans(d.client, settle=SETTLE_S)
    assert_not_valid(d, 20, latest=30)
    code, doc = verify(killed)
    assert code == 1 and ".metadata" in doc["message"], doc


def test_the_tracker_decides(inproc_daemon: Any, tmp_path: Path) -> None:
    """Saves whose tracker was never written (the job died after the save, before rank 0
    wrote it) wait; each becomes valid once the tracker names it or a later iteration."""
    d = inproc_daemon(roots=[megatron_root(tmp_path, remote=False)])
    root = d.roots["gpt"]
    save(root, 10, 20, tracker=False)
    assert not (root / TRACKER).exists()
    wait_scans(d.client, settle=SETTLE_S)
    for step in (10, 20):
        assert_not_valid(d, step, latest=None)
    code, doc = verify(root / iter_dir(10))
    assert code == 1 and f"{TRACKER} naming 10" in doc["message"], doc

    (root / TRACKER).write_text("10")  # rank 0's write, as Megatron-LM makes it
    assert d.wait_for("gpt", 10, timeout=60)["state"] == "valid"
    wait_scans(d.client, settle=SETTLE_S)
    assert_not_valid(d, 20, latest=10)  # the tracker names an older iteration
    code, doc = verify(root / iter_dir(20))
    assert code == 1 and "names '10'" in doc["message"], doc

    (root / TRACKER).write_text("20")
    assert d.wait_for("gpt", 20, timeout=60)["state"] == "valid"
    assert d.client.latest("gpt")["step"] == 20  # type: ignore[index]
