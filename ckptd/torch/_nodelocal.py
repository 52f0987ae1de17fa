"""`ckptd.torch.save(..., node_local=True)`: each node writes its own ranks' files to its own
disk (a multi-node root, docs/MULTINODE.md). Ranks find out with a probe which of them share a
directory, meet through torch.distributed (never through files another node cannot see), and
rank 0 writes `meta.json` naming every rank's files; the other nodes' step directories hold
their ranks' files without it, and the daemons commit the step through the object store.

Runs inside training processes (imports torch); never imported by the daemon.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

from ckptd import fileio
from ckptd.errors import CkptdError
from ckptd.torch import _native

HERE = ".here.rank"  # `<tmp>/.here.rank<R>`: rank R writes into this directory (the probe)


def save(tmp: Path, final: Path, rank: int, world: int, parts: list[_native.Part],
         head: dict[str, Any]) -> None:
    """Probe -> clear -> write -> gather -> commit, each step behind a collective."""
    import torch.distributed as dist

    token_box: list[Any] = [uuid.uuid4().hex if rank == 0 else None]
    dist.broadcast_object_list(token_box, src=0)
    token = str(token_box[0])
    tmp.mkdir(exist_ok=True)
    if tmp.is_symlink() or not tmp.is_dir():  # its leftovers are cleared: never follow a link
        raise CkptdError(f"ckptd.torch.save: {tmp} is not a directory of this root")
    fileio.atomic_write_json(tmp / f"{HERE}{rank}", {"token": token})
    dist.barrier()
    views: list[Any] = [None] * world
    dist.all_gather_object(views, _seen(tmp, token, world))
    group = groups_of(views)[rank]
    leader = min(group)
    if rank == leader:
        _clear(tmp, {f"{HERE}{r}" for r in group})
    dist.barrier()
    entries = _native._write_parts(tmp, rank, parts)
    gathered: list[Any] | None = [None] * world if rank == 0 else None
    dist.gather_object(entries, gathered, dst=0)
    if rank == leader:
        for r in group:
            (tmp / f"{HERE}{r}").unlink()
        if rank == 0:
            assert gathered is not None
            everyone = [e for ranks in gathered for e in ranks]
            _check_sizes(tmp, [e for r in group for e in gathered[r]])
            _native._commit(tmp, final, {**head, "nodes": len(set(map(tuple, views))),
                                         "files": everyone})
        else:
            _native._commit(tmp, final, None)  # this node's share: no meta.json
    dist.barrier()  # every rank returns a path that exists on its node


def _seen(tmp: Path, token: str, world: int) -> list[int]:
    """The ranks whose probe with this save's token is in `tmp` (as this rank sees it)."""
    found = []
    for p in tmp.iterdir():
        if p.name.startswith(HERE) and p.name[len(HERE):].isdigit():
            r = int(p.name[len(HERE):])
            probe = _native._try_read_json(p)
            if r < world and probe is not None and probe.get("token") == token:
                found.append(r)
    return sorted(found)


def groups_of(views: list[list[int]]) -> dict[int, tuple[int, ...]]:
    """Rank -> the ranks sharing its directory, from what each rank saw. The views must be a
    partition (each rank sees itself, and ranks that see each other see the same set);
    anything else (a directory cache that hides files) is refused before a byte is written."""
    out: dict[int, tuple[int, ...]] = {}
    for rank, seen in enumerate(views):
        group = tuple(seen)
        if rank not in group or any(tuple(views[r]) != group for r in group):
            raise CkptdError(
                f"ckptd.torch.save(node_local=True): rank {rank} sees ranks {list(group)} in"
                " its step directory, and they disagree; each node's ranks must share one"
                " directory that no other node sees")
        out[rank] = group
    return out


def _clear(tmp: Path, keep: set[str]) -> None:
    """What an interrupted save left in this node's directory goes; the probes stay."""
    for p in tmp.iterdir():
        if p.name in keep:
            continue
        fileio.remove_tree(p)  # a link goes, never what it points to


def _check_sizes(tmp: Path, entries: list[_native.Entry]) -> None:
    for e in entries:  # this node's files must still be what their ranks reported
        size = (tmp / e["path"]).stat().st_size
        if size != e["size"]:
            raise CkptdError(f"{tmp / e['path']}: size {size}, its rank reported {e['size']}")
