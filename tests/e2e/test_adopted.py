"""Adopted checkpoints: what was on disk before ckptd first watched a root is validated, listed
and uploaded, but never deleted locally without a verified remote copy, unless the user runs
`ckptd prune ROOT --apply` once. In-process daemon, real files, real socket."""

from __future__ import annotations

import json
from pathlib import Path

from support import Harness, wait_until
from writers import save_torch

KEEP_TWO = {"local": {"keep_last": 2, "keep_best": 0, "min_free": "0"}}


def _ls(h: Harness) -> dict[int, dict[str, object]]:
    status, doc = h.client.request("GET", "/v1/roots/r/checkpoints")
    assert status == 200
    return {c["step"]: c for c in doc["checkpoints"]}


def test_a_first_start_deletes_none_of_a_users_checkpoints(tmp_path: Path,
                                                          short_dir: Path) -> None:
    h = Harness(tmp_path, short_dir, retention=KEEP_TWO)
    for step in range(1, 7):
        save_torch(h.root / f"model_step_{step}.pt")
    h.daemon.start()
    try:
        wait_until(lambda: len([c for c in _ls(h).values() if c["state"] == "valid"]) == 6,
                   what="all six valid")
        h.daemon.retention.request("r")  # a background run sees them; none may delete
        wait_until(lambda: h.daemon.retention.health("r") is not None, what="a retention run")
        assert all((h.root / f"model_step_{s}.pt").exists() for s in range(1, 7))
        assert all(c["adopted"] for c in _ls(h).values())
        root_status = h.client.status()["roots"][0]  # type: ignore[index]
        assert root_status["adopted"]["count"] == 6
        assert root_status["adopted"]["held"] == [1, 2, 3, 4]
        assert "ckptd prune r --apply" in root_status["adopted"]["message"]
        # a save ckptd sees being born is not adopted, and the rules apply to it
        save_torch(h.root / "model_step_7.pt")
        assert h.client.wait("r", 7, until="valid", timeout=30)
        assert _ls(h)[7]["adopted"] is False
        # the user's say-so, once: the plan runs with adopted ones included
        status, doc = h.client.request("POST", "/v1/roots/r/prune")
        assert status == 200, doc
        deleted = sorted(o["step"] for o in doc["outcomes"] if o["action"] == "deleted")
        assert deleted == [1, 2, 3, 4, 5]
        assert sorted(p.name for p in h.root.glob("model_step_*.pt")) == [
            "model_step_6.pt", "model_step_7.pt"]
    finally:
        h.daemon.stop(grace=5)


def test_adopted_checkpoints_become_deletable_once_uploaded(tmp_path: Path,
                                                            short_dir: Path) -> None:
    h = Harness(tmp_path, short_dir, uploads=True, retention=KEEP_TWO)
    for step in range(1, 5):
        save_torch(h.root / f"model_step_{step}.pt")
    h.daemon.start()
    try:
        for step in range(1, 5):
            assert h.client.wait("r", step, until="uploaded", timeout=60)
        h.daemon.retention.request("r")
        wait_until(lambda: not (h.root / "model_step_1.pt").exists()
                   and not (h.root / "model_step_2.pt").exists(),
                   what="the uploaded adopted ones pruned by keep_last")
        assert (h.root / "model_step_3.pt").exists() and (h.root / "model_step_4.pt").exists()
        assert json.loads((h.root / ".ckptd" / "latest.json").read_text())["step"] == 4
    finally:
        h.daemon.stop(grace=5)
