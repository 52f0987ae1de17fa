"""The one JSON line a restore child process (`ckptd.cli.restore_child`) answers with:
written there, read by ckptd.torch. Standard library and ckptd.errors only (a training
process imports it).
"""

from __future__ import annotations

import json

from ckptd import errors
from ckptd.errors import CkptdError

# The errors of a restore that keep their class across the process boundary; any other
# CkptdError arrives as a CkptdError with its message.
PASSED_ON: tuple[type[CkptdError], ...] = (
    errors.NotFound, errors.ObjectReplaced, errors.CorruptData, errors.ConfigError,
    errors.UnsafePath, errors.TransientError, errors.PermanentError, errors.DiskFull)


def done(paths: list[str]) -> str:
    return json.dumps({"paths": paths})


def failed(exc: CkptdError) -> str:
    return json.dumps({"error": type(exc).__name__, "message": str(exc)})


def error_of(output: str) -> CkptdError:
    """The error a failed child's output ends with, as the class it was (among PASSED_ON)."""
    try:
        doc = json.loads(output.strip().splitlines()[-1])
        name, message = str(doc["error"]), str(doc["message"])
    except (ValueError, IndexError, KeyError, TypeError):
        return CkptdError(f"the restore process failed without an answer: {output[-2000:]!r}")
    for cls in PASSED_ON:
        if cls.__name__ == name:
            return cls(message)
    return CkptdError(message)
