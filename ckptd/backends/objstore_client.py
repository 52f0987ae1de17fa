"""Building an obstore client from a storage URL and its settings: the scheme's store (S3,
GCS, Azure), credentials, timeouts, obstore's own per-request retry, whether plain http is
allowed. Never reads or writes an object (that is `objstore`) and never translates an error.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from obstore.store import AzureStore, GCSStore, S3Store

from ckptd.backends.credentials import Creds, s3_credential_provider, s3_sdk_endpoints
from ckptd.errors import PermanentError

if TYPE_CHECKING:
    from obstore.store import AzureConfig, ClientConfig, GCSConfig, RetryConfig, S3Config

S3_SCHEMES = ("s3", "s3a")
AZURE_SCHEMES = ("az", "abfs", "abfss")
SCHEMES = (*S3_SCHEMES, "gs", *AZURE_SCHEMES)


def open_client(
    url: str,
    *,
    endpoint: str,
    region: str,
    creds: Creds,
    connect_timeout_s: float,
    read_timeout_s: float | None,
    request_timeout_s: float,
    request_retries: int,
) -> Any:
    """The obstore store of `url` (s3://, gs://, az://, abfs://), or PermanentError for a URL
    or credentials that cannot work. `read_timeout_s` None: no read timeout (an upload's
    client, which hears nothing back while a part is being sent)."""
    options = _client_options(url, endpoint, connect_timeout_s, read_timeout_s, request_timeout_s)
    retry = _retry_config(request_retries, request_timeout_s)
    return _open_store(url, endpoint, region, creds, options, retry)


def _open_store(
    url: str,
    endpoint: str,
    region: str,
    creds: Creds,
    options: ClientConfig,
    retry: RetryConfig,
) -> Any:
    parts = urlsplit(url)
    if parts.scheme in S3_SCHEMES:
        prefix = parts.path.strip("/")
        return _s3_store(parts.netloc, prefix, endpoint, region, creds, options, retry)
    if parts.scheme == "gs":
        if creds.key_id:
            raise PermanentError(
                "gs:// takes credentials from GOOGLE_APPLICATION_CREDENTIALS (a service account "
                "file); access_key_id/secret_access_key are for s3:// and az://"
            )
        # endpoint: another GCS-compatible server (an emulator), as GOOGLE_BASE_URL would.
        config: GCSConfig = {"base_url": endpoint} if endpoint else {}
        return GCSStore.from_url(url, config=config, client_options=options, retry_config=retry)
    if parts.scheme in AZURE_SCHEMES:
        return _azure_store(url, endpoint, creds, options, retry)
    raise PermanentError(
        f"unsupported storage URL {url!r}: use s3://, gs://, az://, abfs:// or file://"
    )


def _azure_store(
    url: str, endpoint: str, creds: Creds, options: ClientConfig, retry: RetryConfig
) -> Any:
    """`az://container/prefix` or `abfs[s]://container@account.dfs.core.windows.net/prefix`.

    `access_key_id` is the storage account, `secret_access_key` its key; without them obstore
    reads the AZURE_STORAGE_* variables. `endpoint` replaces the account's blob URL (Azurite:
    `http://127.0.0.1:10000/devstoreaccount1`)."""
    container, at, host = urlsplit(url).netloc.partition("@")
    if not container:
        raise PermanentError(f"{url} names no container: use az://container/prefix")
    config: AzureConfig = {}
    if creds.key_id:
        in_url = host.split(".", 1)[0] if at else ""
        if in_url and in_url != creds.key_id:
            raise PermanentError(
                f"{url} names the storage account {in_url!r} but access_key_id is "
                f"{creds.key_id!r}: they must agree"
            )
        if not in_url:  # obstore refuses the account given twice
            config["account_name"] = creds.key_id
        config["account_key"] = creds.secret
    if endpoint:
        config["endpoint"] = endpoint
    return AzureStore.from_url(url, config=config, client_options=options, retry_config=retry)


def _s3_store(
    bucket: str,
    prefix: str,
    endpoint: str,
    region: str,
    creds: Creds,
    options: ClientConfig,
    retry: RetryConfig,
) -> Any:
    if not bucket:
        raise PermanentError("s3:// URL names no bucket: use s3://bucket/prefix")
    config: S3Config = {"skip_signature": False}
    if endpoint:
        config["endpoint"] = endpoint
    if region:
        config["region"] = region
    config.update(s3_sdk_endpoints())
    return S3Store(
        bucket,
        prefix=prefix or None,
        config=config,
        client_options=options,
        retry_config=retry,
        credential_provider=s3_credential_provider(creds),  # type: ignore[arg-type]
    )


# Where obstore finds an endpoint when the config names none: plain http is allowed only
# when the endpoint in force says http://.
_ENDPOINT_VARIABLES = {
    **dict.fromkeys(S3_SCHEMES, ("AWS_ENDPOINT_URL", "AWS_ENDPOINT")),
    "gs": ("GOOGLE_BASE_URL",),
    **dict.fromkeys(AZURE_SCHEMES, ("AZURE_STORAGE_ENDPOINT", "AZURE_ENDPOINT")),
}


def _client_options(
    url: str, endpoint: str, connect_s: float, read_s: float | None, request_s: float
) -> ClientConfig:
    # The endpoint may also come from the standard variables obstore reads itself.
    env = os.environ
    names = _ENDPOINT_VARIABLES.get(urlsplit(url).scheme, ())
    effective = endpoint or next((env[name] for name in names if env.get(name)), "")
    options: ClientConfig = {
        "allow_http": effective.startswith("http://"),
        "connect_timeout": timedelta(seconds=connect_s),
        "timeout": timedelta(seconds=request_s),
    }
    if read_s is not None:
        options["read_timeout"] = timedelta(seconds=read_s)
    return options


def _retry_config(retries: int, request_s: float) -> RetryConfig:
    return {
        "max_retries": max(0, retries),
        "retry_timeout": timedelta(seconds=request_s),
        "backoff": {
            "init_backoff": timedelta(milliseconds=100),
            "max_backoff": timedelta(seconds=2),
            "base": 2,
        },
    }
