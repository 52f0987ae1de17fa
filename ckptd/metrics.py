"""Prometheus metrics of the daemon: a private registry, typed update methods, the text
rendering, and an optional TCP listener that serves `/metrics` and nothing else.

Owns metric names and labels; holds numbers it is handed and never reads the store itself.
"""

from __future__ import annotations

import platform
import socket
import socketserver
import threading
from collections.abc import Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Info,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.metrics import MetricWrapperBase

from ckptd import __version__
from ckptd.model import State

# Stages run from well under a second (a small file) to hours (a 1 TB upload).
STAGE_BUCKETS = (0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0,
                 3600.0, 7200.0, 14400.0)
BYTE_KINDS = ("read", "written", "uploaded")


class Metrics:
    """Every metric ckptd exports. Methods are thread-safe (prometheus_client locks)."""

    def __init__(self, version: str = __version__, process: bool = True) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._roots: set[str] = set()
        self._define_root_gauges()
        self._define_activity()
        self._define_daemon(version)
        if process:  # process_resident_memory_bytes etc.: the bounded-memory promise, visible
            ProcessCollector(registry=self.registry)

    def _gauge(self, name: str, doc: str, labels: tuple[str, ...] = ("root",)) -> Gauge:
        return Gauge(name, doc, labels, registry=self.registry)

    def _define_root_gauges(self) -> None:
        self.checkpoints = self._gauge("ckptd_checkpoints", "Checkpoints by root and state.",
                                       ("root", "state"))
        self.ratio = self._gauge("ckptd_compression_ratio",
                                 "Stored bytes / original bytes of compressed checkpoints.")
        self.queue = self._gauge("ckptd_queue_depth", "Stage work waiting to run.")
        self.steps_since_remote = self._gauge(
            "ckptd_steps_since_remote_verified",
            "Latest valid step minus the latest step uploaded and verified remotely.")
        self.disk_free = self._gauge("ckptd_disk_free_bytes", "Free bytes on the root's disk.")
        self.preflight = self._gauge("ckptd_preflight_warning",
                                     "1 when the root's preflight check warns, else 0.")
        self.latest = self._gauge("ckptd_latest_step", "Latest valid step of the root.")

    def _define_activity(self) -> None:
        self.stage_seconds = Histogram("ckptd_stage_duration_seconds", "Time a stage took.",
                                       ("stage",), buckets=STAGE_BUCKETS, registry=self.registry)
        self.bytes = {kind: Counter(f"ckptd_bytes_{kind}", f"Checkpoint bytes {kind}.",
                                    ("root",), registry=self.registry)
                      for kind in BYTE_KINDS}
        self.errors = Counter("ckptd_errors", "Errors by kind.", ("kind",),
                              registry=self.registry)

    def _define_daemon(self, version: str) -> None:
        self.up = Gauge("ckptd_up", "1 while the daemon runs.", registry=self.registry)
        self.up.set(1)
        build = Info("ckptd_build", "Version of ckptd and Python.", registry=self.registry)
        build.info({"version": version, "python": platform.python_version()})
        self.reload_ok = Gauge("ckptd_config_last_reload_successful",
                               "1 when the last config reload was applied, 0 if rejected.",
                               registry=self.registry)
        self.reload_ok.set(1)
        self.reload_time = Gauge("ckptd_config_last_reload_timestamp_seconds",
                                 "Unix time of the last config load or reload attempt.",
                                 registry=self.registry)
        self.reload_time.set_to_current_time()  # the config was loaded at start

    # -- updates -----------------------------------------------------------------------------

    def observe_stage(self, stage: str, seconds: float) -> None:
        self.stage_seconds.labels(stage).observe(seconds)

    def add_bytes(self, kind: str, root: str, n: int) -> None:
        """`kind` is read, written or uploaded; `n` is not negative."""
        counter = self.bytes.get(kind)
        if counter is None:
            raise ValueError(f"byte kind must be one of {BYTE_KINDS}, got {kind!r}")
        counter.labels(root).inc(n)

    def error(self, kind: str) -> None:
        """Count an error; `kind` is a short fixed word (scan, stage, upload, notify, ...)."""
        self.errors.labels(kind).inc()

    def reloaded(self, ok: bool, when: float) -> None:
        self.reload_ok.set(1 if ok else 0)
        self.reload_time.set(when)

    def set_root(self, root: str, *, counts: Mapping[str, int], queue: int,
                 disk_free: int | None = None, latest: int | None = None,
                 steps_since_remote: int | None = None, preflight_warning: bool = False,
                 ratio: float | None = None) -> None:
        """Replace one root's gauges. None means unknown: the series is dropped rather than
        exported as a made-up 0."""
        self._roots.add(root)
        for state in _states(counts):
            self.checkpoints.labels(root, state).set(counts.get(state, 0))
        self.queue.labels(root).set(queue)
        self.preflight.labels(root).set(1 if preflight_warning else 0)
        _set_or_drop(self.disk_free, root, disk_free)
        _set_or_drop(self.latest, root, latest)
        _set_or_drop(self.steps_since_remote, root, steps_since_remote)
        _set_or_drop(self.ratio, root, ratio)

    def remove_root(self, root: str) -> None:
        """Drop every series of a root (it left the config on reload). Counters included:
        a root that comes back starts from 0, which Prometheus' rate() handles as a reset."""
        self._roots.discard(root)
        for state in _states({}):
            _drop(self.checkpoints, root, state)
        for gauge in (self.queue, self.preflight, self.disk_free, self.latest,
                      self.steps_since_remote, self.ratio, *self.bytes.values()):
            _drop(gauge, root)

    def roots(self) -> set[str]:
        return set(self._roots)

    def render(self) -> str:
        """The Prometheus text exposition format."""
        return generate_latest(self.registry).decode()

    def serve_tcp(self, listen: str) -> MetricsServer:
        return MetricsServer(self, listen)


def _states(counts: Mapping[str, int]) -> list[str]:
    # Every known state is always exported, so a state dropping to none reads 0, not stale.
    return [s.value for s in State] + sorted(set(counts) - {s.value for s in State})


def _set_or_drop(gauge: Gauge, root: str, value: float | None) -> None:
    if value is None:
        _drop(gauge, root)
    else:
        gauge.labels(root).set(value)


def _drop(metric: MetricWrapperBase, *labels: str) -> None:
    try:
        metric.remove(*labels)
    except KeyError:
        pass


def split_listen(listen: str) -> tuple[str, int]:
    """`HOST:PORT` or `[V6]:PORT` to (host, port). Raises ValueError."""
    host, sep, port = listen.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"not a HOST:PORT address: {listen!r}")
    return host.removeprefix("[").removesuffix("]"), int(port)


class _Handler(BaseHTTPRequestHandler):
    metrics: Metrics  # set on the subclass MetricsServer builds

    def do_GET(self) -> None:
        self._answer(body=True)

    def do_HEAD(self) -> None:
        self._answer(body=False)

    def _answer(self, body: bool) -> None:
        if self.path.split("?", 1)[0] != "/metrics":
            data, status, ctype = b"not found; try /metrics\n", 404, "text/plain; charset=utf-8"
        else:
            data, status, ctype = self.metrics.render().encode(), 200, CONTENT_TYPE_LATEST
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if body:
            self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        return  # a scrape every 15 s would drown the journal


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], handler: type[_Handler]) -> None:
        # The family follows the address: binding "::1" must not fall back to IPv4 or
        # widen to every interface.
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        super().__init__(address, handler)

    def server_bind(self) -> None:
        # HTTPServer.server_bind looks up the host's FQDN: a DNS query nobody needs here.
        socketserver.TCPServer.server_bind(self)
        host, port = self.server_address[:2]
        self.server_name, self.server_port = str(host), int(port)


class MetricsServer:
    """`/metrics` over HTTP on exactly the address given (e.g. 127.0.0.1:9464); 404 for any
    other path. Runs in a daemon thread until `shutdown()`."""

    def __init__(self, metrics: Metrics, listen: str) -> None:
        handler = type("MetricsHandler", (_Handler,), {"metrics": metrics})
        self._server = _Server(split_listen(listen), handler)
        self._thread = threading.Thread(target=self._server.serve_forever,
                                        name="ckptd-metrics", daemon=True)
        self._thread.start()

    @property
    def address(self) -> tuple[str, int]:
        host, port = self._server.server_address[:2]
        return str(host), int(port)

    @property
    def port(self) -> int:
        return self.address[1]

    def shutdown(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5.0)
