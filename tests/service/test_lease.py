"""One daemon acts on a root at a time: the root lease (`<root>/.ckptd/lease.json`).

The rule is a pure function (tabled below); the rest runs real `ckptd run` processes on one
root: one acts, the other stands by and answers `latest`, takes over when the holder is killed
or stops, and a lease left by a daemon on another machine is taken once it goes stale.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from support.ckpts import save_single
from support.clock import FakeClock
from support.fixtures import short_tempdir
from support.leases import _daemon, _root_status
from support.wait import wait_until

from ckptd.client import Client, ClientError
from ckptd.cluster.lease import Holder, Judgement, Me, Seen, Verdict, judge
from ckptd.config import RootConfig
from ckptd.service.lease import Leases
from ckptd.store import Store

ME = Me(token="a" * 32, host="node-a", boot="boot-1")
OTHER = "b" * 32


def holder(token: str = OTHER, gen: int = 3, host: str = "node-b", released: bool = False
           ) -> Holder:
    return Holder(gen=gen, token=token, node=host, pid=4242, host=host, boot="boot-9",
                  since=1.0, released=released)


@pytest.mark.parametrize(("seen", "quiet_for", "alive", "verdict", "why"), [
    (Seen(0, None, None, ()), 0, None, Verdict.TAKE, "no daemon"),
    (Seen(3, ME.token, holder(ME.token), ()), 999, None, Verdict.HOLD, "ours"),
    (Seen(3, OTHER, holder(), ()), 5, None, Verdict.STANDBY, "held by another"),
    (Seen(3, OTHER, holder(), ()), 30, None, Verdict.TAKE, "not renewed for 30s"),
    (Seen(3, OTHER, holder(released=True), ()), 0, None, Verdict.TAKE, "released"),
    # released by this very daemon: taken afresh (create-only), never resumed
    (Seen(3, ME.token, holder(ME.token, released=True), ()), 0, None, Verdict.TAKE, "released"),
    (Seen(3, OTHER, holder(), ()), 0, False, Verdict.TAKE, "process on this machine is gone"),
    (Seen(3, OTHER, holder(), ()), 0, True, Verdict.STANDBY, "held by another"),
    # lease.json still names an older generation: only time decides (the new one is starting)
    (Seen(4, OTHER, holder(released=True), ()), 0, False, Verdict.STANDBY, "held by another"),
    # a torn look (claims listed before another daemon claimed 4, lease.json read after it
    # wrote it): never "ours" by the old claim, though that claim holds this daemon's token
    (Seen(3, ME.token, holder(gen=4), ()), 0, None, Verdict.STANDBY, "newer generation"),
    (Seen(3, OTHER, holder(gen=4), ()), 5, True, Verdict.STANDBY, "newer generation"),
    (Seen(3, ME.token, holder(gen=4), ()), 30, None, Verdict.TAKE, "never claimed"),
    # a damaged lease.json: judged by the claim and by time
    (Seen(3, None, None, ()), 29, None, Verdict.STANDBY, "held by another"),
    (Seen(3, None, None, ()), 31, None, Verdict.TAKE, "not renewed"),
])
def test_the_lease_rule(seen: Seen, quiet_for: float, alive: bool | None, verdict: Verdict,
                        why: str) -> None:
    j = judge(ME, seen, changed_at=100.0, now=100.0 + quiet_for, timeout=30.0,
              process_alive=alive)
    assert j == Judgement(verdict, j.why) and why in j.why


@pytest.mark.parametrize("doc", [
    None, [], {"format": "ckptd-lease/1"}, {**holder().as_json(), "gen": 0},
    {**holder().as_json(), "pid": True}, {**holder().as_json(), "token": "x" * 8},
    {**holder().as_json(), "node": "n" * 300}, {**holder().as_json(), "since": float("nan")},
    # `since` is shown as a date in `status`: what no date can be is refused here
    {**holder().as_json(), "since": float("inf")}, {**holder().as_json(), "since": 1e300},
    {**holder().as_json(), "since": -1.0}, {**holder().as_json(), "since": 10**400},
    {**holder().as_json(), "format": "other/1"},
])
def test_a_damaged_lease_document_is_refused(doc: Any) -> None:
    with pytest.raises(ValueError):
        Holder.from_json(doc)
    assert Holder.from_json(holder().as_json()) == holder()


# -- real daemons on one root ---------------------------------------------------------------------


def _uploads(remote: Path) -> list[str]:
    return sorted(p.name for p in remote.rglob("MANIFEST.json"))


@pytest.fixture
def pair(tmp_path: Path) -> Any:
    with short_tempdir() as sock_dir:
        root, remote = tmp_path / "ckpt", tmp_path / "remote"
        root.mkdir()
        # A lease timeout far above any stall of a loaded machine: every takeover these tests
        # see is by a release or a holder gone, never by staleness.
        made = [_daemon(tmp_path / "a", sock_dir, root, remote, "node-a", lease_timeout="60s"),
                _daemon(tmp_path / "b", sock_dir, root, remote, "node-b", lease_timeout="60s")]
        try:
            yield root, remote, made
        finally:
            for d in made:
                d.stop()


def test_two_daemons_on_one_root_one_acts_the_other_stands_by_and_takes_over(pair: Any) -> None:
    root, remote, (a, b) = pair
    a.start()
    b.start()
    assert _root_status(a)["holder"]["node"] == "node-a" and _root_status(a)["acting"]
    st = _root_status(b)
    assert st["holder"]["node"] == "node-a" and st["holder"]["pid"] == a.proc.pid
    assert not st["acting"] and not st["holder"]["this_daemon"]
    assert b.events("lease_standby")

    save_single(root, 10)
    a.wait_for("r", 10, "valid")
    assert a.client.wait("r", 10, until="uploaded", timeout=30)
    # The standby answers latest from what the holder published, and changes nothing itself.
    # latest.json is rewritten by the effects after the upload's transition commits, and a
    # wait may answer between the two: wait for the document that names the remote copy.
    standby = Client(b.socket, timeout=5)
    wait_until(lambda: (standby.latest("r", tier="remote") or {}).get("step") == 10, 15,
               "the standby to answer latest")
    assert [(standby.latest("r", tier=t) or {}).get("step") for t in ("local", "remote")] == [
        10, 10]  # the published step has a copy in both tiers (answers.in_tier)
    with pytest.raises(ClientError) as refused:
        b.client.pin("r", 10)
    assert refused.value.status == 409 and "node-a" in str(refused.value)
    assert Client(b.socket, timeout=5).checkpoint("r", 10) is None  # never scanned by the standby
    started = time.monotonic()
    with pytest.raises(ClientError) as refused:  # a wait is refused, not waited out
        b.client.wait("r", 10, timeout=30)
    assert refused.value.status == 409 and time.monotonic() - started < 5

    a.kill9()
    # Same machine, holder's process gone: taken at the standby's next look, not after 60s.
    wait_until(lambda: _root_status(b)["acting"], 20, "the standby to take over")
    (took,) = b.events("lease_acquired")[-1:]
    assert "gone" in took["why"] and "node-a" in took["previous"]
    save_single(root, 20)
    b.wait_for("r", 20, "valid")
    assert b.client.wait("r", 20, until="uploaded", timeout=30)
    # Step 10 (uploaded by a) is checked against its remote copy by b, in no set order with 20.
    assert b.client.wait("r", 10, until="uploaded", timeout=30)
    rec = b.client.checkpoint("r", 10)
    assert rec is not None and rec["remote"] == "uploaded" and not rec["adopted"]
    assert _uploads(remote) == ["MANIFEST.json", "MANIFEST.json"]  # once each, no double upload
    assert b.client.pin("r", 20)


def test_a_clean_stop_hands_the_root_over_at_once(pair: Any) -> None:
    root, _, (a, b) = pair
    a.start()
    b.start()
    assert not _root_status(b)["acting"]
    started = time.monotonic()
    assert a.stop() == 0
    # a marked the lease released as it stopped. Not read back from lease.json: the standby
    # may have taken the root (and rewritten the file) between a's release and its exit.
    assert [e["root"] for e in a.events("lease_released")] == ["r"]
    doc = json.loads((root / ".ckptd" / "lease.json").read_text())
    assert (doc["node"], doc["released"]) in {("node-a", True), ("node-b", False)}, doc
    wait_until(lambda: _root_status(b)["acting"], 20, "the standby to take over")
    assert time.monotonic() - started < 30.0  # long before the lease could go stale (60s)
    assert "released by its holder" in b.events("lease_acquired")[-1]["why"]  # a's mark, read


def test_a_lease_held_on_another_machine_is_taken_once_stale(tmp_path: Path) -> None:
    root, remote = tmp_path / "ckpt", tmp_path / "remote"
    (root / ".ckptd").mkdir(parents=True)
    save_single(root, 5)
    os.utime(root / "model_step_5.pt", (time.time() - 60, time.time() - 60))
    other = Holder(gen=7, token="c" * 32, node="far", pid=1, host="far-host", boot="x",
                   since=time.time() - 3600)
    (root / ".ckptd" / "lease.claim.7").write_text(other.token)
    (root / ".ckptd" / "lease.json").write_text(json.dumps(other.as_json()))
    with short_tempdir() as sock_dir:
        d = _daemon(tmp_path / "d", sock_dir, root, remote, "near", lease_timeout="3s")
        try:
            d.start()
            st = _root_status(d)
            assert st["holder"]["node"] == "far" and not st["acting"]
            assert Client(d.socket, timeout=5).checkpoint("r", 5) is None
            wait_until(lambda: _root_status(d)["acting"], 15, "a takeover of the stale lease")
            assert "not renewed" in d.events("lease_acquired")[-1]["why"]
            rec = d.wait_for("r", 5, "valid")
            # Another ckptd acted on this root before: its checkpoints are not adopted.
            assert not rec["adopted"]
            assert (root / ".ckptd" / "lease.claim.8").read_text() != other.token
            assert not (root / ".ckptd" / "lease.claim.7").exists()
            assert json.loads((root / ".ckptd" / "lease.json").read_text())["gen"] == 8
        finally:
            d.stop()


def test_a_ckptd_dir_that_is_a_symlink_is_never_followed(tmp_path: Path) -> None:
    root, outside = tmp_path / "ckpt", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    (root / ".ckptd").symlink_to(outside)
    with short_tempdir() as sock_dir:
        d = _daemon(tmp_path / "d", sock_dir, root, tmp_path / "remote", "n1")
        try:
            d.start()
            st = _root_status(d)
            assert not st["acting"] and "symlink" in (st["last_error"] or "")
            assert list(outside.iterdir()) == []
            assert d.events("lease_failed")
        finally:
            d.stop()


# -- the lease service in this process, on real files and a real Store ---------------------------


class _Roots:
    """A daemon's configured roots, changed by a reload."""

    def __init__(self, *roots: RootConfig) -> None:
        self.now = {r.name: r for r in roots}

    def __call__(self) -> dict[str, RootConfig]:
        return dict(self.now)


def _leases(state: Path, roots: _Roots, node: str, timeout: float = 30.0,
            clock: FakeClock | None = None) -> Leases:
    """A lease service on a clock the test moves (`leases.clock.advance`): staleness and
    renewal deadlines come by a call, never by waiting them out."""
    return Leases(Store(state / node / "state.db"), roots, lambda: node, lambda: timeout,
                  clock=clock or FakeClock())


def clock(leases: Leases) -> FakeClock:
    assert isinstance(leases.clock, FakeClock)
    return leases.clock


def _damage(own: Path, how: str) -> None:
    if how == ".ckptd is a file":
        own.write_text("x")
        return
    if how == ".ckptd is a dangling symlink":
        own.symlink_to(own.parent / "nowhere")
        return
    own.mkdir()
    lease, claim = own / "lease.json", own / "lease.claim.3"
    {"lease.json is a directory": lambda: lease.mkdir(),
     "lease.json is a FIFO": lambda: os.mkfifo(lease),
     "lease.json is huge": lambda: lease.write_bytes(b"{" * (4 << 20)),
     "lease.json nests deeply": lambda: lease.write_bytes(b"[" * 60_000),
     "lease.json is binary junk": lambda: lease.write_bytes(bytes(range(256)) * 64),
     "lease.json has wrong types": lambda: lease.write_text(json.dumps(
         {**holder().as_json(), "gen": "3", "pid": 1e400, "since": 10**400})),
     "a claim is a directory": lambda: claim.mkdir(),
     "a claim is a FIFO": lambda: os.mkfifo(claim),
     "a claim is a symlink": lambda: claim.symlink_to("/etc/passwd"),
     "a claim has an odd name": lambda: (own / "lease.claim.-1").write_text("a" * 32),
     "a claim holds junk": lambda: claim.write_bytes(b"\xff" * 100_000),
     }[how]()


@pytest.mark.parametrize("how", [
    ".ckptd is a file", ".ckptd is a dangling symlink", "lease.json is a directory",
    "lease.json is a FIFO", "lease.json is huge", "lease.json nests deeply",
    "lease.json is binary junk", "lease.json has wrong types", "a claim is a directory",
    "a claim is a FIFO", "a claim is a symlink", "a claim has an odd name", "a claim holds junk",
])
def test_damaged_lease_files_never_stop_the_lease_service(tmp_path: Path, how: str) -> None:
    """Whatever lies in `.ckptd`: the service's look returns at once, the root is acted on
    (once the lease is stale, where a claim cannot be read) or its problem is said, and nothing
    but an outdated claim is removed."""
    root = tmp_path / "ckpt"
    root.mkdir()
    own = root / ".ckptd"
    _damage(own, how)
    if own.is_dir() and not own.is_symlink():
        (own / "keep.me").write_text("not ckptd's")
    leases = _leases(tmp_path, _Roots(RootConfig(name="r", path=root)), "n1", timeout=0.3)
    started = time.monotonic()
    leases.tick()
    clock(leases).advance(0.35)  # past the timeout: a lease it cannot read is stale now
    leases.tick()
    assert time.monotonic() - started < 5
    problem = leases.problem("r")
    assert leases.holds("r") or problem, how
    if problem:
        assert problem == leases.store.root_info("r")["last_error"] and "Traceback" not in problem
    leases.holder_json("r")  # shown by status: never raises
    assert (own / "keep.me").exists() or not own.is_dir()
    assert Path("/etc/passwd").is_file()


def test_a_lease_json_that_is_a_directory_is_said_and_not_acted_on(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    (root / ".ckptd" / "lease.json").mkdir(parents=True)
    leases = _leases(tmp_path, _Roots(RootConfig(name="r", path=root)), "n1")
    leases.tick()
    assert not leases.holds("r")
    assert "lease.json" in (leases.problem("r") or "")
    assert (root / ".ckptd" / "lease.json").is_dir()


def test_the_last_generation_is_retired_once_stale_not_kept_for_good(tmp_path: Path) -> None:
    """A claim of the highest generation there can be (put there by hand): once nobody renews
    it, it is retired and the root taken at generation 1; it never keeps the root for good
    (it used to: 'remove the lease.claim.* files by hand'), and only claims are removed."""
    root = tmp_path / "ckpt"
    (root / ".ckptd").mkdir(parents=True)
    (root / ".ckptd" / f"lease.claim.{2**62 - 1}").write_text(OTHER)
    (root / ".ckptd" / "lease.claim.5").write_text(OTHER)
    (root / ".ckptd" / "keep.me").write_text("not ckptd's")
    leases = _leases(tmp_path, _Roots(RootConfig(name="r", path=root)), "n1", timeout=0.3)
    leases.tick()
    assert not leases.holds("r")
    clock(leases).advance(0.29)
    leases.tick()
    assert not leases.holds("r")  # not stale yet
    clock(leases).advance(0.02)
    leases.tick()
    assert leases.holds("r"), "the stale claim retired"
    assert leases.problem("r") is None
    assert sorted(p.name for p in (root / ".ckptd").iterdir()) == [
        "keep.me", "lease.claim.1", "lease.json"]
    assert json.loads((root / ".ckptd" / "lease.json").read_text())["gen"] == 1


def _acting(*leases: Leases) -> list[str]:
    return [lz.node() for lz in leases if lz.holds("r")]


def test_two_daemons_starting_at_the_same_instant_one_acts(tmp_path: Path) -> None:
    """Their looks at a free root, at one its holder released, and at a stale one run at once
    in two threads (many times): exactly one acts every time, and it stays the one."""
    stores = {n: Store(tmp_path / n / "state.db") for n in ("a", "b")}
    # One clock for both, moved by hand: a stalled look never turns into a takeover, and a
    # stale lease is one `advance` away.
    now = FakeClock()
    for i in range(25):
        root = tmp_path / f"ckpt{i}"
        root.mkdir()
        roots = _Roots(RootConfig(name="r", path=root))
        pair = [Leases(stores[n], roots, lambda n=n: n, lambda: 60.0,  # type: ignore[misc]
                       clock=now) for n in ("a", "b")]
        for round_ in range(3 if i < 5 else 2):  # a stale lease only takes waiting out
            gate = threading.Barrier(2)

            def tick(lz: Leases, gate: threading.Barrier = gate) -> None:
                gate.wait()
                lz.tick()

            threads = [threading.Thread(target=tick, args=(lz,)) for lz in pair]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            (one,) = _acting(*pair)
            for lz in pair * 3:  # interleaved looks change nothing
                lz.tick()
                assert _acting(*pair) == [one]
            if round_ == 0:  # next: a lease released by its holder, taken by both at once
                next(lz for lz in pair if lz.node() == one).release()
            elif round_ == 1 and i < 5:  # next: a third daemon's lease, never renewed
                held = json.loads((root / ".ckptd" / "lease.json").read_text())
                (root / ".ckptd" / f"lease.claim.{held['gen'] + 1}").write_text("d" * 32)
                for lz in pair:
                    lz.tick()
                assert _acting(*pair) == []
                now.advance(61.0)  # never renewed: stale at the next look
    for store in stores.values():
        store.close()


def test_a_root_that_disappears_and_reappears_is_taken_again(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    root.mkdir()
    leases = _leases(tmp_path, _Roots(RootConfig(name="r", path=root)), "n1", timeout=0.4)
    leases.tick()
    assert leases.holds("r")
    shutil.rmtree(root)
    leases.tick()
    assert "does not exist" in leases.store.root_info("r")["last_error"]
    clock(leases).advance(0.19)
    assert leases.holds("r")
    # just past half the timeout without a renewal: it stops acting (not at exactly half:
    # the clock starts at the real monotonic time, so `start + 0.2 - start` may round below 0.2)
    clock(leases).advance(0.02)
    assert not leases.holds("r")
    root.mkdir()
    leases.tick()
    assert leases.holds("r") and leases.problem("r") is None
    assert leases.store.root_info("r")["last_error"] == ""


def test_a_holder_whose_renewal_fails_stops_acting_within_half_the_timeout(
        tmp_path: Path) -> None:
    """`.ckptd` replaced by a file while the daemon holds the root: it cannot renew; within
    lease_timeout/2 of its last renewal it no longer acts, though it keeps looking."""
    root = tmp_path / "ckpt"
    root.mkdir()
    timeout = 0.6
    leases = _leases(tmp_path, _Roots(RootConfig(name="r", path=root)), "n1", timeout=timeout)
    leases.tick()
    renewed = clock(leases).monotonic()
    assert leases.holds("r")
    shutil.rmtree(root / ".ckptd")
    (root / ".ckptd").write_text("not a directory")
    for _ in range(100):  # looks 20 ms apart, as the service's loop makes them
        if not leases.holds("r"):
            break
        leases.tick()
        clock(leases).advance(0.02)
    stopped_after = clock(leases).monotonic() - renewed
    assert timeout / 2 - 1e-9 <= stopped_after <= timeout / 2 + 0.02 + 1e-9  # one look late
    assert "not a directory" in (leases.problem("r") or "").lower()
    (root / ".ckptd").unlink()
    leases.tick()
    assert leases.holds("r") and leases.store.root_info("r")["last_error"] == ""


def test_a_root_removed_or_moved_by_a_reload_is_released_at_once(tmp_path: Path) -> None:
    """A reload that drops a root, or points its name at another path: the lease held on the
    old path is released (another daemon takes it at once), and the new path is acted on only
    once its own lease is held."""
    old, new, other = tmp_path / "old", tmp_path / "new", tmp_path / "other"
    for d in (old, new, other):
        d.mkdir()
    roots = _Roots(RootConfig(name="r", path=old), RootConfig(name="o", path=other))
    a = _leases(tmp_path, roots, "a")
    a.tick()
    assert a.holds("r") and a.holds("o")
    b = _leases(tmp_path, _Roots(RootConfig(name="r", path=old)), "b")
    b.tick()
    assert not b.holds("r")

    roots.now["r"] = RootConfig(name="r", path=new)  # the reload
    assert not a.holds("r") and "r" not in a.acting()  # before its next look
    a.tick()
    assert json.loads((old / ".ckptd" / "lease.json").read_text())["released"]
    assert a.holds("r") and json.loads((new / ".ckptd" / "lease.json").read_text())["node"] == "a"
    b.tick()
    assert b.holds("r")  # at once, not after the 30s timeout

    del roots.now["o"]
    a.tick()
    assert json.loads((other / ".ckptd" / "lease.json").read_text())["released"]
    assert not a.holds("o")
