"""What a torch archive's data.pkl says, read with every global an inert stand-in: the storages
it references and its top-level dict's plain values. Call only on a pickle `picklescan` passed;
nothing of the file runs, and nothing here decides whether a pickle is safe.
"""

from __future__ import annotations

import io
import pickle
from dataclasses import dataclass

from ckptd.errors import ValidationFailed
from ckptd.model import PlainValue, Reason

# Bytes per element of the storage classes torch's zip format names in its persistent ids.
STORAGE_ITEM_BYTES = {
    "Double": 8, "Float": 4, "Half": 2, "BFloat16": 2, "Long": 8, "Int": 4, "Short": 2,
    "Char": 1, "Byte": 1, "Bool": 1, "ComplexFloat": 8, "ComplexDouble": 16, "Untyped": 1,
    "QInt8": 1, "QUInt8": 1, "QInt32": 4, "QUInt4x2": 1, "QUInt2x4": 1,
}


class _Inert(dict):  # type: ignore[type-arg]
    """What a global becomes while storage references are read: nothing of the file runs, and
    whatever the pickle does to it (set items, append, set state) is absorbed."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__()

    def append(self, item: object) -> None:
        pass

    def extend(self, items: object) -> None:
        pass

    def __setstate__(self, state: object) -> None:
        pass


class _StorageRefs(pickle.Unpickler):
    """Reads a scanned-safe torch pickle only for its persistent ids ('storage', type, key,
    location, numel) and its plain top-level values; every global is an inert stand-in,
    nothing of the file runs."""

    def __init__(self, data: bytes) -> None:
        super().__init__(io.BytesIO(data))
        self.refs: list[tuple[str, str, int]] = []

    def find_class(self, module: str, name: str) -> object:
        return type(name, (_Inert,), {})

    def persistent_load(self, pid: object) -> object:
        if (isinstance(pid, tuple) and len(pid) >= 5 and pid[0] == "storage"
                and isinstance(pid[2], str) and isinstance(pid[4], int)):
            kind = getattr(pid[1], "__name__", str(pid[1])).removesuffix("Storage")
            self.refs.append((pid[2], kind, pid[4]))
        return _Inert()


MAX_FIELD_CHARS = 1024  # a longer string is not a count or a name a completion rule needs


@dataclass(frozen=True)
class TorchPickle:
    """What a torch archive's data.pkl says without anything of it running: the storages it
    references (key, element type, numel) and its top-level dict's plain values (numbers,
    short strings, booleans, None), e.g. DeepSpeed's `dp_world_size`."""

    refs: tuple[tuple[str, str, int], ...]
    fields: dict[str, PlainValue]


def read_torch_pickle(data: bytes, what: str) -> TorchPickle:
    """Read a torch data.pkl with every global an inert stand-in. Call only on a pickle
    `scan_pickle` passed. ValidationFailed(bad_header) when it does not load."""
    reader = _StorageRefs(data)
    try:
        top = reader.load()
    except Exception as exc:  # untrusted bytes: a pickle that does not load is not a checkpoint
        raise ValidationFailed(Reason.BAD_HEADER, f"{what}: its pickle does not load:"
                               f" {type(exc).__name__}: {exc}", what) from None
    return TorchPickle(tuple(reader.refs), plain_fields(top))


def plain_fields(top: object) -> dict[str, PlainValue]:
    if not isinstance(top, dict):
        return {}
    return {k: v for k, v in top.items() if isinstance(k, str) and (
        v is None or type(v) in (int, float, bool)
        or (type(v) is str and len(v) <= MAX_FIELD_CHARS))}

