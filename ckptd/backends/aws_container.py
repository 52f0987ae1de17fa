"""Container credentials from AWS_CONTAINER_CREDENTIALS_FULL_URI (EKS Pod Identity, ECS with a
full URI, a local credentials server), which obstore's client does not read itself.

Owns the one GET the AWS SDKs send there: the Authorization header from
AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE (re-read each time) or AWS_CONTAINER_AUTHORIZATION_TOKEN,
no proxy, and the SDKs' rule on where the URI may point (https, loopback, or the ECS/EKS
link-local addresses). Never reads a relative URI (obstore fetches that one itself).
"""

from __future__ import annotations

import ipaddress
import json
import os
import threading
import urllib.error
import urllib.request
from typing import Any
from urllib.parse import urlsplit

from ckptd.backends.aws_profile import RefreshingCredentials, parse_credentials
from ckptd.errors import PermanentError, TransientError

FETCH_TIMEOUT_S = 5.0
# The addresses the SDKs allow over plain http besides loopback: ECS and EKS Pod Identity.
_LINK_LOCAL = {"169.254.170.2", "169.254.170.23", "fd00:ec2::23"}
_PROVIDERS: dict[str, ContainerS3Credentials] = {}
_PROVIDERS_LOCK = threading.Lock()


def full_uri_provider() -> ContainerS3Credentials | None:
    """A provider for AWS_CONTAINER_CREDENTIALS_FULL_URI, or None when it is not set (or a
    relative URI, which the SDKs prefer, is)."""
    env = os.environ
    uri = env.get("AWS_CONTAINER_CREDENTIALS_FULL_URI", "").strip()
    if not uri or env.get("AWS_CONTAINER_CREDENTIALS_RELATIVE_URI"):
        return None
    parts = urlsplit(uri)
    host = parts.hostname or ""
    if parts.scheme != "https" and not (parts.scheme == "http" and _allowed_http_host(host)):
        raise PermanentError(
            f"AWS_CONTAINER_CREDENTIALS_FULL_URI {uri!r}: plain http only to a loopback "
            "address or the ECS/EKS credential addresses, as in the AWS SDKs"
        )
    with _PROVIDERS_LOCK:  # one per URI: every client shares the keys fetched
        return _PROVIDERS.setdefault(uri, ContainerS3Credentials(uri))


def _allowed_http_host(host: str) -> bool:
    if host == "localhost" or host in _LINK_LOCAL:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class ContainerS3Credentials(RefreshingCredentials):
    """The keys the container credentials endpoint answers, fetched again before they expire."""

    def __init__(self, uri: str) -> None:
        super().__init__()
        self._uri = uri
        # The SDKs never send these through a proxy.
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    def __repr__(self) -> str:
        return f"ContainerS3Credentials(uri={self._uri!r})"

    def _fetch(self) -> dict[str, Any]:
        request = urllib.request.Request(self._uri)
        token = _authorization_token()
        if token:
            request.add_header("Authorization", token)
        what = f"container credentials from {self._uri}"
        try:
            with self._opener.open(request, timeout=FETCH_TIMEOUT_S) as answer:
                body = answer.read()
        except urllib.error.HTTPError as exc:
            kind = TransientError if exc.code >= 500 or exc.code == 429 else PermanentError
            raise kind(f"{what}: HTTP {exc.code}") from None
        except OSError as exc:  # refused, reset, timed out
            raise TransientError(f"{what}: {exc}") from None
        try:
            parsed = json.loads(body)
        except ValueError:
            raise PermanentError(f"{what}: the answer is not JSON") from None
        if not isinstance(parsed, dict):
            raise PermanentError(f"{what}: the answer is not a JSON object")
        return parse_credentials(parsed, what)


def _authorization_token() -> str:
    env = os.environ
    path = env.get("AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE", "").strip()
    if path:
        try:
            with open(path, encoding="utf-8") as f:
                return f.read().strip()
        except OSError as exc:
            raise PermanentError(f"AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE {path}: {exc}") from None
    return env.get("AWS_CONTAINER_AUTHORIZATION_TOKEN", "").strip()
