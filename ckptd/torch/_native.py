"""Save training state in the `native` layout (the blocking writer): one file per component,
rank 0 commits; the helpers the loader and the async path share.

Runs inside training processes (imports torch); never imported by the daemon. Talks to the daemon
only through `ckptd.client`, and a missing daemon never fails or blocks a training step.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import re
import time
from collections.abc import Callable, Iterator, Mapping
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from ckptd import fileio, inputs
from ckptd.errors import BadInput, BadValue, ValidationFailed

__all__ = ["FORMAT", "Stateful", "save"]  # the blocking writer; ckptd.torch re-exports

FORMAT = "ckptd-native/1"
PREFIX = "_orig_mod."  # what torch.compile's OptimizedModule puts before every key
log = logging.getLogger("ckptd.torch")
_STEP_DIR = re.compile(r"^step-(\d+)$")
_PLAIN = (torch.Tensor, int, float, bool, str, bytes, type(None), torch.dtype, torch.Size)
Entry = dict[str, Any]  # one `files` row of meta.json


class Stateful(Protocol):
    """Anything with the torch state_dict protocol (optimizers, schedulers, scalers, EMA)."""

    def state_dict(self) -> Any: ...

    def load_state_dict(self, state_dict: Any, /) -> Any: ...


# ---------------------------------------------------------------------------------------- save


def save(
    root_dir: str | os.PathLike[str],
    step: int,
    *,
    model: torch.nn.Module | None = None,
    optimizer: Stateful | None = None,
    scheduler: Stateful | None = None,
    scaler: Stateful | None = None,
    ema: Stateful | None = None,
    extra: Mapping[str, Any] | None = None,
    metrics: Mapping[str, Any] | None = None,
    config: Mapping[str, Any] | None = None,
    rank: int | None = None,
    world_size: int | None = None,
    register: bool = True,
    root_name: str | None = None,
    client: Any = None,
    timeout: float = 1800.0,
    writer: Writer | None = None,
) -> Path:
    """Write `<root_dir>/step-<step>/` and return its path once every rank's files are in it.

    Every rank calls this with its own optimizer; rank 0 also writes model, EMA, scheduler,
    scaler and extra, then meta.json, then renames the directory into place and registers it.
    `writer`: how the ranks write and commit instead of the shared-directory ways here (the
    public `save(node_local=True)` passes ckptd.torch._nodelocal's; needs torch.distributed).
    """
    if step < 0:
        raise BadValue(f"step must be a non-negative integer, got {step}")
    if extra is not None:
        _check_plain(extra, "extra")
    rank, world = _rank_world(rank, world_size)
    root = Path(root_dir)
    root.mkdir(parents=True, exist_ok=True)
    tmp, final = root / f"step-{step}.tmp", root / f"step-{step}"
    head = _meta_head(step, world, metrics, config)  # fail on bad metrics before writing
    parts = _parts(rank, model, optimizer, scheduler, scaler, ema, extra)
    if writer is not None and not _dist_up(world):
        raise BadValue("node_local=True needs torch.distributed initialised with every rank:"
                         " the nodes share no directory to meet in")
    try:
        if writer is not None:
            writer(tmp, final, rank, world, parts, head)
        elif _dist_matches(world):
            _save_dist(tmp, final, rank, world, parts, head)
        else:
            _save_files(tmp, final, rank, world, parts, head, time.monotonic() + timeout)
    except BaseException:
        # All or nothing: a save that failed (a state_dict that raised, a full disk) leaves no
        # step-N.tmp behind. Rank 0 owns the directory; the others' files go with it. (Node-
        # local: each node's leftover is cleared by the next save's probe.)
        if rank == 0:
            with contextlib.suppress(OSError):
                fileio.remove_tree(tmp)
        raise
    if rank == 0 and register:
        _register(root_name or root.resolve().name, step, head["metrics"], client)
    return final


Part = tuple[str, str, Callable[[], Any]]  # (file name, component, builds the state to write)
# Writes every rank's parts into tmp and commits it as final: (tmp, final, rank, world, parts,
# meta.json's head).
Writer = Callable[[Path, Path, int, int, list[Part], dict[str, Any]], None]


def _parts(rank: int, model: torch.nn.Module | None, optimizer: Stateful | None,
           scheduler: Stateful | None, scaler: Stateful | None, ema: Stateful | None,
           extra: Mapping[str, Any] | None) -> list[Part]:
    """This rank's files in write order; each state is built only when its turn comes."""
    shared = [("model.pt", "model", model), ("ema.pt", "ema", ema),
              ("scheduler.pt", "scheduler", scheduler), ("scaler.pt", "scaler", scaler)]
    parts: list[Part] = [(name, component, partial(_module_state, obj))
                         for name, component, obj in shared if rank == 0 and obj is not None]
    if rank == 0 and extra is not None:
        parts.append(("extra.pt", "extra", partial(dict, extra)))
    if optimizer is not None:
        parts.append((f"optim.rank{rank}.pt", "optimizer", optimizer.state_dict))
    parts.append((f"rng.rank{rank}.pt", "rng", _rng_state))
    return parts


def _write_parts(tmp: Path, rank: int, parts: list[Part]) -> list[Entry]:
    entries = []
    for name, component, build in parts:
        state = build()
        torch.save(state, tmp / name)
        del state  # drop this component's dict (and any device->host copies) before the next
        fileio.drop_cache(tmp / name)  # starts writeback now, overlapping the next component
        entry: Entry = {"path": name, "component": component}
        if name.startswith(("optim.rank", "rng.rank")):
            entry["rank"] = rank
        entries.append(entry)
    for entry in entries:
        # written and durable: keep the training job's own pages in the cache
        fileio.fsync_file(tmp / entry["path"], drop=True)
        entry["size"] = (tmp / entry["path"]).stat().st_size
    return entries


def _save_dist(tmp: Path, final: Path, rank: int, world: int, parts: list[Part],
               head: dict[str, Any]) -> None:
    """With torch.distributed: barriers order clear -> write -> commit -> return."""
    import torch.distributed as dist

    from ckptd import arena_write

    if rank == 0:
        _fresh_dir(tmp)
    dist.barrier()
    with _dirs(tmp) as (_root_fd, tmp_fd):
        arena_write.report(tmp_fd, rank, "", _write_parts(tmp, rank, parts))
    dist.barrier()
    if rank == 0:
        # Markers are there after the barrier; the grace covers slow directory caches (NFS).
        with _dirs(tmp) as (_root_fd, tmp_fd):
            entries = arena_write.collect(tmp_fd, world, "", time.monotonic() + 60,
                                          arena_write.Cancel())
        _commit(tmp, final, {**head, "files": entries})
    dist.barrier()  # every rank returns a path that exists


def _save_files(tmp: Path, final: Path, rank: int, world: int, parts: list[Part],
                head: dict[str, Any], deadline: float) -> None:
    """Without torch.distributed: rendezvous through marker files in the tmp dir, the native
    commit protocol of `ckptd.arena_write` (rank 0's fresh `.ready` token; the others write
    under it, and again when a leftover dir's token changes under them)."""
    from ckptd import arena_write  # the writer's side: a load never imports it

    with _opened(tmp.parent) as root_fd:
        def write(_tmp_fd: int) -> list[Entry]:
            return _write_parts(tmp, rank, parts)

        if rank == 0:
            _warn_leftover(tmp)
            arena_write.save_rank0(root_fd, tmp.name, final.name, world, head, write, deadline,
                                   arena_write.Cancel(), arena_write.replace_here(root_fd))
        else:
            arena_write.save_rank(root_fd, tmp.name, final.name, rank, write, deadline,
                                  arena_write.Cancel())


def _commit(tmp: Path, final: Path, meta: dict[str, Any] | None) -> None:
    """The native commit (`arena_write.commit`) of `tmp` as `final` in the trainer's process:
    meta.json last (None: a node's share, without it); the earlier save of the step goes."""
    from ckptd import arena_write

    with _dirs(tmp) as (root_fd, tmp_fd):
        arena_write.commit(root_fd, tmp_fd, tmp.name, final.name, meta,
                           arena_write.replace_here(root_fd), time.monotonic() + 60,
                           arena_write.Cancel())


def _fresh_dir(tmp: Path) -> None:
    from ckptd import arena_write

    _warn_leftover(tmp)
    with _opened(tmp.parent) as root_fd:
        arena_write.fresh_dir(root_fd, tmp.name)


def _warn_leftover(tmp: Path) -> None:
    if os.path.lexists(tmp):
        log.warning("ckptd.torch: removed %s left by an interrupted save", tmp)


@contextlib.contextmanager
def _opened(root: Path) -> Iterator[int]:
    root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        yield root_fd
    finally:
        os.close(root_fd)


@contextlib.contextmanager
def _dirs(tmp: Path) -> Iterator[tuple[int, int]]:
    """Descriptors of the root (`tmp`'s parent) and of `tmp`, opened beneath it."""
    from ckptd import arena_write

    with _opened(tmp.parent) as root_fd, arena_write.opendir(root_fd, tmp.name) as tmp_fd:
        yield root_fd, tmp_fd


def _meta_head(step: int, world: int, metrics: Mapping[str, Any] | None,
               config: Mapping[str, Any] | None) -> dict[str, Any]:
    clean: dict[str, float] = {}
    for key, value in (metrics or {}).items():
        number = float(value)
        if np.isfinite(number):
            clean[str(key)] = number
        else:  # JSON has no NaN; losing the checkpoint over a metric would be worse
            log.warning("ckptd.torch: metric %s=%s is not finite; left out", key, value)
    created = datetime.now(UTC).isoformat(timespec="seconds").replace("+00:00", "Z")
    cfg = json.loads(json.dumps(dict(config or {}), default=str))
    return {"format": FORMAT, "step": int(step), "world_size": world, "created": created,
            "metrics": clean, "config": cfg}


def _register(name: str, step: int, metrics: dict[str, float], client: Any) -> None:
    """Wake the daemon; without paths, its `native` recognizer describes the checkpoint."""
    try:
        if client is None:
            from ckptd.client import Client

            client = Client(timeout=1.0)  # bounds the cost of a hung daemon to the step
        client.register(name, step, paths=None, metrics=metrics)
    except Exception as exc:  # the save is durable already; registration is only a wake-up call
        if getattr(client, "strict", False):
            raise
        log.warning("ckptd.torch: could not register %s step %s: %s", name, step, exc)


# ----------------------------------------------------------------------------------- helpers


def _rank_world(rank: int | None, world: int | None) -> tuple[int, int]:
    dist_rank, dist_world = 0, 1
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        dist_rank, dist_world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    rank = dist_rank if rank is None else rank
    world = dist_world if world is None else world
    if not 0 <= rank < world:
        raise BadValue(f"rank {rank} is outside world_size {world}")
    return rank, world


def _dist_matches(world: int) -> bool:
    """Use torch.distributed barriers only when it is up and describes the same ranks."""
    return world > 1 and _dist_up(world)


def _dist_up(world: int) -> bool:
    return (torch.distributed.is_available() and torch.distributed.is_initialized()
            and torch.distributed.get_world_size() == world)


def _unwrap(module: torch.nn.Module) -> torch.nn.Module:
    """The model inside DDP/DataParallel: their `module.` prefix is not part of the model."""
    wrappers = (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)
    while isinstance(module, wrappers):
        module = module.module
    return module


def _module_state(obj: Any) -> Any:
    if not isinstance(obj, torch.nn.Module):
        return obj.state_dict()
    return {k.replace(PREFIX, ""): v for k, v in _unwrap(obj).state_dict().items()}


def _check_plain(obj: Any, where: str) -> None:
    """`extra` must load with weights_only=True; refuse at save time, not at resume time."""
    if isinstance(obj, Mapping):
        for key, value in obj.items():
            _check_plain(key, where)
            _check_plain(value, f"{where}[{key!r}]")
    elif isinstance(obj, list | tuple):
        for i, value in enumerate(obj):
            _check_plain(value, f"{where}[{i}]")
    elif not isinstance(obj, _PLAIN):
        raise TypeError(f"{where} is a {type(obj).__name__}: only tensors, numbers, strings and "
                        "dicts/lists of them can be loaded back safely")


def _rng_state() -> dict[str, Any]:
    """Every RNG's state as tensors, lists and numbers, so it loads with weights_only=True."""
    kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    assert isinstance(keys, np.ndarray)  # the legacy form is always (kind, keys, ...)
    version, internal, gauss_next = random.getstate()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": {"kind": str(kind), "keys": torch.from_numpy(keys.astype(np.int64)),
                  "pos": int(pos), "has_gauss": int(has_gauss), "cached": float(cached)},
        "python": {"version": version, "internal": torch.tensor(internal, dtype=torch.int64),
                   "gauss_next": gauss_next},
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        # only when CUDA is already up: reading its RNG must not start it in a CPU job
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _read_json(path: Path) -> dict[str, Any]:
    """A metadata file of a checkpoint (meta.json, latest.json, markers) through the bounded
    reader: a regular file, not a link, at most 1 MiB, strict JSON."""
    try:
        data = inputs.read_json(path, inputs.ROOT_META)
    except BadInput as exc:
        raise ValidationFailed("bad_metadata", str(exc), str(path)) from None
    if not isinstance(data, dict):
        raise ValidationFailed("bad_metadata", f"{path}: not a JSON object", str(path))
    return data


def _try_read_json(path: Path) -> dict[str, Any] | None:
    try:
        return _read_json(path)
    except (OSError, ValueError, ValidationFailed):
        return None
