"""Async saves (`ckptd.torch.save(..., blocking=False)`) with real torch, a real daemon on a real
socket and real processes: snapshot semantics, the trainer killed after `save` returned, the
daemon killed mid-save, flush, skip, the fallback without a daemon, refused peers, two ranks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptd.torch as ckpt
from ckptd.client import Client

REPO = Path(__file__).resolve().parents[1]


def trained(seed: int = 0, width: int = 64) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU(),
                                torch.nn.Linear(width, 4))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model(torch.randn(8, width)).pow(2).mean().backward()
    opt.step()
    return model, opt


def clone(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in sd.items()}


def run_py(code: str, sock: Path, *args: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "CKPTD_SOCKET": str(sock)}
    return subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)


def test_async_save_is_a_snapshot_and_becomes_valid(inproc_daemon: Any) -> None:
    d = inproc_daemon(roots=[{"name": "r1"}])
    root = d.roots["r1"]
    model, opt = trained()
    before = clone(model.state_dict())
    h = ckpt.save(root, 10, model=model, optimizer=opt, metrics={"loss": 1.5},
                  client=d.client, blocking=False)
    with torch.no_grad():  # the training step right after save returned
        for p in model.parameters():
            p.add_(1.0)
    assert h.wait(30) and h.done() and h.error is None and not h.skipped
    assert h.path == root / "step-10"
    rec = d.wait_for("r1", 10)
    assert rec["state"] == "valid" and rec["layout"] == "native"
    meta = json.loads((root / "step-10" / "meta.json").read_text())
    assert {f["path"] for f in meta["files"]} == {"model.pt", "optim.rank0.pt", "rng.rank0.pt"}
    assert all(f["hash_alg"] == "xxh3-128" and len(f["hash"]) == 32 for f in meta["files"])
    fresh, fresh_opt = trained(seed=5)
    step, _ = ckpt.load(root, 10, model=fresh, optimizer=fresh_opt, client=d.client)
    assert step == 10
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in before.items())
    assert not (root / "step-10.tmp").exists()


def test_arena_is_reused_and_flush_waits(inproc_daemon: Any) -> None:
    d = inproc_daemon(roots=[{"name": "r1"}])
    root = d.roots["r1"]
    model, opt = trained()
    handles = [ckpt.save(root, s, model=model, optimizer=opt, client=d.client, blocking=False)
               for s in (1, 2, 3)]
    assert ckpt.flush(30)
    assert all(h.done() and h.error is None for h in handles)
    for s in (1, 2, 3):
        assert d.wait_for("r1", s)["state"] == "valid"


SKIP_CODE = """
import sys, ckptd.torch as ckpt, torch
m = torch.nn.Linear(4, 4)
first = ckpt.save(sys.argv[1], 7, model=m, rank=0, world_size=2, timeout=3, blocking=False)
second = ckpt.save(sys.argv[1], 8, model=m, rank=0, world_size=2, if_busy="skip",
                   blocking=False)
print(second.skipped, second.done(), second.wait(0), first.done())
ok = ckpt.flush(30)
print(ok, first.done(), first.error is not None)
"""


def test_skip_while_busy_and_a_save_that_fails_reports_it(inproc_daemon: Any) -> None:
    """Rank 0 of two: the daemon writes its files, then waits for rank 1, which never comes."""
    d = inproc_daemon(roots=[{"name": "r1"}])
    p = run_py(SKIP_CODE, d.socket, str(d.roots["r1"]))
    out, err = p.communicate(timeout=60)
    assert p.returncode == 0, err[-3000:]
    lines = out.split("\n")
    assert lines[0] == "True True False False"
    assert lines[1] == "False True True"
    assert "timed out waiting for rank 1" in d.log_text()
    assert not (d.roots["r1"] / "step-7").exists()


def test_fallback_without_daemon(tmp_path: Path, short_dir: Path,
                                 caplog: pytest.LogCaptureFixture) -> None:
    client = Client(short_dir / "absent.sock", timeout=1.0)
    model, opt = trained()
    h = ckpt.save(tmp_path / "r", 4, model=model, optimizer=opt, client=client, blocking=False)
    assert h.done() and h.wait(0) and h.error is None
    assert "was not reached" in caplog.text
    fresh, fresh_opt = trained(seed=3)
    ckpt.load(tmp_path / "r", 4, model=fresh, optimizer=fresh_opt, client=client)
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in model.state_dict().items())
