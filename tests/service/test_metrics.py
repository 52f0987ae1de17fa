"""Metrics: the text rendering, parsed back with the Prometheus client's own parser, and the
optional TCP listener that serves /metrics and nothing else."""

from __future__ import annotations

import http.client
import threading
from collections.abc import Iterator

import pytest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample
from support.clock import FakeClock

from ckptd.errors import ConfigError
from ckptd.service.metrics import Metrics, MetricsServer, RootSample
from ckptd.service.supervisor import Calls


def set_roots(metrics: Metrics, *roots: RootSample) -> None:
    """What the daemon's store reads would answer at the next scrape."""
    metrics.set_samples(lambda: roots)


def samples(metrics: Metrics) -> dict[str, list[Sample]]:
    """Samples by family name, from the rendered text."""
    return {f.name: f.samples for f in text_string_to_metric_families(metrics.render())}


def value(metrics: Metrics, sample: str, **labels: str) -> float | None:
    for fam in text_string_to_metric_families(metrics.render()):
        for s in fam.samples:
            if s.name == sample and s.labels == labels:
                return float(s.value)
    return None


def test_every_family_is_exported_with_its_type() -> None:
    m = Metrics()
    m.add_bytes("read", "llm-7b", 1)
    m.add_bytes("written", "llm-7b", 1)
    m.add_bytes("uploaded", "llm-7b", 1)
    m.observe_stage("validate", 1.0)
    m.error("scan")
    m.observe_safe("llm-7b", 30.0)
    set_roots(m, RootSample("llm-7b", counts={}, queue=0, disk_free=1, latest=1,
                            steps_since_remote=1, ratio=0.5, newest_committed=1, remote_latest=1,
                            unsafe_s=0.0, min_free=1, saved=1, invalid={"nan": 1}))
    types = {f.name: f.type for f in text_string_to_metric_families(m.render())}
    expected = {
        "ckptd_checkpoints": "gauge", "ckptd_stage_duration_seconds": "histogram",
        "ckptd_bytes_read": "counter", "ckptd_bytes_written": "counter",
        "ckptd_bytes_uploaded": "counter", "ckptd_compression_ratio": "gauge",
        "ckptd_queue_depth": "gauge", "ckptd_steps_since_remote_verified": "gauge",
        "ckptd_disk_free_bytes": "gauge", "ckptd_preflight_warning": "gauge",
        "ckptd_errors": "counter", "ckptd_latest_step": "gauge", "ckptd_up": "gauge",
        "ckptd_build_info": "gauge", "ckptd_config_last_reload_successful": "gauge",
        "process_resident_memory_bytes": "gauge",
        "ckptd_latest_uploaded_step": "gauge", "ckptd_latest_remote_verified_step": "gauge",
        "ckptd_unsafe_seconds": "gauge", "ckptd_time_to_safe_seconds": "histogram",
        "ckptd_root_held": "gauge", "ckptd_min_free_bytes": "gauge",
        "ckptd_compression_saved_bytes": "gauge", "ckptd_invalid_checkpoints": "gauge",
    }
    assert {k: types.get(k) for k in expected} == expected


def test_root_gauges_carry_labels_and_values() -> None:
    m = Metrics(process=False)
    set_roots(m, RootSample("llm-7b", counts={"valid": 3, "invalid": 1}, queue=2,
                            disk_free=10**12, latest=1200, steps_since_remote=400,
                            preflight_warning=True, ratio=0.62),
              RootSample("vit", counts={"pending": 1}, queue=0))
    assert value(m, "ckptd_checkpoints", root="llm-7b", state="valid") == 3
    assert value(m, "ckptd_checkpoints", root="llm-7b", state="invalid") == 1
    assert value(m, "ckptd_checkpoints", root="llm-7b", state="pending") == 0  # never stale
    assert value(m, "ckptd_checkpoints", root="vit", state="pending") == 1
    assert value(m, "ckptd_queue_depth", root="llm-7b") == 2
    assert value(m, "ckptd_disk_free_bytes", root="llm-7b") == 10**12
    assert value(m, "ckptd_latest_step", root="llm-7b") == 1200
    assert value(m, "ckptd_steps_since_remote_verified", root="llm-7b") == 400
    assert value(m, "ckptd_preflight_warning", root="llm-7b") == 1
    assert value(m, "ckptd_preflight_warning", root="vit") == 0
    assert value(m, "ckptd_compression_ratio", root="llm-7b") == pytest.approx(0.62)
    assert value(m, "ckptd_latest_step", root="vit") is None  # unknown is absent, not 0


def test_safety_gauges_and_invalid_reasons() -> None:
    m = Metrics(process=False)
    set_roots(m, RootSample("llm-7b", counts={}, queue=0, latest=1300, newest_committed=1200,
                            remote_latest=1100, unsafe_s=42.5, held=True, min_free=10**9,
                            saved=3 * 10**8, invalid={"crc_mismatch": 2, "": 1}),
              RootSample("vit", counts={}, queue=0))
    assert value(m, "ckptd_latest_uploaded_step", root="llm-7b") == 1200
    assert value(m, "ckptd_latest_remote_verified_step", root="llm-7b") == 1100
    assert value(m, "ckptd_unsafe_seconds", root="llm-7b") == 42.5
    assert value(m, "ckptd_root_held", root="llm-7b") == 1
    assert value(m, "ckptd_min_free_bytes", root="llm-7b") == 10**9
    assert value(m, "ckptd_compression_saved_bytes", root="llm-7b") == 3 * 10**8
    assert value(m, "ckptd_invalid_checkpoints", root="llm-7b", reason="crc_mismatch") == 2
    assert value(m, "ckptd_invalid_checkpoints", root="llm-7b", reason="unknown") == 1
    assert value(m, "ckptd_root_held", root="vit") == 0  # always there: 0 is a fact
    for name in ("ckptd_latest_uploaded_step", "ckptd_latest_remote_verified_step",
                 "ckptd_unsafe_seconds", "ckptd_min_free_bytes"):
        assert value(m, name, root="vit") is None  # unknown, or no remote: absent


def test_time_to_safe_buckets_span_a_second_to_four_hours() -> None:
    m = Metrics(process=False)
    for seconds in (0.4, 90.0, 20000.0, -1.0):  # a clock step back counts as 0
        m.observe_safe("r", seconds)
    assert value(m, "ckptd_time_to_safe_seconds_count", root="r") == 4
    assert value(m, "ckptd_time_to_safe_seconds_bucket", root="r", le="1.0") == 2
    assert value(m, "ckptd_time_to_safe_seconds_bucket", root="r", le="120.0") == 3
    assert value(m, "ckptd_time_to_safe_seconds_bucket", root="r", le="14400.0") == 3
    assert value(m, "ckptd_time_to_safe_seconds_bucket", root="r", le="+Inf") == 4
    m.remove_root("r")
    assert value(m, "ckptd_time_to_safe_seconds_count", root="r") is None


def test_unknown_values_drop_their_series() -> None:
    m = Metrics(process=False)
    set_roots(m, RootSample("r", counts={}, queue=0, disk_free=5, latest=7, ratio=0.5))
    assert value(m, "ckptd_latest_step", root="r") == 7
    set_roots(m, RootSample("r", counts={}, queue=0, disk_free=None, latest=None, ratio=None))
    assert value(m, "ckptd_disk_free_bytes", root="r") is None
    assert value(m, "ckptd_latest_step", root="r") is None
    assert value(m, "ckptd_compression_ratio", root="r") is None


def test_counters_and_histogram() -> None:
    m = Metrics(process=False)
    m.add_bytes("read", "r", 100)
    m.add_bytes("read", "r", 50)
    m.add_bytes("uploaded", "r", 7)
    m.error("upload")
    m.error("upload")
    m.observe_stage("compress", 0.3)
    m.observe_stage("compress", 45.0)
    assert value(m, "ckptd_bytes_read_total", root="r") == 150
    assert value(m, "ckptd_bytes_uploaded_total", root="r") == 7
    assert value(m, "ckptd_errors_total", kind="upload") == 2
    assert value(m, "ckptd_stage_duration_seconds_count", stage="compress") == 2
    assert value(m, "ckptd_stage_duration_seconds_sum", stage="compress") == pytest.approx(45.3)
    assert value(m, "ckptd_stage_duration_seconds_bucket", stage="compress", le="0.5") == 1
    assert value(m, "ckptd_stage_duration_seconds_bucket", stage="compress", le="60.0") == 2
    with pytest.raises(ValueError):
        m.add_bytes("deleted", "r", 1)
    with pytest.raises(ValueError):
        m.add_bytes("read", "r", -1)


def test_daemon_info_and_reload() -> None:
    m = Metrics(version="9.9.9", process=False)
    assert value(m, "ckptd_up") == 1
    build = samples(m)["ckptd_build_info"][0]
    assert build.labels["version"] == "9.9.9" and build.value == 1
    m.reloaded(False, 1234.0)
    assert value(m, "ckptd_config_last_reload_successful") == 0
    assert value(m, "ckptd_config_last_reload_timestamp_seconds") == 1234.0


def test_remove_root_drops_every_series() -> None:
    m = Metrics(process=False)
    set_roots(m, RootSample("gone", counts={"valid": 1}, queue=1, disk_free=1, latest=1,
                            steps_since_remote=1, ratio=0.5))
    m.add_bytes("written", "gone", 1)
    m.add_bytes("written", "kept", 1)
    set_roots(m, RootSample("kept", counts={}, queue=0))  # the reload left it out
    m.remove_root("gone")
    assert m.roots() == {"kept"}
    assert 'root="gone"' not in m.render()
    assert 'root="kept"' in m.render()


def test_registries_are_private() -> None:
    a, b = Metrics(process=False), Metrics(process=False)
    a.error("x")
    assert value(b, "ckptd_errors_total", kind="x") is None


# -- TCP listener ------------------------------------------------------------------------------


@pytest.fixture(scope="module")  # one listener: each shutdown waits out a poll interval
def server() -> Iterator[tuple[Metrics, MetricsServer]]:
    m = Metrics(process=False)
    srv = m.serve_tcp(("127.0.0.1", 0))
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        yield m, srv
    finally:
        srv.shutdown()
        srv.close()
        t.join(5)


def get(port: int, path: str, method: str = "GET") -> tuple[int, str, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.request(method, path)
        resp = conn.getresponse()
        return resp.status, resp.getheader("Content-Type") or "", resp.read()
    finally:
        conn.close()


def test_tcp_serves_metrics_read_at_scrape_time(server: tuple[Metrics, MetricsServer]) -> None:
    m, srv = server
    set_roots(m, RootSample("r", counts={"valid": 2}, queue=0, latest=9))
    status, ctype, body = get(srv.port, "/metrics")
    assert status == 200 and ctype.startswith("text/plain")
    fams = {f.name: f for f in text_string_to_metric_families(body.decode())}
    assert "ckptd_checkpoints" in fams
    assert [s.value for s in fams["ckptd_latest_step"].samples] == [9]
    assert get(srv.port, "/metrics?name[]=ckptd_up")[0] == 200


@pytest.mark.parametrize("path", ["/", "/v1/status", "/metrics/", "/metricsx", "/favicon.ico"])
def test_tcp_serves_nothing_else(server: tuple[Metrics, MetricsServer], path: str) -> None:
    assert get(server[1].port, path)[0] == 404


@pytest.mark.parametrize("method", ["POST", "PUT", "HEAD"])
def test_tcp_rejects_other_methods(server: tuple[Metrics, MetricsServer], method: str) -> None:
    assert get(server[1].port, "/metrics", method=method)[0] == 405


def test_tcp_close_frees_the_port_and_a_taken_port_is_a_config_error() -> None:
    m = Metrics(process=False)
    srv = m.serve_tcp(("127.0.0.1", 0))
    port = srv.port
    with pytest.raises(ConfigError, match=f"metrics.listen = '127.0.0.1:{port}'"):
        m.serve_tcp(("127.0.0.1", port))  # taken: one line naming the key, exit 78
    srv.close()
    with pytest.raises(OSError):
        get(port, "/metrics")
    again = m.serve_tcp(("127.0.0.1", port))  # the port is free to bind again
    again.close()


def test_a_stuck_calls_seconds_and_the_first_load_are_on_the_daemons_clock() -> None:
    """The metrics read the clock the daemon gives them: the config load time at start, and a
    stuck call's quiet seconds as its board measures them (the same clock)."""
    clock = FakeClock()
    clock.advance(5000.0)
    calls = Calls(clock)
    m = Metrics(process=False, clock=clock)
    assert value(m, "ckptd_config_last_reload_timestamp_seconds") == clock.time()
    m.set_health(lambda: (True, calls.stuck()))
    calls.begin("worker-0", "upload", "r", 7, bound_s=900.0)
    clock.advance(1000.0)
    assert value(m, "ckptd_stuck_call_seconds", who="worker-0", stage="upload", root="r",
                 step="7") == pytest.approx(1000.0)
    assert value(m, "ckptd_degraded") == 1.0
