"""Storage backends: the contract (`Backend`, in `base`), its implementations (`local` for
file://, with `localfiles` its files' own protocol of temp files, locks and version tags;
`objstore` for object stores, with `objstore_client` building the library's client,
`objstore_errors` translating the library's exceptions and `credentials` finding its keys,
with `aws_profile` reading AWS profiles and `aws_container` a container credentials endpoint),
a put's bytes sent from a file's pages (`mapped`) and the wrappers (`wrappers`).

`make_backend` opens a URL; `wrap_backend` adds retries, a bandwidth cap and a transfer limit.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from ckptd.backends.base import DEFAULT_PART_SIZE, Backend, ObjectMeta, check_key
from ckptd.backends.local import LocalBackend
from ckptd.backends.objstore import ObstoreBackend
from ckptd.backends.wrappers import LimitedBackend, RetryingBackend, ThrottledBackend, TokenBucket
from ckptd.errors import PermanentError

if TYPE_CHECKING:  # the config (pydantic) is imported by its readers, not by a bare URL's load
    from ckptd.config import RootConfig, UploadConfig

__all__ = [
    "DEFAULT_PART_SIZE",
    "Backend",
    "BackendCache",
    "LimitedBackend",
    "LocalBackend",
    "ObjectMeta",
    "ObstoreBackend",
    "RetryingBackend",
    "ThrottledBackend",
    "TokenBucket",
    "backend_for_upload",
    "check_key",
    "make_backend",
    "register",
    "wrap_backend",
]

# Opens a URL of a registered scheme: `opener(url, **the keyword arguments of make_backend)`.
Opener = Callable[..., Backend]
# Stores registered besides the built-in ones (file:, and what ObstoreBackend opens).
_OPENERS: dict[str, Opener] = {}


def register(scheme: str, opener: Opener, example: str) -> None:
    """A storage backend for `scheme://` URLs, the one registration an object store needs:
    the config then accepts such an upload URL (`example`, e.g. "mem://bucket/prefix", is how
    its error sentences show one) and `make_backend` opens it with `opener`. The backend says
    itself whether its etags are MD5s (`Backend.md5_etags`)."""
    from ckptd.config.fields import STORAGE_SCHEMES

    _OPENERS[scheme] = opener
    STORAGE_SCHEMES[scheme] = example


def make_backend(
    url: str,
    *,
    endpoint: str = "",
    region: str = "",
    access_key_id: str = "",
    secret_access_key: str = "",
    part_size: int = DEFAULT_PART_SIZE,
    concurrency: int = 4,
    connect_timeout_s: float = 10.0,
    read_timeout_s: float = 60.0,
    request_timeout_s: float = 600.0,
    request_retries: int = 2,
) -> Backend:
    """The bare backend for an upload URL (`file://`, `s3://`, `gs://`, `az://`, or a scheme
    `register` added).

    `concurrency` is how many parts of one multipart upload are in flight at once; peak memory
    of one put is about `concurrency * part_size`. Raises PermanentError for an unsupported URL
    or unusable credentials. The timeouts and `request_retries` are those of `ObstoreBackend`.
    """
    if url.startswith("file:"):
        return LocalBackend(_file_path(url), part_size=part_size)
    opener = _OPENERS.get(url.partition("://")[0], ObstoreBackend)
    return opener(
        url,
        endpoint=endpoint,
        region=region,
        access_key_id=access_key_id,
        secret_access_key=secret_access_key,
        part_size=part_size,
        concurrency=concurrency,
        connect_timeout_s=connect_timeout_s,
        read_timeout_s=read_timeout_s,
        request_timeout_s=request_timeout_s,
        request_retries=request_retries,
    )


def wrap_backend(
    backend: Backend,
    *,
    attempts: int = 5,
    base_delay: float = 0.5,
    max_delay: float = 30.0,
    max_bytes_per_s: float | None = None,
    max_transfers: int | None = None,
) -> Backend:
    """`backend` with the standard layers, innermost first: bandwidth cap, retries, limit.

    The cap sits inside the retries so re-sent bytes count against it; the limit sits outside
    so a transfer keeps its slot while it backs off instead of letting another one start.
    """
    wrapped: Backend = backend
    if max_bytes_per_s:
        wrapped = ThrottledBackend(wrapped, max_bytes_per_s)
    wrapped = RetryingBackend(wrapped, attempts, base_delay, max_delay)
    if max_transfers:
        wrapped = LimitedBackend(wrapped, max_transfers)
    return wrapped


def _file_path(url: str) -> str:
    """The directory of a file URL, taken literally (config has already made it absolute)."""
    rest = url[len("file:") :]
    if rest.startswith("//"):
        rest = rest[2:]
        host, slash, path = rest.partition("/")
        if host not in ("", "localhost"):
            raise PermanentError(f"file URL {url!r} names a host; use file:///absolute/dir")
        rest = slash + path
    return rest


def backend_for_upload(up: UploadConfig) -> Backend:
    """The backend a root's `[upload]` table describes, with retries and its bandwidth cap:
    the one construction used by the daemon and by `ckptd restore`."""
    backend = make_backend(
        up.url, endpoint=up.endpoint, region=up.region, access_key_id=up.access_key_id,
        secret_access_key=up.secret_access_key.get_secret_value(), part_size=up.part_size,
        concurrency=up.concurrency, connect_timeout_s=up.connect_timeout,
        read_timeout_s=up.read_timeout, request_timeout_s=up.request_timeout)
    return wrap_backend(backend, attempts=up.attempts, max_bytes_per_s=up.max_bandwidth)


class BackendCache:
    """One backend per root, rebuilt only when the root's upload settings change (reload)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cache: dict[str, tuple[UploadConfig, Backend]] = {}

    def get(self, root: RootConfig) -> Backend | None:
        """The root's backend; None when it does not upload."""
        if not root.upload.enabled:
            return None
        with self._lock:
            cached = self._cache.get(root.name)
            if cached is not None and cached[0] == root.upload:
                return cached[1]
            backend = backend_for_upload(root.upload)
            self._cache[root.name] = (root.upload, backend)
            return backend
