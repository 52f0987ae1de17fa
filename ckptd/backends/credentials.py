"""Where S3 credentials come from, in the AWS SDKs' order: the config, the environment, the
profile in the shared files (its keys or its `credential_process`), then obstore's own chain
(web identity, container credentials, instance metadata).

Hands obstore a credential provider for what it finds itself, so keys from the config never mix
with the environment's. Sends no request itself (obstore fetches web identity, ECS and instance
credentials, `aws_container` a full-URI container endpoint's) and never parses the AWS files
(that is `aws_profile`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

from ckptd.backends.aws_container import ContainerS3Credentials, full_uri_provider
from ckptd.backends.aws_profile import (
    ProcessS3Credentials,
    load_profile,
    process_provider,
    profile_name,
    static_keys,
)
from ckptd.errors import PermanentError

if TYPE_CHECKING:
    from obstore.store import S3Config


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


def s3_credential_provider(
    creds: Creds,
) -> StaticS3Credentials | ProcessS3Credentials | ContainerS3Credentials | None:
    """Where S3 credentials come from, first match wins, in the AWS SDKs' order; None leaves
    the rest of the chain to obstore.

    Order: the config's keys; AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY(/AWS_SESSION_TOKEN); the
    profile (AWS_PROFILE or "default") in the shared credentials and config files, its keys or
    its `credential_process`; web identity (AWS_WEB_IDENTITY_TOKEN_FILE + AWS_ROLE_ARN, obstore
    asks STS); container credentials (a RELATIVE_URI: obstore; a FULL_URI: `aws_container`);
    the instance metadata service (obstore), as in the SDKs, unless
    AWS_EC2_METADATA_DISABLED=true: then finding nothing is a PermanentError before any request.
    """
    env = os.environ
    if creds.key_id:
        return StaticS3Credentials(creds.key_id, creds.secret, None, from_file=False)
    if env.get("AWS_ACCESS_KEY_ID") and env.get("AWS_SECRET_ACCESS_KEY"):
        token = env.get("AWS_SESSION_TOKEN") or None
        return StaticS3Credentials(
            env["AWS_ACCESS_KEY_ID"], env["AWS_SECRET_ACCESS_KEY"], token, from_file=False
        )
    profile = load_profile()
    if profile is not None:
        found = static_keys(profile)
        if found is not None:
            return StaticS3Credentials(*found, from_file=True)
        if profile.get("credential_process"):
            return process_provider(profile["credential_process"], profile_name()[0])
    if _obstore_fetches_them(env):
        return None
    container = full_uri_provider()
    if container is not None:
        return container
    if not metadata_disabled():
        return None
    raise PermanentError(
        "no S3 credentials: set access_key_id and secret_access_key under [roots.upload], "
        "or AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, or a profile in ~/.aws/credentials or "
        "~/.aws/config (AWS_PROFILE), or web identity or container credentials; the instance "
        "metadata service is off (AWS_EC2_METADATA_DISABLED=true)"
    )


def metadata_disabled() -> bool:
    """AWS_EC2_METADATA_DISABLED=true, as the SDKs spell it: no instance metadata lookups."""
    return os.environ.get("AWS_EC2_METADATA_DISABLED", "").strip().lower() == "true"


def s3_sdk_endpoints() -> S3Config:
    """The SDKs' endpoint overrides for the instance metadata service
    (AWS_EC2_METADATA_SERVICE_ENDPOINT, or _MODE=IPv6) and STS (AWS_ENDPOINT_URL_STS), in
    obstore's words; obstore's own variables (AWS_METADATA_ENDPOINT, AWS_STS_ENDPOINT) win."""
    env = os.environ
    config: S3Config = {}
    imds = env.get("AWS_EC2_METADATA_SERVICE_ENDPOINT", "").strip().rstrip("/")
    if not imds and env.get("AWS_EC2_METADATA_SERVICE_ENDPOINT_MODE", "").lower() == "ipv6":
        imds = "http://[fd00:ec2::254]"
    if imds and not env.get("AWS_METADATA_ENDPOINT"):
        config["metadata_endpoint"] = imds
    return config


def _obstore_fetches_them(env: Mapping[str, str]) -> bool:
    """Web identity (EKS/IRSA) or ECS container credentials by relative URI: obstore's own."""
    web_identity = env.get("AWS_WEB_IDENTITY_TOKEN_FILE") and env.get("AWS_ROLE_ARN")
    return bool(web_identity or env.get("AWS_CONTAINER_CREDENTIALS_RELATIVE_URI"))


def _shared_file_credentials() -> tuple[str, str, str | None] | None:
    """The profile's keys as the files say now (re-read, so a rotated file is picked up)."""
    profile = load_profile()
    return static_keys(profile) if profile is not None else None
