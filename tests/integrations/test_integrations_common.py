"""`ckptd.integrations.common` without a framework, against a real daemon on its socket and a
`file://` remote: what the Lightning and HF integrations (tested with the frameworks in
tests/frameworks/test_integrations.py) build on. Registering a save with its metric, the
preemption flush with its bounded wait, and `resume`: this node's file, else a restore from
the bucket, None only when nothing can be resumed from, and DaemonUnavailable when nothing
can tell."""

from __future__ import annotations

import filecmp
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from support.config import write_layout

from ckptd.client import Client, DaemonUnavailable
from ckptd.integrations import Resume, flush_and_wait, resume
from ckptd.integrations.common import finite_metrics, register


def saved(root: Path, step: int) -> Path:
    path = root / f"model_step_{step}.pt"
    torch.save({"w": torch.arange(4.0) * step}, path)
    return path


def test_importing_the_integrations_imports_neither_torch_nor_the_restore() -> None:
    probe = ("import sys, ckptd.integrations; print(sorted(m for m in ('torch', 'lightning',"
             " 'transformers', 'ckptd.restore', 'ckptd.config', 'pydantic') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          timeout=60, check=True)
    assert done.stdout.strip() == "[]"


def test_only_finite_numbers_are_registered_as_metrics() -> None:
    assert finite_metrics({"a": 1, "b": float("nan"), "c": "x", "d": torch.tensor(0.5),
                           "e": float("inf")}) == {"a": 1.0, "d": 0.5}


def test_a_registered_save_is_flushed_and_resumed_here_then_from_the_bucket(
        inproc_daemon: Any, tmp_path: Path) -> None:
    d = inproc_daemon(roots=[{"name": "r1", "upload": {"url": f"file://{tmp_path / 'remote'}"}}])
    root, client = d.roots["r1"], Client(d.socket)
    path = saved(root, 5)
    assert register(client, "r1", 5, path, {"loss": torch.tensor(0.25), "bad": float("nan")})
    d.wait_for("r1", 5, "valid", timeout=30)
    assert flush_and_wait(client, "r1", 30.0, step=5) is True
    rec = d.client.checkpoint("r1", 5)
    assert rec is not None and rec["remote"] == "uploaded" and rec["metrics"] == {"loss": 0.25}
    assert resume("r1", client=client) == Resume(5, path, False)

    kept = tmp_path / "kept.pt"
    shutil.copy2(path, kept)
    d.stop()
    shutil.rmtree(root)
    root.mkdir()
    assert flush_and_wait(client, "r1", 1.0) is False  # no daemon: said, never raised
    to = tmp_path / "to"
    found = resume("r1", to=to, config=d.config, client=client)
    assert found == Resume(5, to / path.name, True)
    assert filecmp.cmp(found.path, kept, shallow=False)


def test_resume_is_none_only_when_the_daemon_says_there_is_nothing(
        inproc_daemon: Any, tmp_path: Path) -> None:
    d = inproc_daemon(roots=[{"name": "r1"}])
    assert resume("r1", config=d.config, client=Client(d.socket)) is None
    assert resume("r1", config=tmp_path / "none.toml", client=Client(d.socket)) is None


def test_resume_raises_when_neither_a_daemon_nor_a_bucket_can_tell(
        tmp_path: Path, short_dir: Path) -> None:
    layout = write_layout(tmp_path, short_dir / "none.sock", roots=[{"name": "r1"}])
    client = Client(layout.socket)
    with pytest.raises(DaemonUnavailable):
        resume("r1", config=layout.config, client=client)  # no bucket configured
    with pytest.raises(DaemonUnavailable):
        resume("r1", config=tmp_path / "none.toml", client=client)  # no config at all
    with_bucket = write_layout(tmp_path / "b", short_dir / "none.sock", roots=[
        {"name": "r1", "upload": {"url": f"file://{tmp_path / 'empty'}"}}])
    assert resume("r1", config=with_bucket.config, client=client) is None  # the bucket's word
