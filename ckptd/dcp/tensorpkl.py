"""A DCP slice's pickles: each one scanned by the daemon's bounded opcode scan
(`formats.picklescan`) before an unpickler sees it, and the one tensor a slice's data.pkl
rebuilds read as its layout with inert stand-ins. Nothing of the file runs; never reads the
tensor's bytes (that is `slices`).
"""

from __future__ import annotations

import io
import pickle
import re
import zipfile
from dataclasses import dataclass
from typing import Any

import torch

from ckptd.errors import CorruptData, ValidationFailed
from ckptd.formats.picklescan import SAFE_GLOBALS, scan_pickle

_STORAGE_NAME = re.compile(r"[A-Za-z0-9]+Storage")
# The legacy storage class names torch's pickles name a tensor's dtype by ("FloatStorage"):
# torch's own table, the one its loader uses. Newer dtypes are pickled otherwise and take the
# slow way.
_STORAGE_DTYPES: dict[str, torch.dtype] = {
    name: dtype for dtype, name in torch.storage._dtype_to_storage_type_map().items()}


@dataclass(frozen=True)
class Layout:
    """The one tensor a slice's data.pkl rebuilds: its storage and view of it."""

    key: str
    dtype: torch.dtype
    numel: int
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]


class Unusual(Exception):
    """The archive is not the plain one-tensor archive DCP writes: read it the slow way."""


class _Ref:
    def __init__(self, key: str, dtype: torch.dtype, numel: int) -> None:
        self.key, self.dtype, self.numel = key, dtype, numel


class _Rebuilt:
    def __init__(self, ref: Any, offset: Any, size: Any, stride: Any) -> None:
        if not isinstance(ref, _Ref):
            raise Unusual("a tensor without a storage reference")
        self.layout = Layout(ref.key, ref.dtype, ref.numel, int(offset),
                             tuple(int(s) for s in size), tuple(int(s) for s in stride))


def _rebuild(ref: Any, offset: Any, size: Any, stride: Any, *_rest: Any) -> _Rebuilt:
    return _Rebuilt(ref, offset, size, stride)


class _LayoutReader(pickle.Unpickler):
    """data.pkl with only the names a plain tensor's pickle holds, each an inert stand-in."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _rebuild
        if (module, name) == ("collections", "OrderedDict"):
            return dict
        if module == "torch" and _STORAGE_NAME.fullmatch(name):
            return ("storage-class", name)
        raise Unusual(f"data.pkl names {module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise Unusual("an unknown persistent id")
        kind, key, numel = pid[1], pid[2], pid[4]
        if not (isinstance(kind, tuple) and kind[0] == "storage-class"):
            raise Unusual("a storage of no known type")
        dtype = _STORAGE_DTYPES.get(kind[1])
        if dtype is None or not isinstance(numel, int) or numel < 0:
            raise Unusual(f"storage type {kind[1]}")
        return _Ref(str(key), dtype, numel)


def scan(pkl: bytes, where: str) -> None:
    """The daemon's opcode scan of one pickle of a slice (bounded memo and stack, the globals
    torch.load(weights_only=True) allows): CorruptData naming `where` when it refuses."""
    try:
        scan_pickle(pkl, where, SAFE_GLOBALS)
    except ValidationFailed as exc:
        raise CorruptData(f"{where}: refused ({exc.reason}: {exc.message})") from None


def scan_archive(data: bytes, where: str) -> None:
    """Scan every pickle of a tensor archive held in memory before torch.load reads it:
    CorruptData naming `where` when it is no zip torch writes or a pickle is refused."""
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            for info in archive.infolist():
                if not info.filename.endswith(".pkl"):
                    continue
                if info.compress_type != zipfile.ZIP_STORED or info.file_size > len(data):
                    raise CorruptData(f"{where}: {info.filename} is not stored as torch "
                                      "stores it")
                scan(archive.read(info), f"{where} {info.filename}")
    except CorruptData:
        raise
    except Exception as exc:  # untrusted bytes: no zip, no tensor archive
        raise CorruptData(f"{where}: not a tensor archive ({type(exc).__name__}: {exc})"
                          ) from None


def read_layout(pkl: bytes, where: str) -> Layout:
    scan(pkl, f"{where} data.pkl")
    try:
        found = _LayoutReader(io.BytesIO(pkl)).load()
    except Unusual:
        raise
    except Exception as exc:  # a malformed pickle: torch.load will say what is wrong
        raise Unusual(f"data.pkl: {exc}") from None
    if not isinstance(found, _Rebuilt):
        raise Unusual("data.pkl holds something other than one tensor")
    return found.layout
