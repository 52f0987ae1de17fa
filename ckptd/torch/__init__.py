"""Save and load training state in the `native` layout: one file per component, rank 0 commits;
`save(..., blocking=False)` hands the write to the daemon (docs/ASYNC.md).

Runs inside training processes (imports torch); never imported by the daemon. Talks to the daemon
only through its socket, and a missing daemon never fails or blocks a training step.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, overload

from ckptd import needs_torch
from ckptd.errors import BadValue

try:
    import torch
except ModuleNotFoundError as exc:  # the slim install (`pip install ckptd`) brings no torch
    if exc.name != "torch":
        raise
    raise ModuleNotFoundError(needs_torch("ckptd.torch"), name="torch") from None

from ckptd.torch import _native
from ckptd.torch._load import load, resolve
from ckptd.torch._native import FORMAT, Stateful

if TYPE_CHECKING:
    from ckptd.torch._async import SaveHandle, flush

__all__ = ["FORMAT", "SaveHandle", "Stateful", "flush", "load", "resolve", "save"]

# The async save (its arena, its socket client) and the node-local writer load on first use: a
# process that only loads never imports them (tests/torch/test_lazy_imports.py).
_LAZY = {"SaveHandle": "ckptd.torch._async", "flush": "ckptd.torch._async"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'ckptd.torch' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


@overload
def save(root_dir: str | os.PathLike[str], step: int, *, model: torch.nn.Module | None = ...,
         optimizer: Stateful | None = ..., scheduler: Stateful | None = ...,
         scaler: Stateful | None = ..., ema: Stateful | None = ...,
         extra: Mapping[str, Any] | None = ..., metrics: Mapping[str, Any] | None = ...,
         config: Mapping[str, Any] | None = ..., rank: int | None = ...,
         world_size: int | None = ..., register: bool = ..., root_name: str | None = ...,
         client: Any = ..., timeout: float = ..., blocking: Literal[True] = ...,
         if_busy: Literal["wait", "skip"] = ..., node_local: bool = ...) -> Path: ...


@overload
def save(root_dir: str | os.PathLike[str], step: int, *, model: torch.nn.Module | None = ...,
         optimizer: Stateful | None = ..., scheduler: Stateful | None = ...,
         scaler: Stateful | None = ..., ema: Stateful | None = ...,
         extra: Mapping[str, Any] | None = ..., metrics: Mapping[str, Any] | None = ...,
         config: Mapping[str, Any] | None = ..., rank: int | None = ...,
         world_size: int | None = ..., register: bool = ..., root_name: str | None = ...,
         client: Any = ..., timeout: float = ..., blocking: Literal[False],
         if_busy: Literal["wait", "skip"] = ..., node_local: Literal[False] = ...
         ) -> SaveHandle: ...


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
    blocking: bool = True,
    if_busy: Literal["wait", "skip"] = "wait",
    node_local: bool = False,
) -> Path | SaveHandle:
    """Write `<root_dir>/step-<step>/`. Blocking: return its path once every rank's files are
    in it. `blocking=False`: return a SaveHandle once the state is copied into this process's
    arena and handed to the daemon, which writes the files. `node_local=True`: each node's ranks
    write to that node's own disk, rank 0's node also `meta.json` (a multi-node root,
    docs/MULTINODE.md); blocking only, needs torch.distributed."""
    if blocking:
        writer = None
        if node_local:
            from ckptd.torch import _nodelocal

            writer = _nodelocal.save
        return _native.save(root_dir, step, model=model, optimizer=optimizer,
                            scheduler=scheduler, scaler=scaler, ema=ema, extra=extra,
                            metrics=metrics, config=config, rank=rank, world_size=world_size,
                            register=register, root_name=root_name, client=client,
                            timeout=timeout, writer=writer)
    if node_local:
        raise BadValue("node_local=True saves are blocking only (blocking=True)")
    if if_busy not in ("wait", "skip"):
        raise BadValue(f"if_busy must be 'wait' or 'skip', got {if_busy!r}")
    if step < 0:
        raise BadValue(f"step must be a non-negative integer, got {step}")
    if extra is not None:
        _native._check_plain(extra, "extra")
    rank, world = _native._rank_world(rank, world_size)
    root = Path(root_dir)
    root.mkdir(parents=True, exist_ok=True)
    head = _native._meta_head(step, world, metrics, config)
    parts = _native._parts(rank, model, optimizer, scheduler, scaler, ema, extra)
    from ckptd.torch._async import save_async

    return save_async(root, step, rank, world, parts, head, root_name or root.resolve().name,
                      client, timeout, if_busy, register)
