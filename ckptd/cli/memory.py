"""`ckptd memory fetch ROOT STEP --node ID --to DIR`: one node's state fetched back from the
peers that hold it, the way a replaced node's daemon does (docs/MEMORY.md), and written out as
the native checkpoint's files (with meta.json when rank 0 and every rank came back).

Reads the config for the root's bucket (where its peers are listed) and the job's secret;
needs no daemon. Writes only into DIR, never over a file that is there.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
from pathlib import Path
from typing import Any

from ckptd.config import Config
from ckptd.errors import NotFound
from ckptd.memory.own import Kept

CHUNK = 8 << 20


def fetch(cfg: Config, root_name: str, step: int, node: str, to: Path) -> dict[str, Any]:
    """Fetch node `node`'s ranks of `step` into `to/step-<step>/`; the summary document."""
    from ckptd.backends import BackendCache
    from ckptd.memory.replicate import Peers

    root = cfg.root(root_name)
    memory = cfg.memory.model_copy(update={"listen": ""})  # fetches; serves no one
    peers = Peers(memory, node, lambda: {root.name: root}, BackendCache().get)
    why: list[str] = []
    got = peers.fetch_all(root, step, why)
    if not got:
        raise NotFound(f"no peer holds step {step} of node {node!r} of {root_name!r}"
                       + (f": {'; '.join(why)}" if why else ""))
    out = to / f"step-{step}"
    try:
        out.mkdir(parents=True, exist_ok=True)
        entries = [e for k in got for e in _write(k, out)]
        world = got[0].world_size
        whole = {k.rank for k in got} == set(range(world))
        if whole:
            head = next(k.head for k in got if k.rank == 0)
            meta = {**head, "files": entries}
            with open(out / "meta.json", "x") as f:
                json.dump(meta, f)
    finally:
        for k in got:
            with contextlib.suppress(OSError):
                os.close(k.fd)
    return {"root": root_name, "step": step, "node": node, "to": str(out),
            "ranks": sorted(k.rank for k in got), "sources": sorted({k.source for k in got}),
            "complete": whole, "files": [e["path"] for e in entries], "skipped": why}


def _write(k: Kept, out: Path) -> list[dict[str, Any]]:
    entries = []
    for f in k.files:
        fd = os.open(out / f.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            done = 0
            while done < f.size:
                piece = os.pread(k.fd, min(CHUNK, f.size - done), f.offset + done)
                done += len(piece)
                while piece:
                    piece = piece[os.write(fd, piece):]
            os.fsync(fd)
        finally:
            os.close(fd)
        entry: dict[str, Any] = {"path": f.path, "component": f.component, "size": f.size,
                                 "hash": f.hash, "hash_alg": "xxh3-128"}
        if f.component in ("optimizer", "rng"):
            entry["rank"] = k.rank
        entries.append(entry)
    return entries


def run(args: argparse.Namespace, cfg: Config) -> dict[str, Any]:
    """`ckptd memory fetch`'s document."""
    return fetch(cfg, args.root, args.step, args.node, Path(args.to))
