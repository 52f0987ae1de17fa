"""An AWS profile as the SDKs read it: the shared credentials and config files, and a profile's
`credential_process` run for its JSON answer.

Owns reading `~/.aws/credentials` and `~/.aws/config` (or the files AWS_SHARED_CREDENTIALS_FILE
and AWS_CONFIG_FILE name), choosing the profile (AWS_PROFILE, else `default`) and running a
profile's `credential_process` (no shell; its stdout per the AWS spec, Version 1), caching its
answer until shortly before it expires. Never sends a request of its own and never decides the
order of the credential chain (that is `credentials`).
"""

from __future__ import annotations

import configparser
import json
import os
import shlex
import subprocess
import threading
from datetime import UTC, datetime, timedelta
from typing import Any

from ckptd.errors import PermanentError

# A cached answer goes to a new client only while more than this is left (the SDKs refresh
# this early); obstore asks again once fewer than 5 minutes are left: this must stay above.
REFRESH_BEFORE = timedelta(minutes=15)
# Close to expiry a command is run at most this often, while its keys outlast the gap.
RERUN_GAP = timedelta(seconds=60)
PROCESS_TIMEOUT_S = 60.0
_KEYS = ("aws_access_key_id", "aws_secret_access_key", "aws_session_token", "credential_process")


def profile_name() -> tuple[str, bool]:
    """The profile in force and whether it was named explicitly (AWS_PROFILE)."""
    named = os.environ.get("AWS_PROFILE", "").strip()
    return (named, True) if named else ("default", False)


def load_profile() -> dict[str, str] | None:
    """The profile's credential settings, the credentials file's over the config file's;
    None when neither file has the profile. PermanentError for a file that cannot be parsed or
    a profile named by AWS_PROFILE that neither file has (the SDKs refuse that too)."""
    name, explicit = profile_name()
    home = os.path.expanduser("~")
    config_path = os.environ.get("AWS_CONFIG_FILE") or os.path.join(home, ".aws", "config")
    creds_path = os.environ.get("AWS_SHARED_CREDENTIALS_FILE") or os.path.join(
        home, ".aws", "credentials"
    )
    # In the config file a profile is `[profile NAME]`; `[default]` may go without the word.
    config_sections = [f"profile {name}"] + (["default"] if name == "default" else [])
    found = False
    merged: dict[str, str] = {}
    for path, sections in ((config_path, config_sections), (creds_path, [name])):
        parser = _read(path)
        section = next((s for s in sections if parser and parser.has_section(s)), None)
        if parser is None or section is None:
            continue
        found = True
        for key in _KEYS:
            value = parser[section].get(key, "").strip()
            if value:
                merged[key] = value
    if not found:
        if explicit:
            raise PermanentError(
                f"AWS_PROFILE names the profile {name!r}, which neither {creds_path} nor "
                f"{config_path} has"
            )
        return None
    return merged


def _read(path: str) -> configparser.ConfigParser | None:
    parser = configparser.ConfigParser(interpolation=None)
    try:
        return parser if parser.read(path) else None
    except configparser.Error as exc:
        raise PermanentError(f"cannot parse the AWS file {path}: {exc}") from None


def static_keys(profile: dict[str, str]) -> tuple[str, str, str | None] | None:
    key_id = profile.get("aws_access_key_id", "")
    secret = profile.get("aws_secret_access_key", "")
    if not key_id or not secret:
        return None
    return key_id, secret, profile.get("aws_session_token") or None


class RefreshingCredentials:
    """obstore credential provider that fetches keys (`_fetch`) and fetches them again shortly
    before they expire (never, for keys without an expiry)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._answer: dict[str, Any] | None = None
        self._fetched_at = datetime.min.replace(tzinfo=UTC)

    def __call__(self) -> dict[str, Any]:
        with self._lock:
            now = datetime.now(UTC)
            answer = self._answer
            if answer is None or not self._fresh(now):
                answer = self._answer = self._fetch()
                self._fetched_at = now
            return dict(answer)

    def _fresh(self, now: datetime) -> bool:
        if self._answer is None:
            return False
        expires = self._answer["expires_at"]
        if expires is None or expires - now > REFRESH_BEFORE:
            return True
        return expires - now > RERUN_GAP and now - self._fetched_at < RERUN_GAP

    def _fetch(self) -> dict[str, Any]:
        raise NotImplementedError


class ProcessS3Credentials(RefreshingCredentials):
    """A profile's `credential_process`, run without a shell."""

    def __init__(self, command: str, profile: str) -> None:
        super().__init__()
        self._argv = shlex.split(command)
        if not self._argv:
            raise PermanentError(f"profile {profile!r}: credential_process is empty")
        self._profile = profile

    def __repr__(self) -> str:
        return f"ProcessS3Credentials(profile={self._profile!r}, command={self._argv[0]!r})"

    def _fetch(self) -> dict[str, Any]:
        what = f"credential_process of AWS profile {self._profile!r} ({self._argv[0]})"
        try:
            done = subprocess.run(
                self._argv, capture_output=True, stdin=subprocess.DEVNULL,
                timeout=PROCESS_TIMEOUT_S, check=False,
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise PermanentError(f"{what} could not run: {exc}") from None
        if done.returncode != 0:
            err = done.stderr.decode(errors="replace").strip()[-300:]
            raise PermanentError(f"{what} exited with {done.returncode}: {err}")
        return parse_process_output(done.stdout, what)


def parse_process_output(stdout: bytes, what: str) -> dict[str, Any]:
    """The obstore credential of a credential_process's JSON (Version 1); its stdout is never
    quoted in an error, since it holds the secret."""
    try:
        answer = json.loads(stdout)
    except ValueError:
        raise PermanentError(f"{what} did not print JSON") from None
    if not isinstance(answer, dict) or answer.get("Version") != 1:
        raise PermanentError(f"{what} printed no Version 1 JSON object")
    return parse_credentials(answer, what)


def parse_credentials(answer: dict[str, Any], what: str) -> dict[str, Any]:
    """The obstore credential of the SDKs' JSON shape (AccessKeyId, SecretAccessKey,
    SessionToken or Token, Expiration), shared by credential_process and container endpoints."""
    key_id, secret = answer.get("AccessKeyId"), answer.get("SecretAccessKey")
    if not isinstance(key_id, str) or not key_id or not isinstance(secret, str) or not secret:
        raise PermanentError(f"{what} gave no AccessKeyId and SecretAccessKey")
    token = answer.get("SessionToken") or answer.get("Token")
    expires = answer.get("Expiration")
    expires_at = None
    if expires is not None:
        try:
            expires_at = datetime.fromisoformat(str(expires))
        except ValueError:
            raise PermanentError(f"{what} gave an Expiration that is not ISO 8601") from None
        if expires_at.tzinfo is None:
            expires_at = expires_at.replace(tzinfo=UTC)
    return {
        "access_key_id": key_id,
        "secret_access_key": secret,
        "token": token if isinstance(token, str) and token else None,
        "expires_at": expires_at,
    }


_PROCESSES: dict[tuple[str, str], ProcessS3Credentials] = {}
_PROCESSES_LOCK = threading.Lock()


def process_provider(command: str, profile: str) -> ProcessS3Credentials:
    """One provider per (profile, command) for the process, so every client shares its cached
    answer; run once now, so a command that cannot work fails while the client is built."""
    with _PROCESSES_LOCK:
        provider = _PROCESSES.get((profile, command))
        if provider is None:
            provider = ProcessS3Credentials(command, profile)
            provider()
            _PROCESSES[(profile, command)] = provider
    return provider
