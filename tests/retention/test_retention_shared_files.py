"""Retention never deletes past a checkpoint's own files, and the lifecycle table refuses a
prune retention did not do. A real store, a real retention service, a real daemon."""

from __future__ import annotations

import threading
from pathlib import Path

from support import Harness, wait_until
from writers import save_torch

from ckptd.config import parse_config
from ckptd.lifecycle.table import Event
from ckptd.model import Candidate, FileRecord, Local, ValidationResult
from ckptd.service.retention import RetentionService
from ckptd.store import Found, Store


def test_retention_never_deletes_past_a_checkpoints_own_files(tmp_path: Path) -> None:
    """Two rows that hold one file (a directory checkpoint holding a file another step
    registered): deleting the older would delete part of the newer. The shared-files net
    refuses it; the planner asked for it (keep_last = 1)."""
    root = tmp_path / "r"
    (root / "step-300").mkdir(parents=True)
    for name in ("model.pt", "meta.pt"):
        save_torch(root / "step-300" / name)
    cfg = parse_config({"daemon": {"state_dir": str(tmp_path / "state"),
                                   "socket": str(tmp_path / "s")},
                        "roots": [{"name": "r", "path": str(root), "retention": {
                            "local": {"keep_last": 1, "keep_best": 0, "min_free": "0"}}}]},
                       tmp_path)
    store = Store(tmp_path / "state.db")
    found = [Found(Candidate("registered", 5, "step-300/model.pt", ("step-300/model.pt",),
                             True), "a"),
             Found(Candidate("dcp", 300, "step-300", ("step-300/meta.pt", "step-300/model.pt"),
                             True), "b")]
    store.sync_root("r", found, 1.0)
    for _ in found:
        job = store.claim("w", 2.0, 60)
        assert job is not None
        res = ValidationResult(True, files=tuple(FileRecord(f, 1, "h", "x") for f in job.files))
        assert store.finish_validation(job, "w", job.checkpoint.fingerprint, res, 2.0)
    svc = RetentionService(store, lambda: {"r": cfg.roots[0]}, lambda r: None)
    stop = threading.Event()
    loop = threading.Thread(target=svc.run, args=(stop,))
    loop.start()
    try:
        outcomes = [o.as_json() for o in svc.run_now("r", timeout=30)]
    finally:
        stop.set()
        svc.wake()
        loop.join(10)
    (five,) = [o for o in outcomes if o["step"] == 5]
    assert five["action"] == "refused" and "shared_files" in five["reason"], outcomes
    assert (root / "step-300" / "model.pt").exists()
    assert store.status("r", 300).local is Local.PRESENT  # type: ignore[union-attr]


def test_the_table_refuses_what_retention_did_not_do(h: Harness) -> None:
    save_torch(h.root / "model_step_2.pt")
    assert h.client.wait("r", 2, until="valid", timeout=30)
    assert not h.daemon.store.record("r", 2, Event.PRUNED_REMOTE)  # never uploaded
    wait_until(lambda: h.daemon.store.status("r", 2) is not None, what="a row")
