"""Deep validation of a safetensors file: NaN/Inf in its floating tensors, read through a
memory map in bounded blocks (torch files go through `deepscan`). Reads only; never loads torch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ckptd.errors import ValidationFailed
from ckptd.formats import safetensors
from ckptd.model import Reason

_SCAN_BLOCK = 1 << 24  # elements checked for NaN/Inf at a time (bounded scratch memory)
_FLOAT_VIEWS = {"F16": "<f2", "F32": "<f4", "F64": "<f8"}


def scan_safetensors(path: Path, header: safetensors.SafetensorsHeader, rel: str) -> None:
    """ValidationFailed(nan) naming the first F16/F32/F64/BF16 tensor with a NaN or an Inf."""
    import numpy as np

    if header.data_size == 0:
        return
    data = np.memmap(path, np.uint8, "r", header.data_start, (header.data_size,))
    try:
        for t in header.tensors:
            if _nonfinite(data[t.begin : t.end], t.dtype):
                raise ValidationFailed(
                    Reason.NAN, f"{rel}: tensor {t.name} has NaN/Inf values", rel
                )
    finally:
        del data


def _nonfinite(raw: Any, dtype: str) -> bool:
    import numpy as np

    step = _SCAN_BLOCK * 8
    for lo in range(0, len(raw), step):
        block = raw[lo : lo + step]
        if dtype in _FLOAT_VIEWS:
            if not np.isfinite(block.view(_FLOAT_VIEWS[dtype])).all():
                return True
        elif dtype == "BF16":
            # bfloat16 is NaN/Inf exactly when its 8 exponent bits are all ones.
            if ((block.view("<u2") & 0x7F80) == 0x7F80).any():
                return True
    return False
