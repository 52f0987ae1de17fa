"""The checkpoint manifest (format `ckptd-manifest/1`): what a stored copy of one step holds.

The same document commits a step remotely (`<url>/<root>/step-<N>/MANIFEST.json`, written last)
and describes a local compressed copy (`<root>/.ckptd/objects/step-<N>/MANIFEST.json`), so
restore needs neither the daemon nor its store. Pure data and JSON; no I/O.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from ckptd.errors import CorruptData

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
               "created": self.created, "metrics": dict(self.metrics),
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
        raise ValueError(f"step {manifest.step} was committed by nodes {sorted(parts)},"
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
    """Parse and check a manifest; raises CorruptData naming what is wrong."""
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise CorruptData(f"{where}: not JSON: {exc}") from exc
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise CorruptData(f"{where}: not a {FORMAT} manifest")
    try:
        files = tuple(_file(f) for f in doc["files"])
        step = doc["step"]
        if not isinstance(step, int) or step < 0:
            raise ValueError("step")
        return Manifest(root=str(doc["root"]), step=step, layout=str(doc["layout"]),
                        files=files, created=str(doc["created"]),
                        metrics={str(k): float(v) for k, v in (doc.get("metrics") or {}).items()},
                        nodes=tuple((str(n["node"]), str(n["attempt"]), str(n.get("record", "")))
                                    for n in doc.get("nodes") or ()))
    except (KeyError, TypeError, ValueError) as exc:
        raise CorruptData(f"{where}: malformed manifest ({exc})") from exc


def _file(f: Any) -> StoredFile:
    path, key = str(f["path"]), str(f["key"])
    for p in (path, key):
        parts = p.split("/")
        if p.startswith("/") or any(x in ("", ".", "..") for x in parts):
            raise ValueError(f"unsafe path {p!r}")
    return StoredFile(path=path, size=int(f["size"]), hash=str(f["hash"]),
                      hash_alg=str(f["hash_alg"]), codec=str(f["codec"]),
                      stored_size=int(f["stored_size"]), key=key)
