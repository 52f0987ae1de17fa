"""The one bounded reader for what ckptd does not write itself: remote objects (LATEST,
MANIFEST.json, parts), a root's metadata (meta*.json, trackers, lease and claims, pins) and the
arena header. Regular files only, opened non-blocking and never through a link; a size cap per
kind; strict JSON with bounded integers and finite floats.

Owns the caps (docs/SECURITY.md lists them) and the parse; knows nothing of what a document
means. Every error is `BadInput`, naming the item, so a caller can skip it and go on.
"""

from __future__ import annotations

import errno
import json
import math
import os
import stat
from dataclasses import dataclass
from typing import Any

from ckptd.errors import BadInput

KiB = 1024
MiB = 1024 * KiB

# Integers in a document: |n| < 2^63, the range a step, size, offset or generation lives in.
# A longer digit string is refused before Python converts it (int() of 10^5 digits is slow).
INT_LIMIT = 2**63
_INT_DIGITS = 19
# Nesting deeper than this is no document ckptd writes or reads.
MAX_DEPTH = 64


@dataclass(frozen=True)
class Kind:
    """One kind of outside input: its name in messages and the most bytes it may hold."""

    name: str
    cap: int


# The caps, one per kind (docs/SECURITY.md, "Inputs and their bounds").
LATEST = Kind("LATEST", 4 * KiB)
MANIFEST = Kind("MANIFEST.json", 32 * MiB)
PART = Kind("part", 32 * MiB)
REMOTE_JSON = Kind("remote JSON", 1 * MiB)
ROOT_META = Kind("metadata file", 1 * MiB)  # meta.json, meta_<N>.json, Orbax's metadata
TRAINER_STATE = Kind("trainer_state.json", 16 * MiB)  # HF Trainer's, with its log history
DCP_METADATA = Kind("DCP .metadata", 64 * MiB)  # the whole save plan of a sharded checkpoint
TRACKER = Kind("tracker file", 4 * KiB)  # DeepSpeed's latest, Megatron's tracker
LEASE = Kind("lease", 64 * KiB)  # lease.json and its claims
PINS = Kind("pins", 1 * MiB)
MARKER = Kind("marker", 1 * MiB)  # an async save's markers in its step-N.tmp (.ready, results)
LEDGER = Kind("upload ledger", 64 * MiB)  # a local copy's record of objects sent (JSON lines)
JOURNAL = Kind("trash journal", 1 * MiB)  # a trash entry's record of what it holds
ARENA_HEADER = Kind("arena header", 1 * MiB)
LATEST_JSON = Kind("latest.json", 64 * KiB)


def read_file(path: str | os.PathLike[str], kind: Kind, *, dir_fd: int | None = None) -> bytes:
    """The bytes of the regular file `path` (relative to `dir_fd` when given), at most
    `kind.cap`. Refused (BadInput): a symlink, a FIFO, a device, a directory, a file over the
    cap. A missing file is FileNotFoundError, as from open(); other OS errors pass as they are.
    """
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NOCTTY
    try:
        fd = os.open(path, flags, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise BadInput(f"{path}: a symlink, not a regular file ({kind.name})") from None
        raise
    try:
        return read_fd(fd, kind, str(path))
    finally:
        os.close(fd)


def read_fd(fd: int, kind: Kind, what: str) -> bytes:
    """The bytes of an open descriptor from its start, at most `kind.cap`: it must be a regular
    file (a memfd is one). Reads at most cap + 1 bytes, whatever the file claims or grows to."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise BadInput(f"{what}: not a regular file ({kind.name})")
    if st.st_size > kind.cap:
        raise BadInput(f"{what}: {st.st_size} bytes, over the {kind.name} cap of {kind.cap}")
    chunks: list[bytes] = []
    got = 0
    while got <= kind.cap:
        chunk = os.pread(fd, min(kind.cap + 1 - got, MiB), got)
        if not chunk:
            break
        chunks.append(chunk)
        got += len(chunk)
    if got > kind.cap:
        raise BadInput(f"{what}: over the {kind.name} cap of {kind.cap} bytes")
    return b"".join(chunks)


def check_size(data: bytes, kind: Kind, what: str) -> bytes:
    """`data` if within `kind.cap` (for bytes read some other way, e.g. from a store)."""
    if len(data) > kind.cap:
        raise BadInput(f"{what}: {len(data)} bytes, over the {kind.name} cap of {kind.cap}")
    return data


def loads(data: bytes | str, what: str, *, nan: bool = False) -> Any:
    """Strict JSON: UTF-8, no NaN/Infinity, no duplicate keys, integers within ±2^63, floats
    finite, nesting at most MAX_DEPTH. Anything else is BadInput naming `what`. `nan=True`
    lets the constants NaN and ±Infinity through as floats (a framework's metadata, written by
    Python's json with a NaN loss: the caller treats them as no number)."""
    try:
        text = data.decode("utf-8") if isinstance(data, bytes) else data
        doc = json.loads(text, parse_constant=float if nan else _no_constant,
                         parse_int=_bounded_int,
                         parse_float=_finite_float, object_pairs_hook=_unique_keys)
    except BadInput as exc:
        raise BadInput(f"{what}: {exc}") from None
    except RecursionError:
        raise BadInput(f"{what}: JSON nested too deeply") from None
    except (UnicodeDecodeError, ValueError) as exc:
        raise BadInput(f"{what}: not JSON ({exc})") from None
    if _depth(doc) > MAX_DEPTH:
        raise BadInput(f"{what}: JSON nested deeper than {MAX_DEPTH}")
    return doc


def read_json(path: str | os.PathLike[str], kind: Kind, *, dir_fd: int | None = None) -> Any:
    """`read_file` then `loads`."""
    return loads(read_file(path, kind, dir_fd=dir_fd), str(path))


def check_int(value: object, what: str, lo: int = 0, hi: int = INT_LIMIT - 1) -> int:
    """`value` if it is an int (not a bool) with lo <= value <= hi, else BadInput naming it."""
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
        raise BadInput(f"{what}: {_show(value)} is not an integer in [{lo}, {hi}]")
    return value


def check_float(value: object, what: str, lo: float = -math.inf, hi: float = math.inf) -> float:
    """`value` as a finite float within [lo, hi] (ints accepted, bools not), else BadInput."""
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    number = float(value) if ok and abs(value) < 2.0**1023 else math.nan  # type: ignore[arg-type]
    if not math.isfinite(number) or not lo <= number <= hi:
        raise BadInput(f"{what}: {_show(value)} is not a finite number in [{lo}, {hi}]")
    return number


def _show(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _no_constant(name: str) -> Any:
    raise BadInput(f"{name} is not allowed")


def _bounded_int(text: str) -> int:
    if len(text.lstrip("-")) > _INT_DIGITS:
        raise BadInput(f"integer of {len(text)} digits is out of range")
    value = int(text)
    if not -INT_LIMIT < value < INT_LIMIT:
        raise BadInput(f"integer {value} is out of range")
    return value


def _finite_float(text: str) -> float:
    if len(text) > 64:
        raise BadInput("number literal longer than 64 characters")
    value = float(text)
    if not math.isfinite(value):
        raise BadInput(f"number {text} is not finite")
    return value


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise BadInput(f"key {key[:40]!r} appears twice")
        out[key] = value
    return out


def _depth(doc: Any) -> int:
    """Nesting depth without recursion (json.loads already bounded it by the stack)."""
    deepest, todo = 0, [(doc, 1)]
    while todo:
        node, level = todo.pop()
        deepest = max(deepest, level)
        if level > MAX_DEPTH:
            return level
        if isinstance(node, dict):
            todo.extend((child, level + 1) for child in node.values())
        elif isinstance(node, list):
            todo.extend((child, level + 1) for child in node)
    return deepest
