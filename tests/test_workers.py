"""The stage workers' dispatch: one runner per lifecycle Stage, and the Job a claim hands out
names its stage with the Stage enum, as the table is keyed. Real SQLite store, no daemon."""

from __future__ import annotations

from pathlib import Path

from ckptd.lifecycle.table import Policy, Stage
from ckptd.model import Candidate
from ckptd.service.commits import Waiting
from ckptd.service.runners import Crew, UploadRunner, runners
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
