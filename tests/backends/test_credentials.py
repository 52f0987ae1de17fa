"""S3 credentials found the way the AWS SDKs find them, each path ending in a write and a read on
the real S3 server: profiles in the shared files, `credential_process`, container credentials
and instance metadata served by a stand-in HTTP server on 127.0.0.1 that obstore reaches
through the SDKs' own endpoint overrides.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from support.wait import wait_until

from ckptd.backends import make_backend
from ckptd.backends.aws_profile import parse_process_output
from ckptd.backends.credentials import Creds, s3_credential_provider
from ckptd.errors import PermanentError

if TYPE_CHECKING:
    from gcsserver import GCSServer
    from s3server import S3Server

pytest_plugins = ["s3server", "gcsserver"]  # fixtures: s3_server, s3_url; gcs_server, gs_url

ROLE = "ckptd-node-role"
IMDS_TOKEN = "imds-session-token-1"
TASK_PATH = "/v1/credentials/task"


class StandIn:
    """The metadata endpoints an SDK asks for keys (IMDSv2 and the container endpoint), on a
    loopback port; it answers with `keys` and records every request."""

    def __init__(self, keys: tuple[str, str]) -> None:
        self.keys = keys
        self.requests: list[tuple[str, str, dict[str, str]]] = []
        stand_in = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_PUT(self) -> None:  # noqa: N802 (http.server's naming)
                stand_in.record(self)
                if self.path == "/latest/api/token" and self.headers.get(
                    "X-aws-ec2-metadata-token-ttl-seconds"
                ):
                    self.answer(200, IMDS_TOKEN)
                else:
                    self.answer(400, "bad token request")

            def do_POST(self) -> None:  # noqa: N802 (STS)
                stand_in.record(self)
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                self.answer(200, stand_in.sts_answer())

            def do_GET(self) -> None:  # noqa: N802
                stand_in.record(self)
                base = "/latest/meta-data/iam/security-credentials/"
                if self.path.startswith(base):
                    if self.headers.get("X-aws-ec2-metadata-token") != IMDS_TOKEN:
                        self.answer(401, "IMDSv2 token missing")
                    elif self.path == base:
                        self.answer(200, ROLE)
                    elif self.path == base + ROLE:
                        self.answer(200, stand_in.credentials())
                    else:
                        self.answer(404, "no such role")
                elif self.path == TASK_PATH:
                    self.answer(200, stand_in.credentials())
                else:
                    self.answer(404, "not found")

            def answer(self, status: int, body: str) -> None:
                data = body.encode()
                self.send_response(status)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def record(self, handler: BaseHTTPRequestHandler) -> None:
        self.requests.append((handler.command, handler.path, dict(handler.headers)))

    def credentials(self) -> str:
        expires = datetime.now(UTC) + timedelta(hours=6)
        return json.dumps({
            "Code": "Success",
            "Type": "AWS-HMAC",
            "AccessKeyId": self.keys[0],
            "SecretAccessKey": self.keys[1],
            "Token": "",
            "Expiration": expires.strftime("%Y-%m-%dT%H:%M:%SZ"),
            "LastUpdated": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        })

    def sts_answer(self) -> str:
        expires = (datetime.now(UTC) + timedelta(hours=1)).strftime("%Y-%m-%dT%H:%M:%SZ")
        return (
            '<AssumeRoleWithWebIdentityResponse xmlns="https://sts.amazonaws.com/doc/2011-06-15/">'
            "<AssumeRoleWithWebIdentityResult><Credentials>"
            f"<AccessKeyId>{self.keys[0]}</AccessKeyId>"
            f"<SecretAccessKey>{self.keys[1]}</SecretAccessKey>"
            f"<SessionToken></SessionToken><Expiration>{expires}</Expiration>"
            "</Credentials></AssumeRoleWithWebIdentityResult>"
            "</AssumeRoleWithWebIdentityResponse>"
        )

    def paths(self) -> list[str]:
        return [f"{method} {path}" for method, path, _ in self.requests]

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)


@pytest.fixture
def stand_in(s3_server: S3Server) -> Iterator[StandIn]:
    server = StandIn((s3_server.access_key, s3_server.secret_key))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def bare_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """No AWS_* variable, a HOME without ~/.aws, metadata lookups off: each test adds its own."""
    for name in list(os.environ):
        if name.startswith("AWS_"):
            monkeypatch.delenv(name)
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    return home


def _round_trip(s3_server: S3Server, url: str, name: str) -> None:
    backend = make_backend(url, endpoint=s3_server.endpoint, region=s3_server.region,
                           request_retries=0)
    backend.put(name, name.encode())
    assert backend.get_bytes(name) == name.encode()


# -- instance metadata and container credentials, through the stand-in ----------------------


def test_instance_metadata_is_asked_by_default_through_the_sdk_endpoint_override(
    s3_server: S3Server, s3_url: str, stand_in: StandIn, bare_env: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("AWS_EC2_METADATA_DISABLED")  # as on a fresh EC2 node: nothing set
    monkeypatch.setenv("AWS_EC2_METADATA_SERVICE_ENDPOINT", stand_in.endpoint + "/")
    _round_trip(s3_server, s3_url, "imds")
    paths = stand_in.paths()
    assert paths[0] == "PUT /latest/api/token", "IMDSv2: a session token first"
    assert "GET /latest/meta-data/iam/security-credentials/" in paths
    assert f"GET /latest/meta-data/iam/security-credentials/{ROLE}" in paths


def test_metadata_disabled_means_no_credentials_and_no_request(
    stand_in: StandIn, bare_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AWS_EC2_METADATA_SERVICE_ENDPOINT", stand_in.endpoint)
    with pytest.raises(PermanentError, match="AWS_EC2_METADATA_DISABLED=true"):
        make_backend("s3://bucket/p", endpoint="http://127.0.0.1:9")
    assert stand_in.requests == []


def test_container_credentials_from_the_full_uri_with_its_token(
    s3_server: S3Server, s3_url: str, stand_in: StandIn, bare_env: Path, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    token = tmp_path / "pod-identity-token"
    token.write_text("pod-token-1\n")
    monkeypatch.setenv("AWS_CONTAINER_CREDENTIALS_FULL_URI", f"{stand_in.endpoint}{TASK_PATH}")
    monkeypatch.setenv("AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE", str(token))
    _round_trip(s3_server, s3_url, "container")
    assert stand_in.paths() == [f"GET {TASK_PATH}"], "fetched once, no instance metadata"
    assert stand_in.requests[0][2]["Authorization"] == "pod-token-1"


def test_container_full_uri_over_plain_http_must_stay_local(
    bare_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AWS_CONTAINER_CREDENTIALS_FULL_URI", "http://example.com/creds")
    with pytest.raises(PermanentError, match="plain http only"):
        make_backend("s3://bucket/p", endpoint="http://127.0.0.1:9")


def test_web_identity_is_left_to_obstore_before_container_and_instance_credentials(
    bare_env: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """obstore 0.12 asks the regional STS itself and takes no STS endpoint override, so no
    loopback round trip: the hand-off is what is checked."""
    token = tmp_path / "irsa-token"
    token.write_text("irsa-jwt-1")
    monkeypatch.setenv("AWS_WEB_IDENTITY_TOKEN_FILE", str(token))
    monkeypatch.setenv("AWS_ROLE_ARN", "arn:aws:iam::123456789012:role/ckptd")
    monkeypatch.setenv("AWS_CONTAINER_CREDENTIALS_FULL_URI", "http://127.0.0.1:9/creds")
    assert s3_credential_provider(Creds("", "")) is None
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AK")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "SK")
    assert s3_credential_provider(Creds("", "")) is not None, "the environment's keys first"


# -- profiles in the shared files ------------------------------------------------------------


def test_profile_from_the_config_file(
    s3_server: S3Server, s3_url: str, bare_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (bare_env / ".aws").mkdir()
    (bare_env / ".aws" / "config").write_text(
        f"[profile train]\naws_access_key_id = {s3_server.access_key}\n"
        f"aws_secret_access_key = {s3_server.secret_key}\nregion = us-east-1\n"
    )
    monkeypatch.setenv("AWS_PROFILE", "train")
    _round_trip(s3_server, s3_url, "config-file")


def test_credentials_file_wins_over_config_file_for_one_profile(
    s3_server: S3Server, s3_url: str, bare_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (bare_env / ".aws").mkdir()
    (bare_env / ".aws" / "config").write_text(
        "[default]\naws_access_key_id = stale\naws_secret_access_key = stale\n"
    )
    (bare_env / ".aws" / "credentials").write_text(
        f"[default]\naws_access_key_id = {s3_server.access_key}\n"
        f"aws_secret_access_key = {s3_server.secret_key}\n"
    )
    _round_trip(s3_server, s3_url, "both-files")


def test_a_named_profile_that_does_not_exist_is_refused(
    bare_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (bare_env / ".aws").mkdir()
    (bare_env / ".aws" / "credentials").write_text("[default]\naws_access_key_id = k\n")
    monkeypatch.setenv("AWS_PROFILE", "nope")
    with pytest.raises(PermanentError, match="'nope'"):
        make_backend("s3://bucket/p", endpoint="http://127.0.0.1:9")


def test_environment_keys_come_before_the_profile(
    s3_server: S3Server, s3_url: str, bare_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (bare_env / ".aws").mkdir()
    (bare_env / ".aws" / "credentials").write_text(
        "[default]\naws_access_key_id = wrong\naws_secret_access_key = wrong\n"
    )
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_server.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_server.secret_key)
    _round_trip(s3_server, s3_url, "env-first")


# -- credential_process ----------------------------------------------------------------------

_PROCESS = """
import json, sys
from pathlib import Path
count = Path(sys.argv[1])
count.write_text(str(int(count.read_text() or 0) + 1) if count.exists() else "1")
print(json.dumps({"Version": 1, "AccessKeyId": sys.argv[2], "SecretAccessKey": sys.argv[3],
                  "Expiration": sys.argv[4]}))
"""


def _process_profile(home: Path, tmp: Path, keys: tuple[str, str], expires: str) -> Path:
    script, count = tmp / "creds-process.py", tmp / "runs.txt"
    script.write_text(_PROCESS)
    (home / ".aws").mkdir(exist_ok=True)
    (home / ".aws" / "config").write_text(
        f"[profile proc]\ncredential_process = {sys.executable} {script} {count} "
        f"{keys[0]} {keys[1]} {expires}\n"
    )
    return count


def test_credential_process_gives_the_keys_and_is_run_once_while_they_last(
    s3_server: S3Server, s3_url: str, bare_env: Path, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    later = (datetime.now(UTC) + timedelta(hours=1)).strftime("%Y-%m-%dT%H:%M:%SZ")
    runs = _process_profile(bare_env, tmp_path, (s3_server.access_key, s3_server.secret_key),
                            later)
    monkeypatch.setenv("AWS_PROFILE", "proc")
    _round_trip(s3_server, s3_url, "process")
    _round_trip(s3_server, s3_url, "process-again")
    assert runs.read_text() == "1"


def test_credential_process_is_run_again_when_its_keys_near_expiry(
    s3_server: S3Server, s3_url: str, bare_env: Path, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """obstore asks again once fewer than 5 minutes are left; the command is run again then,
    and a run that fails refuses the request with the command's own words."""
    soon = (datetime.now(UTC) + timedelta(minutes=4)).strftime("%Y-%m-%dT%H:%M:%SZ")
    runs = _process_profile(bare_env, tmp_path, (s3_server.access_key, s3_server.secret_key),
                            soon)
    monkeypatch.setenv("AWS_PROFILE", "proc")
    from ckptd.backends import aws_profile

    monkeypatch.setattr(aws_profile, "RERUN_GAP", timedelta(0))
    backend = make_backend(s3_url, endpoint=s3_server.endpoint, request_retries=0)
    backend.put("a", b"1")

    def run_again() -> bool:  # obstore waits 100 ms before asking again this close to expiry
        backend.put("b", b"2")
        return int(runs.read_text()) >= 3

    wait_until(run_again, 10, "a request near expiry to run the command again")
    runs.unlink()
    runs.mkdir()  # the command now fails: it cannot write its count

    def refused() -> PermanentError | None:
        try:
            backend.put("c", b"3")
        except PermanentError as exc:
            return exc
        return None

    assert "credential_process of AWS profile 'proc'" in str(wait_until(refused, 10, "refusal"))


def test_a_failing_credential_process_is_permanent_and_keeps_its_output_private(
    bare_env: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (bare_env / ".aws").mkdir()
    (bare_env / ".aws" / "config").write_text(
        f"[default]\ncredential_process = {sys.executable} -c "
        "\"import sys; sys.stderr.write('token expired, run login'); sys.exit(3)\"\n"
    )
    with pytest.raises(PermanentError, match="exited with 3: token expired, run login"):
        make_backend("s3://bucket/p", endpoint="http://127.0.0.1:9")


def test_credential_process_output_per_the_spec() -> None:
    out = parse_process_output(
        b'{"Version": 1, "AccessKeyId": "AK", "SecretAccessKey": "SK", "SessionToken": "T",'
        b' "Expiration": "2030-01-02T03:04:05Z"}', "p")
    assert out["token"] == "T"
    assert out["expires_at"] == datetime(2030, 1, 2, 3, 4, 5, tzinfo=UTC)
    assert parse_process_output(
        b'{"Version": 1, "AccessKeyId": "AK", "SecretAccessKey": "SK"}', "p"
    )["expires_at"] is None, "no Expiration: the keys never expire"
    for bad in (b"not json", b'{"Version": 2, "AccessKeyId": "AK", "SecretAccessKey": "SK"}',
                b'{"Version": 1, "AccessKeyId": "AK"}'):
        with pytest.raises(PermanentError) as info:
            parse_process_output(bad, "p")
        assert "SK" not in str(info.value).replace("SecretAccessKey", "")


# -- GCS: application default credentials ---------------------------------------------------


def _service_account_file(path: Path) -> Path:
    """A service-account JSON with a fresh RSA key: obstore signs its own JWT with it, so no
    token server is asked (fake-gcs-server takes any token)."""
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("openssl not installed")
    key = subprocess.run(
        [openssl, "genpkey", "-algorithm", "RSA", "-pkeyopt", "rsa_keygen_bits:2048"],
        capture_output=True, text=True, check=True, timeout=30,
    ).stdout
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({
        "type": "service_account", "project_id": "ckptd-test", "private_key_id": "k1",
        "private_key": key, "client_email": "ckptd@ckptd-test.iam.gserviceaccount.com",
    }))
    return path


@pytest.mark.parametrize("where", ["GOOGLE_APPLICATION_CREDENTIALS", "gcloud ADC file"])
def test_gcs_application_default_credentials(
    gcs_server: GCSServer, gs_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    where: str,
) -> None:
    monkeypatch.delenv("GOOGLE_SERVICE_ACCOUNT")  # the fixture's emulator file: not this path
    monkeypatch.delenv("GOOGLE_APPLICATION_CREDENTIALS", raising=False)
    home = tmp_path / "home"
    if where == "GOOGLE_APPLICATION_CREDENTIALS":
        adc = _service_account_file(tmp_path / "sa.json")
        monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(adc))
    else:  # where `gcloud auth application-default login` writes
        _service_account_file(home / ".config" / "gcloud" / "application_default_credentials.json")
    monkeypatch.setenv("HOME", str(home))
    bucket, _, prefix = gs_url.removeprefix("gs://").partition("/")
    gcs_server.upload(bucket, f"{prefix}/adc", b"adc")
    assert gcs_server.backend(gs_url).get_bytes("adc") == b"adc"


def test_gcs_a_missing_application_credentials_file_is_permanent(
    gcs_server: GCSServer, gs_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("GOOGLE_SERVICE_ACCOUNT")
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(tmp_path / "absent.json"))
    with pytest.raises(PermanentError, match="absent.json"):
        gcs_server.backend(gs_url)
