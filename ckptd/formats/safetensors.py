"""Checks the framing of a safetensors file as it streams past: the 8-byte header length, the JSON
header, each tensor's dtype/shape against its byte range, and ranges that tile the data section.

Reads header bytes only; tensor data is not interpreted here (NaN scans live in validate).
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from typing import Any

from ckptd.errors import ValidationFailed
from ckptd.model import Reason

# The format's own limit on the header (the reference implementation refuses bigger ones).
MAX_HEADER = 100_000_000
# Bits per element of every dtype the format names.
DTYPE_BITS = {
    "BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8,
    "I16": 16, "U16": 16, "F16": 16, "BF16": 16,
    "I32": 32, "U32": 32, "F32": 32,
    "I64": 64, "U64": 64, "F64": 64, "C64": 64,
    "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6,
}  # fmt: skip


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of the header; `begin`/`end` are offsets into the data section."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


@dataclass(frozen=True)
class SafetensorsHeader:
    header_size: int  # the JSON's length in bytes (the file's first 8 bytes)
    tensors: tuple[TensorInfo, ...]  # in data order
    metadata: dict[str, str]

    @property
    def data_start(self) -> int:
        return 8 + self.header_size

    @property
    def data_size(self) -> int:
        return self.tensors[-1].end if self.tensors else 0


def parse_header(header: bytes, path: str = "safetensors") -> SafetensorsHeader:
    """Parse and check the JSON header (without the 8-byte length). Raises ValidationFailed:
    `bad_header` for bad JSON or ranges that overlap or leave gaps, `size_mismatch` for a
    tensor whose range does not match its dtype and shape."""
    try:
        doc = json.loads(header)
    except (ValueError, RecursionError) as exc:
        raise ValidationFailed(
            Reason.BAD_HEADER, f"{path}: header is not JSON: {exc}", path
        ) from None
    if not isinstance(doc, dict):
        raise ValidationFailed(Reason.BAD_HEADER, f"{path}: header is not a JSON object", path)
    metadata = doc.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise ValidationFailed(Reason.BAD_HEADER, f"{path}: __metadata__ must map str to str", path)
    tensors = sorted(
        (_tensor(name, info, path) for name, info in doc.items()), key=lambda t: (t.begin, t.end)
    )
    _check_tiling(tensors, path)
    return SafetensorsHeader(len(header), tuple(tensors), metadata)


def _tensor(name: str, info: Any, path: str) -> TensorInfo:
    def bad(why: str) -> ValidationFailed:
        return ValidationFailed(Reason.BAD_HEADER, f"{path}: tensor {name!r}: {why}", path)

    if not isinstance(info, dict):
        raise bad("entry is not an object")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if dtype not in DTYPE_BITS:
        raise bad(f"unknown dtype {dtype!r}")
    if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
        raise bad(f"bad shape {shape!r}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(_is_count, offsets))):
        raise bad(f"bad data_offsets {offsets!r}")
    begin, end = offsets
    if end < begin:
        raise bad(f"data_offsets {offsets!r} run backwards")
    bits = math.prod(shape) * DTYPE_BITS[dtype]
    if bits % 8 or bits // 8 != end - begin:
        raise ValidationFailed(
            Reason.SIZE_MISMATCH,
            f"{path}: tensor {name!r} ({dtype}{shape}) needs {bits / 8:g} bytes,"
            f" its range holds {end - begin}",
            path,
        )
    return TensorInfo(name, str(dtype), tuple(shape), begin, end)


def _is_count(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _check_tiling(tensors: list[TensorInfo], path: str) -> None:
    expected = 0
    for t in tensors:
        if t.begin != expected:
            what = "overlaps the one before" if t.begin < expected else "leaves a gap before it"
            raise ValidationFailed(Reason.BAD_HEADER, f"{path}: tensor {t.name!r} {what}", path)
        expected = t.end


class SafetensorsSink:
    """A `read_pass` sink checking a safetensors file's framing: the header parses and the
    tensors' ranges cover the data section exactly to the end of the file."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._prefix = bytearray()
        self._header = bytearray()
        self._header_size = -1
        self.header: SafetensorsHeader | None = None

    def update(self, offset: int, view: memoryview) -> None:
        if self.header is not None:
            return
        if len(self._prefix) < 8:
            _take(self._prefix, 0, 8, offset, view)
            if len(self._prefix) < 8:
                return
            self._header_size = self._check_size(struct.unpack("<Q", self._prefix)[0])
        _take(self._header, 8, self._header_size, offset, view)
        if len(self._header) == self._header_size:
            self.header = parse_header(bytes(self._header), self.path)
            self._header = bytearray()

    def _check_size(self, n: int) -> int:
        if n > MAX_HEADER:
            raise ValidationFailed(
                Reason.BAD_HEADER, f"{self.path}: header length {n} is over the limit", self.path
            )
        return int(n)

    def finish(self, total: int) -> None:
        if self.header is None:
            raise ValidationFailed(
                Reason.TRUNCATED, f"{self.path}: file ends inside the header", self.path
            )
        data = total - self.header.data_start
        if data < self.header.data_size:
            raise ValidationFailed(
                Reason.TRUNCATED,
                f"{self.path}: data section holds {data} bytes, header needs"
                f" {self.header.data_size}",
                self.path,
            )
        if data > self.header.data_size:
            raise ValidationFailed(
                Reason.SIZE_MISMATCH,
                f"{self.path}: {data - self.header.data_size} bytes after the last tensor",
                self.path,
            )


def _take(buf: bytearray, start: int, size: int, offset: int, view: memoryview) -> None:
    """Append to `buf` the bytes of [start+len(buf), start+size) that `view` (at offset) holds."""
    lo, hi = max(offset, start + len(buf)), min(offset + len(view), start + size)
    if lo < hi:
        buf += view[lo - offset : hi - offset]
