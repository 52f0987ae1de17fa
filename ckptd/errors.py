"""The documented exception tree of ckptd.

Owns every exception type ckptd raises across module boundaries; imports nothing else of ckptd.
Only `ckptd.cli.main` turns these into exit codes (see `exit_code`).
"""

from __future__ import annotations


class CkptdError(Exception):
    """Base of every error ckptd raises on purpose."""

    exit_code = 1


class ConfigError(CkptdError):
    """The configuration is malformed or has a bad value. Message names the key's path."""

    exit_code = 78


class UsageError(CkptdError):
    """The command line or a request was malformed."""

    exit_code = 2


class DaemonUnreachable(CkptdError):
    """No daemon answered on the socket."""

    exit_code = 69


class StateUnusable(ConfigError):
    """The state database is corrupt, truncated or unreadable: the daemon refuses to start
    rather than take it for an empty one (an operator must look at it)."""


class StateLocked(CkptdError):
    """Another daemon holds the state directory's lock."""

    exit_code = 75


class ServiceUnavailable(CkptdError):
    """A service of the daemon could not do what was asked in time (not running, or busy);
    asking again later may succeed. The socket API answers it with 503."""

    exit_code = 69


class NotFound(CkptdError):
    """No such root, step or object."""

    exit_code = 1


class ValidationFailed(CkptdError):
    """A checkpoint (or one file of it) is invalid; `reason` is machine-readable."""

    def __init__(self, reason: str, message: str, path: str | None = None) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message
        self.path = path


class UnsafePath(CkptdError):
    """A path leaves its root (directly or through a symlink)."""


class StorageError(CkptdError):
    """A storage backend failed. Subclasses say whether retrying can help."""


class TransientError(StorageError):
    """Retrying later may succeed (timeouts, 5xx, connection resets)."""


class PermanentError(StorageError):
    """Retrying will not help (bad credentials, no such bucket, bad request)."""


class ObjectNotFound(PermanentError):
    """The object does not exist."""


class ObjectExists(PermanentError):
    """A create-only put found the object already there."""


class PreconditionFailed(StorageError):
    """A conditional put (`if_match`) found the object changed or gone: neither transient nor
    permanent, the caller re-reads and decides again."""


class CorruptData(CkptdError):
    """Stored data does not match its recorded hash, size or framing."""


class BadInput(CorruptData):
    """An input from outside the daemon's own state (a remote object, a root's metadata file,
    an arena header) is not what it must be: not a regular file, over its size cap, not strict
    JSON, a number out of range. The message names the item; the item alone is set aside."""


class DiskFull(CkptdError):
    """No space left while writing (ENOSPC/EDQUOT)."""


def exit_code(err: BaseException) -> int:
    """The process exit code for an error that reached the command line."""
    if isinstance(err, CkptdError):
        return err.exit_code
    return 1
