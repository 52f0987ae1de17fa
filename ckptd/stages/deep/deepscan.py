"""Deep validation of a torch file (a weights-only `torch.load`, then every floating tensor
scanned for NaN/Inf) in a child process, so that torch, and the ~100+ MiB it takes once
imported, never lives in the daemon: the child's memory goes back to the system when it ends.

Owns the child's protocol (the file's inherited fd in, one JSON verdict out); reads the file
only in the child, and never unpickles beyond torch's weights-only loader.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ckptd import needs_torch
from ckptd.errors import CkptdError, ValidationFailed
from ckptd.model import Reason

_SCAN_BLOCK = 1 << 24  # elements checked for NaN/Inf at a time (bounded scratch memory)
# One child at a time: each holds torch and a mapping of the file it loads.
_DEEP_LOCK = threading.Lock()
_CHILD_START_S = 120.0
_CHILD_RATE = 16 << 20  # bytes a second


def child_timeout(size: int) -> float:
    """How long one file's deep check may take: a start (python + torch import) and a rate
    far below what the scan does (its time follows the file's bytes), so only a hung child
    meets it. Past it the child is killed and the job fails (retried later), never holding the
    one deep-check slot for good."""
    return _CHILD_START_S + size / _CHILD_RATE


def scan_torch_file(fd: int, rel: str, timeout: float | None = None) -> None:
    """Deep-check the torch file open at `fd` (named `rel`) in a child process; raise
    ValidationFailed for what it finds, CkptdError when the child itself failed (killed,
    out of memory, past `timeout` (default `child_timeout`): a retry may succeed, so the
    checkpoint is not called invalid for it)."""
    argv = [sys.executable, "-m", "ckptd.stages.deep.deepscan", str(fd), rel]
    limit = child_timeout(os.fstat(fd).st_size) if timeout is None else timeout
    with _DEEP_LOCK:
        try:
            proc = subprocess.run(argv, pass_fds=(fd,), capture_output=True, text=True,
                                  check=False, env=dict(os.environ, PYTHONSAFEPATH="1"),
                                  timeout=limit)
        except subprocess.TimeoutExpired:  # run() has killed and reaped the child
            raise CkptdError(f"{rel}: the deep check took longer than {limit:.0f}s; "
                             "its process was stopped") from None
    lines = proc.stdout.strip().splitlines()
    try:
        verdict = json.loads(lines[-1]) if proc.returncode == 0 and lines else None
    except ValueError:
        verdict = None
    if not isinstance(verdict, dict):
        why = (proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"])[-1]
        raise CkptdError(f"{rel}: the deep check's process failed: {why}")
    if verdict.get("reason"):
        raise ValidationFailed(Reason(verdict["reason"]), str(verdict.get("message", "")), rel)


def main(argv: list[str]) -> int:
    """The child: `python -m ckptd.stages.deep.deepscan FD REL`; prints one JSON verdict."""
    fd, rel = int(argv[0]), argv[1]
    try:
        _scan(Path(f"/proc/self/fd/{fd}"), rel)
    except ValidationFailed as exc:
        print(json.dumps({"reason": str(exc.reason), "message": exc.message}))
    else:
        print(json.dumps({"reason": None}))
    return 0


def _scan(path: Path, rel: str) -> None:
    """In the child: load weights-only and scan; ValidationFailed says what is wrong."""
    try:
        import torch
    except ModuleNotFoundError as exc:  # not the file's fault: the daemon's job fails instead
        if exc.name != "torch":
            raise
        raise SystemExit(needs_torch("deep_validate")) from None

    try:
        with torch.serialization.safe_globals(_numpy_safe_globals()):
            obj = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as exc:
        raise ValidationFailed(Reason.UNSAFE_PICKLE, f"{rel}: {exc}", rel) from None
    except Exception as exc:  # torch's loader reports corrupt input with assorted exceptions
        raise ValidationFailed(
            Reason.BAD_HEADER, f"{rel}: torch.load failed: {type(exc).__name__}: {exc}", rel
        ) from None
    # Elements scanned through strided views, at most twice the file's bytes: past that, a
    # view is checked through its storage span (what the file holds), not element by element.
    seen = _Scanned(budget=2 * path.stat().st_size)
    for key, tensor in _tensors(obj):
        scanned = _within_storage(tensor, f"{rel}: tensor {key}", rel)
        try:
            nonfinite = seen.nonfinite(scanned)
        except RuntimeError as exc:  # torch refuses the view itself (the pickle's sizes)
            raise ValidationFailed(Reason.BAD_METADATA, f"{rel}: tensor {key} cannot be read:"
                                   f" {exc}", rel) from None
        if nonfinite:
            raise ValidationFailed(Reason.NAN, f"{rel}: tensor {key} has NaN/Inf values", rel)


def _within_storage(t: Any, what: str, rel: str) -> Any:
    """Check a tensor's extent against its storage before touching data, and return what to
    scan: the tensor, or (a view that reuses elements: stride 0, overlaps) the span of its
    storage it reads, so the scan's work is bounded by the file, not by the view's size."""
    import torch

    if t.layout != torch.strided or t.is_quantized or t.device.type == "meta":
        return t
    if any(st < 0 for st in t.stride()) or t.storage_offset() < 0:
        raise ValidationFailed(Reason.BAD_METADATA, f"{what} has a negative stride", rel)
    if t.numel() == 0:
        return t
    last = t.storage_offset() + sum((n - 1) * st for n, st in zip(t.shape, t.stride(),
                                                                     strict=True))
    held = t.untyped_storage().nbytes() // max(1, t.element_size())
    if last >= held:
        raise ValidationFailed(Reason.BAD_METADATA, f"{what} reaches element {last} of a"
                               f" storage of {held}: beyond its data", rel)
    if t.numel() <= last - t.storage_offset() + 1:
        return t
    flat = torch.empty(0, dtype=t.dtype)
    flat.set_(t.untyped_storage(), t.storage_offset(), (last - t.storage_offset() + 1,), (1,))
    return flat


_CLEAN_BLOCK = 1024  # elements per mark of "scanned, all finite" in a storage's map


class _Scanned:
    """What has been found finite so far, per (storage, dtype), in blocks of _CLEAN_BLOCK
    elements: a storage's elements are scanned about once however many tensors view them (a
    pickle can hold 10^5 views of one large storage), so the work follows the file's bytes."""

    def __init__(self, budget: int) -> None:
        self.maps: dict[tuple[int, Any], bytearray] = {}
        self.budget = budget

    def nonfinite(self, t: Any) -> bool:
        if not _floating(t) or t.numel() == 0:
            return False
        lo = t.storage_offset()
        hi = lo + 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride(), strict=True))
        held = t.untyped_storage().nbytes() // max(1, t.element_size())
        key = (t.untyped_storage().data_ptr(), t.dtype)
        marks = self.maps.setdefault(key, bytearray(-(-held // _CLEAN_BLOCK)))
        if t.is_contiguous() and t.numel() == hi - lo:  # reads every element of its span
            return self._span(t, marks, lo, hi, held)
        first, last = lo // _CLEAN_BLOCK, (hi - 1) // _CLEAN_BLOCK
        if marks.find(0, first, last + 1) < 0:
            return False  # every element it reads was found finite already
        if t.numel() <= self.budget:
            self.budget -= t.numel()
            return _has_nonfinite(t)
        return self._span(t, marks, lo, hi, held)

    @staticmethod
    def _span(t: Any, marks: bytearray, lo: int, hi: int, held: int) -> bool:
        """Scan the elements of [lo, hi) of `t`'s storage not yet found finite; mark the
        whole blocks found finite."""
        first, last = lo // _CLEAN_BLOCK, (hi - 1) // _CLEAN_BLOCK
        at = first
        while at <= last:
            gap = marks.find(0, at, last + 1)
            if gap < 0:
                return False
            end = marks.find(1, gap, last + 1)
            end = last + 1 if end < 0 else end
            a, b = max(lo, gap * _CLEAN_BLOCK), min(hi, end * _CLEAN_BLOCK)
            if _has_nonfinite(_storage_slice(t, a, b)):
                return True
            whole_to = -(-held // _CLEAN_BLOCK) if b == held else b // _CLEAN_BLOCK
            whole_from = -(-a // _CLEAN_BLOCK)
            if whole_to > whole_from:
                marks[whole_from:whole_to] = b"\x01" * (whole_to - whole_from)
            at = end
        return False


def _storage_slice(t: Any, lo: int, hi: int) -> Any:
    """Elements [lo, hi) of `t`'s storage, as a 1-D tensor of its dtype (a view, no copy)."""
    import torch

    flat = torch.empty(0, dtype=t.dtype)
    flat.set_(t.untyped_storage(), lo, (hi - lo,), (1,))
    return flat


def _floating(t: Any) -> bool:
    import torch

    if t.layout != torch.strided or t.is_quantized or t.device.type == "meta":
        return False
    return bool(t.is_floating_point() or t.is_complex())


def _numpy_safe_globals() -> list[Any]:
    """picklescan.EXTRA_SAFE_GLOBALS as objects, for torch's weights-only loader."""
    import numpy as np

    core = getattr(np, "_core", None) or np.core
    out: list[Any] = [np.ndarray, np.dtype, frozenset, slice]
    # torch's loader also checks the class of what BUILD sets state on: each dtype's class.
    out += [getattr(np.dtypes, n) for n in dir(np.dtypes) if n.endswith("DType")]
    for mod in ("numpy.core.multiarray", "numpy._core.multiarray"):
        out += [(core.multiarray._reconstruct, f"{mod}._reconstruct")]
        out += [(core.multiarray.scalar, f"{mod}.scalar")]
    return out


def _tensors(obj: Any) -> Iterator[tuple[str, Any]]:
    """(dotted key, tensor) for every tensor in nested dicts/lists/tuples, depth-first in order.
    Iterative and cycle-safe: the structure comes from the checkpoint."""
    import torch

    stack: list[tuple[str, Any]] = [("", obj)]
    seen: set[int] = set()
    while stack:
        key, value = stack.pop()
        if isinstance(value, torch.Tensor):
            yield key or "<root>", value
            continue
        if id(value) in seen or not isinstance(value, dict | list | tuple):
            continue
        seen.add(id(value))
        items = value.items() if isinstance(value, dict) else enumerate(value)
        children = [(f"{key}.{k}" if key else str(k), v) for k, v in items]
        stack.extend(reversed(children))


def _has_nonfinite(t: Any) -> bool:
    import torch

    if not _floating(t):
        return False
    return any(not bool(torch.isfinite(block).all()) for block in _blocks(t.detach()))


def _blocks(t: Any) -> Iterator[Any]:
    """Pieces of `t` of at most _SCAN_BLOCK elements each (a piece of a strided view is itself
    a view: nothing is copied). The number of pieces is about numel / _SCAN_BLOCK whatever the
    shape and strides: a view with many small rows (a transposed matrix, many dimensions) is
    cut into slabs of whole rows, not visited row by row."""
    if t.is_contiguous() or t.dim() <= 1:
        flat = t.reshape(-1)
        for start in range(0, flat.numel(), _SCAN_BLOCK):
            yield flat[start : start + _SCAN_BLOCK]
        return
    stack = [t]
    while stack:
        x = stack.pop()
        if x.numel() <= _SCAN_BLOCK:
            yield x
            continue
        if x.dim() == 1:
            for start in range(0, x.numel(), _SCAN_BLOCK):
                yield x[start : start + _SCAN_BLOCK]
            continue
        rows, per = x.shape[0], x.numel() // x.shape[0]
        if per > _SCAN_BLOCK:  # each row is a piece of its own (or more): one dimension less
            stack.extend(x[i] for i in range(rows - 1, -1, -1))
        else:
            k = _SCAN_BLOCK // per
            stack.extend(x[i : i + k] for i in reversed(range(0, rows, k)))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
