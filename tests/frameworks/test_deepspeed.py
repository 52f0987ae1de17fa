"""DeepSpeed 0.19.8 checkpoints written by the library itself (ZeRO-2, two gloo ranks on CPU, a
tiny model: scripts/deepspeed_train.py), watched by a daemon in the test process.

A whole save is valid with the default config (DeepSpeed's optimizer states pickle a few of
its own plain-data classes), uploaded, restored byte for byte with a `latest` naming the
restored tag, and a fresh engine's `load_checkpoint(DIR)` resumes from it at the saved step.
A save missing one rank's optimizer shard, a save killed half-way, and a rank whose shard lands
after `latest` are never called valid (the last one: not even complete until it lands). bf16 and
fp16 saves verify with the default config too."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import fw
import pytest
from support.config import SETTLE_S
from support.wait import wait_scans

pytest.importorskip("deepspeed")
import torch  # noqa: E402

SCRIPT = "deepspeed_train.py"
WORLD = 2
ROOT = "ds"
TAG_FILES = ["mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt",
             "zero_pp_rank_1_mp_rank_00_optim_states.pt"]


def save(root: Path, steps: str, *extra: str) -> list[str]:
    return fw.run_ranks(SCRIPT, ["save", str(root), "--steps", steps, *extra], world=WORLD,
                        timeout=600)


def start_save(root: Path, steps: str, *extra: str) -> list[Any]:
    return fw.start_ranks(SCRIPT, ["save", str(root), "--steps", steps, *extra], world=WORLD)


def daemon(inproc_daemon: Any, root: Path, tmp_path: Path, **keys: Any) -> Any:
    """A daemon watching `root` (layout auto, no world_size: the ranks come from the files)."""
    return inproc_daemon(roots=[{"name": ROOT, "path": str(root),
                                 "upload": {"url": f"file://{tmp_path / 'remote'}"}, **keys}])


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One real save of step 3 (its `latest` names global_step3), for tests that copy it."""
    root = tmp_path_factory.mktemp("ds-saved")
    save(root, "3")
    return root


def copy_save(src: Path, dst: Path, tag: str = "global_step3") -> Path:
    """The tag dir, then `latest`, as DeepSpeed orders them (mtimes kept)."""
    dst.mkdir(parents=True, exist_ok=True)
    shutil.copytree(src / tag, dst / tag)
    shutil.copy2(src / "latest", dst / "latest")
    return dst / tag


def state(d: Any, step: int) -> str | None:
    """The step's state as the daemon's store has it (None: not seen)."""
    rec = d.store.checkpoint(ROOT, step)
    return None if rec is None else str(rec.state)


def assert_never_valid(d: Any, step: int) -> None:
    wait_scans(d.client, settle=SETTLE_S)  # two scans begun past the settle time
    assert state(d, step) in (None, "pending", "invalid"), d.store.checkpoint(ROOT, step)
    latest = d.client.latest(ROOT)
    assert latest is None or latest.get("step") != step, latest


def test_save_is_valid_uploaded_restored_and_resumed(inproc_daemon: Any, tmp_path: Path) -> None:
    root, dumps = tmp_path / "run", tmp_path / "dumps"
    root.mkdir()
    dumps.mkdir()
    d = daemon(inproc_daemon, root, tmp_path)
    save(root, "3,5", "--dump", str(dumps / "weights_{step}.pt"))
    assert (root / "latest").read_text() == "global_step5"

    for step in (3, 5):
        rec = d.wait_for(ROOT, step, timeout=60)
        assert (rec["state"], rec["layout"], rec["path"]) == (
            "valid", "deepspeed", f"global_step{step}"), rec
        assert d.client.wait(ROOT, step, until="uploaded", timeout=60), d.log_text()[-3000:]
    assert d.client.latest(ROOT)["step"] == 5  # type: ignore[index]
    files = fw.files_of(d, ROOT, 3)
    assert files == [f"global_step3/{n}" for n in sorted(TAG_FILES)]  # `latest` is no member

    code, doc = fw.verify(root / "global_step3")  # default config: no trusted_globals given
    assert code == 0 and (doc["valid"], doc["layout"], doc["step"]) == (True, "deepspeed", 3), doc

    out = tmp_path / "restored"  # a fresh node: nothing there yet
    fw.restore(d.config, ROOT, 3, out)
    fw.same_files(root, out, files)
    assert (out / "latest").read_text() == "global_step3"  # not the run's global_step5
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()) == \
        sorted([*files, "latest"])

    fw.run_ranks(SCRIPT, ["resume", str(out), "--dump", str(dumps / "resumed.pt")], world=WORLD,
                 timeout=600)
    resumed = torch.load(dumps / "resumed.pt", weights_only=True)
    saved3 = torch.load(dumps / "weights_3.pt", weights_only=True)
    assert resumed["global_steps"] == 3
    assert resumed["weights"].keys() == saved3["weights"].keys()
    for k, v in saved3["weights"].items():
        assert torch.equal(resumed["weights"][k], v), k


def test_missing_optimizer_shard_is_never_valid(inproc_daemon: Any, saved: Path,
                                                tmp_path: Path) -> None:
    """The model states record dp_world_size 2: rank 1's shard is required, with or without a
    `world_size` in the config, by verify and by the daemon."""
    lost = copy_save(saved, tmp_path / "copy")
    shard = lost / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    shard.unlink()
    code, doc = fw.verify(lost)
    assert code == 1 and doc["valid"] is False and doc["reason"] == "missing_file", doc
    assert shard.name in doc["message"], doc

    root = tmp_path / "run"
    root.mkdir()
    d = daemon(inproc_daemon, root, tmp_path, pending_timeout="3s")
    (tmp_path / "copy" / "global_step3").rename(root / "global_step3")
    shutil.copy2(saved / "latest", root / "latest")
    assert_never_valid(d, 3)
    assert d.wait_for(ROOT, 3, state="invalid", timeout=30)["reason"] == "missing_file"
    rec = d.store.checkpoint(ROOT, 3)  # given up after pending_timeout, saying why
    assert shard.name in rec.message, rec
    assert d.client.latest(ROOT) is None


def test_save_killed_half_way_is_never_valid(inproc_daemon: Any, saved: Path,
                                             tmp_path: Path) -> None:
    """A run saving into a dir whose `latest` names a valid global_step3 is killed (every
    rank, SIGKILL) once its step-5 save has begun: the first file of global_step5 exists,
    `latest` still names global_step3."""
    root = tmp_path / "run"
    copy_save(saved, root)
    d = daemon(inproc_daemon, root, tmp_path)
    assert d.wait_for(ROOT, 3, timeout=60)["state"] == "valid"
    tag = root / "global_step5"
    procs = start_save(root, "5", "--slow", "2")
    fw.kill_when(procs, lambda: tag.is_dir() and any(tag.iterdir()))
    assert (root / "latest").read_text() == "global_step3"
    assert len(list(tag.iterdir())) < len(TAG_FILES)
    assert_never_valid(d, 5)
    assert d.client.latest(ROOT)["step"] == 3  # type: ignore[index]
    code, doc = fw.verify(tag)
    assert code == 1 and doc["valid"] is False, doc


def test_straggler_shard_after_latest_is_waited_for(inproc_daemon: Any, tmp_path: Path) -> None:
    """Rank 0 writes `latest` without waiting for rank 1; rank 1's shard lands 3 s later.
    The daemon (no world_size) keeps the step pending all that time, then validates it."""
    root = tmp_path / "run"
    root.mkdir()
    d = daemon(inproc_daemon, root, tmp_path)
    shard = root / "global_step3" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    latest = root / "latest"
    procs = start_save(root, "3", "--straggle", "3")
    seen = fw.observe_until_done(procs, lambda: (latest.exists(), shard.exists(), state(d, 3)))
    fw.finish(procs)
    early = [s for has_latest, has_shard, s in seen if has_latest and not has_shard]
    assert early and set(early) <= {None, "pending"}, seen
    assert "pending" in early, seen  # the daemon did see the step while the shard was missing
    assert d.wait_for(ROOT, 3, timeout=60)["state"] == "valid"
    assert d.client.latest(ROOT)["step"] == 3  # type: ignore[index]


def _deepspeed_runs_fp16_here() -> bool:
    """DeepSpeed's CPU accelerator (the one these ranks use) runs fp16 only where oneDNN has
    fp16 kernels for this processor (AVX512-FP16 or AMX); elsewhere `deepspeed.initialize`
    itself refuses fp16 ("Type fp16 is not supported on your device")."""
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

    return bool(CPU_Accelerator().is_fp16_supported())


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_other_precisions_verify_with_the_default_config(precision: str, tmp_path: Path) -> None:
    """bf16 names its shards `bf16_zero_pp_rank_*` and fp16 pickles DynamicLossScaler: both
    are whole and valid with no configuration; without rank 1's shard, neither is."""
    if precision == "fp16" and not _deepspeed_runs_fp16_here():
        pytest.skip("DeepSpeed refuses fp16 on this processor's CPU accelerator (no oneDNN "
                    "fp16 kernels): it can write no fp16 save here")
    save(tmp_path, "2", "--precision", precision)
    tag = tmp_path / "global_step2"
    prefix = "bf16_" if precision == "bf16" else ""
    shard = tag / f"{prefix}zero_pp_rank_1_mp_rank_00_optim_states.pt"
    assert shard.is_file()
    code, doc = fw.verify(tag)
    assert code == 0 and (doc["valid"], doc["layout"]) == (True, "deepspeed"), doc
    assert len(doc["files"]) == len(TAG_FILES)
    shard.unlink()
    code, doc = fw.verify(tag)
    assert code == 1 and doc["reason"] == "missing_file" and shard.name in doc["message"], doc
