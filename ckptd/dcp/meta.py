"""A DCP `.metadata` pickle read into torch's own Metadata classes, through an unpickler that
resolves only the names DCP metadata holds (the allow-list `formats.dcpmeta` checks files with):
anything else is refused before it is looked up, so nothing named by the file runs. The bytes go
through the daemon's bounded opcode scan first (`dcpmeta.scan_metadata`), so no unpickler
sees a memo index or a stack the scan would refuse; then every number a load acts on (tensor
sizes, chunk offsets and sizes, the storage entry of every chunk, each entry a byte range of a
file inside the checkpoint directory) is checked before DCP's planner sees the Metadata.
"""

from __future__ import annotations

import importlib
import io
import pickle
import posixpath
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)

from ckptd.errors import CorruptData, ValidationFailed
from ckptd.formats.dcpmeta import ALLOWED_GLOBALS, MAX_METADATA_BYTES, scan_metadata

__all__ = ["MAX_METADATA_BYTES", "read_metadata"]

# Dimensions a saved tensor may have: torch's own limit (a view of more fails in torch).
MAX_DIMS = 64


class _Allowed(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in ALLOWED_GLOBALS:
            raise pickle.UnpicklingError(f"references {module}.{name}, which DCP metadata "
                                         "never holds")
        return getattr(importlib.import_module(module), name)


def read_metadata(data: bytes, where: str) -> Metadata:
    """The Metadata in `data`; CorruptData naming `where` (and the entry) when it is not DCP
    metadata or says what no DCP save says."""
    if len(data) > MAX_METADATA_BYTES:
        raise CorruptData(f"{where}: DCP metadata over {MAX_METADATA_BYTES} bytes")
    try:  # the daemon's opcode scan: a bounded memo and stack, DCP's names only
        scan_metadata(data, where)
    except ValidationFailed as exc:
        raise CorruptData(f"{where}: not DCP metadata ({exc.reason}: {exc.message})") from None
    try:
        found = _Allowed(io.BytesIO(data)).load()
    except Exception as exc:
        raise CorruptData(f"{where}: not DCP metadata ({type(exc).__name__}: {exc})") from None
    if not isinstance(found, Metadata):
        raise CorruptData(f"{where}: the pickle holds a {type(found).__name__}, not Metadata")
    check_metadata(found, where)
    return found


def _count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _counts(v: Any) -> tuple[int, ...] | None:
    """`v` as a tuple of non-negative ints (a torch.Size, a list), None when it is not one."""
    if not isinstance(v, tuple | list) or len(v) > MAX_DIMS or not all(_count(x) for x in v):
        return None
    return tuple(v)


def check_metadata(md: Metadata, where: str) -> None:
    """Every entry of `md` has the shape DCP writes: a tensor's size and dtype, its chunks
    inside it, every chunk and bytes item with its storage entry, each entry a byte range of
    a named file. CorruptData naming `where` and the entry otherwise."""
    state = getattr(md, "state_dict_metadata", None)
    storage = getattr(md, "storage_data", None)
    if not isinstance(state, dict) or not isinstance(storage, dict):
        raise CorruptData(f"{where}: state_dict_metadata/storage_data are not mappings")
    for index, info in storage.items():
        fqn = getattr(index, "fqn", None)
        if not isinstance(index, MetadataIndex) or not isinstance(fqn, str):
            raise CorruptData(f"{where}: a storage key is a {type(index).__name__}")
        rel, offset, length = (getattr(info, k, None)
                               for k in ("relative_path", "offset", "length"))
        if not (isinstance(rel, str) and rel and _count(offset) and _count(length)):
            raise CorruptData(f"{where}: {fqn!r}: bad storage entry "
                              f"{rel!r} [{offset!r}, +{length!r})")
        norm = posixpath.normpath(rel)
        if posixpath.isabs(rel) or norm == ".." or norm.startswith("../"):
            raise CorruptData(f"{where}: {fqn!r}: data file {rel!r} leaves the checkpoint "
                              "directory")
    for fqn, entry in state.items():
        if not isinstance(fqn, str):
            raise CorruptData(f"{where}: a state_dict key is a {type(fqn).__name__}")
        if isinstance(entry, BytesStorageMetadata):
            if MetadataIndex(fqn) not in storage:
                raise CorruptData(f"{where}: {fqn!r} has no storage entry")
        elif isinstance(entry, TensorStorageMetadata):
            _check_tensor(fqn, entry, storage, where)
        else:
            raise CorruptData(f"{where}: {fqn!r} is a {type(entry).__name__}, not a DCP entry")


def _check_tensor(fqn: str, entry: TensorStorageMetadata, storage: dict[MetadataIndex, Any],
                  where: str) -> None:
    size = _counts(getattr(entry, "size", None))
    props = getattr(entry, "properties", None)
    if size is None or not isinstance(getattr(props, "dtype", None), torch.dtype):
        raise CorruptData(f"{where}: {fqn!r}: bad size or dtype")
    chunks = getattr(entry, "chunks", None)
    if not isinstance(chunks, list):
        raise CorruptData(f"{where}: {fqn!r}: chunks are not a list")
    for chunk in chunks:
        if not isinstance(chunk, ChunkStorageMetadata):
            raise CorruptData(f"{where}: {fqn!r}: a chunk is a {type(chunk).__name__}")
        offsets = _counts(getattr(chunk, "offsets", None))
        sizes = _counts(getattr(chunk, "sizes", None))
        if (offsets is None or sizes is None or len(offsets) != len(size)
                or len(sizes) != len(size)
                or any(o + n > s for o, n, s in zip(offsets, sizes, size, strict=True))):
            raise CorruptData(f"{where}: {fqn!r}: chunk at {offsets} of {sizes} is not "
                              f"inside its tensor of {tuple(size)}")
        if MetadataIndex(fqn, offsets) not in storage:
            raise CorruptData(f"{where}: {fqn!r}: the chunk at {list(offsets)} has no "
                              "storage entry")
