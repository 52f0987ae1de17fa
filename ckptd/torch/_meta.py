"""A native checkpoint's `meta.json` as a load reads it, from a root or from the bucket: through
the bounded strict reader (`ckptd.inputs`), then every value a load acts on checked before the
first tensor is touched. Decides nothing about where the bytes come from; reads no tensor.

A refused meta.json is `BadInput` (a `CorruptData`) naming the object and the entry.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckptd import inputs
from ckptd.errors import BadInput

NAME = "meta.json"
FORMAT_PREFIX = "ckptd-native/"
KIND = inputs.ROOT_META  # 1 MiB: a few hundred bytes per file listed, far more than save writes
MAX_WORLD = 1 << 20  # ranks a meta.json may name
_MAX_TEXT = 255  # a listed path or component name
# The files `ckptd.torch.save` writes, and the component each holds.
_FIXED = {"model.pt": "model", "ema.pt": "ema", "scheduler.pt": "scheduler",
          "scaler.pt": "scaler", "extra.pt": "extra"}
_PER_RANK = re.compile(r"^(optim|rng)\.rank(\d{1,7})\.pt$")
_PER_RANK_COMPONENT = {"optim": "optimizer", "rng": "rng"}


@dataclass(frozen=True)
class Meta:
    """A checked meta.json: the document (what `load` returns) and its listed files by path."""

    doc: dict[str, Any]
    step: int
    world_size: int
    files: dict[str, int]  # path -> listed size

    def component_files(self, rank: int) -> dict[str, str]:
        """Component -> file name, of the components a load of `rank` reads, as listed."""
        return {c: n for c, n in component_names(rank).items() if n in self.files}


def component_names(rank: int) -> dict[str, str]:
    """Component -> the file a load of `rank` reads it from (wherever the files are)."""
    return {"model": "model.pt", "ema": "ema.pt", "scheduler": "scheduler.pt",
            "scaler": "scaler.pt", "optimizer": f"optim.rank{rank}.pt"}


def read(path: Path, step: int | None = None) -> Meta:
    """The meta.json at `path` (a regular file, not a link, at most 1 MiB), checked."""
    try:
        raw = inputs.read_file(path, KIND)
    except FileNotFoundError:
        raise BadInput(f"{path}: no such file (a native checkpoint's {NAME})") from None
    except OSError as exc:
        raise BadInput(f"{path}: cannot read it: {exc.strerror or exc}") from None
    return parse(raw, str(path), step)


def parse(data: bytes, where: str, step: int | None = None) -> Meta:
    """meta.json's bytes, named `where`, checked: strict JSON within the cap, a native
    format, a step (equal to `step`, the step the checkpoint is known as, when given), a
    world size, and a file list whose paths stay in the step and whose sizes, components and
    ranks agree with what `ckptd.torch.save` writes."""
    doc = inputs.loads(inputs.check_size(data, KIND, where), where)
    if not isinstance(doc, dict):
        raise BadInput(f"{where}: not a JSON object")
    fmt = doc.get("format")
    if not isinstance(fmt, str) or not fmt.startswith(FORMAT_PREFIX):
        raise BadInput(f"{where}: format {_show(fmt)} is not {FORMAT_PREFIX}*")
    n = inputs.check_int(doc.get("step"), f"{where}: step")
    if step is not None and n != step:
        raise BadInput(f"{where}: step {n}, but the checkpoint is step {step}")
    world = inputs.check_int(doc.get("world_size", 1), f"{where}: world_size", 1, MAX_WORLD)
    _check_optional(doc, where)
    listing = doc.get("files")
    if not isinstance(listing, list):
        raise BadInput(f"{where}: 'files' is not a list")
    files: dict[str, int] = {}
    for i, entry in enumerate(listing):
        path, size = _entry(entry, f"{where}: files[{i}]", world)
        if path in files:
            raise BadInput(f"{where}: files[{i}]: {path!r} is listed twice")
        files[path] = size
    return Meta(doc, n, world, files)


def _entry(entry: Any, what: str, world: int) -> tuple[str, int]:
    if not isinstance(entry, dict):
        raise BadInput(f"{what}: not an object")
    path, component = entry.get("path"), entry.get("component")
    if not isinstance(path, str) or not _safe_relative(path):
        raise BadInput(f"{what}: path {_show(path)} is not a file inside the step")
    size = inputs.check_int(entry.get("size"), f"{what} ({path}): size")
    if not isinstance(component, str) or not 0 < len(component) <= _MAX_TEXT:
        raise BadInput(f"{what} ({path}): component {_show(component)} is not a name")
    rank = entry.get("rank")
    if rank is not None:
        inputs.check_int(rank, f"{what} ({path}): rank", 0, world - 1)
    expected, expected_rank = _written_as(path)
    if expected is not None and component != expected:
        raise BadInput(f"{what}: {path} holds the {expected}, not {_show(component)}")
    if expected_rank is not None and rank != expected_rank:
        raise BadInput(f"{what}: {path} is rank {expected_rank}'s, not rank {_show(rank)}'s")
    return path, size


def _written_as(path: str) -> tuple[str | None, int | None]:
    """The component (and rank) `ckptd.torch.save` writes under this name, if it is one."""
    if path in _FIXED:
        return _FIXED[path], None
    match = _PER_RANK.match(path)
    if match is None:
        return None, None
    return _PER_RANK_COMPONENT[match.group(1)], int(match.group(2))


def _check_optional(doc: dict[str, Any], where: str) -> None:
    """What `load` hands back in meta: present or not, of the type save writes."""
    metrics = doc.get("metrics", {})
    if not isinstance(metrics, dict):
        raise BadInput(f"{where}: 'metrics' is not an object")
    for key, value in metrics.items():
        inputs.check_float(value, f"{where}: metrics[{key[:40]!r}]")
    if not isinstance(doc.get("config", {}), dict):
        raise BadInput(f"{where}: 'config' is not an object")
    for key in ("created", "save_id"):
        if not isinstance(doc.get(key, ""), str):
            raise BadInput(f"{where}: {key!r} is not a string")
    if "nodes" in doc:
        inputs.check_int(doc["nodes"], f"{where}: nodes", 1, MAX_WORLD)


def _safe_relative(path: str) -> bool:
    """A listed path stays inside the step dir: no absolute path, no `..`, not meta.json."""
    if not 0 < len(path) <= _MAX_TEXT or path.startswith("/") or "\\" in path or "\0" in path:
        return False
    return all(p not in ("", ".", "..") for p in path.split("/")) and path != NAME


def _show(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
