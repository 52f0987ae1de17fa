"""The checkpoint manifest (format `ckptd-manifest/1`): what a stored copy of one step holds.

The same document commits a step remotely (`<url>/<root>/step-<N>/MANIFEST.json`, written last)
and describes a local compressed copy (`<root>/.ckptd/objects/step-<N>/MANIFEST.json`), so
restore needs neither the daemon nor its store. Pure data and JSON; no I/O.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from ckptd import inputs
from ckptd.errors import BadValue, CorruptData, Malformed

FORMAT = "ckptd-manifest/1"
MANIFEST_NAME = "MANIFEST.json"
LATEST_NAME = "LATEST"


@dataclass(frozen=True)
class StoredFile:
    """One original file and its stored object. `key` is the object's name relative to the
    step's prefix (`<path><codec suffix>`); `size`/`hash` describe the original bytes."""

    path: str
    size: int
    hash: str
    hash_alg: str
    codec: str
    stored_size: int
    key: str

    def as_json(self) -> dict[str, Any]:
        return {"path": self.path, "size": self.size, "hash": self.hash,
                "hash_alg": self.hash_alg, "codec": self.codec,
                "stored_size": self.stored_size, "key": self.key}


@dataclass(frozen=True)
class Manifest:
    root: str
    step: int
    layout: str
    files: tuple[StoredFile, ...]
    created: str = field(default_factory=lambda: rfc3339_now())
    metrics: dict[str, float] = field(default_factory=dict)
    # A multi-node commit (docs/MULTINODE.md): (node, attempt, record path or "") per part.
    nodes: tuple[tuple[str, str, str], ...] = ()

    @property
    def size(self) -> int:
        return sum(f.size for f in self.files)

    @property
    def stored_size(self) -> int:
        return sum(f.stored_size for f in self.files)

    def as_json(self) -> dict[str, Any]:
        doc = {"format": FORMAT, "root": self.root, "step": self.step, "layout": self.layout,
               "created": self.created,
               # Only finite numbers: a manifest is strict JSON (no NaN), read back by others.
               "metrics": {k: v for k, v in self.metrics.items() if math.isfinite(v)},
               "files": [f.as_json() for f in self.files]}
        if self.nodes:
            doc["nodes"] = [{"node": n, "attempt": a, **({"record": r} if r else {})}
                            for n, a, r in self.nodes]
        return doc

    def to_bytes(self) -> bytes:
        return json.dumps(self.as_json(), indent=1, sort_keys=True).encode() + b"\n"


def for_node(manifest: Manifest, node: str) -> Manifest:
    """The files of a multi-node commit one node restores: "*" all of them (the whole
    checkpoint, as one node would have written it), else that node's files and the
    coordinator's record. ValueError for a node not in the commit."""
    if node == "*" or not manifest.nodes:
        return manifest
    parts = {n: a for n, a, _r in manifest.nodes}
    if node not in parts:
        raise BadValue(f"step {manifest.step} was committed by nodes {sorted(parts)},"
                         f" not {node!r}")
    records = {r for _n, _a, r in manifest.nodes if r}
    # A node's keys are under `<node>.<attempt>/` (its part's attempt, or an earlier one's
    # where the same file was sent before).
    files = tuple(f for f in manifest.files
                  if f.key.split("/", 1)[0].rpartition(".")[0] == node or f.path in records)
    return Manifest(root=manifest.root, step=manifest.step, layout=manifest.layout,
                    files=files, created=manifest.created, metrics=dict(manifest.metrics),
                    nodes=manifest.nodes)


def step_prefix(root: str, step: int) -> str:
    """The key prefix of one step under the remote URL: `<root>/step-<N>`."""
    return f"{root}/step-{step}"


def rfc3339_now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


def parse_manifest(data: bytes, where: str = MANIFEST_NAME) -> Manifest:
    """Parse and check a manifest; raises CorruptData naming what is wrong (BadInput, a
    CorruptData, when it is not strict JSON or a number is out of range).

    Malformed too: a path or key that is absolute or holds an empty, "." or ".." part; a
    path named twice; a path that is another's directory ("a" beside "a/b"). Restore relies on this:
    every file lands at its own name, none through another.
    """
    doc = inputs.loads(data, where)
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise CorruptData(f"{where}: not a {FORMAT} manifest")
    try:
        listed = doc["files"]
        if not isinstance(listed, list):
            raise Malformed("files is not a list")
        files = tuple(_file(f) for f in listed)
        distinct_paths(f.path for f in files)
        step = inputs.check_int(doc["step"], "step")
        metrics = doc.get("metrics") or {}
        if not isinstance(metrics, dict):
            raise Malformed("metrics is not an object")
        return Manifest(root=str(doc["root"]), step=step, layout=str(doc["layout"]),
                        files=files, created=str(doc["created"]),
                        metrics={str(k): inputs.check_float(v, f"metric {k!r}")
                                 for k, v in metrics.items()},
                        nodes=tuple((str(n["node"]), str(n["attempt"]), str(n.get("record", "")))
                                    for n in doc.get("nodes") or ()))
    except (KeyError, TypeError, ValueError, AttributeError, CorruptData) as exc:
        raise CorruptData(f"{where}: malformed manifest ({exc})") from None


def _file(f: Any) -> StoredFile:
    path, key = str(f["path"]), str(f["key"])
    for p in (path, key):
        parts = p.split("/")
        if p.startswith("/") or "\x00" in p or any(x in ("", ".", "..") for x in parts):
            raise Malformed(f"unsafe path {p[:200]!r}")
    return StoredFile(path=path, size=inputs.check_int(f["size"], f"size of {path[:200]!r}"),
                      hash=str(f["hash"]), hash_alg=str(f["hash_alg"]), codec=str(f["codec"]),
                      stored_size=inputs.check_int(f["stored_size"],
                                                   f"stored_size of {path[:200]!r}"),
                      key=key)


def distinct_paths(names: Iterable[str]) -> None:
    """No path twice, no path that is the directory of another (ValueError naming it): what a
    manifest or a part lists must be placeable as files, all or nothing."""
    paths: set[str] = set()
    for name in names:
        if name in paths:
            raise Malformed(f"path {name[:200]!r} is named twice")
        paths.add(name)
    for p in paths:
        parts = p.split("/")
        for i in range(1, len(parts)):
            above = "/".join(parts[:i])
            if above in paths:
                raise Malformed(f"path {above[:200]!r} is also the directory of {p[:200]!r}")
