"""The two-pass copy of an async save's components into the arena (docs/ASYNC.md): torch.save
writes each zip over placeholder storages that cost no memory, then each tensor's real storage
is copied straight from its device into its record's place in the arena.

Owns the placeholders, their record offsets and the copies; never changes a byte torch.save
would write for the real tensors, and never unpickles anything.
"""

from __future__ import annotations

import ctypes
import mmap
import pickle
import types
import warnings
from typing import Any, cast

import torch

from ckptd.errors import Signal

_torch: Any = torch  # (for the calls torch's stubs leave untyped)
_DEVICES = ("cpu", "cuda")


class Placeholders:
    """Pickling hook for one torch.save: each plain tensor is pickled as a CPU tensor of the
    same dtype, offset, size and stride over a never-written storage of its storage's size
    (one per real storage, so shared storages and views serialise as the real ones do), with
    the real storage's device as its location. The writer recognises a placeholder's record by
    its address and leaves its bytes to `copy_storages`."""

    def __init__(self) -> None:
        self._by_storage: dict[int, torch.UntypedStorage] = {}  # real storage id -> placeholder
        self._kept: set[int] = set()  # real storages pickled as themselves
        self._pending: dict[int, torch.UntypedStorage] = {}  # placeholder address -> real
        self.sizes: set[int] = set()
        self.found: list[tuple[int, torch.UntypedStorage]] = []  # (arena offset, real)

    def reduce(self, obj: Any) -> Any:
        if not isinstance(obj, torch.Tensor):
            return NotImplemented
        real = obj.untyped_storage()
        key = real._cdata
        if not _plain(obj):
            if key in self._by_storage:
                raise Unsupported("a storage shared by a plain tensor and another kind")
            self._kept.add(key)
            return NotImplemented
        if key in self._kept:
            raise Unsupported("a storage shared by a plain tensor and another kind")
        stand_in = self._by_storage.get(key)
        if stand_in is None:
            stand_in = _torch.UntypedStorage(real.nbytes())  # untouched pages: no memory
            self._by_storage[key] = stand_in
            if real.nbytes():
                self._pending[stand_in.data_ptr()] = real
                self.sizes.add(real.nbytes())
        view = torch.empty(0, dtype=obj.dtype).set_(
            stand_in, obj.storage_offset(), obj.size(), obj.stride())
        func, args = cast(Any, view).__reduce_ex__(pickle.DEFAULT_PROTOCOL)[:2]
        if obj.device.type != "cpu":
            args[0]._fake_device = obj.device  # torch.save names the real device
        return func, args

    def claim(self, data: memoryview, offset: int) -> bool:
        """True if `data` is a placeholder's record (its bytes go in later), noted at offset."""
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "the buffer is not writable": only read here
            address = torch.frombuffer(data, dtype=torch.uint8).data_ptr()
        real = self._pending.pop(address, None)
        if real is None:
            return False
        self.found.append((offset, real))
        return True

    def check_all_found(self) -> None:
        if self._pending:
            raise Unsupported(f"{len(self._pending)} storage records were not recognised")


class Unsupported(Signal):
    """This state cannot go through placeholders; the component is written the plain way.
    An exception, not a return value: it is raised inside `torch.save`'s pickler (the
    persistent-id hook), which only an exception can stop; `_async` catches it around the save."""


def _plain(t: torch.Tensor) -> bool:
    return (type(t) is torch.Tensor and t.layout == torch.strided and not t.requires_grad
            and t.device.type in _DEVICES and not t.is_quantized and not t.is_conj()
            and not t.is_neg() and not _torch._utils._get_obj_state(t))


def pickle_module(hook: Placeholders) -> types.ModuleType:
    """A pickle module for torch.save whose Pickler asks `hook` to reduce each object first."""

    class Pickler(pickle.Pickler):
        def reducer_override(self, obj: Any) -> Any:
            return hook.reduce(obj)

    module = types.ModuleType("ckptd_arena_pickle")
    module.Pickler = Pickler  # type: ignore[attr-defined]
    return module


def copy_storages(buf: Any, found: list[tuple[int, torch.UntypedStorage]],
                  non_blocking: bool) -> None:
    """Each real storage's bytes into the arena at its record's offset (`buf` is the arena's
    writable mapping); device copies are issued non-blocking, then one synchronize per device
    they came from."""
    devices: set[torch.device] = set()
    for offset, real in found:
        n = real.nbytes()
        if real.device.type == "cpu":  # one memcpy (torch's copy_ is slower here)
            buf[offset:offset + n] = (ctypes.c_char * n).from_address(real.data_ptr())
            continue
        dst = torch.frombuffer(buf, dtype=torch.uint8, count=n, offset=offset)
        src = torch.empty(0, dtype=torch.uint8, device=real.device).set_(real)
        devices.add(real.device)
        dst.copy_(src, non_blocking=non_blocking)
        del dst, src  # (each holds the mapping's buffer: released before it may grow)
    for device in devices:
        torch.cuda.synchronize(device)


class HostRegistration:
    """The arena's mapping registered as pinned memory with CUDA (so device copies into it
    are DMA, not staged through a driver buffer); undone before the mapping moves or goes."""

    def __init__(self) -> None:
        self.span: tuple[int, int] | None = None
        self.failed = False

    def ensure(self, mm: Any, used: int) -> bool:
        """Register the first `used` bytes (page-rounded), not the whole mapping: registering
        pins, and so makes resident, every page it covers, the arena's unused growth room
        included (measured: 1.20x the state resident instead of 1.00x)."""
        if self.failed:
            return False
        length = min(len(mm), -(-used // mmap.PAGESIZE) * mmap.PAGESIZE)
        if self.span is not None and self.span[1] >= length:
            return True
        self.release()
        probe = ctypes.c_char.from_buffer(mm)
        address = ctypes.addressof(probe)
        del probe
        err = _torch.cuda.cudart().cudaHostRegister(address, length, 0)
        if int(err) != 0:
            self.failed = True  # pageable copies: correct, slower
            return False
        self.span = (address, length)
        return True

    def release(self) -> None:
        if self.span is not None:
            _torch.cuda.cudart().cudaHostUnregister(self.span[0])
            self.span = None
