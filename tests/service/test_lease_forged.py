"""The root lease cannot be stolen for good: someone with write access to a root forges a claim
(at the last generation, at the next one, naming this daemon's own process) and a lease.json to
match. Two real lease services (`ckptd.service.lease.Leases`, real files, real SQLite) share one
root; a forged claim that nobody renews costs the root at most `lease_timeout`, and the live
daemons take it back. docs/MULTINODE.md says what such a writer can and cannot do."""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.ckpts import save_single
from support.clock import FakeClock
from support.fixtures import short_tempdir
from support.leases import _daemon, _root_status
from support.wait import wait_until

from ckptd.cluster.lease import MAX_GENERATION, Holder
from ckptd.config import RootConfig
from ckptd.service.lease import Leases, boot_id
from ckptd.store import Store

FORGED = "f" * 32
TIMEOUT = 0.5


class _Roots:
    def __init__(self, root: Path) -> None:
        self.root = RootConfig(name="r", path=root)

    def __call__(self) -> dict[str, RootConfig]:
        return {"r": self.root}


@pytest.fixture
def two(tmp_path: Path) -> Iterator[tuple[Path, Leases, Leases]]:
    """Two lease services on one root, `a` holding it, `b` standing by, on one clock the test
    moves (`a.clock`)."""
    root = tmp_path / "ckpt"
    root.mkdir()
    stores = [Store(tmp_path / n / "state.db") for n in ("a", "b")]
    now = FakeClock()
    a, b = (Leases(s, _Roots(root), lambda n=n: n, lambda: TIMEOUT,  # type: ignore[misc]
                   clock=now) for s, n in zip(stores, ("a", "b"), strict=True))
    a.tick()
    b.tick()
    assert a.holds("r") and not b.holds("r")
    try:
        yield root, a, b
    finally:
        for s in stores:
            s.close()


def forge(root: Path, gen: int, host: str = "elsewhere", pid: int = 4242,
          boot: str = "another-boot") -> None:
    """What a writer to the root can do: a claim and a lease.json that names it."""
    own = root / ".ckptd"
    (own / f"lease.claim.{gen}").write_text(FORGED)
    doc = Holder(gen=gen, token=FORGED, node="forged", pid=pid, host=host, boot=boot,
                 since=time.time())
    (own / "lease.json").write_text(json.dumps(doc.as_json()))


def acting(*leases: Leases) -> list[str]:
    return [lz.node() for lz in leases if lz.holds("r")]


def clock(leases: Leases) -> FakeClock:
    assert isinstance(leases.clock, FakeClock)
    return leases.clock


def tick_until_one_acts(a: Leases, b: Leases, within: float) -> str:
    """Look with both, `TIMEOUT / 10` apart on their clock, until one acts (within `within`
    seconds of that clock); then it stays the only one."""
    started = clock(a).monotonic()
    while not acting(a, b):
        assert clock(a).monotonic() - started < within, "a live daemon to take the root back"
        clock(a).advance(TIMEOUT / 10)
        a.tick()
        b.tick()
    (one,) = acting(a, b)
    for _ in range(5):  # and it stays the only one
        a.tick()
        b.tick()
        assert acting(a, b) == [one]
    return one


def test_a_forged_claim_at_the_last_generation_is_taken_back(
        two: tuple[Path, Leases, Leases]) -> None:
    root, a, b = two
    forge(root, MAX_GENERATION - 1)
    a.tick()
    b.tick()
    assert acting(a, b) == []  # a claim it cannot yet judge: nobody acts meanwhile
    started = clock(a).monotonic()
    tick_until_one_acts(a, b, 20 * TIMEOUT)
    assert clock(a).monotonic() - started < 10 * TIMEOUT
    assert a.problem("r") is None and b.problem("r") is None
    names = sorted(p.name for p in (root / ".ckptd").iterdir())
    assert names == ["lease.claim.1", "lease.json"], names
    doc = json.loads((root / ".ckptd" / "lease.json").read_text())
    assert doc["gen"] == 1 and doc["token"] != FORGED


def test_a_forged_claim_at_the_next_generation_is_taken_back(
        two: tuple[Path, Leases, Leases]) -> None:
    root, a, b = two
    held = json.loads((root / ".ckptd" / "lease.json").read_text())["gen"]
    forge(root, held + 1)
    a.tick()
    b.tick()
    assert acting(a, b) == []
    tick_until_one_acts(a, b, 20 * TIMEOUT)
    doc = json.loads((root / ".ckptd" / "lease.json").read_text())
    assert doc["gen"] == held + 2 and doc["token"] != FORGED


def test_a_forged_claim_naming_the_holders_own_process_is_taken_back_at_once(
        tmp_path: Path) -> None:
    """A claim whose lease.json names this daemon's host, boot and pid but a token none of its
    lease services has is a forgery (no live holder stands behind it): the holder takes the
    root back at its next look, not after lease_timeout."""
    root = tmp_path / "ckpt"
    root.mkdir()
    store = Store(tmp_path / "a" / "state.db")
    try:
        a = Leases(store, _Roots(root), lambda: "a", lambda: 60.0)
        a.tick()
        assert a.holds("r")
        held = json.loads((root / ".ckptd" / "lease.json").read_text())["gen"]
        forge(root, held + 1, host=socket.gethostname(), pid=os.getpid(), boot=boot_id())
        a.tick()
        assert a.holds("r")
        doc = json.loads((root / ".ckptd" / "lease.json").read_text())
        assert doc["gen"] == held + 2 and doc["token"] == a.me.token
    finally:
        store.close()


def test_a_forged_claim_that_keeps_being_renewed_keeps_the_root_standing_by(
        two: tuple[Path, Leases, Leases]) -> None:
    """The limit of the rule, said in docs/MULTINODE.md: a writer who keeps renewing a forged
    lease keeps the daemons standing by (acting on nothing) for as long as it writes; the
    moment it stops, they take the root back."""
    root, a, b = two
    forge(root, 100)
    lease = root / ".ckptd" / "lease.json"
    mtime = lease.stat().st_mtime_ns
    for _ in range(40):  # 4 timeouts of renewals, TIMEOUT / 10 apart
        mtime += 1_000_000
        os.utime(lease, ns=(mtime, mtime))  # a renewal, as a holder makes it
        a.tick()
        b.tick()
        assert acting(a, b) == []
        clock(a).advance(TIMEOUT / 10)
    tick_until_one_acts(a, b, 20 * TIMEOUT)


def test_two_real_daemons_take_a_root_back_from_a_forged_last_generation(
        tmp_path: Path) -> None:
    """Two `ckptd run` processes on one root; a writer to the root forges the last claim there
    can be and a lease.json from another host. Both stand by while it may be live, then one
    takes the root back and acts on it again (a checkpoint saved afterwards is validated)."""
    root, remote = tmp_path / "ckpt", tmp_path / "remote"
    root.mkdir()
    with short_tempdir() as sock_dir:
        a = _daemon(tmp_path / "a", sock_dir, root, remote, "node-a", lease_timeout="2s")
        b = _daemon(tmp_path / "b", sock_dir, root, remote, "node-b", lease_timeout="2s")
        try:
            a.start()
            b.start()
            wait_until(lambda: _root_status(a)["acting"], 15, "node-a to act")
            forge(root, MAX_GENERATION - 1)
            wait_until(lambda: not _root_status(a)["acting"], 15, "node-a to stand down")
            wait_until(lambda: _root_status(a)["acting"] or _root_status(b)["acting"], 30,
                       "a daemon to take the root back")
            holder = a if _root_status(a)["acting"] else b
            assert a.events("lease_claims_retired") or b.events("lease_claims_retired")
            save_single(root, 30)
            holder.wait_for("r", 30, "valid")
            doc = json.loads((root / ".ckptd" / "lease.json").read_text())
            # generation 1, or a few more where a loaded machine stalled a renewal since
            assert doc["token"] != FORGED and doc["gen"] < 10
        finally:
            a.stop()
            b.stop()
