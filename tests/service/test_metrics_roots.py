"""Every per-root series is exported for each configured root from the first scrape of a real
daemon's `/metrics` (its Unix socket), before anything happened: counters and histograms at 0,
gauges at 0 where 0 is a fact, and absent only where 0 would be a made-up value (a step
number, a ratio). A root added by reload gets them at once; a root removed loses them, and
one that comes back starts again from 0 (`Metrics.set_roots`, which the daemon calls)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families
from support.config import root_table

from ckptd.client import Client
from ckptd.model import Reason, State
from ckptd.service.metrics import Metrics

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]

# Per-root series at 0 on a fresh root, with the labels beside `root` they carry.
AT_ZERO = [
    ("ckptd_bytes_read_total", {}), ("ckptd_bytes_written_total", {}),
    ("ckptd_bytes_uploaded_total", {}), ("ckptd_time_to_safe_seconds_count", {}),
    ("ckptd_time_to_safe_seconds_sum", {}), ("ckptd_time_to_safe_seconds_bucket", {"le": "+Inf"}),
    ("ckptd_bad_inputs", {"kind": "metadata"}), ("ckptd_bad_inputs", {"kind": "remote"}),
    ("ckptd_queue_depth", {}), ("ckptd_preflight_warning", {}),
    ("ckptd_compression_saved_bytes", {}),
    *[("ckptd_checkpoints", {"state": s.value}) for s in State],
    *[("ckptd_invalid_checkpoints", {"reason": r.value}) for r in Reason],
]
# Absent until known: 0 would be a step that never was, or a ratio of nothing.
ABSENT = ["ckptd_latest_step", "ckptd_latest_uploaded_step",
          "ckptd_latest_remote_verified_step", "ckptd_compression_ratio"]


def scrape(client: Client) -> Samples:
    status, text = client.request("GET", "/metrics")
    assert status == 200
    return {(s.name, tuple(sorted(s.labels.items()))): float(s.value)
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def value(samples: Samples, name: str, **labels: str) -> float | None:
    return samples.get((name, tuple(sorted(labels.items()))))


def roots_in(samples: Samples) -> set[str]:
    return {dict(labels)["root"] for _, labels in samples if "root" in dict(labels)}


def assert_fresh(samples: Samples, root: str, remote: bool) -> None:
    missing = [(name, labels) for name, labels in AT_ZERO
               if value(samples, name, root=root, **labels) != 0]
    assert not missing, f"{root}: not exported at 0: {missing}"
    for name in ABSENT:
        assert value(samples, name, root=root) is None, (root, name)
    assert value(samples, "ckptd_root_held", root=root) in (0, 1)  # 0 until its lease is taken
    assert value(samples, "ckptd_disk_free_bytes", root=root) is not None
    assert value(samples, "ckptd_min_free_bytes", root=root) is not None
    # Steps and seconds not yet safe remotely: none yet where there is a remote; no such
    # thing where there is none (absent, as the metrics table says).
    for name in ("ckptd_steps_since_remote_verified", "ckptd_unsafe_seconds"):
        assert value(samples, name, root=root) == (0 if remote else None), (root, name)


def test_a_fresh_daemon_exports_every_per_root_series_for_each_root(inproc_daemon: Any,
                                                                   tmp_path: Path) -> None:
    d = inproc_daemon(roots=[{"name": "llm", "upload": {"url": f"file://{tmp_path / 'remote'}"}},
                             {"name": "vit"}])
    m = scrape(d.client)
    assert roots_in(m) == {"llm", "vit"}
    assert_fresh(m, "llm", remote=True)
    assert_fresh(m, "vit", remote=False)
    assert value(m, "ckptd_root_held", root="llm") == value(m, "ckptd_root_held", root="vit") == 1


def test_a_root_added_by_reload_is_exported_at_once_and_a_removed_one_is_gone(
        inproc_daemon: Any, tmp_path: Path) -> None:
    d = inproc_daemon(roots=[{"name": "llm"}, {"name": "vit"}])
    assert roots_in(scrape(d.client)) == {"llm", "vit"}
    text = d.config.read_text()
    head, *tables = text.split("\n[[roots]]")
    kept = [t for t in tables if 'name = "vit"' not in t]
    assert len(kept) == 1
    new_path = tmp_path / "roots" / "bert"
    new_path.mkdir(parents=True)
    d.config.write_text(head + "".join("\n[[roots]]" + t for t in kept)
                        + root_table("bert", new_path))
    assert d.reload() is True
    m = scrape(d.client)
    assert roots_in(m) == {"llm", "bert"}
    assert_fresh(m, "bert", remote=False)


def test_set_roots_starts_new_roots_at_0_and_a_returning_root_from_0() -> None:
    m = Metrics(process=False)
    m.set_roots(["a", "b"])
    m.add_bytes("read", "a", 5)
    m.observe_safe("a", 3.0)
    m.bad_inputs("a", "metadata", 2)
    m.set_roots(["a", "b"])  # a reload that changes nothing keeps the counts
    assert value(parsed(m), "ckptd_bytes_read_total", root="a") == 5
    m.set_roots(["b"])
    assert "a" not in roots_in(parsed(m))
    m.set_roots(["a", "b"])
    fresh = parsed(m)
    for name, labels in [("ckptd_bytes_read_total", {}), ("ckptd_time_to_safe_seconds_count", {}),
                         ("ckptd_bad_inputs", {"kind": "metadata"})]:
        assert value(fresh, name, root="a", **labels) == 0, name


def parsed(m: Metrics) -> Samples:
    return {(s.name, tuple(sorted(s.labels.items()))): float(s.value)
            for fam in text_string_to_metric_families(m.render()) for s in fam.samples}
