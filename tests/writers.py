"""Writers of real checkpoint files for format and validation tests: torch.save of a small model
with Adam state, torch.distributed.checkpoint saves, safetensors per the format's spec, hostile
pickles, and byte-level damage (flip, truncate)."""

from __future__ import annotations

import json
import os
import struct
import warnings
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn


def small_state(seed: int = 0) -> dict[str, Any]:
    """A model + Adam optimizer state dict after one step, with nested plain data."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    return {
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "step": 7,
        "extra": {"losses": [1.5, 1.25], "name": "run-1", "flags": (True, None), "n": 3},
    }


def save_torch(path: Path, state: dict[str, Any] | None = None, **kw: Any) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(small_state() if state is None else state, path, **kw)
    return path


def save_dcp(directory: Path, state: dict[str, Any] | None = None) -> Path:
    """A single-process torch.distributed.checkpoint save into `directory`."""
    from torch.distributed.checkpoint.state_dict_saver import save

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is disabled ... single process"
        save(small_state() if state is None else state, checkpoint_id=directory, no_dist=True)
    return directory


_ST_DTYPES = {np.float32: "F32", np.float16: "F16", np.float64: "F64", np.int64: "I64"}


def write_safetensors(
    path: Path,
    tensors: dict[str, np.ndarray],
    metadata: dict[str, str] | None = None,
    dtypes: dict[str, str] | None = None,
) -> Path:
    """A safetensors file exactly per the format: u64 LE header size, JSON header, then the
    tensors' bytes back to back in header order. `dtypes` overrides a tensor's dtype name
    (BF16 data is given as its raw uint16 bits)."""
    header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    blobs, offset = [], 0
    for name, arr in tensors.items():
        blob = np.ascontiguousarray(arr).tobytes()
        dtype = (dtypes or {}).get(name) or _ST_DTYPES[arr.dtype.type]
        header[name] = {"dtype": dtype, "shape": list(arr.shape),
                        "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)  # the reference writer pads the header to 8 bytes
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"".join(blobs))
    return path


def st_header_bytes(header: dict[str, Any]) -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw


class RunsShell:
    """Unpickling this runs a shell command (the classic hostile checkpoint)."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (self.command,))


class RunsExec:
    """Unpickling this runs Python code through builtins.exec."""

    def __init__(self, code: str) -> None:
        self.code = code

    def __reduce__(self) -> tuple[Any, ...]:
        return (exec, (self.code,))


def hostile_state(payload: object) -> dict[str, Any]:
    state = small_state()
    state["extra"]["callback"] = payload
    return state


def member_data_offset(path: Path, suffix: str) -> tuple[int, int]:
    """(offset, size) in the file of the first zip member whose name ends with `suffix`,
    located with the standard library's zipfile (independent of ckptd's parser)."""
    with zipfile.ZipFile(path) as z:
        info = next(i for i in z.infolist() if i.filename.endswith(suffix))
    with open(path, "rb") as f:
        f.seek(info.header_offset)
        local = f.read(30)
    n, m = struct.unpack("<HH", local[26:30])
    return info.header_offset + 30 + n + m, info.compress_size


def flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))


def truncate(path: Path, keep: int) -> None:
    with open(path, "r+b") as f:
        f.truncate(keep)
