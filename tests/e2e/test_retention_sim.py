"""A simulated 200-step run with random metrics, random corrupt saves and random daemon
kills (-9): after every step the latest valid checkpoint is on disk or verified remotely, and
the run ends with exactly the set the retention rules describe."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import torch
from support.wait import WaitTimeout, wait_until

from ckptd.client import Client

STEPS = 200
KEEP_LAST, KEEP_BEST = 2, 1
REMOTE_LAST, REMOTE_BEST = 4, 1


def save(root: Path, step: int, corrupt: bool) -> Path:
    """Write under a temp name and rename, so the daemon never sees a half-made file."""
    path = root / f"model_step_{step}.pt"
    tmp = root / f".model_step_{step}.pt.tmp"
    torch.save({"w": torch.full((8,), float(step)), "step": step}, tmp)
    if corrupt:  # cut short: a save killed mid-write
        with open(tmp, "r+b") as f:
            f.truncate(tmp.stat().st_size - 40)
    tmp.rename(path)
    return path


def settle(c: Client, step: int, timeout: float = 60) -> dict[str, Any]:
    def settled() -> dict[str, Any] | None:
        rec = c.checkpoint("sim", step)
        return rec if rec and rec["state"] in ("valid", "invalid") else None

    return wait_until(settled, timeout, f"step {step} validated", interval=0.02)


def latest_is_safe(c: Client, root: Path, remote: Path) -> None:
    latest = c.latest("sim")
    if latest is None:
        return
    step = latest["step"]
    on_disk = (root / f"model_step_{step}.pt").exists()
    uploaded = (remote / "sim" / f"step-{step}" / "MANIFEST.json").exists()
    assert on_disk or uploaded, f"latest {step} is neither on disk nor committed remotely"


def test_random_run_with_kills_keeps_invariants(daemon_factory: Any, tmp_path: Path) -> None:
    rng = random.Random(20261121)
    remote = tmp_path / "remote"
    d = daemon_factory(roots=[{
        "name": "sim", "settle": "0s", "metric": "loss",
        "upload": {"url": f"file://{remote}"}, "compress": {"codec": "zstd"},
        "retention": {"local": {"keep_last": KEEP_LAST, "keep_best": KEEP_BEST,
                                "min_free": "0"},
                      "remote": {"keep_last": REMOTE_LAST, "keep_best": REMOTE_BEST,
                                 "keep_every": 0, "keep_within": ""}},
    }])
    root = d.roots["sim"]
    c = Client(d.socket, timeout=10)
    metrics: dict[int, float] = {}
    corrupt: set[int] = set()
    kills = 0
    for step in range(1, STEPS + 1):
        if rng.random() < 0.05:
            corrupt.add(step)
        path = save(root, step, step in corrupt)
        metrics[step] = round(rng.uniform(0.1, 10.0), 6)
        assert c.register("sim", step, paths=[str(path)], metrics={"loss": metrics[step]})
        if rng.random() < 0.04:
            d.kill9()
            kills += 1
            d.start()
            c = Client(d.socket, timeout=10)
        rec = settle(c, step)
        assert rec["state"] == ("invalid" if step in corrupt else "valid"), rec
        latest_is_safe(c, root, remote)
    assert kills >= 3
    valid = [s for s in range(1, STEPS + 1) if s not in corrupt]
    best = min(valid, key=lambda s: (metrics[s], -s))
    for s in valid:  # everything valid gets uploaded (and maybe pruned remotely since)
        assert c.wait("sim", s, until="uploaded", timeout=60), s
    c.request_json("POST", "/v1/roots/sim/prune", timeout=60)
    expected_local = set(valid[-KEEP_LAST:]) | {best} | corrupt  # invalid kept (no delete_invalid)
    remote_best = sorted(valid, key=lambda s: (metrics[s], -s))[:REMOTE_BEST]
    expected_remote = set(valid[-REMOTE_LAST:]) | set(remote_best) | {best}

    def copies() -> tuple[set[int], set[int]]:
        ls = {x["step"]: x for x in c.checkpoints("sim")}  # type: ignore[union-attr]
        return ({s for s, x in ls.items() if x["local"] == "present"},
                {s for s, x in ls.items() if x["remote"] == "uploaded"})

    def pruned_as_described() -> bool:
        if copies() == (expected_local, expected_remote):
            return True
        c.request_json("POST", "/v1/roots/sim/prune", timeout=60)
        return False

    try:
        wait_until(pruned_as_described, 30, "the copies retention describes", interval=0.5)
    except WaitTimeout:
        pass  # the assertions below say which set differs
    local, remote_now = copies()
    assert local == expected_local
    assert remote_now == expected_remote
    on_disk = {int(p.stem.split("_")[-1]) for p in root.glob("model_step_*.pt")}
    assert on_disk == expected_local
    committed = {int(p.parent.name.split("-")[1]) for p in (remote / "sim").glob("*/MANIFEST.json")}
    assert committed == expected_remote
    assert c.latest("sim")["step"] == valid[-1]  # type: ignore[index]
