"""Read native checkpoints (and legacy single-file ones) back into training objects, one
component at a time, and find the step to resume from.

Runs inside training processes (imports torch); never runs code from a checkpoint: every file
is read with `torch.load(weights_only=True)`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import random
import re
import subprocess
import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ckptd.errors import (
    BadInput,
    BadValue,
    CkptdError,
    ConfigError,
    CorruptData,
    NotFound,
    ValidationFailed,
)
from ckptd.lifecycle import answers
from ckptd.model import CKPTD_DIR, Local
from ckptd.restore import answer
from ckptd.torch import _meta
from ckptd.torch._native import (
    _STEP_DIR,
    PREFIX,
    Stateful,
    _rank_world,
    _unwrap,
)

log = logging.getLogger("ckptd.torch")

# ---------------------------------------------------------------------------------------- load


def load(
    path_or_root: str | os.PathLike[str],
    step: int | str = "latest",
    *,
    model: torch.nn.Module | None = None,
    optimizer: Stateful | None = None,
    scheduler: Stateful | None = None,
    scaler: Stateful | None = None,
    ema: Stateful | None = None,
    map_location: Any = "cpu",
    rank: int | None = None,
    strict: bool = True,
    upcast_bf16: bool = False,
    assign: bool = False,
    restore_rng: bool = False,
    root_name: str | None = None,
    client: Any = None,
    source: str = "auto",
    config: str | os.PathLike[str] | None = None,
    remote: str | None = None,
) -> tuple[int, dict[str, Any]]:
    """Load a checkpoint's state into the given objects in place; return `(step, meta)`.

    `meta` is meta.json's content plus `path`, `source` (which tier served it: `memory`,
    `peer:<node>`, `local` or `remote`) and, when the checkpoint has one, `extra`.
    `source`: "memory" reads the state the daemon keeps in memory (this node's, else a
    peer's copy) and nothing else; "local" reads the root's disk (restoring a compressed copy
    first); "remote" streams the step straight from the root's remote (`config=` or
    `remote=`, as `ckptd.dcp.StorageReader`), no staging disk; "auto" (default): memory when
    it holds the chosen step whole, else local when the step is here, else the remote.
    """
    if source not in ("auto", "memory", "local", "remote"):
        raise BadValue(f"source must be 'auto', 'memory', 'local' or 'remote', not {source!r}")
    opts = _LoadOpts(map_location, strict, upcast_bf16, assign)
    objs = (model, optimizer, scheduler, scaler, ema)
    name = root_name or Path(path_or_root).resolve().name
    if source in ("auto", "memory"):
        served = _load_memory(Path(path_or_root), name, step, objs, rank, restore_rng, opts,
                              client, only=source == "memory")
        if served is not None:
            return served
    if source == "remote":
        return _sourced(_load_remote(name, step, objs, rank, restore_rng, opts, config, remote),
                        "remote")
    try:
        found = _locate(path_or_root, step, root_name, client, stream=source == "auto")
    except NotFound as local:
        if source == "local":
            raise
        try:
            return _sourced(_load_remote(name, step, objs, rank, restore_rng, opts, config,
                                         remote), "remote")
        except (NotFound, ConfigError) as far:
            raise NotFound(f"{local}; and from the remote: {far}") from None
    if isinstance(found, int):  # only the remote has it: streamed, never staged on disk
        return _sourced(_load_remote(name, found, objs, rank, restore_rng, opts, config,
                                     remote), "remote")
    with _hold(found, root_name, client):
        return _sourced(_load_into(found, *objs, rank, restore_rng, opts), "local")


def _sourced(loaded: tuple[int, dict[str, Any]], source: str) -> tuple[int, dict[str, Any]]:
    loaded[1]["source"] = source
    return loaded


def _load_memory(path: Path, name: str, step: int | str, objs: tuple[Any, ...],
                 rank: int | None, restore_rng: bool, opts: _LoadOpts, client: Any,
                 only: bool) -> tuple[int, dict[str, Any]] | None:
    """The chosen step from the state the daemon keeps in memory, or None (with `only`:
    NotFound naming each tier and why) when it holds no whole copy of it."""
    if not path.is_dir() or (path / "meta.json").is_file():
        if only:
            raise NotFound(f"{path}: a load from memory takes a root directory")
        return None  # a step directory or a file names itself: read it
    from ckptd.torch import _memory
    chosen: Any = step
    if step == "latest":
        info = _ask_latest(path, name, client)
        chosen = info.get("step") if info is not None else None
        if chosen is None:
            if only:
                raise NotFound(f"{name}: the daemon names no valid step to load from memory")
            return None
    r = _rank_world(None, None)[0] if rank is None else rank
    if client is None:
        from ckptd.client import Client

        client = Client()
    try:
        doc, fds = _memory.open_state(client.socket, name, int(chosen), r, timeout=600.0)
        state = _memory.MemoryState(doc, fds)
    except CkptdError as exc:
        if only:
            raise NotFound(f"step {chosen} of {name} from memory: {exc}") from None
        level = logging.WARNING if "peer " in str(exc) or "hash" in str(exc) else logging.INFO
        log.log(level, "ckptd.torch: step %s of %s not from memory (%s); reading it from disk"
                " or the remote", chosen, name, exc)
        return None
    try:
        loaded = _from_arenas(state, int(chosen), objs, r, restore_rng, opts)
    except _memory.TornState as exc:
        if only:
            raise
        log.warning("ckptd.torch: %s; reading step %s from disk or the remote", exc, chosen)
        return None
    finally:
        state.close()
    return loaded


def _from_arena(state: Any, name: str, map_location: Any) -> Callable[[bool], Any]:
    return lambda _mmap: _arena_load(state, name, map_location)


def _arena_load(state: Any, name: str, map_location: Any) -> Any:
    """One component from a kept arena, as `_torch_load` reads a file (weights only)."""
    try:
        return state.load(name, map_location)
    except pickle.UnpicklingError as exc:
        raise ValidationFailed("unsafe_pickle", f"{state.where}/{name}: refused, it needs more"
                               f" than plain tensors and containers to load ({exc})",
                               f"{state.where}/{name}") from exc


def _from_arenas(state: Any, step: int, objs: tuple[Any, ...], rank: int, restore_rng: bool,
                 opts: _LoadOpts) -> tuple[int, dict[str, Any]]:
    states = {c: _from_arena(state, n, opts.map_location)
              for c, n in _meta.component_names(rank).items() if n in state.files}
    _check_wanted(states, objs, state.where)
    meta = {**state.head, "files": state.entries(), "path": state.where,
            "source": state.source}
    from ckptd.torch._memory import TornState

    try:
        if "extra.pt" in state.files:
            meta["extra"] = _arena_load(state, "extra.pt", opts.map_location)
        _apply_all(states, objs, state.where, opts)
        rng_name = f"rng.rank{rank}.pt"
        if restore_rng:
            _restore_rng(_arena_load(state, rng_name, "cpu") if rng_name in state.files
                         else None, state.where)
    except Exception as exc:  # torn under the read (it fails the parse), or a real failure
        try:
            state.check_whole()
        except CorruptData as torn:
            raise TornState(f"{torn} while it was read ({type(exc).__name__})") from None
        raise
    try:
        state.check_whole()
    except CorruptData as exc:
        raise TornState(f"{exc} while it was read") from None
    return step, meta


def _load_remote(name: str, step: int | str, objs: tuple[Any, ...], rank: int | None,
                 restore_rng: bool, opts: _LoadOpts, config: Any, remote: str | None
                 ) -> tuple[int, dict[str, Any]]:
    from ckptd.torch._remote import RemoteNative

    reader = RemoteNative(name, step, _rank_world(None, None)[0] if rank is None else rank,
                          opts.map_location, config=config, remote=remote)
    try:
        if reader.single is not None:  # one legacy file, split into components as on disk
            where = f"{reader.where}/{reader.single}"
            states, meta = _legacy_split(reader.load(reader.single), where)
            _check_wanted(states, objs, where)
            _apply_all(states, objs, where, opts)
            return int(meta["step"]), meta
        meta = dict(reader.meta)  # checked when the reader opened the step
        meta["path"] = reader.where
        states = reader.states()
        _check_wanted(states, objs, reader.where)
        if reader.has("extra.pt"):
            meta["extra"] = reader.load("extra.pt")
        _apply_all(states, objs, reader.where, opts)
        if restore_rng:
            _restore_rng(reader.rng(), reader.where)
        return reader.step, meta
    finally:
        reader.close()


def _hold(target: Path, root_name: str | None, client: Any) -> Any:
    """While a native checkpoint is read, the daemon's retention must not delete it."""
    match = _STEP_DIR.match(target.name)
    if not match or not target.is_dir():
        return contextlib.nullcontext()
    if client is None:
        from ckptd.client import Client

        client = Client(timeout=10.0)  # a hold may wait for a running prune's deletes
    name = root_name or target.parent.resolve().name
    return client.hold(name, int(match.group(1)), ttl=3600)


def _load_into(target: Path, model: torch.nn.Module | None, optimizer: Stateful | None,
               scheduler: Stateful | None, scaler: Stateful | None, ema: Stateful | None,
               rank: int | None, restore_rng: bool, opts: _LoadOpts) -> tuple[int, dict[str, Any]]:
    map_location = opts.map_location
    objs = (model, optimizer, scheduler, scaler, ema)
    if target.is_file():
        states, meta = _legacy_states(target, map_location)
        native = None
    else:
        # Every value of meta.json the load acts on is checked before a tensor is touched.
        checked = _meta.read(target / _meta.NAME, _dir_step(target))
        meta = {**checked.doc, "path": str(target)}
        native = _NativeReader(target, _rank_world(None, None)[0] if rank is None else rank,
                               map_location, checked)
        states = native.states()
        if "extra.pt" in checked.files:
            meta["extra"] = _torch_load(native.listed("extra.pt"), map_location)
    _check_wanted(states, objs, target)
    _apply_all(states, objs, target, opts)
    if restore_rng:
        _restore_rng(native.rng() if native else None, target)
    return int(meta["step"]), meta


def _dir_step(target: Path) -> int | None:
    """The step a native checkpoint's directory is named for (`step-<N>`), if it is."""
    match = _STEP_DIR.match(target.name)
    return int(match.group(1)) if match else None


def _check_wanted(states: Mapping[str, Any], objs: tuple[Any, ...], where: Path | str) -> None:
    """Every object given has its state in the checkpoint: refused before any is filled."""
    for component, obj in zip(_ORDER, objs, strict=True):
        if obj is not None and states.get(component) is None:
            raise NotFound(f"{where} holds no {component} state for this rank (saved without "
                           f"{component}=, or by a different number of ranks)")


_ORDER = ("model", "optimizer", "scheduler", "scaler", "ema")  # load()'s objects, in order


def _apply_all(states: Mapping[str, Callable[[bool], Any]], objs: tuple[Any, ...],
               where: Path | str, opts: _LoadOpts) -> None:
    model, optimizer, scheduler, scaler, ema = objs
    for component, obj in (("model", model), ("ema", ema), ("optimizer", optimizer),
                           ("scheduler", scheduler), ("scaler", scaler)):
        if obj is not None:
            _apply(obj, states.get(component), component, where, opts)


def _restore_rng(rng: Any, where: Path | str) -> None:
    if rng is None:
        log.warning("ckptd.torch: %s holds no RNG state for this rank; not restored", where)
    else:
        _set_rng_state(rng)


@dataclass(frozen=True)
class _LoadOpts:
    map_location: Any
    strict: bool
    upcast: bool
    assign: bool


class _NativeReader:
    """Hands out one component's state at a time, so only one is in memory at once. Reads
    only the files meta.json lists, each checked at its listed size before any is read."""

    def __init__(self, path: Path, rank: int, map_location: Any, meta: _meta.Meta) -> None:
        self.path, self.rank, self.map_location, self.meta = path, rank, map_location, meta

    def states(self) -> dict[str, Callable[[bool], Any]]:
        files = self.meta.component_files(self.rank)
        return {c: self._loader(self.listed(n)) for c, n in files.items()}

    def listed(self, name: str) -> Path:
        """`name` of the step, there at the size meta.json lists (BadInput otherwise)."""
        path = self.path / name
        try:
            size = path.stat().st_size
        except OSError as exc:
            raise BadInput(f"{path}: listed in {_meta.NAME}, but {exc.strerror}") from None
        if size != self.meta.files[name]:
            raise BadInput(f"{path}: {size} bytes, {_meta.NAME} lists "
                           f"{self.meta.files[name]}")
        return path

    def _loader(self, path: Path) -> Callable[[bool], Any]:
        return lambda mmap: _torch_load(path, self.map_location, mmap=mmap)

    def rng(self) -> Any:
        name = f"rng.rank{self.rank}.pt"
        return _torch_load(self.listed(name), "cpu") if name in self.meta.files else None


def _apply(obj: Stateful, state: Callable[[bool], Any] | None, component: str,
           where: Path | str, opts: _LoadOpts) -> None:
    if state is None:  # _check_wanted refuses this before the first object is filled
        raise NotFound(f"{where} holds no {component} state for this rank")
    if not isinstance(obj, torch.nn.Module):
        obj.load_state_dict(state(False))
        return
    # mmap: tensors are read page by page while copied into the module; not with assign=True,
    # where the module would keep pointing into the checkpoint file.
    sd = state(not opts.assign)
    if opts.upcast:
        sd = {k: v.float() if _is_bf16(v) else v for k, v in sd.items()}
    module = _unwrap(obj)
    module.load_state_dict(_match_prefix(sd, module), strict=opts.strict, assign=opts.assign)


def _is_bf16(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.dtype == torch.bfloat16


def _match_prefix(sd: Mapping[str, Any], module: torch.nn.Module) -> dict[str, Any]:
    """Rename keys to the module's own, adding or dropping `_orig_mod.` wherever it sits."""
    own = {k.replace(PREFIX, ""): k for k in module.state_dict()}
    return {own.get(k.replace(PREFIX, ""), k.replace(PREFIX, "")): v for k, v in sd.items()}


# ------------------------------------------------------------------------------- legacy files

_LEGACY_KEYS = {
    "model": ("model", "model_state_dict", "state_dict", "model_state", "module"),
    "optimizer": ("optimizer", "optimizer_state_dict", "optim", "optimizer_state"),
    "scheduler": ("scheduler", "lr_scheduler", "scheduler_state_dict"),
    "scaler": ("scaler", "grad_scaler", "scaler_state_dict"),
    "ema": ("ema", "ema_state_dict", "model_ema", "ema_model"),
}
_STEP_KEYS = ("step", "global_step", "iteration", "iter", "epoch")
_STEP_IN_NAME = re.compile(r"(?:step[_=-]|iter_|_)(\d+)(?:\.|$)")


def _legacy_states(path: Path, map_location: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """A single-file checkpoint: one dict, split into components by the usual key names."""
    return _legacy_split(_torch_load(path, map_location), str(path))


def _legacy_split(obj: Any, path: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """What `_legacy_states` makes of a loaded single file found at `path` (a file or URL)."""
    if not isinstance(obj, dict):
        raise ValidationFailed("bad_metadata", f"{path}: not a dict of states", str(path))
    if all(isinstance(v, torch.Tensor) for v in obj.values()):
        obj = {"model": obj}  # a bare model state_dict
    states: dict[str, Any] = {}
    used: set[str] = set()
    for component, keys in _LEGACY_KEYS.items():
        key = next((k for k in keys if isinstance(obj.get(k), dict)), None)
        if key is not None:
            states[component] = _given(obj[key])
            used.add(key)
    extra = {k: v for k, v in obj.items() if k not in used}
    meta = {"format": "legacy", "step": _legacy_step(path, obj), "path": str(path),
            "metrics": {}, "config": {}, "extra": extra}
    return states, meta


def _given(value: Any) -> Callable[[bool], Any]:
    return lambda _mmap: value  # already in memory: a legacy file loads in one piece


def _legacy_step(path: str, obj: Mapping[str, Any]) -> int:
    for key in _STEP_KEYS:
        value = obj.get(key)
        if isinstance(value, int | torch.Tensor) and not isinstance(value, bool):
            return int(value)
    match = _STEP_IN_NAME.search(path.rpartition("/")[2])
    return int(match.group(1)) if match else 0


# ---------------------------------------------------------------------------- finding a step


def resolve(path_or_root: str | os.PathLike[str], step: int | str = "latest", *,
            root_name: str | None = None, client: Any = None) -> Path:
    """The checkpoint `load` would read: a native step dir or a single legacy file (a step
    only the remote has is restored to disk first: `load` streams it instead)."""
    found = _locate(path_or_root, step, root_name, client, stream=False)
    assert isinstance(found, Path)
    return found


def _locate(path_or_root: str | os.PathLike[str], step: int | str, root_name: str | None,
            client: Any, stream: bool) -> Path | int:
    """What `resolve` says, except that with `stream` a latest step only the remote holds is
    answered by its number (the caller reads it from the remote)."""
    path = Path(path_or_root)
    if path.is_file() or (path / "meta.json").is_file():
        return path
    if not path.is_dir():
        raise NotFound(f"{path}: no such checkpoint or root directory")
    if step != "latest":
        found = path / f"step-{int(step)}"
        if not _complete(found):
            raise NotFound(f"{found}: no complete native checkpoint (if it lives only in "
                           f"compressed or remote form, run `ckptd restore ROOT {step} --to DIR`)")
        return found
    return _resolve_latest(path, root_name or path.resolve().name, client, stream)


def _resolve_latest(root: Path, name: str, client: Any, stream: bool) -> Path | int:
    info = _ask_latest(root, name, client)
    if info is not None and info.get("step") is not None:
        where = _under(root, info.get("path"))
        copies = answers.where_of(info)
        if copies.local is Local.PRESENT and where is not None and where.exists():
            return where
        compressed = copies.local is Local.COMPRESSED
        if stream and not compressed and answers.is_committed(copies):
            return int(info["step"])
        if compressed or answers.is_committed(copies):
            return _restore(name, int(info["step"]), root)
        log.warning("ckptd.torch: latest %s of %s is not on disk; scanning", info["step"], name)
    found: dict[int, Path] = {}

    def usable(n: int) -> bool:
        done = next((d for d in sorted(dirs[n], reverse=True) if _complete(d)), None)
        if done is not None:
            found[n] = done
        return done is not None

    dirs: dict[int, list[Path]] = {}
    for n, d in _step_dirs(root):
        dirs.setdefault(n, []).append(d)
    top = answers.newest(dirs, usable)
    if top is None:
        raise NotFound(f"{root}: no complete checkpoint to resume from")
    return found[top]


def _ask_latest(root: Path, name: str, client: Any) -> dict[str, Any] | None:
    """The daemon's latest, else latest.json's (the client reads it when no daemon answers);
    None when neither names a step (the caller then scans the root's step dirs)."""
    try:
        if client is None:
            from ckptd.client import Client

            client = Client(timeout=2.0)
        info = client.latest(name, tier="any", root_dir=root)
    except Exception as exc:
        if getattr(client, "strict", False):
            raise
        log.warning("ckptd.torch: could not ask ckptd for the latest of %s: %s", name, exc)
        return None
    return info if isinstance(info, dict) else None


def _under(root: Path, rel: Any) -> Path | None:
    return None if not rel else root / str(rel)  # an absolute `rel` stays absolute


def _step_dirs(root: Path) -> Iterator[tuple[int, Path]]:
    for entry in root.iterdir():
        match = _STEP_DIR.match(entry.name)
        if match and entry.is_dir():
            yield int(match.group(1)), entry


def _complete(step_dir: Path) -> bool:
    """The native commit rule: meta.json there and every file it lists at its listed size."""
    try:
        meta = _meta.read(step_dir / _meta.NAME, _dir_step(step_dir))
        return all((step_dir / p).stat().st_size == size for p, size in meta.files.items())
    except (OSError, BadInput):
        return False


def _restore(name: str, step: int, root: Path) -> Path:
    """Rebuild a compressed or remote-only checkpoint under `<root>/.ckptd/restored/`, in a
    child process (`ckptd.cli.restore_child`): the backends, the config and the object-store
    library never enter the training process."""
    to = root / CKPTD_DIR / "restored" / f"step-{step}"
    # The child finds ckptd where this process found it, even if only this one's sys.path had it.
    here = str(Path(__file__).resolve().parents[2])
    paths = [p for p in (os.environ.get("PYTHONPATH", ""), here) if p]
    child = subprocess.run([sys.executable, "-m", "ckptd.cli.restore_child", name, str(step),
                            str(to), "--root-dir", str(root)], capture_output=True, text=True,
                           check=False, env={**os.environ, "PYTHONPATH": os.pathsep.join(paths)})
    if child.returncode != 0:
        raise answer.error_of(child.stdout or child.stderr)
    for candidate in (to, to / f"step-{step}"):
        if _complete(candidate):
            return candidate
    files = [p for p in to.rglob("*") if p.is_file()]
    if len(files) == 1:
        return files[0]
    raise CkptdError(f"restored step {step} of {name} into {to}, but found no checkpoint there")


# ----------------------------------------------------------------------------------- helpers

def _torch_load(path: Path | Any, map_location: Any, mmap: bool = False) -> Any:
    """torch.load that never runs code from the file: weights_only, always."""
    try:
        return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as exc:
        raise ValidationFailed(
            "unsafe_pickle",
            f"{path}: refused, it needs more than plain tensors and containers to load ({exc})",
            str(path)) from exc


def _set_rng_state(state: Mapping[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"],
                         n["has_gauss"], n["cached"]))
    p = state["python"]
    random.setstate((p["version"], tuple(int(x) for x in p["internal"].tolist()), p["gauss_next"]))
