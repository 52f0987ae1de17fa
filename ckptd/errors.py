"""The documented exception tree of ckptd: every exception type raised across module boundaries.

Imports nothing else of ckptd, and so cannot import an exception that carries an area's own
types; those few live in their area's module, derive from a class here, and are listed here
(each is caught by its area's caller, never by the command line):

- `ckptd.lifecycle.table.Refused` (a Signal): the lifecycle table refuses a (status, event)
  pair; carries the `Status` and `Event`. The store records nothing.
- `ckptd.stages.multinode.parts.NotCommitted` and `ShareChanged` (TransientErrors): a node's part is
  written, the step waits for the other nodes' parts; carries the commit `Plan` and the nodes'
  states.
- `ckptd.retention.nets.DeleteRefused` (a Signal): a safety net refuses one deletion, with its
  reason.
- `ckptd.service.lease_files.LeaseProblem` (a CkptdError): a root's lease cannot be looked at
  or written. `ckptd.service.uploads.CopyMissing` (a NotFound): no usable local copy to upload.
- `ckptd.service.progress.StageCancelled` (an Interrupt): a running stage is stopped.
- `ckptd.client.ClientError` and its `DaemonUnavailable` (CkptdErrors): the client is standard
  library only and imports nothing of ckptd but this module; `ckptd.cli.main` translates them
  into the errors below.

Private flow signals (Signals), because a callee that is not ckptd's must be unwound (a return
value cannot cross it): `formats.picklescan._Unsafe` and `formats.dcpmeta._Unsafe` (inside a
pickle interpreter and `pickle.Unpickler.find_class`), `dcp.tensorpkl.Unusual` (inside
`pickle.Unpickler`), `fetch.pipe._Cancelled` and `fetch.openfile._Stopped` (inside a
backend's `get` writing into a pipe), `torch._arena_copy.Unsupported` (inside `torch.save`'s
pickler), `client._NoAnswer`. They never leave their module's caller.

`BadValue` and `Malformed` are also ValueErrors: a pydantic validator reports a ValueError as
its field's error, argparse as a bad argument, and Python callers of a public function expect
one for a bad argument. The few plain ValueErrors left are listed in tests/test_errors_tree.py.

Only `ckptd.cli.main` turns these into exit codes (see `exit_code`; docs/CLI.md lists them).
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
    """No daemon answered on the socket (the command line's translation of the client's
    DaemonUnavailable)."""

    exit_code = 69


class StateUnusable(ConfigError):
    """The state database is corrupt, truncated or unreadable: the daemon refuses to start
    rather than take it for an empty one (an operator must look at it)."""


class StateLocked(CkptdError):
    """Another daemon holds the state directory's lock."""

    exit_code = 75


class ServiceUnavailable(CkptdError):
    """A service of the daemon could not do what was asked in time (not running, or busy), or
    the daemon is shutting down; asking again later may succeed. The socket API answers it with
    503, and the command line exits 69 on a 503 (EX_UNAVAILABLE, as for no daemon at all)."""

    exit_code = 69


class NotFound(CkptdError):
    """No such root, step or object."""

    exit_code = 1


class ObjectReplaced(NotFound):
    """A stored object was replaced by another version (or rewritten in place) while it was
    being read: the version the read started on is gone, and nothing of the new one is mixed
    in. A NotFound, as for an object deleted mid-read (the step that was read is no longer
    there as it was); reading again from the start reads the new version whole. The message
    names the object."""


class ValidationFailed(CkptdError):
    """A checkpoint (or one file of it) is invalid; `reason` is machine-readable."""

    def __init__(self, reason: str, message: str, path: str | None = None) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message
        self.path = path


class TooManyFiles(CkptdError):
    """A step has more files than this process may hold open at once (RLIMIT_NOFILE): not a
    fault of the checkpoint, so its stage is retried later rather than marked invalid."""


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


class Cancelled(CkptdError):
    """The daemon is stopping: an async save (`ckptd.arena_write`) is abandoned before its
    commit."""


class Malformed(CorruptData, ValueError):
    """Bytes read from a file or an object (a manifest, a lease file, a pins file, a pickle, a
    layout's metadata, an arena header) do not parse as their format; the message says what is
    wrong. Also a ValueError, which their parsers' callers catch."""


class BadValue(CkptdError, ValueError):
    """A value handed to ckptd (a config field, a command-line argument, a request's field, a
    public function's argument) is malformed or out of range; the message names it. Also a
    ValueError: pydantic reports it as the field's error, argparse as a bad argument."""


class InternalError(CkptdError):
    """ckptd broke one of its own rules (a service returned without being stopped, a loop
    entered twice, a thread it relies on died): a fault of ckptd or its machine, never of the
    input. The supervisor reports it and restarts the service."""


class BadPart(Malformed):
    """A multi-node part object (`ckptd.cluster.commit.parse_part`) that is not a
    `ckptd-part/1` document; the message says what is wrong. Its readers skip that part (or
    refuse to take its key) and go on."""


class Signal(Exception):
    """Base of the signals that stay inside one area: a decision carried up to its own caller
    (`lifecycle.table.Refused`, `retention.nets.Refusal`) or a private flow signal unwinding a
    callee that is not ckptd's. Not a CkptdError, so no `except CkptdError` on its way swallows
    it, and none reaches the command line."""


class Interrupt(BaseException):
    """Base of the signals that must pass through `except Exception` as well: a stage stopped
    mid-run (`service.progress.StageCancelled`) unwinds past the stage's own error handling."""


class HttpError(Signal):
    """An answer of the socket API to one request: `status`, a machine-readable `code` and a
    `message` (`ckptd.api`). Not a CkptdError: it never leaves the API's request handlers,
    which turn it into `{"error": code, "message": message}`."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message


def exit_code(err: BaseException) -> int:
    """The process exit code for an error that reached the command line."""
    if isinstance(err, CkptdError):
        return err.exit_code
    return 1
