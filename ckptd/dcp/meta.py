"""A DCP `.metadata` pickle read into torch's own Metadata classes, through an unpickler that
resolves only the names DCP metadata holds (the allow-list `formats.dcpmeta` checks files with):
anything else is refused before it is looked up, so nothing named by the file runs.
"""

from __future__ import annotations

import importlib
import io
import pickle
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata

from ckptd.errors import CorruptData
from ckptd.formats.dcpmeta import ALLOWED_GLOBALS, MAX_METADATA_BYTES

__all__ = ["MAX_METADATA_BYTES", "read_metadata"]


class _Allowed(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in ALLOWED_GLOBALS:
            raise pickle.UnpicklingError(f"references {module}.{name}, which DCP metadata "
                                         "never holds")
        return getattr(importlib.import_module(module), name)


def read_metadata(data: bytes, where: str) -> Metadata:
    """The Metadata in `data`; CorruptData naming `where` when it is not DCP metadata."""
    if len(data) > MAX_METADATA_BYTES:
        raise CorruptData(f"{where}: DCP metadata over {MAX_METADATA_BYTES} bytes")
    try:
        found = _Allowed(io.BytesIO(data)).load()
    except Exception as exc:
        raise CorruptData(f"{where}: not DCP metadata ({type(exc).__name__}: {exc})") from None
    if not isinstance(found, Metadata):
        raise CorruptData(f"{where}: the pickle holds a {type(found).__name__}, not Metadata")
    return found
