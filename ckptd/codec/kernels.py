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
import platform
import sys
from types import ModuleType

from ckptd.errors import BadValue

ENV = "CKPTD_CODEC_KERNELS"
CHOICES = ("auto", "c", "numpy")

_loaded: tuple[ModuleType | None, str] | None = None
_why = ""  # why the numpy path runs, when it does


def _load() -> tuple[ModuleType | None, str]:
    global _why
    wanted = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if wanted not in CHOICES:
        raise BadValue(f"{ENV}={wanted!r}: expected one of {', '.join(CHOICES)}")
    if wanted == "numpy":
        _why = f"{ENV}=numpy"
        return None, "numpy"
    if sys.byteorder != "little":
        _why = "a big-endian machine"
        return None, "numpy"
    try:
        return importlib.import_module("ckptd.codec._planes"), "c"
    except ImportError as exc:
        if wanted == "c":
            raise
        _why = f"ckptd.codec._planes not importable ({exc})"
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


def describe() -> str:
    """The kernels in use, in words: `c (AVX2)` where the CPU has AVX2 (the compiled loops'
    AVX2 clones run there: an ifunc picks them on x86-64 glibc), `c (baseline)` elsewhere, or
    `numpy (no compiled kernels: <why>)`."""
    if name() == "numpy":
        return f"numpy (no compiled kernels: {_why or 'not built'})"
    return "c (AVX2)" if _has_avx2() else "c (baseline)"


def _has_avx2() -> bool:
    if platform.machine() not in ("x86_64", "AMD64"):
        return False
    try:
        with open("/proc/cpuinfo", "rb") as f:
            head = f.read(1 << 16)  # the first CPU's flags are within it
    except OSError:
        return False
    flags = next((line for line in head.splitlines() if line.startswith(b"flags")), b"")
    return b"avx2" in flags.split()


def reset() -> None:
    """Read the environment again at next use (tests switch between the two paths)."""
    global _loaded, _why
    _loaded, _why = None, ""
