"""Pytest fixtures for a real Azure Blob endpoint: Azurite (`azurite-blob`, from npm) on a
loopback port, in memory, telemetry off.

Fixtures: `azurite` (session), `az_url` (a fresh container per test). `make test` installs
Azurite into .cache/azurite; a missing install fails the tests that need it, saying so.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import http.client
import os
import re
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from email.utils import formatdate
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from support.servers import die_with_parent, free_port, stop_process
from support.wait import wait_until

if TYPE_CHECKING:
    from ckptd.backends import ObstoreBackend

# Azurite's one built-in account and its published key (the same in every Azurite).
ACCOUNT = "devstoreaccount1"
ACCOUNT_KEY = (
    "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
)
CONTAINER = "ckptd-test"
START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 5.0
_API_VERSION = "2021-08-06"
REPO = Path(__file__).resolve().parent.parent
INSTALL_DIR = REPO / ".cache" / "azurite"


def pinned_version() -> str:
    """The Azurite version the Makefile installs (`AZURITE_VERSION := X`), the one place it is
    written; "" when the Makefile does not say."""
    try:
        text = (REPO / "Makefile").read_text()
    except OSError:
        return ""
    found = re.search(r"^AZURITE_VERSION\s*:?=\s*(\S+)\s*$", text, re.MULTILINE)
    return found.group(1) if found else ""


@dataclass
class Azurite:
    """A running `azurite-blob`: where it listens and how to sign in."""

    host: str
    port: int
    account: str
    key: str
    logfile: Path
    process: subprocess.Popen[bytes]

    @property
    def endpoint(self) -> str:
        """The account's blob endpoint, path-style (the `endpoint` of an az:// remote)."""
        return f"http://{self.host}:{self.port}/{self.account}"

    def url(self, container: str, prefix: str = "") -> str:
        return f"az://{container}/{prefix}".rstrip("/")

    def create_container(self, name: str) -> None:
        """PUT ?restype=container, signed with the account key (Shared Key)."""
        status, body = self._request("PUT", f"/{self.account}/{name}", "restype=container")
        if status != 201:
            raise RuntimeError(f"creating container {name}: HTTP {status} {body[:300]!r}")

    def backend(self, url: str, **kw: Any) -> ObstoreBackend:
        """An ObstoreBackend here, configured as a user would (account, key, endpoint), with
        5 MiB parts and obstore's own retries off so the tests' wrappers decide."""
        from ckptd.backends import ObstoreBackend

        options: dict[str, Any] = {
            "endpoint": self.endpoint,
            "access_key_id": self.account,
            "secret_access_key": self.key,
            "part_size": 5 * 1024 * 1024,
            "concurrency": 2,
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

    def _request(self, method: str, path: str, query: str) -> tuple[int, bytes]:
        date = formatdate(usegmt=True)
        headers = {"x-ms-date": date, "x-ms-version": _API_VERSION, "Content-Length": "0"}
        canonical_headers = f"x-ms-date:{date}\nx-ms-version:{_API_VERSION}\n"
        canonical_query = "".join(
            f"\n{k}:{v}" for k, v in sorted(p.split("=", 1) for p in query.split("&") if p)
        )
        # VERB, then eleven standard headers (all empty here), then the x-ms-* headers and
        # the resource: /<account><path>, path-style URLs keeping the account twice.
        to_sign = f"{method}\n" + "\n" * 11 + canonical_headers
        to_sign += f"/{self.account}{path}{canonical_query}"
        digest = hmac.new(base64.b64decode(self.key), to_sign.encode(), hashlib.sha256)
        signature = base64.b64encode(digest.digest()).decode()
        headers["Authorization"] = f"SharedKey {self.account}:{signature}"
        conn = http.client.HTTPConnection(self.host, self.port, timeout=5)
        try:
            conn.request(method, f"{path}?{query}", headers=headers)
            response = conn.getresponse()
            return response.status, response.read()
        finally:
            conn.close()


def azurite_binary() -> str | None:
    """`azurite-blob` from .cache/azurite (what `make test` installs), else from PATH."""
    local = INSTALL_DIR / "node_modules" / ".bin" / "azurite-blob"
    if local.is_file() and os.access(local, os.X_OK):
        return str(local)
    return shutil.which("azurite-blob")


def start_azurite(base: Path) -> Azurite:
    """Start `azurite-blob` under `base` (its cwd: it writes nothing there in memory mode) and
    wait until the test container can be created."""
    binary = azurite_binary()
    if binary is None:
        version = pinned_version()
        package = f"azurite@{version}" if version else "azurite"
        pytest.fail(
            "Azurite is not installed: run `make test` (it installs it into .cache/azurite) "
            f"or `npm install --prefix .cache/azurite {package}`"
        )
    base.mkdir(parents=True, exist_ok=True)
    port = free_port()
    logfile = base / "azurite.log"
    args = [
        binary, "--blobHost", "127.0.0.1", "--blobPort", str(port), "--inMemoryPersistence",
        "--loose", "--skipApiVersionCheck", "--disableTelemetry",
    ]
    with open(logfile, "wb") as out:
        proc = subprocess.Popen(
            args, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=base,
            env=dict(os.environ, TMPDIR=str(base)), start_new_session=True,
            preexec_fn=die_with_parent,
        )
    server = Azurite("127.0.0.1", port, ACCOUNT, ACCOUNT_KEY, logfile, proc)
    try:
        _wait_ready(server)
    except BaseException:
        stop_azurite(server)
        raise
    return server


def _wait_ready(server: Azurite) -> None:
    last = ["not contacted yet"]

    def created() -> bool:
        if server.process.poll() is not None:
            raise RuntimeError(
                f"azurite-blob exited with {server.process.returncode}:\n{server.log_tail()}"
            )
        try:
            server.create_container(CONTAINER)
            return True
        except (OSError, RuntimeError) as exc:
            last[0] = str(exc)
            return False

    wait_until(created, START_TIMEOUT_S, "Azurite to create a container", interval=0.1,
               detail=lambda: f"last error: {last[0]}\n{server.log_tail()}")


def stop_azurite(server: Azurite) -> None:
    """SIGTERM by PID, SIGKILL after a grace period."""
    stop_process(server.process, STOP_TIMEOUT_S)


@pytest.fixture(scope="session")
def azurite(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Azurite]:
    """One Azurite for the session (about a second to start); tests isolate by container."""
    server = start_azurite(tmp_path_factory.mktemp("azurite"))
    try:
        yield server
    finally:
        stop_azurite(server)


@pytest.fixture
def az_url(azurite: Azurite) -> str:
    """`az://<fresh container>/<prefix>` for one test: the container is created first."""
    container = f"t-{uuid.uuid4().hex[:12]}"
    azurite.create_container(container)
    return azurite.url(container, "ckpt")
