"""A remote copy that vanished: a step recorded uploaded whose manifest is absent from every
listing for LOST_AFTER_S is no longer had remotely (`remote_copy_lost`); one listing without it
is not enough (retention deletes a remote step before it records the deletion). The daemon runs
in this process on a FakeClock, so two minutes of listings take no two minutes."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from support.ckpts import save_single
from support.clock import FakeClock
from support.wait import wait_until

from ckptd.service.discovery import LOST_AFTER_S, MIN_AGE_S


def test_a_remote_copy_absent_from_every_listing_for_lost_after_s_is_lost(
        inproc_daemon: Any, tmp_path: Path) -> None:
    clock = FakeClock(running=True)
    remote = tmp_path / "remote"
    d = inproc_daemon(roots=[{"name": "r1", "upload": {"url": f"file://{remote}"}}], clock=clock)
    save_single(d.roots["r1"], 4)
    assert d.client.wait("r1", 4, until="uploaded", timeout=60), d.log_text()[-3000:]
    shutil.rmtree(remote / "r1" / "step-4")  # gone from the remote, not by ckptd

    def listed_after(seconds: float) -> dict[int, dict[str, Any]]:
        """Move the clock, let the lease catch up, have the root listed (a fresh listing, as
        the last is older than MIN_AGE_S) and wait for that listing, so that it is taken at
        this time of the clock, not after the next move; then the root's steps as `ls` has
        them."""
        clock.advance(seconds)
        d.wake_lease()
        wait_until(lambda: d.client.status()["roots"][0]["acting"], 30,
                   "the root's lease renewed on the moved clock")
        d.list_remote("r1")
        return {c["step"]: c for c in d.client.checkpoints("r1")}

    first = listed_after(MIN_AGE_S + 1)  # absent from a listing, from now on
    assert first[4]["remote"] == "uploaded"
    later = listed_after(LOST_AFTER_S - 20)
    assert later[4]["remote"] == "uploaded" and not d.events("remote_copy_lost")
    listed_after(20)  # absent from every listing for LOST_AFTER_S
    (lost,) = d.wait_event("remote_copy_lost")
    assert (lost["root"], lost["step"]) == ("r1", 4)
