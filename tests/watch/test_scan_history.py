"""A scan of a root that keeps its finished steps: what it rebuilds is bounded by what changed,
not by the steps the root already holds (each file's record and each checkpoint's fingerprint
are reused while nothing under them changed); what it reports is the same as a fresh scan's."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from ckptd.model import RootOptions
from ckptd.watch import scanner as scanner_mod
from ckptd.watch.scanner import RootScanner

FILES = 20  # data files per step


def write_step(root: Path, step: int) -> None:
    d = root / f"step-{step}"
    d.mkdir()
    for i in range(FILES):
        (d / f"__0_{i}.distcp").write_bytes(b"y" * (10 + i))
    (d / ".metadata").write_bytes(b"x")


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The candidates whose fingerprint a scan computed (the real function, counted)."""
    calls: list[str] = []
    real = scanner_mod.fingerprint

    def spy(cand, seen):  # type: ignore[no-untyped-def]
        calls.append(cand.path)
        return real(cand, seen)

    monkeypatch.setattr(scanner_mod, "fingerprint", spy)
    return calls


def test_rescan_touches_only_new_paths(tmp_path: Path, counted: list[str]) -> None:
    for step in (100, 200, 300):
        write_step(tmp_path, step)
    sc = RootScanner("r", tmp_path, "dcp", RootOptions(settle=0.0))
    now = time.time()
    snap1, found1 = sc.scan(now)
    assert sorted(counted) == ["step-100", "step-200", "step-300"]
    counted.clear()

    write_step(tmp_path, 400)  # a new step beside three finished ones
    snap2, found2 = sc.scan(now + 1)
    assert counted == ["step-400"]  # the finished steps' fingerprints are not recomputed
    old = [rel for rel in snap1.files]
    assert all(snap2.files[rel] is snap1.files[rel] for rel in old)  # nor their records
    assert dict((c.path, fp) for c, fp in found2 if c.path != "step-400") == {
        c.path: fp for c, fp in found1}

    # What is reported is what a fresh scanner of the same tree reports.
    fresh = RootScanner("r", tmp_path, "dcp", RootOptions(settle=0.0))
    _, again = fresh.scan(now + 1)
    assert [(c.path, c.files, c.complete, fp) for c, fp in again] == [
        (c.path, c.files, c.complete, fp) for c, fp in found2]


def test_a_change_in_a_finished_step_is_still_seen(tmp_path: Path, counted: list[str]) -> None:
    for step in (100, 200):
        write_step(tmp_path, step)
    sc = RootScanner("r", tmp_path, "dcp", RootOptions(settle=0.0))
    now = time.time()
    _, before = sc.scan(now)
    counted.clear()
    member = tmp_path / "step-100" / "__0_3.distcp"
    member.write_bytes(b"z" * 99)  # rewritten in place: the directory's mtime stays
    snap, after = sc.scan(now + 1)
    assert counted == ["step-100"]
    prints = {c.path: fp for c, fp in before}
    assert {c.path: fp for c, fp in after}["step-100"] != prints["step-100"]
    assert {c.path: fp for c, fp in after}["step-200"] == prints["step-200"]
    assert snap.files["step-100/__0_3.distcp"].changed_at == now + 1

    counted.clear()
    member.unlink()  # a member gone: the step's fingerprint is computed again
    snap, gone = sc.scan(now + 2)
    assert "step-100" in counted and "step-100/__0_3.distcp" not in snap.files
    assert {c.path: fp for c, fp in gone}["step-100"] != {c.path: fp for c, fp in after}[
        "step-100"]


def test_an_open_mark_on_an_unchanged_file_is_still_reported(tmp_path: Path) -> None:
    write_step(tmp_path, 100)
    sc = RootScanner("r", tmp_path, "dcp", RootOptions(settle=0.0))
    now = time.time()
    sc.scan(now)
    rel = "step-100/__0_1.distcp"
    sc.open_files.opened(os.path.join(tmp_path, rel), now + 1)
    snap, _ = sc.scan(now + 1)
    assert snap.files[rel].open_for_write
    sc.open_files.closed(os.path.join(tmp_path, rel))
    snap, _ = sc.scan(now + 2)
    assert not snap.files[rel].open_for_write
