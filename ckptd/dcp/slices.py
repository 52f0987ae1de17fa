"""One DCP storage slice (a tensor's `torch.save` archive inside a data file), fed in order,
straight into the destination tensor: the archive's records are parsed as they stream by, the
tensor's bytes land in the destination's memory when the layouts agree, else in one buffer the
size of the saved tensor. Anything unusual falls back to `torch.load(weights_only=True)` of the
whole slice. Nothing of the file runs: its pickles are scanned and read only by `tensorpkl`.
A size the header claims is compared with the bytes the slice holds before any memory of that
size is taken.
"""

from __future__ import annotations

import io
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ckptd.codec.buffers import same_memory
from ckptd.dcp.tensorpkl import Layout, Unusual, read_layout, scan_archive
from ckptd.errors import CorruptData

_LOCAL = struct.Struct("<IHHHHHIIIHH")  # zip local file header
_LOCAL_SIG, _CENTRAL_SIG, _DESC_SIG = 0x04034B50, 0x02014B50, 0x08074B50
_DESCRIPTOR = b"PK\x07\x08"
# A small record (data.pkl, byteorder, version) longer than this means this is not an
# archive as torch writes it: the slice is read whole and handed to torch.load instead.
_SMALL_MAX = 1 << 20
_ZIP64 = 0xFFFFFFFF


Target = Callable[[], torch.Tensor]  # the destination of one read item, resolved when needed
Done = Callable[[torch.Tensor], None]  # called with the filled destination


@dataclass
class Want:
    """One read item of a slice: which hypercube of the saved tensor goes where."""

    storage_offsets: Sequence[int]
    lengths: Sequence[int]
    target: Target
    done: Done
    chunk: tuple[int, ...] | None = None  # the saved tensor's size, as the metadata says
    dtype: torch.dtype | None = None  # and its element type

    def fill(self, saved: torch.Tensor, where: str) -> None:
        """Copy this item's hypercube of the saved tensor into its destination."""
        size = tuple(saved.size())
        if self.chunk is not None and size != self.chunk:
            raise CorruptData(f"{where}: the slice holds a tensor of {size}, the metadata's "
                              f"chunk is {self.chunk}")
        if self.dtype is not None and saved.dtype != self.dtype:
            raise CorruptData(f"{where}: the slice holds {saved.dtype}, the metadata says "
                              f"{self.dtype}")
        if not _whole(size, tuple(saved.stride()), int(saved.storage_offset()),
                      saved.untyped_storage().nbytes() // max(saved.element_size(), 1)):
            raise CorruptData(f"{where}: the saved tensor's view ({size}, stride "
                              f"{tuple(saved.stride())}, offset {saved.storage_offset()}) is "
                              "not its storage's every element once, as DCP saves it")
        try:
            piece = _narrow(saved, self.storage_offsets, self.lengths)
        except (RuntimeError, IndexError, ValueError, TypeError):
            raise CorruptData(f"{where}: the saved tensor of {tuple(saved.size())} has no "
                              f"piece of {list(self.lengths)} at {list(self.storage_offsets)}"
                              ) from None
        target = self.target()
        if target.size() != piece.size():
            raise CorruptData(f"{where}: the saved piece is {tuple(piece.size())}, "
                              f"the destination {tuple(target.size())}")
        target.copy_(piece)
        self.done(target)


def _narrow(t: torch.Tensor, offsets: Sequence[int], lengths: Sequence[int]) -> torch.Tensor:
    for dim, (off, n) in enumerate(zip(offsets, lengths, strict=True)):
        if off != 0 or n != t.size(dim):
            t = t.narrow(dim, off, n)
    return t


class TensorSlice:
    """Feed the slice's bytes in order (`feed`), then `finish()` fills every Want."""

    def __init__(self, length: int, wants: list[Want], where: str) -> None:
        self.length, self.wants, self.where = length, wants, where
        self._head = bytearray()  # bytes seen and not yet consumed by the parser
        self._seen = bytearray()  # every byte before routing starts (for the slow way)
        self._slow = False
        self._layout: Layout | None = None
        self._dest: memoryview | None = None  # where the storage's bytes go
        self._temp: torch.Tensor | None = None
        self._direct: torch.Tensor | None = None
        self._left = 0  # bytes of the storage record still to come
        self._zip64_data = False
        self._consumed = 0  # bytes of the slice parsed and dropped from the head
        self._data_at = -1  # where the storage's bytes start in the slice, once known
        self._state = "records"  # records | data | descriptor | trailer | done
        self._got = 0

    # -- feeding -----------------------------------------------------------------------------

    def feed(self, view: memoryview) -> None:
        self._got += len(view)
        if self._slow:
            self._seen += view
            return
        if self._state == "done":
            return
        if self._state == "data":
            view = self._take_data(view)
            if not view:
                return
        if self._dest is None:  # kept until routing starts, for the slow way
            self._seen += view
        self._head += view
        try:
            self._parse()
        except Unusual:
            self._slow = True
            self._head = bytearray()

    def _take_data(self, view: memoryview) -> memoryview:
        n = min(self._left, len(view))
        assert self._dest is not None
        at = len(self._dest) - self._left
        target = self._dest[at : at + n]
        if n and not same_memory(target, view[:n]):  # else decoded in place already
            target[:] = view[:n]
        self._left -= n
        if self._left == 0:
            self._state = "descriptor"
        return view[n:]

    def _parse(self) -> None:
        while self._state in ("records", "descriptor", "trailer"):
            if self._state == "trailer":  # the record after the tensor's: where it must be
                if len(self._head) < 4:
                    return
                if struct.unpack_from("<I", self._head)[0] not in (_LOCAL_SIG, _CENTRAL_SIG):
                    raise CorruptData(f"{self.where}: no zip record follows the tensor's "
                                      "bytes: its record is not where its header puts it")
                self._state = "done"
                return
            if self._state == "descriptor":
                if len(self._head) < 4:
                    return
                if bytes(self._head[:4]) == _DESCRIPTOR:
                    size = 24 if self._zip64_data else 16
                    if len(self._head) < size:
                        return
                    self._check_descriptor(size)
                    del self._head[:size]
                self._state = "trailer" if self._layout is not None else "records"
                continue
            if not self._record():
                return

    def _record(self) -> bool:
        """Parse the next local record from the head; False when more bytes are needed."""
        head = self._head
        if len(head) < 4:
            return False
        sig = struct.unpack_from("<I", head)[0]
        if sig == _CENTRAL_SIG:
            raise Unusual("the central directory came before the tensor's data")
        if sig != _LOCAL_SIG:
            raise Unusual("not a zip local record")
        if len(head) < _LOCAL.size:
            return False
        _, _, flags, method, _, _, _, csize, _, nlen, xlen = _LOCAL.unpack_from(head)
        start = _LOCAL.size + nlen + xlen
        if len(head) < start:
            return False
        if method != 0:
            raise Unusual("a compressed record")
        name = bytes(head[_LOCAL.size : _LOCAL.size + nlen]).decode("utf-8", "replace")
        if "/data/" in name and not name.endswith(".pkl"):
            return self._storage(name, start, flags)
        end = self._small_end(start, flags, csize)
        if end is None:
            return False
        if name.endswith("data.pkl"):
            self._layout = read_layout(bytes(head[start:end]), self.where)
        elif name.endswith("/byteorder") and bytes(head[start:end]) != b"little":
            raise Unusual("a big-endian archive")
        drop = end + self._descriptor_len(flags, end)
        del head[:drop]
        self._consumed += drop
        return True

    def _small_end(self, start: int, flags: int, csize: int) -> int | None:
        head = self._head
        if not flags & 0x08:
            return start + csize if len(head) >= start + csize else None
        at = start
        while True:
            at = head.find(_DESCRIPTOR, at)
            if at < 0:
                if len(head) - start > _SMALL_MAX:
                    raise Unusual("a small record without its end")
                return None
            if len(head) < at + 16:
                return None
            if struct.unpack_from("<I", head, at + 8)[0] == at - start:
                return at
            at += 1

    def _descriptor_len(self, flags: int, end: int) -> int:
        return 16 if flags & 0x08 and bytes(self._head[end : end + 4]) == _DESCRIPTOR else 0

    def _storage(self, name: str, start: int, flags: int) -> bool:
        layout = self._layout
        if layout is None or name.rsplit("/", 1)[-1] != layout.key:
            raise Unusual(f"record {name!r} before data.pkl, or a second storage")
        nbytes = layout.numel * layout.dtype.itemsize
        held = self.length - (self._consumed + start)  # the slice's bytes after the header
        if nbytes > held:  # before any memory of the claimed size is taken
            raise CorruptData(f"{self.where}: data.pkl claims a storage of {nbytes} bytes, "
                              f"the slice holds {max(held, 0)} after its header")
        self._zip64_data = nbytes >= _ZIP64
        self._data_at = self._consumed + start  # set before _dest: `placement` reads both
        self._dest = self._destination(layout, nbytes)
        self._left = nbytes
        rest = memoryview(bytes(self._head[start:]))
        self._head = bytearray()
        self._seen = bytearray()
        self._state = "data" if nbytes else "descriptor"
        rest = self._take_data(rest) if nbytes else rest
        self._head += rest
        return True

    def _check_descriptor(self, size: int) -> None:
        fmt = "<IIQQ" if size == 24 else "<IIII"
        _, _, csize, _ = struct.unpack_from(fmt, self._head)
        assert self._layout is not None
        if csize != self._layout.numel * self._layout.dtype.itemsize:
            raise CorruptData(f"{self.where}: the tensor record holds {csize} bytes, its "
                              "data.pkl says otherwise")

    # -- where the bytes go ------------------------------------------------------------------

    def placement(self, rel: int, n: int) -> memoryview | None:
        """The destination of the slice's bytes [rel, rel+n) when they are all tensor data
        and the destination is known; called on a decoding thread while this slice is fed
        (`_dest` and `_data_at` are set once, `_data_at` first)."""
        dest = self._dest
        data_at = self._data_at
        if dest is None or self._slow or data_at < 0:
            return None
        lo = rel - data_at
        if lo < 0 or lo + n > len(dest):
            return None
        return dest[lo : lo + n]

    def _destination(self, layout: Layout, nbytes: int) -> memoryview:
        if len(self.wants) == 1 and self._fits(layout, self.wants[0]):
            target = self.wants[0].target()
            self._direct = target
            return _bytes_of(target)
        self._temp = torch.empty(nbytes, dtype=torch.uint8)
        return self._temp.numpy().data

    @staticmethod
    def _fits(layout: Layout, want: Want) -> bool:
        """The saved tensor is exactly the destination's bytes: same dtype and shape, both
        contiguous, the whole tensor wanted, the destination in CPU memory."""
        if layout.offset != 0 or tuple(want.lengths) != layout.size:
            return False
        if (want.chunk is not None and want.chunk != layout.size
                or want.dtype is not None and want.dtype != layout.dtype):
            return False
        if any(want.storage_offsets) or layout.numel != _numel(layout.size):
            return False
        if layout.stride != _contiguous(layout.size):
            return False
        target = want.target()
        return (target.device.type == "cpu" and target.dtype == layout.dtype
                and tuple(target.shape) == layout.size and target.is_contiguous())

    # -- the end -----------------------------------------------------------------------------

    def finish(self) -> None:
        if self._got != self.length:
            raise CorruptData(f"{self.where}: the slice gave {self._got} of {self.length} bytes")
        if self._slow:
            self._finish_slow()
            return
        if self._state != "done" or self._layout is None:
            raise CorruptData(f"{self.where}: the slice ended before its tensor's data")
        if self._direct is not None:
            self.wants[0].done(self._direct)
            return
        assert self._temp is not None
        lay = self._layout
        saved = self._temp.view(lay.dtype) if lay.numel else torch.empty(0, dtype=lay.dtype)
        try:
            tensor = saved.as_strided(lay.size, lay.stride, lay.offset)
        except RuntimeError as exc:
            raise CorruptData(f"{self.where}: data.pkl's view does not fit its storage ({exc})"
                              ) from None
        self._fill(tensor)
        self._temp = None

    def _finish_slow(self) -> None:
        data, self._seen = bytes(self._seen), bytearray()
        scan_archive(data, self.where)
        try:
            tensor = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        except Exception as exc:
            raise CorruptData(f"{self.where}: not a tensor archive torch can read ({exc})"
                              ) from None
        if not isinstance(tensor, torch.Tensor):
            raise CorruptData(f"{self.where}: the slice does not hold a tensor")
        self._fill(tensor)

    def _fill(self, tensor: torch.Tensor) -> None:
        for want in self.wants:
            want.fill(tensor, self.where)


def _whole(size: tuple[int, ...], stride: tuple[int, ...], offset: int, numel: int) -> bool:
    """The view is its storage of `numel` elements, each element once (any order of the
    dimensions): what DCP saves, a chunk whose storage is its own."""
    if offset != 0 or len(stride) != len(size) or _numel(size) != numel:
        return False
    expected = 1
    for n, st in sorted(((n, st) for n, st in zip(size, stride, strict=True) if n != 1),
                        key=lambda p: p[1]):
        if st != expected:
            return numel == 0
        expected *= n
    return True


def _numel(size: tuple[int, ...]) -> int:
    n = 1
    for s in size:
        n *= s
    return n


def _contiguous(size: tuple[int, ...]) -> tuple[int, ...]:
    strides, acc = [], 1
    for s in reversed(size):
        strides.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(strides))


def _bytes_of(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, writable in place."""
    flat = t.detach().reshape(-1)
    if flat.numel() == 0:
        return memoryview(bytearray())
    return flat.view(torch.uint8).numpy().data
