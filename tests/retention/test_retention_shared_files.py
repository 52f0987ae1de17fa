"""Retention never deletes past a checkpoint's own files, and the lifecycle table refuses a
prune retention did not do. A real store, a real retention service, a real daemon."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
from support import Harness, wait_until
from writers import save_torch

from ckptd.config import Config, parse_config
from ckptd.lifecycle.table import Event
from ckptd.model import Candidate, FileRecord, Local, ValidationResult
from ckptd.retention import views
from ckptd.retention.views import shared_steps
from ckptd.service.retention import RetentionService
from ckptd.store import Found, Store


def _step_300(tmp_path: Path, root_table: dict[str, Any]) -> tuple[Path, Config, Store]:
    """A root holding `step-300/` (two torch files), its config and a fresh store."""
    root = tmp_path / "r"
    (root / "step-300").mkdir(parents=True)
    for name in ("model.pt", "meta.pt"):
        save_torch(root / "step-300" / name)
    cfg = parse_config({"daemon": {"state_dir": str(tmp_path / "state"),
                                   "socket": str(tmp_path / "s")},
                        "roots": [{**root_table, "path": str(root)}]}, tmp_path)
    return root, cfg, Store(tmp_path / "state.db")


def test_retention_never_deletes_past_a_checkpoints_own_files(tmp_path: Path) -> None:
    """Two rows that hold one file (a directory checkpoint holding a file another step
    registered): deleting the older would delete part of the newer. The shared-files net
    refuses it; the planner asked for it (keep_last = 1)."""
    root, cfg, store = _step_300(tmp_path, {"name": "r", "retention": {
        "local": {"keep_last": 1, "keep_best": 0, "min_free": "0"}}})
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


def _shared_by_definition(members: dict[int, list[str]], dirs: dict[int, str]) -> set[int]:
    """The shared-files rule as written: every file of every step against every other step."""
    shared = set()
    for step, files in members.items():
        for other, theirs in members.items():
            if other != step and set(files) & set(theirs):
                shared.add(step)
    for step, path in dirs.items():
        prefix = path.rstrip("/") + "/"
        if any(f.startswith(prefix) for other, theirs in members.items() if other != step
               for f in theirs):
            shared.add(step)
    return shared


def test_shared_steps_matches_the_rule_on_random_trees() -> None:
    """The one-pass lookup by parent directory decides as the rule does: a step whose files
    another step holds, or whose directory holds another step's file at any depth (nested
    steps, a file registered alone inside a directory step, look-alike prefixes such as
    `step-1` and `step-10`, a trailing slash, a leading one)."""
    import random

    rng = random.Random(7)
    names = ["step-1", "step-10", "step-1/sub", "a/step-2", "a", "", "/abs", "step-1/"]
    leaves = ["model.pt", "optim.pt", "x", "sub/y", ".metadata"]
    for _ in range(400):
        members: dict[int, list[str]] = {}
        dirs: dict[int, str] = {}
        for step in rng.sample(range(1, 9), rng.randint(1, 5)):
            base = rng.choice(names)
            files = [f"{base.rstrip('/')}/{leaf}" if base else leaf
                     for leaf in rng.sample(leaves, rng.randint(1, 3))]
            members[step] = files
            if rng.random() < 0.6:
                dirs[step] = base
            elif rng.random() < 0.5:  # a single registered file, its path its own
                members[step] = files[:1]
        assert shared_steps(members, dirs) == _shared_by_definition(members, dirs), (members,
                                                                                      dirs)


def test_the_shared_files_net_is_worked_out_again_only_when_a_list_changes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The nets are read before every delete: a second read with nothing changed reuses the
    last answer; a member list that changed in the store is seen at the next read."""
    _, cfg, store = _step_300(tmp_path, {"name": "shared-memo"})

    def sync(dcp_files: tuple[str, ...], fp: str) -> None:
        found = [Found(Candidate("registered", 5, "step-300/model.pt", ("step-300/model.pt",),
                                 True), "a"),
                 Found(Candidate("dcp", 300, "step-300", dcp_files, True), fp)]
        store.sync_root("shared-memo", found, 1.0)
        while (job := store.claim("w", 2.0, 60)) is not None:
            res = ValidationResult(True, files=tuple(FileRecord(f, 1, "h", "x")
                                                     for f in job.files))
            assert store.finish_validation(job, "w", job.checkpoint.fingerprint, res, 2.0)

    calls = []
    real = views.shared_steps
    monkeypatch.setattr(views, "shared_steps", lambda *a: calls.append(a) or real(*a))
    sync(("step-300/meta.pt",), "b")
    assert views.guards_for(store, cfg.roots[0], 3.0).shared == {300}  # its dir holds 5's file
    assert views.guards_for(store, cfg.roots[0], 3.0).shared == {300}
    assert len(calls) == 1
    sync(("step-300/meta.pt", "step-300/model.pt"), "c")  # re-saved: now it lists that file
    rec = store.checkpoint("shared-memo", 300)
    assert rec is not None and rec.local is Local.PRESENT and rec.fingerprint == "c"
    assert views.guards_for(store, cfg.roots[0], 3.0).shared == {5, 300}
    assert len(calls) == 2
