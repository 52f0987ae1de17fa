"""What the socket API accepts from a client, checked at the door: steps, numbers, strings,
registrations and paths. Every refusal is an HttpError with its 4xx status; nothing here
touches the store or the daemon.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

from ckptd import inputs
from ckptd.errors import BadInput, BadValue, HttpError
from ckptd.model import Tier

MAX_STEP = 2**63
MAX_PATHS = 10_000
MAX_METRICS = 256


def taken(owners: dict[str, int], paths: list[str], step: int) -> list[tuple[str, int]]:
    """Registered paths that are, or hold, another checkpoint's files."""
    taken = [(p, owners[p]) for p in paths if owners.get(p, step) != step]
    dirs = tuple(p + "/" for p in paths)
    taken += [(f, s) for f, s in owners.items() if s != step and f.startswith(dirs)]
    return sorted(taken)


def step(text: str) -> int:
    """A step: ASCII decimal digits, below 2^63 (what SQLite and every layout can hold)."""
    if not (text.isascii() and text.isdigit()) or len(text) > 19 or int(text) >= MAX_STEP:
        raise HttpError(400, "bad_field", f"step must be an integer from 0 to 2^63-1, got"
                        f" {text[:40]!r}")
    return int(text)


def text(value: str, name: str, limit: int = 4096) -> str:
    """A client string: bounded, no NUL, no lone surrogate (nothing a file system, SQLite or
    a JSON encoder would refuse later)."""
    if len(value) > limit or "\x00" in value or not _encodable(value):
        raise HttpError(400, "bad_field", f"{name} must be UTF-8 text without NUL, at most"
                        f" {limit} characters")
    return value


def owner(value: str) -> str:
    """A hold's owner: a non-empty id of at most 128 characters."""
    value = text(value, "owner")
    if not value or len(value) > 128:
        raise HttpError(400, "bad_field", "owner must be a non-empty id (<= 128 chars)")
    return value


def _encodable(value: str) -> bool:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def no_constant(name: str) -> Any:
    raise BadValue(f"{name} is not JSON (numbers must be finite)")


def finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e999 parses as infinity
        raise BadValue(f"{text[:40]} is out of range")
    return value


def tier(text: str) -> Tier:
    try:
        return Tier(text)
    except ValueError as exc:
        raise HttpError(400, "bad_field", "tier must be any, local or remote") from exc


def number(text: str, name: str, lo: float, hi: float) -> float:
    """A finite number of seconds in [lo, hi]; NaN, infinities and values out of range are
    refused, never clamped into something the client did not ask for."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or not lo <= value <= hi:
        raise HttpError(400, "bad_field", f"{name} must be a number of seconds from {lo:g}"
                        f" to {hi:g}, got {text[:40]!r}")
    return value


def parse_registration(body: Any, root_path: Path) -> tuple[int, list[str], dict[str, float]]:
    """Check a registration body; paths become root-relative. Raises HttpError."""
    if not isinstance(body, dict):
        raise HttpError(400, "bad_json", "body must be a JSON object with a 'step'")
    unknown = set(body) - {"step", "paths", "metrics"}
    if unknown:
        raise HttpError(400, "bad_field", f"unknown field(s): {', '.join(sorted(unknown))}")
    step = body.get("step")
    if not isinstance(step, int) or isinstance(step, bool) or not 0 <= step < MAX_STEP:
        raise HttpError(400, "bad_field", "step must be an integer from 0 to 2^63-1")
    paths = body.get("paths") or []
    if (not isinstance(paths, list) or len(paths) > MAX_PATHS
            or not all(isinstance(p, str) and p for p in paths)):
        raise HttpError(400, "bad_field", f"paths must be a list of at most {MAX_PATHS}"
                        " non-empty strings")
    metrics = body.get("metrics") or {}
    if not isinstance(metrics, dict) or len(metrics) > MAX_METRICS:
        raise HttpError(400, "bad_field", f"metrics must map at most {MAX_METRICS} names to"
                        " finite numbers")
    checked: dict[str, float] = {}
    for k, v in metrics.items():
        try:  # an integer of 400 digits is no float: refused here, never stored
            checked[text(k, "a metric name", 256)] = inputs.check_float(v, f"metric {k[:40]!r}")
        except BadInput as exc:
            raise HttpError(400, "bad_field", f"metrics must map at most {MAX_METRICS} names"
                            f" to finite numbers: {exc}") from None
    rel = [relative_inside(root_path, text(p, "a path")) for p in paths]
    return step, rel, checked


def relative_inside(root: Path, p: str) -> str:
    """`p` (absolute, or relative to the root) as a root-relative path; 422 when it leaves
    the root, directly or through a symlink, or is longer than the file system allows."""
    candidate = Path(p) if os.path.isabs(p) else root / p
    real_root = os.path.realpath(root)
    real = os.path.realpath(candidate)
    if real != real_root and not real.startswith(real_root + os.sep):
        raise HttpError(422, "outside_root", f"{p} is outside the root {root}")
    rel = os.path.relpath(real, real_root)
    if rel == "." or rel.split(os.sep)[0] == ".ckptd":
        raise HttpError(422, "outside_root", f"{p} is not a checkpoint path inside {root}")
    name_max, path_max = _limits(real_root)
    if (len(os.fsencode(real)) >= path_max
            or any(len(os.fsencode(part)) > name_max for part in rel.split(os.sep))):
        raise HttpError(422, "path_too_long", f"{p[:200]} is longer than the file system"
                        f" allows ({name_max} bytes a name, {path_max} a path)")
    return rel.replace(os.sep, "/")


def _limits(path: str) -> tuple[int, int]:
    try:
        return os.pathconf(path, "PC_NAME_MAX"), os.pathconf(path, "PC_PATH_MAX")
    except (OSError, ValueError):
        return 255, 4096


def memory_request(body: Any) -> tuple[str, int, int]:
    """`POST /v1/memory/open`'s body: `{"root", "step", "rank"}`, each checked."""
    if not isinstance(body, dict) or set(body) - {"root", "step", "rank"}:
        raise HttpError(400, "bad_request", 'the body must be {"root", "step", "rank"}')
    root = body.get("root")
    if not isinstance(root, str) or not root:
        raise HttpError(400, "bad_field", "root must be a root's name")
    values = []
    for name, high in (("step", MAX_STEP - 1), ("rank", (1 << 16) - 1)):
        value = body.get(name)
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= high:
            raise HttpError(400, "bad_field", f"{name} must be an integer from 0 to {high}")
        values.append(value)
    return text(root, "root", 128), values[0], values[1]
