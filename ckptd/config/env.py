"""[daemon] keys from the environment: `CKPTD_<KEY>` (CKPTD_NODE for `node`, CKPTD_SCAN_INTERVAL
for `scan_interval`, ...) overrides the file's value, as a Kubernetes pod's `env` (the downward
API's `spec.nodeName` into CKPTD_NODE) overrides a shared ConfigMap. Reads only the mapping it is
given; validating the result is the loader's.
"""

from __future__ import annotations

import tomllib
from collections.abc import Mapping
from typing import Any

from ckptd.config.schema import DaemonConfig

PREFIX = "CKPTD_"
# Keys whose value is a TOML literal in the file (a number, true/false); a text value of these
# ("30s", "2") is read as TOML first, so CKPTD_WORKERS=4 is 4 and CKPTD_POLLING=true is true.
_LITERAL = frozenset({"workers", "polling", "scan_interval", "lease_timeout"})


def variable(key: str) -> str:
    """The environment variable that sets `[daemon] key`."""
    return PREFIX + key.upper()


def overlay(table: Mapping[str, Any], env: Mapping[str, str]) -> tuple[dict[str, Any], set[str]]:
    """The [daemon] table with every set CKPTD_<KEY> in place of the file's value, and the keys
    that came from the environment (so a problem with one names its variable)."""
    merged, taken = dict(table), set()
    for key in DaemonConfig.model_fields:
        raw = env.get(variable(key))
        if raw is None:
            continue
        merged[key] = _literal(raw) if key in _LITERAL else raw
        taken.add(key)
    return merged, taken


def _literal(raw: str) -> Any:
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw
