"""The metrics that say whether saves are safe remotely, read from a real daemon's `/metrics`
(its Unix socket) with a real file:// remote: the latest uploaded and remote-verified steps,
`ckptd_unsafe_seconds` from the store's own timestamps (so across a restart too), the
time-to-safe histogram observed once per save, the root's lease, min_free in bytes, and
invalid checkpoints by reason."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families
from support.ckpts import flip_byte, save_single
from support.fixtures import running_daemon
from support.wait import wait_scans, wait_until

from ckptd.client import Client
from ckptd.lifecycle.table import Event
from ckptd.model import Reason

MIN_FREE = 5 * 1024**2


def scrape(client: Client) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """(sample name, sorted labels) -> value, parsed by prometheus_client's own parser."""
    status, text = client.request("GET", "/metrics")
    assert status == 200
    return {(s.name, tuple(sorted(s.labels.items()))): float(s.value)
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def value(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str,
          **labels: str) -> float | None:
    return samples.get((name, tuple(sorted(labels.items()))))


def root_cfg(remote: Path, **extra: Any) -> dict[str, Any]:
    return {"name": "r1", "upload": {"url": f"file://{remote}"},
            "retention": {"local": {"min_free": "5MiB"}}, **extra}


def test_a_remote_verified_step_shows_in_every_new_series(inproc_daemon: Any,
                                                         tmp_path: Path) -> None:
    d = inproc_daemon(roots=[root_cfg(tmp_path / "remote")])
    c = d.client
    save_single(d.roots["r1"], 10)
    assert c.wait("r1", 10, until="uploaded", timeout=60)
    m = scrape(c)
    assert value(m, "ckptd_latest_step", root="r1") == 10
    assert value(m, "ckptd_latest_uploaded_step", root="r1") == 10
    assert value(m, "ckptd_latest_remote_verified_step", root="r1") == 10
    assert value(m, "ckptd_steps_since_remote_verified", root="r1") == 0
    assert value(m, "ckptd_unsafe_seconds", root="r1") == 0
    assert value(m, "ckptd_root_held", root="r1") == 1
    assert value(m, "ckptd_min_free_bytes", root="r1") == MIN_FREE
    assert value(m, "ckptd_disk_free_bytes", root="r1") is not None
    saved = value(m, "ckptd_compression_saved_bytes", root="r1")
    assert saved is not None and saved >= 0

    # Observed once, from the save found complete to the upload's commit (the hook runs just
    # after the transition is logged, and before this scrape).
    rec = d.store.checkpoint("r1", 10)
    uploaded_at = d.store.reached("r1", Event.UPLOADED)[10]
    assert value(m, "ckptd_time_to_safe_seconds_count", root="r1") == 1
    took = value(m, "ckptd_time_to_safe_seconds_sum", root="r1")
    assert took is not None and uploaded_at - rec.completed <= took <= time.time() - rec.completed
    assert value(m, "ckptd_time_to_safe_seconds_bucket", root="r1", le="14400.0") == 1
    assert value(m, "ckptd_time_to_safe_seconds_bucket", root="r1", le="+Inf") == 1

    wait_scans(c, wake=d.wake_scan)  # later scans and scrapes observe nothing again
    assert value(scrape(c), "ckptd_time_to_safe_seconds_count", root="r1") == 1
    save_single(d.roots["r1"], 20)
    flip_byte(save_single(d.roots["r1"], 30))
    assert c.wait("r1", 20, until="uploaded", timeout=60)
    assert d.wait_for("r1", 30)["state"] == "invalid"
    m = scrape(c)
    assert value(m, "ckptd_time_to_safe_seconds_count", root="r1") == 2
    assert value(m, "ckptd_latest_remote_verified_step", root="r1") == 20
    assert value(m, "ckptd_steps_since_remote_verified", root="r1") == 0  # 30 is invalid
    invalid = {dict(labels)["reason"]: v for (name, labels), v in m.items()
               if name == "ckptd_invalid_checkpoints" and dict(labels)["root"] == "r1"}
    assert sum(invalid.values()) == 1 and set(invalid) <= {r.value for r in Reason}, invalid


def test_unsafe_seconds_while_the_remote_is_unreachable_and_after_a_restart(
        inproc_daemon: Any, tmp_path: Path) -> None:
    remote = tmp_path / "remote"
    remote.write_text("a file where the remote directory should be\n")  # every put fails
    d = inproc_daemon(roots=[root_cfg(remote)])
    c = d.client
    save_single(d.roots["r1"], 10)
    assert d.wait_for("r1", 10)["state"] == "valid"
    wait_until(lambda: (value(scrape(c), "ckptd_errors_total", kind="upload") or 0) >= 1,
               30, "an upload error")
    valid_at = d.store.reached("r1", Event.VALIDATED)[10]

    def unsafe_now() -> float:
        """The gauge, checked against the stored valid time on both sides of the scrape."""
        before = time.time()
        got = value(scrape(c), "ckptd_unsafe_seconds", root="r1")
        after = time.time()
        assert got is not None and before - valid_at <= got <= after - valid_at, (got, valid_at)
        return got

    assert unsafe_now() > 0
    m = scrape(c)
    assert value(m, "ckptd_latest_step", root="r1") == 10
    assert value(m, "ckptd_latest_uploaded_step", root="r1") is None  # unknown: left out
    assert value(m, "ckptd_latest_remote_verified_step", root="r1") is None
    assert value(m, "ckptd_steps_since_remote_verified", root="r1") == 10
    assert value(m, "ckptd_time_to_safe_seconds_count", root="r1") == 0  # none observed yet

    d.restart()  # the wait is the store's: a new process reads the same valid time
    wait_until(lambda: value(scrape(c), "ckptd_root_held", root="r1") == 1, 30, "the lease")
    assert unsafe_now() > 0
    assert d.store.reached("r1", Event.VALIDATED)[10] == valid_at


def test_root_held_by_one_daemon_of_two(inproc_daemon: Any, tmp_path: Path) -> None:
    """Two daemons configured with one root: the holder says 1, the one standing by 0 (so
    `max by (root) (ckptd_root_held) == 0` finds a root nobody acts on), and only the holder
    exports how long its steps wait."""
    remote = tmp_path / "remote"
    a = inproc_daemon(roots=[root_cfg(remote)])
    (tmp_path / "b").mkdir()
    with running_daemon(tmp_path / "b", roots=[root_cfg(remote, path=str(a.roots["r1"]))]) as b:
        wait_until(lambda: b.events("lease_standby"), 30, "b to stand by")
        ma, mb = scrape(a.client), scrape(b.client)
        assert value(ma, "ckptd_root_held", root="r1") == 1
        assert value(mb, "ckptd_root_held", root="r1") == 0
        assert value(ma, "ckptd_unsafe_seconds", root="r1") == 0
        assert value(mb, "ckptd_unsafe_seconds", root="r1") is None
        assert value(mb, "ckptd_min_free_bytes", root="r1") == MIN_FREE
