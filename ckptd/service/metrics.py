"""Prometheus metrics of the daemon: a private registry with counters the daemon updates and a
collector that reads each root's facts at scrape time, the text rendering, and prometheus_client's
own HTTP listener for `metrics.listen`.

Owns metric names and labels; never reads the store itself (the facts come from a function the
daemon hands it), so the socket's `/metrics` and the TCP listener give the same numbers.
"""

from __future__ import annotations

import platform
import socket
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Info,
    ProcessCollector,
    generate_latest,
    make_wsgi_app,
)
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.exposition import ThreadingWSGIServer
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.registry import Collector

from ckptd import __version__
from ckptd.clock import SYSTEM, Clock
from ckptd.errors import BadValue, ConfigError
from ckptd.model import Reason, State

# Stages run from well under a second (a small file) to hours (a 1 TB upload).
STAGE_BUCKETS = (0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0,
                 3600.0, 7200.0, 14400.0)
# From a completed save to its remote copy verified: seconds (a small file, an idle queue) to
# hours (a large save behind a slow link, or a remote that was away).
SAFE_BUCKETS = (1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1200.0, 1800.0, 3600.0,
                7200.0, 14400.0)
BYTE_KINDS = ("read", "written", "uploaded")
BAD_INPUT_KINDS = ("metadata", "remote")


class Metrics:
    """Every metric ckptd exports. Methods are thread-safe (prometheus_client locks)."""

    def __init__(self, version: str = __version__, process: bool = True,
                 clock: Clock = SYSTEM) -> None:
        """`clock`: the call board's, by which a stuck call's quiet seconds are told."""
        self.registry = CollectorRegistry(auto_describe=True)
        self._roots: set[str] = set()
        self._samples: Callable[[], Iterable[RootSample]] = lambda: ()
        self._health: Callable[[], tuple[bool, Sequence[Any]]] = lambda: (False, ())
        self.registry.register(_RootCollector(lambda: self._samples()))
        self.registry.register(_HealthCollector(lambda: self._health(), clock))
        self._memory: Callable[[], Iterable[tuple[str, int, int]]] = lambda: ()
        self.registry.register(_MemoryCollector(lambda: self._memory()))
        self._define_activity()
        self._define_daemon(version, clock.time())
        if process:  # process_resident_memory_bytes etc.: the bounded-memory promise, visible
            ProcessCollector(registry=self.registry)

    def _define_activity(self) -> None:
        self.stage_seconds = Histogram("ckptd_stage_duration_seconds", "Time a stage took.",
                                       ("stage",), buckets=STAGE_BUCKETS, registry=self.registry)
        self.bytes = {kind: Counter(f"ckptd_bytes_{kind}", f"Checkpoint bytes {kind}.",
                                    ("root",), registry=self.registry)
                      for kind in BYTE_KINDS}
        self.errors = Counter("ckptd_errors", "Errors by kind.", ("kind",),
                              registry=self.registry)
        self.time_to_safe = Histogram(
            "ckptd_time_to_safe_seconds", "From a save found complete to its remote copy"
            " verified, observed once per save when it is.", ("root",), buckets=SAFE_BUCKETS,
            registry=self.registry)
        self.bad = Gauge("ckptd_bad_inputs", "Outside inputs set aside as bad at the last look"
                         " (kind: remote = a remote step's MANIFEST.json, metadata = a root's"
                         " metadata files).",
                         ("root", "kind"), registry=self.registry)
        self._bad_kinds: set[str] = set(BAD_INPUT_KINDS)

    def _define_daemon(self, version: str, loaded: float) -> None:
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
        self.reload_time.set(loaded)  # the config was loaded at start

    # -- updates -----------------------------------------------------------------------------

    def observe_stage(self, stage: str, seconds: float) -> None:
        self.stage_seconds.labels(stage).observe(seconds)

    def add_bytes(self, kind: str, root: str, n: int) -> None:
        """`kind` is read, written or uploaded; `n` is not negative."""
        counter = self.bytes.get(kind)
        if counter is None:
            raise BadValue(f"byte kind must be one of {BYTE_KINDS}, got {kind!r}")
        self._roots.add(root)
        counter.labels(root).inc(n)

    def observe_safe(self, root: str, seconds: float) -> None:
        """A save of `root` became remote-verified `seconds` after it was found complete."""
        self._roots.add(root)
        self.time_to_safe.labels(root).observe(max(0.0, seconds))

    def error(self, kind: str) -> None:
        """Count an error; `kind` is a short fixed word (scan, stage, upload, notify, ...)."""
        self.errors.labels(kind).inc()

    def bad_inputs(self, root: str, kind: str, n: int) -> None:
        """How many bad inputs of `kind` the last look at `root` set aside."""
        self._roots.add(root)
        self._bad_kinds.add(kind)
        self.bad.labels(root, kind).set(n)

    def reloaded(self, ok: bool, when: float) -> None:
        self.reload_ok.set(1 if ok else 0)
        self.reload_time.set(when)

    def set_samples(self, samples: Callable[[], Iterable[RootSample]]) -> None:
        """Where the per-root facts come from (read at each scrape)."""
        self._samples = samples

    def set_health(self, health: Callable[[], tuple[bool, Sequence[Any]]]) -> None:
        """Where health comes from at each scrape: (degraded, the calls past their bound,
        each with who, stage, root, step and `quiet_s(now)` as `supervisor.Call` has)."""
        self._health = health

    def set_memory(self, held: Callable[[], Iterable[tuple[str, int, int]]]) -> None:
        """What `ckptd_memory_held_bytes` reads at scrape time: (root, bytes kept for this
        node's trainers, bytes held for peers) per root."""
        self._memory = held

    def set_roots(self, names: Iterable[str]) -> None:
        """The configured roots (at start and after each reload): a new root's counters and
        histogram start at 0 and its bad inputs read 0 before anything happened, so rate()
        and alerts see a series from the first scrape; a root gone is dropped."""
        names = set(names)
        for root in sorted(self._roots - names):
            self.remove_root(root)
        for root in sorted(names - self._roots):
            self._roots.add(root)
            for counter in self.bytes.values():
                counter.labels(root)
            self.time_to_safe.labels(root)
            for kind in BAD_INPUT_KINDS:
                self.bad.labels(root, kind).set(0)

    def remove_root(self, root: str) -> None:
        """Drop a root's counters (it left the config on reload): a root that comes back
        starts from 0, which Prometheus' rate() handles as a reset."""
        self._roots.discard(root)
        for counter in self.bytes.values():
            _drop(counter, root)
        for kind in self._bad_kinds:
            _drop(self.bad, root, kind)
        _drop(self.time_to_safe, root)

    def roots(self) -> set[str]:
        return set(self._roots)

    def render(self) -> str:
        """The Prometheus text exposition format."""
        return generate_latest(self.registry).decode()

    def serve_tcp(self, address: tuple[str, int]) -> MetricsServer:
        return MetricsServer(self, address)


def _drop(metric: MetricWrapperBase, *labels: str) -> None:
    try:
        metric.remove(*labels)
    except KeyError:
        pass


@dataclass(frozen=True)
class RootSample:
    """One root's facts at scrape time. None means unknown: the series is left out rather
    than exported as a made-up 0."""

    root: str
    counts: Mapping[str, int]
    queue: int
    disk_free: int | None = None
    latest: int | None = None
    steps_since_remote: int | None = None
    preflight_warning: bool = False
    ratio: float | None = None
    newest_committed: int | None = None  # newest step the store records committed
    remote_latest: int | None = None  # the remote tier's latest (valid, committed)
    unsafe_s: float | None = None  # None: the root has no remote
    held: bool = False  # this daemon holds the root's lease and acts on it
    min_free: int | None = None  # the configured min_free in bytes on the root's disk
    saved: int | None = None  # original minus stored bytes of its compressed checkpoints
    invalid: Mapping[str, int] = field(default_factory=dict)  # invalid checkpoints by reason


_GAUGES = (
    ("ckptd_compression_ratio", "Stored bytes / original bytes of compressed checkpoints.",
     "ratio"),
    ("ckptd_queue_depth", "Stage work waiting to run.", "queue"),
    ("ckptd_steps_since_remote_verified",
     "Latest valid step minus the latest step uploaded and verified remotely.",
     "steps_since_remote"),
    ("ckptd_disk_free_bytes", "Free bytes on the root's disk.", "disk_free"),
    ("ckptd_preflight_warning", "1 when the root's preflight check warns, else 0.",
     "preflight_warning"),
    ("ckptd_latest_step", "Latest valid step of the root.", "latest"),
    ("ckptd_latest_uploaded_step", "Newest step whose remote copy the store records.",
     "newest_committed"),
    ("ckptd_latest_remote_verified_step",
     "Newest valid step whose remote copy is committed and verified (the remote's latest).",
     "remote_latest"),
    ("ckptd_unsafe_seconds",
     "Seconds since the oldest valid step newer than the latest remote-verified one became"
     " valid (0 when none waits; absent for a root with no remote).", "unsafe_s"),
    ("ckptd_root_held", "1 while this daemon holds the root's lease and acts on it, else 0.",
     "held"),
    ("ckptd_min_free_bytes", "The root's configured min_free, in bytes of its disk.",
     "min_free"),
    ("ckptd_compression_saved_bytes",
     "Original minus stored bytes of the root's compressed checkpoints.", "saved"),
)
_INVALID_DOC = "Invalid checkpoints by root and the reason validation gave."


class _RootCollector(Collector):
    """Per-root gauges read at scrape time, so any scrape (socket or TCP) is current."""

    def __init__(self, samples: Callable[[], Iterable[RootSample]]) -> None:
        self._samples = samples

    def describe(self) -> Iterator[Metric]:
        yield GaugeMetricFamily("ckptd_checkpoints", "Checkpoints by root and state.",
                                labels=["root", "state"])
        yield GaugeMetricFamily("ckptd_invalid_checkpoints", _INVALID_DOC,
                                labels=["root", "reason"])
        for name, doc, _ in _GAUGES:
            yield GaugeMetricFamily(name, doc, labels=["root"])

    def collect(self) -> Iterator[Metric]:
        samples = list(self._samples())
        counts = GaugeMetricFamily("ckptd_checkpoints", "Checkpoints by root and state.",
                                   labels=["root", "state"])
        for s in samples:
            # Every known state is always exported: a state dropping to none reads 0.
            for state in [x.value for x in State] + sorted(set(s.counts) - set(State)):
                counts.add_metric([s.root, state], s.counts.get(state, 0))
        yield counts
        invalid = GaugeMetricFamily("ckptd_invalid_checkpoints", _INVALID_DOC,
                                    labels=["root", "reason"])
        for s in samples:
            # Every known reason is always exported, so a first invalid checkpoint is a rise
            # from 0 that an alert sees, not a new series.
            by_reason = {r.value: 0 for r in Reason}
            for reason, n in s.invalid.items():
                by_reason[reason or "unknown"] = by_reason.get(reason or "unknown", 0) + n
            for reason, n in sorted(by_reason.items()):
                invalid.add_metric([s.root, reason], n)
        yield invalid
        for name, doc, attr in _GAUGES:
            family = GaugeMetricFamily(name, doc, labels=["root"])
            for s in samples:
                value = getattr(s, attr)
                if value is not None:
                    family.add_metric([s.root], float(value))
            yield family


class _HealthCollector(Collector):
    """`ckptd_degraded` and one `ckptd_stuck_call_seconds` series per call past its bound,
    read at scrape time: a stall shows at the next scrape, not after a loop turns."""

    def __init__(self, health: Callable[[], tuple[bool, Sequence[Any]]], clock: Clock) -> None:
        self._health = health
        self._clock = clock

    def describe(self) -> Iterator[Metric]:
        yield GaugeMetricFamily("ckptd_degraded", _DEGRADED_DOC)
        yield GaugeMetricFamily("ckptd_stuck_call_seconds", _STUCK_DOC,
                                labels=["who", "stage", "root", "step"])

    def collect(self) -> Iterator[Metric]:
        degraded, stuck = self._health()
        yield GaugeMetricFamily("ckptd_degraded", _DEGRADED_DOC, value=1.0 if degraded else 0.0)
        family = GaugeMetricFamily("ckptd_stuck_call_seconds", _STUCK_DOC,
                                   labels=["who", "stage", "root", "step"])
        now = self._clock.monotonic()
        for c in stuck:
            family.add_metric([c.who, c.stage, c.root, "" if c.step is None else str(c.step)],
                              c.quiet_s(now))
        yield family


_DEGRADED_DOC = ("1 while health is degraded (a service down or restarting, a call past its"
                 " bound, the state database lost, a root that cannot act), else 0.")
_STUCK_DOC = ("Seconds a call past its bound has gone without progress, by who makes it, its"
              " stage and its item (root, step).")


class MetricsServer:
    """prometheus_client's WSGI app and threading server on the configured address, answering
    `/metrics` and 404 for anything else. `serve_forever` runs on the caller's thread (the
    daemon's supervised `metrics` service); `shutdown` stops it from another."""

    def __init__(self, metrics: Metrics, address: tuple[str, int]) -> None:
        host, port = address
        where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        try:
            family = socket.getaddrinfo(host or "0.0.0.0", port, type=socket.SOCK_STREAM,
                                        flags=socket.AI_PASSIVE)[0][0]

            class Server(ThreadingWSGIServer):
                address_family = family

            self._server = make_server(host or "0.0.0.0", port, _only_metrics(
                make_wsgi_app(metrics.registry)), Server, handler_class=_Quiet)
        except OSError as exc:
            raise ConfigError(f"metrics.listen = {where!r}: cannot listen there:"
                              f" {exc.strerror or exc}") from None

    @property
    def port(self) -> int:
        return int(self._server.server_port)

    def serve_forever(self) -> None:
        self._server.serve_forever(poll_interval=0.5)

    def shutdown(self) -> None:
        self._server.shutdown()

    def close(self) -> None:
        self._server.server_close()


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        return  # a scrape every 15 s would drown the journal


def _only_metrics(app: Any) -> Any:
    def serve(environ: dict[str, Any], start_response: Any) -> Any:
        if environ.get("REQUEST_METHOD") != "GET":  # prometheus_client's app serves GET only
            start_response("405 Method Not Allowed", [("Allow", "GET"),
                                                      ("Content-Type", "text/plain")])
            return [b"GET /metrics\n"]
        if environ.get("PATH_INFO", "") != "/metrics":
            start_response("404 Not Found", [("Content-Type", "text/plain; charset=utf-8")])
            return [b"not found; try /metrics\n"]
        return app(environ, start_response)

    return serve


_MEMORY_DOC = ("Bytes of checkpoint state held in memory: tier=own, the arenas kept for this"
               " node's restarted trainers; tier=peers, the replicas held for other nodes.")


class _MemoryCollector(Collector):
    """`ckptd_memory_held_bytes{tier, root}`, read at scrape time."""

    def __init__(self, held: Callable[[], Iterable[tuple[str, int, int]]]) -> None:
        self._held = held

    def describe(self) -> Iterator[Metric]:
        yield GaugeMetricFamily("ckptd_memory_held_bytes", _MEMORY_DOC, labels=["tier", "root"])

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily("ckptd_memory_held_bytes", _MEMORY_DOC,
                                   labels=["tier", "root"])
        for root, own, peers in self._held():
            family.add_metric(["own", root], float(own))
            family.add_metric(["peers", root], float(peers))
        yield family
