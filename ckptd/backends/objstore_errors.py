"""obstore's exceptions as ckptd's: transient, permanent, not found, exists, precondition
failed (the table in docs/STORAGE.md). Only the object-store backend calls it.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import TypeVar

from obstore import exceptions as obx

from ckptd.errors import (
    ObjectExists,
    ObjectNotFound,
    PermanentError,
    PreconditionFailed,
    StorageError,
    TransientError,
)

T = TypeVar("T")

# S3 error codes that mean "try again" even when the HTTP status alone would say otherwise.
_TRANSIENT_CODES = frozenset(
    {
        "SlowDown",
        "RequestTimeout",
        "RequestTimeTooSkewed",
        "InternalError",
        "ServiceUnavailable",
        "OperationAborted",
        "ConditionalRequestConflict",
    }
)
# A missing bucket (S3) or container (Azure); Azure's batch delete says so only in words.
_MISSING_BUCKET_CODES = frozenset({"NoSuchBucket", "ContainerNotFound"})
_MISSING_CONTAINER = re.compile(r"specified container does not exist")
_STATUS = re.compile(r"status code: (\d{3})|status: (\d{3})")
_S3_CODE = re.compile(r"<Code>([^<]+)</Code>")
_S3_MESSAGE = re.compile(r"<Message>([^<]*)</Message>")


def guard(op: str, where: str, fn: Callable[[], T]) -> T:
    """Run one obstore call; its exceptions leave as ckptd StorageErrors."""
    try:
        return fn()
    except StorageError:
        raise  # ours, raised from inside a put's source iterator
    except (obx.BaseError, OSError, ValueError) as exc:
        raise translate(exc, op, where) from None


def translate(exc: BaseException, op: str, where: str) -> StorageError:
    """Classify an obstore exception (see docs/STORAGE.md for the table)."""
    text = str(exc)
    status = _status(text)
    code = _first(_S3_CODE, text)
    detail = _detail(text, status, code, type(exc).__name__)
    prefix = f"{op} {where}"
    if op == "open":  # building a store sends nothing: what fails there is the configuration
        return PermanentError(f"{prefix}: {detail}")
    if code in _MISSING_BUCKET_CODES or _MISSING_CONTAINER.search(text):
        return PermanentError(f"{prefix}: the bucket does not exist ({detail})")
    if isinstance(exc, obx.AlreadyExistsError | obx.PreconditionError):
        if op == "put" and isinstance(exc, obx.PreconditionError):  # If-Match: another version
            return PreconditionFailed(f"{where} is gone or was changed since it was read")
        if op == "put":
            return ObjectExists(f"{where} already exists")
        # A get pinned to a version (If-Match): the object was replaced while being read.
        return PreconditionFailed(f"{prefix}: the object changed while being read")
    if isinstance(exc, FileNotFoundError | obx.NotFoundError):
        if op == "put":  # a put cannot miss its object: the bucket (or container) is missing
            return PermanentError(f"{prefix}: the bucket does not exist ({detail})")
        return ObjectNotFound(f"no object {where}")
    if isinstance(exc, obx.PermissionDeniedError | obx.UnauthenticatedError) or status in (
        401,
        403,
    ):
        return PermanentError(
            f"{prefix}: access denied ({detail}); check access_key_id/secret_access_key "
            "or the credentials in the environment"
        )
    if isinstance(
        exc,
        obx.InvalidPathError | obx.NotSupportedError | obx.UnknownConfigurationKeyError,
    ) or (isinstance(exc, ValueError) and status is None):
        return PermanentError(f"{prefix}: {detail}")
    if status is not None:
        if status >= 500 or status in (408, 429) or code in _TRANSIENT_CODES:
            return TransientError(f"{prefix}: {detail}")
        return PermanentError(f"{prefix}: {detail}")
    # No HTTP status: the request never got an answer (connect, reset, timeout, cut body).
    return TransientError(f"{prefix}: {detail}")


def _status(text: str) -> int | None:
    match = _STATUS.search(text)
    if not match:
        return None
    return int(match.group(1) or match.group(2))


def _first(pattern: re.Pattern[str], text: str) -> str:
    match = pattern.search(text)
    return match.group(1) if match else ""


def _detail(text: str, status: int | None, code: str, fallback: str) -> str:
    """A one-line reason: 'HTTP 503 SlowDown: Please reduce...' or the transport error."""
    if status is not None:
        message = _first(_S3_MESSAGE, text)
        words = " ".join(w for w in (f"HTTP {status}", code) if w)
        return f"{words}: {message}" if message else words
    if not text.strip():
        return fallback
    # obstore's first line reads "Generic S3 error: Error performing PUT <url> in 1ms - <why>".
    why = text.strip().splitlines()[0].rsplit(" - ", 1)[-1].strip()
    if "TimedOut" in text or "timed out" in text.lower():
        why += " (timed out)"
    return why
