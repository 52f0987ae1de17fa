"""The scan service's newest-mtime memo (`Scanner._found`): a kept step's newest member mtime is
not worked out again over its files at every scan, and a member whose mtime moved is seen at
the next scan. A real daemon in this process on real files; the store's `sync_root` is the real
one, watched for what each scan handed it."""

from __future__ import annotations

import os
from typing import Any

import pytest
from support import Harness, wait_scans, wait_until
from writers import save_torch

from ckptd.service import scan as scan_service
from ckptd.store import Found


def test_a_kept_steps_newest_mtime_is_reused_and_a_moved_one_seen(
        h: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    handed: list[list[Found]] = []
    real_sync = h.daemon.store.sync_root

    def sync_root(root: str, found: list[Found], *a: Any, **kw: Any) -> Any:
        handed.append(list(found))
        return real_sync(root, found, *a, **kw)

    worked_out: list[int] = []
    real_newest = scan_service._newest  # noqa: SLF001 - what the memo saves

    def newest(snap: Any, c: Any) -> float:
        worked_out.append(c.step)
        return real_newest(snap, c)

    monkeypatch.setattr(h.daemon.store, "sync_root", sync_root)
    monkeypatch.setattr(scan_service, "_newest", newest)
    path = h.root / "model_step_2.pt"
    save_torch(path)
    assert h.client.wait("r", 2, until="valid", timeout=30)
    mtime = path.stat().st_mtime

    def last_newest() -> float:
        (found,) = [f for f in handed[-1] if f.candidate.step == 2]
        return found.newest_mtime

    worked_out.clear()
    wait_scans(h.client, 2)
    assert worked_out == []  # kept: the last value, not recomputed
    assert last_newest() == pytest.approx(mtime, abs=1e-6)  # ns -> s rounds either way

    os.utime(path, (mtime + 100, mtime + 100))  # the same bytes, dated later
    wait_until(lambda: 2 in worked_out and abs(last_newest() - (mtime + 100)) < 1e-6, 30,
               "the moved mtime seen at a scan")

