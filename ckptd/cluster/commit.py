"""The multi-node commit, decided: from the parts the nodes wrote at one step, which attempt of
each node belongs to the coordinator's save, whether they cover its expected set, and whether
this node may commit now. Pure: no store, no clock (`now` is passed in). docs/MULTINODE.md.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ckptd import inputs
from ckptd.errors import BadInput, BadPart, Malformed
from ckptd.remote.manifest import distinct_paths

PART_FORMAT = "ckptd-part/1"
PARTS_DIR = "_parts"
# `_confirms/<coordinator part>/<node>.<attempt>`: that node's part is its share of the save
# whose record the coordinator part holds (written by the node after it saw the record).
CONFIRMS_DIR = "_confirms"
CONFIRM_FORMAT = "ckptd-confirm/1"
MAX_PART_BYTES = inputs.PART.cap
# Clocks of the nodes of one job agree within SKEW_S (NTP keeps them within milliseconds).
SKEW_S = 30.0
# The ranks of one save finish writing within SPREAD_S of the coordinator's first own file.
SPREAD_S = 120.0
# Where a node's confirmation cannot keep attempts apart (a record written before other ranks'
# files; a later save of a completed, uncommitted one), the window does, assuming a re-save of a
# step starts more than GAP_S after the last write of the attempt it replaces.
GAP_S = SPREAD_S + 2 * SKEW_S
_NODE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$", re.ASCII)  # as daemon.node
_ATTEMPT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$", re.ASCII)  # no dot: split at the last


@dataclass(frozen=True)
class PartFile:
    """One file of a node's part: the manifest's fields plus the file's mtime (node clock)."""

    path: str
    size: int
    mtime: float
    hash: str
    hash_alg: str
    codec: str
    stored_size: int
    key: str  # relative to the step's prefix: `<node>.<attempt>/<path><codec suffix>`

    def as_json(self) -> dict[str, Any]:
        return {"path": self.path, "size": self.size, "mtime": self.mtime, "hash": self.hash,
                "hash_alg": self.hash_alg, "codec": self.codec,
                "stored_size": self.stored_size, "key": self.key}


@dataclass(frozen=True)
class CommitRecord:
    """The coordinator's commit record of one save: its file, its mtime, and the expected set
    it describes (path -> the least size the record requires; 0 = present)."""

    path: str
    mtime: float
    expected: Mapping[str, int]
    # How long after the record other ranks may still finish writing (DeepSpeed writes its
    # model states, then each rank its optimizer states concurrently): SPREAD_S there, else 0.
    after: float = 0.0
    # The record gives each file's exact size (native meta.json), not a least one (DCP ranges).
    exact: bool = False

    def as_json(self) -> dict[str, Any]:
        return {"path": self.path, "mtime": self.mtime, "expected": dict(self.expected),
                "after": self.after, "exact": self.exact}


@dataclass(frozen=True)
class Part:
    node: str
    attempt: str
    layout: str
    files: tuple[PartFile, ...]
    record: CommitRecord | None = None
    written: float = 0.0  # when the store says the part object was written (not in the JSON)

    def as_json(self) -> dict[str, Any]:
        return {"format": PART_FORMAT, "node": self.node, "attempt": self.attempt,
                "layout": self.layout, "files": [f.as_json() for f in self.files],
                "record": None if self.record is None else self.record.as_json()}

    def to_bytes(self) -> bytes:
        return json.dumps(self.as_json(), indent=1, sort_keys=True).encode() + b"\n"

    @property
    def name(self) -> str:
        return f"{self.node}.{self.attempt}"

    @property
    def newest_mtime(self) -> float:
        return max((f.mtime for f in self.files), default=-math.inf)


def valid_ids(node: str, attempt: str) -> bool:
    """A node id as `daemon.node` allows; an attempt id of letters, digits, `-`, `_` (no dot:
    `<node>.<attempt>` splits at the last one)."""
    return bool(_NODE.match(node)) and bool(_ATTEMPT.match(attempt))


def attempt_id(stats: Iterable[tuple[str, int, int]]) -> str:
    """The attempt id of a node's save from its files' (path, size, mtime_ns): the same files
    give the same id (a re-run of an upload reuses its objects); a re-save gives a new one."""
    items = sorted(stats)
    digest = hashlib.blake2b(repr(items).encode(), digest_size=5).hexdigest()
    newest = max((m for _p, _s, m in items), default=0) // 1_000_000_000
    return f"{newest}-{digest}"


def parse_part(data: bytes, where: str, written: float = 0.0) -> Part:
    """Parse and check a part object (strict JSON, `inputs.PART`'s cap, bounded numbers);
    BadPart naming what is wrong."""
    try:
        doc = inputs.loads(inputs.check_size(data, inputs.PART, where), where)
    except BadInput as exc:
        raise BadPart(str(exc)) from None
    if not isinstance(doc, dict) or doc.get("format") != PART_FORMAT:
        raise BadPart(f"{where}: not a {PART_FORMAT} document")
    try:
        node, attempt = str(doc["node"]), str(doc["attempt"])
        if not valid_ids(node, attempt):
            raise Malformed(f"bad node or attempt id {node!r}.{attempt!r}")
        files = tuple(_part_file(f, node) for f in doc["files"])
        distinct_paths(f.path for f in files)
        return Part(node=node, attempt=attempt, layout=str(doc["layout"]), files=files,
                    record=_record(doc.get("record")), written=written)
    except (KeyError, TypeError, ValueError, OverflowError, AttributeError, BadInput) as exc:
        raise BadPart(f"{where}: malformed part ({exc})") from None


def _part_file(f: Any, node: str) -> PartFile:
    """A file of `node`'s part; its key is under one of that node's attempts (this part's, or
    an earlier part's where the same file was sent before)."""
    path, key = _safe(str(f["path"])), _safe(str(f["key"]))
    owner, _dot, attempt = key.split("/", 1)[0].rpartition(".")
    if "/" not in key or owner != node or not _ATTEMPT.match(attempt):
        raise Malformed(f"key {key!r} is not under one of {node!r}'s attempts")
    size = inputs.check_int(f["size"], f"size of {path[:200]!r}")
    stored = inputs.check_int(f["stored_size"], f"stored_size of {path[:200]!r}")
    mtime = inputs.check_float(f["mtime"], f"mtime of {path[:200]!r}")
    return PartFile(path=path, size=size, mtime=mtime, hash=str(f["hash"]),
                    hash_alg=str(f["hash_alg"]), codec=str(f["codec"]), stored_size=stored,
                    key=key)


def _record(doc: Any) -> CommitRecord | None:
    if doc is None:
        return None
    mtime = inputs.check_float(doc["mtime"], "record mtime")
    expected = {_safe(str(k)): inputs.check_int(v, f"expected size of {str(k)[:200]!r}")
                for k, v in dict(doc["expected"]).items()}
    after = inputs.check_float(doc.get("after", 0.0), "record after", 0.0, SPREAD_S)
    exact = doc.get("exact", False)
    if not isinstance(exact, bool):
        raise Malformed("record exact")
    return CommitRecord(path=_safe(str(doc["path"])), mtime=mtime, expected=expected, after=after,
                  exact=exact)


def _safe(p: str) -> str:
    if p.startswith("/") or "\x00" in p or any(x in ("", ".", "..") for x in p.split("/")):
        raise Malformed(f"unsafe path {p!r}")
    return p


# -- the decision ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    """What the parts at one step say. `chosen` are the parts of one save (the coordinator's
    first) when they cover its expected set; `missing_nodes` the known nodes with no part of
    that save; `problems` in words (empty when covered)."""

    coordinator: str | None
    chosen: tuple[Part, ...] = ()
    covered: bool = False
    missing_nodes: tuple[str, ...] = ()
    problems: tuple[str, ...] = ()
    newest_written: float = -math.inf
    files: tuple[PartFile, ...] = field(default=())  # the commit's files when covered


def window(coordinator: Part) -> tuple[float, float]:
    """The mtimes (any node's clock) a file of the coordinator's save may carry. `first` is
    the earliest of the coordinator's own files the record names (written by this save), so
    a stale file beside them cannot widen the window."""
    assert coordinator.record is not None
    own = [f.mtime for f in coordinator.files if f.path in coordinator.record.expected]
    first = min(own, default=coordinator.record.mtime)
    last = max([coordinator.record.mtime, *own])
    return first - SPREAD_S - SKEW_S, last + coordinator.record.after + SKEW_S


def confirm_key(coord: Part, part: Part) -> str:
    """Where `part`'s node confirms `part` for the save of `coord`'s record (relative to the
    step's prefix)."""
    return f"{CONFIRMS_DIR}/{coord.name}/{part.name}"


def parse_confirms(keys: Iterable[str]) -> dict[str, frozenset[str]]:
    """The confirmations under a step's `_confirms/` (keys relative to it): coordinator part
    -> the parts confirmed for its save. A key of another shape is ignored (it confirms
    nothing)."""
    out: dict[str, set[str]] = {}
    for key in keys:
        bits = key.split("/")
        if len(bits) != 2 or not all(_part_name(b) for b in bits):
            continue
        out.setdefault(bits[0], set()).add(bits[1])
    return {k: frozenset(v) for k, v in out.items()}


def _part_name(name: str) -> bool:
    node, _dot, attempt = name.rpartition(".")
    return valid_ids(node, attempt)


def choose(parts: Sequence[Part], known_nodes: Iterable[str] = (),
           confirmed: Mapping[str, Collection[str]] | None = None) -> Plan:
    """Decide the step from every part written at it (any node, any attempt) and the
    confirmations (`parse_confirms`): a node's part is chosen only when that node confirmed
    it for the coordinator part's save, i.e. found its files unchanged after it saw the
    record (`stages.multinode.parts`); the window of mtimes is checked as well."""
    newest = max((p.written for p in parts), default=-math.inf)
    coord = _coordinator(parts)
    known = sorted(set(known_nodes) | {p.node for p in parts})
    if coord is None:
        return Plan(None, missing_nodes=tuple(known), newest_written=newest,
                    problems=("no part holds the commit record yet",))
    lo, hi = window(coord)
    by_node: dict[str, list[Part]] = {}
    for p in parts:
        by_node.setdefault(p.node, []).append(p)
    vouched = (confirmed or {}).get(coord.name, ())
    chosen, missing, problems = [coord], [], []
    for node in known:
        if node == coord.node:
            continue
        fits = [p for p in by_node.get(node, []) if p.name in vouched and _within(p, lo, hi)]
        if fits:  # two looks at one save (a share that grew after it settled): the newest
            chosen.append(max(fits, key=lambda p: (p.newest_mtime, len(p.files), p.attempt)))
        else:
            missing.append(node)
    files, gaps = _cover(coord, chosen)
    problems += gaps
    return Plan(coord.node, tuple(chosen), covered=not problems, missing_nodes=tuple(missing),
                problems=tuple(problems), newest_written=newest,
                files=tuple(files) if not problems else ())


def coordinator(parts: Sequence[Part]) -> Part | None:
    """The part whose record decides the step (`_coordinator`)."""
    return _coordinator(parts)


def _coordinator(parts: Sequence[Part]) -> Part | None:
    """The part holding the newest commit record (a re-save's record replaces the first)."""
    with_record = [p for p in parts if p.record is not None]
    if not with_record:
        return None
    return max(with_record, key=lambda p: (p.record.mtime if p.record else 0.0, p.name))


def _within(p: Part, lo: float, hi: float) -> bool:
    return bool(p.files) and all(lo <= f.mtime <= hi for f in p.files)


def _cover(coord: Part, chosen: list[Part]) -> tuple[list[PartFile], list[str]]:
    """The union of the chosen parts' files and what keeps it from covering the record."""
    assert coord.record is not None
    by_path: dict[str, PartFile] = {}
    problems: list[str] = []
    for part in chosen:
        for f in part.files:
            there = by_path.get(f.path)
            if there is None:
                by_path[f.path] = f
            elif (there.size, there.hash) != (f.size, f.hash):
                problems.append(f"{f.path} differs between nodes")
    for path, least in sorted(coord.record.expected.items()):
        got = by_path.get(path)
        if got is None:
            problems.append(f"{path} in no part of the save")
        elif got.size < least or (coord.record.exact and got.size != least):
            need = "" if coord.record.exact else "at least "
            problems.append(f"{path} has {got.size} bytes, the record needs {need}{least}")
    return sorted(by_path.values(), key=lambda f: f.path), problems


def may_commit(plan: Plan, node: str, now: float, commit_timeout: float) -> bool:
    """The coordinator commits as soon as the parts cover its save; any node may once
    `commit_timeout` has passed since the newest part was written (only who commits depends
    on it: the commit itself is create-only and the same whoever writes it)."""
    if not plan.covered:
        return False
    return plan.coordinator == node or now - plan.newest_written >= commit_timeout


def node_states(parts: Sequence[Part], committed: Mapping[str, str] | None,
                known_nodes: Iterable[str] = ()) -> dict[str, str]:
    """Each node's part state at one step, for `ls`: `committed` (its part is in the commit),
    `uploaded` (a part written, no commit yet), `stale` (its parts are not in the commit),
    `missing` (a known node with no part)."""
    out: dict[str, str] = {}
    for node in sorted(set(known_nodes) | {p.node for p in parts}):
        mine = [p for p in parts if p.node == node]
        if committed is not None and node in committed:
            out[node] = "committed"
        elif not mine:
            out[node] = "missing"
        else:
            out[node] = "stale" if committed is not None else "uploaded"
    return out
