"""The stage workers' dispatch: one runner per lifecycle Stage, and the Job a claim hands out
names its stage with the Stage enum, as the table is keyed; a worker's call is judged stuck by
the workers' clock. Real SQLite store, no daemon."""

from __future__ import annotations

import threading
from pathlib import Path

from support.clock import FakeClock

from ckptd.lifecycle.table import Policy, Stage
from ckptd.model import Candidate
from ckptd.service.commits import Waiting
from ckptd.service.metrics import Metrics
from ckptd.service.runners import Crew, UploadRunner, runners
from ckptd.service.workers import Workers
from ckptd.store import Found, Store


def test_every_stage_has_one_runner(tmp_path: Path) -> None:
    store = Store(tmp_path / "state.db")
    table = runners(Crew(store, lambda _root: None, Waiting(), "n0"))
    assert set(table) == set(Stage)
    assert len({id(r) for r in table.values()}) == len(Stage)
    # Only the stages that read the checkpoint's files check them against the row first, and
    # only validation's verdict is on the files it read: they are checked again after it.
    assert {s for s, r in table.items() if not r.checks_files} == {Stage.UPLOAD}
    assert {s for s, r in table.items() if r.judges_files} == {Stage.VALIDATE}
    assert isinstance(table[Stage.UPLOAD], UploadRunner)


def test_a_claimed_job_names_its_stage_with_the_enum(tmp_path: Path) -> None:
    store = Store(tmp_path / "state.db")
    store.set_policies({"r": Policy()})
    store.sync_root("r", [Found(Candidate("single", 1, "a.pt", ("a.pt",), True), "fp")], 1.0)
    job = store.claim("w0", 2.0, 60)
    assert job is not None
    assert job.stage is Stage.VALIDATE
    table = runners(Crew(store, lambda _root: None, Waiting(), "n0"))
    assert table[job.stage] is table[Stage.VALIDATE]


def test_a_workers_call_past_its_bound_on_the_workers_clock_is_set_aside(tmp_path: Path) -> None:
    """The stuck-call bound is measured on the clock the workers are given: an upload quiet
    for exactly its bound is not stuck, a second more is, and setting it aside records the
    root's error at that clock's time, saying how long it was quiet. No waiting."""
    clock = FakeClock()
    store = Store(tmp_path / "state.db")
    workers = Workers(store, dict, 2, lambda: None, lambda _root: None, Metrics(process=False),
                      nets=threading.RLock(), bounds={Stage.UPLOAD: 900.0}, clock=clock)
    workers.calls.begin("worker-1", Stage.UPLOAD.value, "r", 7, workers.bounds[Stage.UPLOAD])
    clock.advance(900.0)
    assert workers.stuck() == []
    clock.advance(1.0)
    assert workers.stuck() == ["worker-1"]
    (call,) = workers.calls.stuck()
    workers.set_aside(call, True)
    info = store.root_info("r")
    assert info["last_error"] == ("upload: stuck: upload of r step 7: no progress for 901 s"
                                  " (bound 900 s); set aside")
    assert info["last_error_at"] == clock.time()
    store.close()
