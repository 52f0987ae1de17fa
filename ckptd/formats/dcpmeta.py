"""Reads a torch.distributed.checkpoint `.metadata` file (a plain pickle, protocol 4 in torch 2.13)
through a restricted unpickler, into plain data: which data files hold which byte ranges.

Pure function on bytes. Never imports torch: each allowed DCP class is replaced by an inert
stand-in that only records its fields, so nothing named by the file runs.
"""

from __future__ import annotations

import collections
import io
import pickle
import posixpath
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import xxhash

from ckptd.errors import Signal, ValidationFailed
from ckptd.formats import picklescan
from ckptd.model import Reason

_DCP = "torch.distributed.checkpoint.metadata"
_OLD_SHARD = "torch.distributed._shard.sharded_tensor.metadata"  # torch <= 2.1 pickled these
_PLANNER = "torch.distributed.checkpoint.planner"
# megatron-core's torch_dist saves (0.16.1 on torch 2.13) also keep every rank's save plan in
# the metadata (`Metadata.all_local_plans`, to reuse the plan on the next save): frozen
# dataclasses of plain data and one Enum, nothing else (docs/SECURITY.md).
_PLAN_CLASSES = {
    (_PLANNER, "SavePlan"),
    (_PLANNER, "WriteItem"),
    (_PLANNER, "WriteItemType"),
    (_PLANNER, "TensorWriteData"),
}
_RECORD_CLASSES = {
    (_DCP, "Metadata"),
    (_DCP, "TensorStorageMetadata"),
    (_DCP, "BytesStorageMetadata"),
    (_DCP, "ChunkStorageMetadata"),
    (_DCP, "TensorProperties"),
    (_DCP, "MetadataIndex"),
    (_DCP, "StorageMeta"),
    (_OLD_SHARD, "TensorProperties"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
} | _PLAN_CLASSES
_TORCH_DTYPES = (
    "bfloat16 bool complex128 complex32 complex64 float16 float32 float64 float8_e4m3fn"
    " float8_e4m3fnuz float8_e5m2 float8_e5m2fnuz float8_e8m0fnu float4_e2m1fn_x2 int8 int16"
    " int32 int64 uint8 uint16 uint32 uint64 qint8 qint32 quint8 quint4x2 quint2x4"
).split()
# The whole list of names the metadata may reference; anything else is unsafe_pickle.
ALLOWED_GLOBALS: frozenset[tuple[str, str]] = frozenset(
    _RECORD_CLASSES
    | {("torch", d) for d in _TORCH_DTYPES}
    | {
        (_DCP, "_MEM_FORMAT_ENCODING"),
        (_OLD_SHARD, "_MEM_FORMAT_ENCODING"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
        ("pathlib", "PosixPath"),
        ("pathlib", "PurePosixPath"),
        ("pathlib", "WindowsPath"),
        ("pathlib", "PureWindowsPath"),
        ("pathlib", "Path"),
        ("collections", "OrderedDict"),
        ("builtins", "set"),
        ("builtins", "frozenset"),
    }
)
# Metadata bigger than this is refused (bad_metadata) rather than parsed into memory.
MAX_METADATA_BYTES = 256 << 20


class _Record:
    """Stand-in for a DCP dataclass: keeps whatever state the pickle gives it, runs nothing."""

    kind = "record"
    fields: dict[str, Any]
    args: tuple[Any, ...]

    def __new__(cls, *args: Any, **kwargs: Any) -> _Record:
        obj = super().__new__(cls)
        obj.fields = {}
        obj.args = args
        return obj

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        # Defining this routes every BUILD here, so a pickle can never set attributes directly.
        if isinstance(state, tuple) and len(state) == 2 and isinstance(state[1], dict):
            state = {**(state[0] or {}), **state[1]}  # the (dict, slots) form
        if isinstance(state, dict):
            self.fields.update(state)
        else:
            self.fields["__state__"] = state


@dataclass(frozen=True)
class _Const:
    """Stand-in for a torch constant (a dtype): only its name is kept."""

    name: str


def _stand_ins() -> dict[tuple[str, str], Any]:
    """A fresh table per parse: whatever one pickle does to its stand-ins (BUILD on a class or
    function sets attributes) cannot leak into the next parse."""

    def size(*args: Any) -> tuple[Any, ...]:
        return tuple(args[0]) if args else ()

    def text(*args: Any) -> str:
        return "/".join(str(a) for a in args)

    table: dict[tuple[str, str], Any] = {
        k: type(k[1], (_Record,), {"kind": k[1]}) for k in _RECORD_CLASSES
    }
    table.update({("torch", d): _Const(f"torch.{d}") for d in _TORCH_DTYPES})
    table.update({k: text for k in ALLOWED_GLOBALS if k[0] == "pathlib"})
    table.update(
        {
            (_DCP, "_MEM_FORMAT_ENCODING"): int,
            (_OLD_SHARD, "_MEM_FORMAT_ENCODING"): int,
            ("torch", "Size"): size,
            ("torch.serialization", "_get_layout"): str,
            ("collections", "OrderedDict"): dict,
            ("builtins", "set"): set,
            ("builtins", "frozenset"): frozenset,
        }
    )
    return table


class _Unsafe(Signal):
    """The metadata pickle names a global DCP metadata never holds. Raised inside
    `pickle.Unpickler.find_class`, which only an exception can stop; `parse_dcp_metadata`
    turns it into its ValidationFailed."""


_SCAN_ALLOWED = frozenset(f"{m}.{n}" for m, n in ALLOWED_GLOBALS) | picklescan.SAFE_GLOBALS


class _RestrictedUnpickler(pickle.Unpickler):
    def __init__(self, data: bytes) -> None:
        super().__init__(io.BytesIO(data))
        self._stand_ins = _stand_ins()

    def find_class(self, module: str, name: str) -> Any:
        try:
            return self._stand_ins[(module, name)]
        except KeyError:
            raise _Unsafe(f"references {module}.{name}, which DCP metadata never holds") from None


@dataclass(frozen=True)
class DcpMetadata:
    """What a `.metadata` says about its data files.

    `references` maps each data file (relative to the metadata's directory) to the least size it
    must have: the end of its last byte range. `ranges` lists each file's (offset, length) items,
    sorted. `transformed` names files whose items DCP stored through a transform (compression,
    ...), whose bytes are therefore not torch.save archives.
    """

    references: dict[str, int]
    ranges: dict[str, tuple[tuple[int, int], ...]]
    transformed: frozenset[str]
    version: str
    entries: int  # state_dict entries described


_PARSED: collections.OrderedDict[tuple[str, int, str], DcpMetadata | ValidationFailed] = (
    collections.OrderedDict())
_PARSED_KEPT = 64
_PARSED_LOCK = threading.Lock()


def parse_once(data: bytes, path: str = ".metadata") -> DcpMetadata:
    """`parse_dcp_metadata`, its verdict remembered by the content's digest (not the bytes) for
    the last 64 contents: the scan that finds a step, its rescans and its validation parse a
    `.metadata` once between them (about 3 s of opcode scan for a 10,000-tensor step), a
    hostile one least of all. A refusal is raised afresh each time."""
    key = (xxhash.xxh3_128_hexdigest(data), len(data), path)
    with _PARSED_LOCK:
        hit = _PARSED.get(key)
        if hit is None:
            try:
                hit = parse_dcp_metadata(data, path)
            except ValidationFailed as exc:
                hit = exc
            _PARSED[key] = hit
            while len(_PARSED) > _PARSED_KEPT:
                _PARSED.popitem(last=False)
        _PARSED.move_to_end(key)
    if isinstance(hit, ValidationFailed):
        raise ValidationFailed(hit.reason, hit.message, hit.path)
    return hit


def scan_metadata(data: bytes, path: str = ".metadata") -> None:
    """The bounded opcode scan every reader of a `.metadata` runs before its unpickler: its
    memo and stack are bounded, so a memo bomb is refused before an unpickler would build a
    memo the size of the index it names. ValidationFailed: `unsafe_pickle` for a global
    outside ALLOWED_GLOBALS, `bad_metadata` for opcodes that do not parse or a bomb."""
    try:
        picklescan.scan_pickle(data, path, _SCAN_ALLOWED)
    except ValidationFailed as exc:
        reason = Reason.UNSAFE_PICKLE if exc.reason == Reason.UNSAFE_PICKLE else Reason.BAD_METADATA
        raise ValidationFailed(reason, exc.message, path) from None


def parse_dcp_metadata(data: bytes, path: str = ".metadata") -> DcpMetadata:
    """Parse `.metadata` bytes. Raises ValidationFailed: `unsafe_pickle` when the pickle names
    anything outside ALLOWED_GLOBALS; `bad_metadata` when it does not parse or does not have
    the shape of DCP metadata; `unsafe_path` when a data file's name leaves the directory."""
    if len(data) > MAX_METADATA_BYTES:
        raise ValidationFailed(
            Reason.BAD_METADATA, f"{path}: over {MAX_METADATA_BYTES} bytes", path
        )
    scan_metadata(data, path)
    try:
        root = _RestrictedUnpickler(data).load()
    except _Unsafe as exc:
        raise ValidationFailed(Reason.UNSAFE_PICKLE, f"{path} {exc}", path) from None
    except Exception as exc:  # untrusted bytes: any failure of the machinery means "unparsable"
        raise ValidationFailed(
            Reason.BAD_METADATA, f"{path}: not DCP metadata: {type(exc).__name__}: {exc}", path
        ) from None
    return _summarize(root, path)


def _summarize(root: Any, path: str) -> DcpMetadata:
    bad = _bad(path)
    if not isinstance(root, _Record) or root.kind != "Metadata":
        raise bad("top object is not a DCP Metadata")
    storage = root.fields.get("storage_data") or {}
    state = root.fields.get("state_dict_metadata") or {}
    if not isinstance(storage, dict) or not isinstance(state, dict):
        raise bad("storage_data/state_dict_metadata are not mappings")
    items: dict[str, list[tuple[int, int]]] = {}
    transformed: set[str] = set()
    for info in storage.values():
        rel, offset, length, transform = _storage_item(info, bad, path)
        items.setdefault(rel, []).append((offset, length))
        if transform:
            transformed.add(rel)
    ranges = {rel: tuple(sorted(v)) for rel, v in items.items()}
    references = {rel: max(o + n for o, n in v) for rel, v in ranges.items()}
    version = root.fields.get("version")
    return DcpMetadata(
        references,
        ranges,
        frozenset(transformed),
        version if isinstance(version, str) else "",
        len(state),
    )


def _bad(path: str) -> Callable[[str], ValidationFailed]:
    def make(why: str) -> ValidationFailed:
        return ValidationFailed(Reason.BAD_METADATA, f"{path}: {why}", path)

    return make


def _storage_item(
    info: Any, bad: Callable[[str], ValidationFailed], path: str
) -> tuple[str, int, int, bool]:
    if not isinstance(info, _Record) or info.kind != "_StorageInfo":
        raise bad("a storage entry is not a _StorageInfo")
    rel, offset, length = (info.fields.get(k) for k in ("relative_path", "offset", "length"))
    if not isinstance(rel, str) or not rel:
        raise bad(f"bad relative_path {rel!r}")
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (offset, length)):
        raise bad(f"bad byte range {offset!r}+{length!r} in {rel}")
    norm = posixpath.normpath(rel)
    if posixpath.isabs(rel) or norm == ".." or norm.startswith("../"):
        raise ValidationFailed(
            Reason.UNSAFE_PATH, f"{path}: data file {rel!r} leaves the dir", path
        )
    assert isinstance(offset, int) and isinstance(length, int)
    return norm, offset, length, bool(info.fields.get("transform_descriptors"))
