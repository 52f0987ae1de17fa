"""The numbers the docs quote are the code's: request and input limits, long-poll and
connection bounds, stuck-call bounds, the supervisor's backoff, the stop grace, and SECURITY.md's
input caps against `ckptd.inputs`' kinds. Each claim is a pattern; a doc that no longer says it
fails too, so the claim is updated with the doc."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import pytest
from support.docs import DOCS, ROOT, MiB, doc_lines, spec, where

from ckptd import inputs
from ckptd.api import checks, door, server
from ckptd.codec import frame, seektable, zstdframes
from ckptd.config import UploadConfig
from ckptd.fetch import holds
from ckptd.service import discovery, persist, supervisor


def _ttl_bounds() -> tuple[float, float]:
    """The hold's ttl bounds, as the handler checks them."""
    m = re.search(r'"ttl", ([\d.]+), ([\d.]+)\)', Path(server.__file__).read_text())
    assert m, "the ttl check moved: update _ttl_bounds"
    return float(m.group(1)), float(m.group(2))


# (doc, pattern with number groups, what the code says, converting each group)
Number = Callable[[str], float]
_n: Number = lambda s: float(s.replace(",", ""))  # noqa: E731
_mib: Number = lambda s: float(s) * MiB  # noqa: E731
_day: Number = lambda s: float(s) * 86400  # noqa: E731
CLAIMS: list[tuple[str, str, Callable[[], tuple[float, ...]], tuple[Number, ...]]] = [
    ("docs/CLI.md", r"body over (\d+) MiB", lambda: (server.MAX_BODY,), (_mib,)),
    ("docs/CLI.md", r"a body is at most (\d+) MiB", lambda: (server.MAX_BODY,), (_mib,)),
    ("docs/CLI.md", r"`ttl` (\d+) s to (\d+) day", _ttl_bounds, (_n, _day)),
    ("docs/CLI.md", r"long-poll \(`timeout` (\d+) to (\d+) s\)",
     lambda: (0, server.MAX_WAIT_S), (_n, _n)),
    ("docs/CLI.md", r"at most ([\d,]+) paths and (\d+) metrics",
     lambda: (checks.MAX_PATHS, checks.MAX_METRICS), (_n, _n)),
    ("docs/CLI.md", r"at most (\d+) requests are answered at once",
     lambda: (server.MAX_THREADS,), (_n,)),
    ("docs/CLI.md", r"(\d+)-deep listen backlog", lambda: (door.LISTEN_BACKLOG,), (_n,)),
    ("docs/CLI.md", r"closed after (\d+) s \(the longest idle first when ([\d,]+) are open",
     lambda: (server.IDLE_TIMEOUT_S, server.MAX_OPEN), (_n, _n)),
    ("docs/CLI.md", r"(\d+) saves in flight", lambda: (persist.MAX_IN_FLIGHT,), (_n,)),
    ("docs/CLI.md", r"long-poll, at most (\d+) s", lambda: (persist.MAX_WAIT_S,), (_n,)),
    ("docs/CLI.md", r"up to (\d+) \(each error cut at (\d+) characters",
     lambda: (discovery.MAX_BAD_SHOWN, discovery.MAX_ERROR_CHARS), (_n, _n)),
    ("docs/CLI.md", r"`MANIFEST.json` over its (\d+) MiB cap", lambda: (inputs.MANIFEST.cap,),
     (_mib,)),
    ("docs/OPERATIONS.md", r"Bounds \(no progress for this long\): validate and compress (\d+) s "
     r"[^,]*, upload (\d+) s", lambda: _stage_bounds("validate", "compress", "upload"), (_n, _n)),
    ("docs/OPERATIONS.md", r"bounded by the backend's (\d+) s request timeout",
     lambda: (UploadConfig().request_timeout,), (_n,)),
    ("docs/OPERATIONS.md", r"an async save's write (\d+) s", lambda: (persist.STALL_BOUND_S,),
     (_n,)),
    ("docs/OPERATIONS.md", r"remote listing by discovery (\d+) s", lambda: (discovery.BOUND_S,),
     (_n,)),
    ("docs/OPERATIONS.md", r"one root's retention run ([\d,]+) s",
     lambda: (_module_constant("ckptd/service/retention.py", "RUN_BOUND_S"),), (_n,)),
    ("docs/OPERATIONS.md", r"an upload quiet for (\d+) s",
     lambda: (_module_constant("ckptd/service/workers.py", "HOLD_AFTER_S"),), (_n,)),
    ("docs/OPERATIONS.md", r"`Restart=on-failure` \(after (\d+) s\)",
     lambda: (float(_unit()["RestartSec"].removesuffix("s")),), (_n,)),
    ("docs/OPERATIONS.md", r"`WatchdogSec=(\d+)`. The daemon pings systemd every (\d+) s",
     lambda: (float(_unit()["WatchdogSec"]), float(_unit()["WatchdogSec"]) / 2), (_n, _n)),
    ("README.md", r"body over (\d+) MiB", lambda: (server.MAX_BODY,), (_mib,)),
    ("docs/FORMAT.md", r"\((\d+) bytes: a width-1 header and one byte; a zstd frame: (\d+)\)",
     lambda: (frame.MIN_BLOCK_STORED, seektable.MIN_FRAME), (_n, _n)),
    ("docs/FORMAT.md", r"at most `raw_size` plus (\d+) bytes a block",
     lambda: (frame.MAX_BLOCK_HEADER,), (_n,)),
    ("docs/FORMAT.md", r"\((\d+) to raw \+ (\d+); a frame (\d+) to",
     lambda: (frame.MIN_BLOCK_STORED, frame.MAX_BLOCK_HEADER, seektable.MIN_FRAME), (_n, _n, _n)),
    ("docs/FORMAT.md", r"the block size, at least (\d+) KiB\)",
     lambda: (zstdframes.MIN_FULL_FRAME,), (lambda s: float(s) * 1024,)),
    ("docs/OPERATIONS.md", r"gives in-flight stages (\d+) s to finish",
     lambda: (_daemon_constant("STOP_GRACE_S"),), (_n,)),
    ("docs/DESIGN.md", r"doubles from ([\d.]+) s up to (\d+) s \(and starts over once it ran"
     r" (\d+) s\)", lambda: (supervisor.BACKOFF_BASE_S, supervisor.BACKOFF_MAX_S,
                                 supervisor.HEALTHY_AFTER_S), (_n, _n, _n)),
    ("docs/OPERATIONS.md", r"restarted after the backoff \(([\d.]+) s doubling up to (\d+) s\)",
     lambda: (supervisor.BACKOFF_BASE_S, supervisor.BACKOFF_MAX_S), (_n, _n)),
    ("SPEC.md", r"413 \(body over (\d+) MiB\)", lambda: (server.MAX_BODY,), (_mib,)),
    ("docs/RETENTION.md", r"`HOLD_TTL_S` = (\d+) s", lambda: (holds.HOLD_TTL_S,), (_n,)),
    ("docs/RETENTION.md", r"`MAX_HOLD_OBJECTS` = ([\d,]+) entries",
     lambda: (holds.MAX_HOLD_OBJECTS,), (_n,)),
    ("docs/RETENTION.md", r"rewrites it every (\d+) s", lambda: (holds.RENEW_S,), (_n,)),
    ("docs/REMOTE_LOAD.md", r"renews it every (\d+) s \(`RENEW_S`", lambda: (holds.RENEW_S,),
     (_n,)),
    ("docs/REMOTE_LOAD.md", r"and `ttl=(\d+)`", lambda: (holds.HOLD_TTL_S,), (_n,)),
    ("docs/OPERATIONS.md", r"over ([\d,]+) objects under `<root>/_holds/`",
     lambda: (holds.MAX_HOLD_OBJECTS,), (_n,)),
]


def _module_constant(module: str, name: str) -> float:
    """A number a module sets at its top (read from its source: the module may not import
    alone, and its constants move while it is split)."""
    m = re.search(rf"^{name}(?:, \w+)* = ([\d.]+)", (ROOT / module).read_text(), re.M)
    assert m, f"{module} has no {name}: update the claim in tests/docs/test_docs.py"
    return float(m.group(1))


def _daemon_constant(name: str) -> float:
    return _module_constant("ckptd/daemon.py", name)


def _stage_bounds(*stages: str) -> tuple[float, ...]:
    """The stage workers' bounds, the first two stages' as one number (the doc says one)."""
    text = (ROOT / "ckptd/service/workers.py").read_text()
    got = [float(m[1]) if (m := re.search(rf"Stage\.{s.upper()}: ([\d.]+)", text)) else -1.0
           for s in stages]
    return (got[0] if got[0] == got[1] else -1.0, *got[2:])


@pytest.mark.parametrize(("doc", "pattern", "truth", "convert"), CLAIMS,
                         ids=[f"{c[0]}:{c[1][:30]}" for c in CLAIMS])
def test_numbers_match_the_code(doc: str, pattern: str, truth: Callable[[], tuple[float, ...]],
                                convert: tuple[Number, ...]) -> None:
    path = spec() if doc == "SPEC.md" else ROOT / doc
    text = path.read_text()
    found = list(re.finditer(pattern.replace(" ", r"\s+"), text))  # however the lines wrap
    assert found, f"{doc} no longer says {pattern!r}: update the claim in tests/docs/test_docs.py"
    want = truth()
    for m in found:
        got = tuple(f(g) for f, g in zip(convert, m.groups(), strict=True))
        assert got == want, f"{where(path, text, m.start())}: says {m.group(0)!r}, code: {want}"


# Rows of SECURITY.md's inputs table (by their first cell's start) and the cap that reads them.
INPUT_ROWS = {
    "| `LATEST`": inputs.LATEST, "| `MANIFEST.json`": inputs.MANIFEST,
    "| a node's part": inputs.PART, "| any other JSON": inputs.REMOTE_JSON,
    "| `meta.json`, `meta_<N>.json`": inputs.ROOT_META, "| `trainer_state.json`":
    inputs.TRAINER_STATE, "| DCP's `.metadata`": inputs.DCP_METADATA,
    "| DeepSpeed's `latest`": inputs.TRACKER, "| `lease.json`": inputs.LEASE,
    "| `pins.json`": inputs.PINS, "| a local compressed copy's `MANIFEST.json`": inputs.MANIFEST,
    "| a copy's upload ledger": inputs.LEDGER, "| a trash entry's journal": inputs.JOURNAL,
    "| an async save's markers": inputs.MARKER, "| `meta.json` read by": inputs.ROOT_META,
}


def test_input_caps_match_inputs_kinds() -> None:
    seen = set()
    for at, line in doc_lines(DOCS / "SECURITY.md"):
        for start, kind in INPUT_ROWS.items():
            if line.startswith(start):
                seen.add(start)
                bound = line.split(" | ")[2]
                m = re.match(r"(\d+) (KiB|MiB)", bound)
                assert m, f"{at}: the bound of {start} names no size"
                size = int(m.group(1)) * (1024 if m.group(2) == "KiB" else MiB)
                assert size == kind.cap, f"{at}: {m.group(0)}, but {kind.name}'s cap is {kind.cap}"
    assert seen == set(INPUT_ROWS), f"rows gone from SECURITY.md: {set(INPUT_ROWS) - seen}"



def _unit() -> dict[str, str]:
    """systemd/ckptd.service's settings (the watchdog pings at half WatchdogSec: sdnotify)."""
    unit: dict[str, str] = {}
    for line in (ROOT / "systemd/ckptd.service").read_text().splitlines():
        key, sep, value = line.partition("=")
        if sep and not line.startswith("#"):
            unit[key.strip()] = value.strip()
    return unit


def test_unit_settings_match_the_unit() -> None:
    """Each `Key=value` OPERATIONS.md quotes of the systemd unit is what systemd/ckptd.service
    sets."""
    unit = _unit()
    quoted = [(at, m[1], m[2]) for at, line in doc_lines(DOCS / "OPERATIONS.md")
              for m in re.finditer(r"`([A-Z]\w+)=([^`\s]+)`", line) if m[1] in unit]
    assert len(quoted) > 5, "OPERATIONS.md quotes no unit settings: the pattern is stale"
    bad = [f"{at}: {key}={value}, the unit: {unit[key]}" for at, key, value in quoted
           if value != unit[key]]
    assert not bad, f"OPERATIONS.md quotes unit settings the unit does not have: {bad}"
