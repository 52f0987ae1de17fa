"""Where S3 credentials come from: the config, the environment, the shared file, or nothing.

Resolves keys in Python so obstore never falls back to a metadata service unasked. Does no I/O
beyond reading the AWS shared credentials file.
"""

from __future__ import annotations

import configparser
import os
from collections.abc import Mapping
from datetime import UTC, datetime, timedelta
from typing import Any

from ckptd.errors import PermanentError

# Shared-file credentials are re-read this often, so a rotated file is picked up.
_FILE_CREDENTIALS_TTL = timedelta(minutes=5)


class Creds:
    """Credential settings from the config; empty strings mean "not given"."""

    def __init__(self, key_id: str, secret: str) -> None:
        if bool(key_id) != bool(secret):
            raise PermanentError(
                "upload credentials: give both access_key_id and secret_access_key, or neither"
            )
        self.key_id = key_id
        self.secret = secret

    def __repr__(self) -> str:  # never show the secret, even in a traceback's locals
        return f"Creds(key_id={self.key_id!r}, secret=***)"


class StaticS3Credentials:
    """obstore credential provider: fixed keys (config or environment) or a shared file."""

    def __init__(self, key_id: str, secret: str, token: str | None, from_file: bool) -> None:
        self._key_id = key_id
        self._secret = secret
        self._token = token
        self._from_file = from_file

    def __repr__(self) -> str:
        return f"StaticS3Credentials(key_id={self._key_id!r}, secret=***)"

    def __call__(self) -> dict[str, Any]:
        if self._from_file:
            found = _shared_file_credentials()
            if found is not None:
                self._key_id, self._secret, self._token = found
        expires = datetime.now(UTC) + _FILE_CREDENTIALS_TTL if self._from_file else None
        return {
            "access_key_id": self._key_id,
            "secret_access_key": self._secret,
            "token": self._token,
            "expires_at": expires,
        }


def s3_credential_provider(creds: Creds) -> StaticS3Credentials | None:
    """Where S3 credentials come from, first match wins; None leaves it to obstore.

    Order: the config's keys; AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY(/AWS_SESSION_TOKEN); the
    shared credentials file (AWS_SHARED_CREDENTIALS_FILE or ~/.aws/credentials, profile
    AWS_PROFILE or "default"); web-identity or container credentials named by their AWS_*
    variables. The instance metadata service is used only when AWS_EC2_METADATA_DISABLED is
    explicitly "false": ckptd sends nothing to an address its config does not name unless told.
    """
    env = os.environ
    if creds.key_id:
        return StaticS3Credentials(creds.key_id, creds.secret, None, from_file=False)
    if env.get("AWS_ACCESS_KEY_ID") and env.get("AWS_SECRET_ACCESS_KEY"):
        token = env.get("AWS_SESSION_TOKEN") or None
        return StaticS3Credentials(
            env["AWS_ACCESS_KEY_ID"], env["AWS_SECRET_ACCESS_KEY"], token, from_file=False
        )
    found = _shared_file_credentials()
    if found is not None:
        return StaticS3Credentials(*found, from_file=True)
    if _delegated_credentials_configured(env):
        return None
    if env.get("AWS_EC2_METADATA_DISABLED", "").strip().lower() == "false":
        return None
    raise PermanentError(
        "no S3 credentials: set access_key_id and secret_access_key under [roots.upload], "
        "or AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, or a shared credentials file "
        "(~/.aws/credentials); to use instance-profile credentials set "
        "AWS_EC2_METADATA_DISABLED=false"
    )


def _delegated_credentials_configured(env: Mapping[str, str]) -> bool:
    """Web identity (EKS/IRSA) or container (ECS) credentials, which obstore fetches itself."""
    web_identity = env.get("AWS_WEB_IDENTITY_TOKEN_FILE") and env.get("AWS_ROLE_ARN")
    container = env.get("AWS_CONTAINER_CREDENTIALS_RELATIVE_URI") or env.get(
        "AWS_CONTAINER_CREDENTIALS_FULL_URI"
    )
    return bool(web_identity or container)


def _shared_file_credentials() -> tuple[str, str, str | None] | None:
    path = os.environ.get("AWS_SHARED_CREDENTIALS_FILE") or os.path.expanduser("~/.aws/credentials")
    profile = os.environ.get("AWS_PROFILE") or "default"
    parser = configparser.ConfigParser(interpolation=None)
    try:
        if not parser.read(path):
            return None
    except configparser.Error as exc:
        raise PermanentError(f"cannot parse the AWS credentials file {path}: {exc}") from None
    if not parser.has_section(profile):
        return None
    section = parser[profile]
    key_id = section.get("aws_access_key_id", "").strip()
    secret = section.get("aws_secret_access_key", "").strip()
    if not key_id or not secret:
        return None
    return key_id, secret, section.get("aws_session_token", "").strip() or None
