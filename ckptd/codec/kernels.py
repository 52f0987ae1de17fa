"""Which byte-plane kernels the codec runs: the compiled ones (the extension module built from
_planes.c at install) or the numpy reference in `planes` and `nibbles`.

Both write the same bytes (tests/test_codec_kernels.py runs both on the same inputs). The
compiled module is optional: an install without a C compiler has none, and the numpy path
runs. `CKPTD_CODEC_KERNELS=numpy` forces the numpy path; `c` insists on the compiled one
(ImportError when it is missing). Read once, at first use.
"""

from __future__ import annotations

import importlib
import os
import sys
from types import ModuleType

from ckptd.errors import BadValue

ENV = "CKPTD_CODEC_KERNELS"
CHOICES = ("auto", "c", "numpy")

_loaded: tuple[ModuleType | None, str] | None = None


def _load() -> tuple[ModuleType | None, str]:
    wanted = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if wanted not in CHOICES:
        raise BadValue(f"{ENV}={wanted!r}: expected one of {', '.join(CHOICES)}")
    if wanted == "numpy" or sys.byteorder != "little":
        return None, "numpy"
    try:
        return importlib.import_module("ckptd.codec._planes"), "c"
    except ImportError:
        if wanted == "c":
            raise
        return None, "numpy"


def native() -> ModuleType | None:
    """The compiled kernels, or None when the numpy path runs."""
    global _loaded
    if _loaded is None:
        _loaded = _load()
    return _loaded[0]


def name() -> str:
    """`c` or `numpy`: the kernels in use (for `ckptd doctor` and debug logs)."""
    native()
    assert _loaded is not None
    return _loaded[1]


def reset() -> None:
    """Read the environment again at next use (tests switch between the two paths)."""
    global _loaded
    _loaded = None
