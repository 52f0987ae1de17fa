"""What a DCP data file's bytes become: the router hands each piece, in file order, to the
slice it belongs to, and each slice's sink fills its destinations (a tensor slice, parsed as it
streams; a bytes item; a slice saved through DCP's stream transforms, undone). Never fetches a
byte (the reader's `RemoteStep` does) and never decides which items to read.
"""

from __future__ import annotations

import bisect
import io
import math
import threading
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

from ckptd.dcp.slices import TensorSlice, Want
from ckptd.dcp.tensorpkl import scan_archive
from ckptd.errors import Cancelled, CorruptData

if TYPE_CHECKING:
    from ckptd.fetch.objects import Ranges

Chunk = tuple[tuple[int, ...], torch.dtype]  # a saved chunk's size and element type


def sink_for(reqs: list[ReadItem], length: int, planner: Any, where: str,
             chunks: dict[MetadataIndex, Chunk], transforms: tuple[str, ...]
             ) -> TensorSlice | _Bytes:
    """The sink of one slice's bytes: undone by DCP's stream transforms when it was saved
    through them, else handed to the planner as bytes, else parsed into its tensors."""
    if transforms:
        return _Transformed(length, reqs, planner, transforms, where, chunks)
    return _slice(reqs, length, planner, where, chunks)


class _Bytes:
    """A BYTE_IO item's slice, collected and handed to the planner."""

    def __init__(self, length: int, reqs: list[ReadItem], planner: Any, where: str) -> None:
        self.buf = bytearray()
        self.length, self.reqs, self.planner, self.where = length, reqs, planner, where

    def feed(self, view: memoryview) -> None:
        self.buf += view

    def finish(self) -> None:
        if len(self.buf) != self.length:
            raise CorruptData(f"{self.where}: a bytes item got {len(self.buf)} of {self.length} "
                              "bytes")
        for req in self.reqs:
            self.planner.load_bytes(req, io.BytesIO(self.buf))


def _slice(reqs: list[ReadItem], length: int, planner: Any, where: str,
           chunks: dict[MetadataIndex, Chunk]) -> TensorSlice | _Bytes:
    if all(r.type == LoadItemType.BYTE_IO for r in reqs):
        return _Bytes(length, reqs, planner, where)
    wants = [Want(r.storage_offsets, r.lengths, _resolver(planner, r), _committer(planner, r),
                  *chunks.get(r.storage_index, (None, None))) for r in reqs]
    return TensorSlice(length, wants, where)


class _Transformed(_Bytes):
    """A slice saved through DCP's stream transforms (its extensions, e.g. compression):
    collected, undone by DCP's own transforms, then read as its FileSystemReader reads it
    (`torch.load(weights_only=True)`; the slice is the size of one saved item)."""

    def __init__(self, length: int, reqs: list[ReadItem], planner: Any,
                 descriptors: tuple[str, ...], where: str,
                 chunks: dict[MetadataIndex, Chunk]) -> None:
        super().__init__(length, reqs, planner, where)
        self.descriptors, self.chunks = descriptors, chunks

    def finish(self) -> None:
        from torch.distributed.checkpoint.filesystem import _StorageReaderTransforms

        if len(self.buf) != self.length:
            raise CorruptData(f"{self.where}: got {len(self.buf)} of {self.length} bytes")
        for req in self.reqs:
            try:
                stream = _StorageReaderTransforms().transform_load_stream(
                    req, self.descriptors, io.BytesIO(self.buf))
                chunk = self.chunks.get(req.storage_index)
                raw = _read_upto(stream, None if req.type == LoadItemType.BYTE_IO or chunk is None
                                 else math.prod(chunk[0]) * chunk[1].itemsize + _ARCHIVE_SLACK)
                if raw is None:
                    raise CorruptData(f"{self.where}: undoing DCP transforms "
                                      f"{list(self.descriptors)} gives more than {chunk} holds")
                if req.type == LoadItemType.BYTE_IO:
                    self.planner.load_bytes(req, io.BytesIO(raw))
                    continue
                scan_archive(raw, self.where)
                tensor = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
            except CorruptData:
                raise
            except Exception as exc:
                raise CorruptData(f"{self.where}: DCP transforms {list(self.descriptors)} "
                                  f"could not be undone ({type(exc).__name__}: {exc})") from None
            Want(req.storage_offsets, req.lengths, _resolver(self.planner, req),
                 _committer(self.planner, req), *self.chunks.get(req.storage_index, (None, None))
                 ).fill(tensor, self.where)


# What a tensor's torch.save archive holds beside the tensor's bytes (data.pkl, byteorder,
# version, the directory): a transformed slice that undoes to more is refused unread.
_ARCHIVE_SLACK = 4 << 20


def _read_upto(stream: Any, limit: int | None) -> bytes | None:
    """All of `stream`, or None as soon as it gives more than `limit` bytes."""
    if limit is None:
        return bytes(stream.read())
    out = bytearray()
    while piece := stream.read(min(1 << 20, limit + 1 - len(out))):
        out += piece
        if len(out) > limit:
            return None
    return bytes(out)


def _resolver(planner: Any, req: ReadItem) -> Any:
    return lambda: planner.resolve_tensor(req).detach()


def _committer(planner: Any, req: ReadItem) -> Any:
    return lambda t: planner.commit_tensor(req, t)


class Router:
    """Pieces of a file in raw order, handed to the slice each belongs to."""

    def __init__(self, where: str, stop: threading.Event) -> None:
        self.where, self.stop = where, stop
        self.offsets: list[int] = []
        self.finished: list[bool] = []
        self.slices: list[tuple[int, int, TensorSlice | _Bytes]] = []
        self.at = 0

    def add(self, offset: int, length: int, sink: TensorSlice | _Bytes) -> None:
        if self.slices and offset < self.slices[-1][0] + self.slices[-1][1]:
            raise CorruptData(f"{self.where}: DCP metadata has overlapping slices at {offset}")
        self.slices.append((offset, length, sink))
        self.offsets.append(offset)
        self.finished.append(False)

    def ranges(self) -> Ranges:
        return [(o, o + n) for o, n, _ in self.slices if n > 0]

    def feed(self, at: int, view: memoryview) -> None:
        if self.stop.is_set():
            raise Cancelled(f"{self.where}: another file of the load failed")
        slices = self.slices
        while view:
            while self.at < len(slices) and slices[self.at][0] + slices[self.at][1] <= at:
                self.at += 1
            offset, length, sink = slices[self.at]
            if at < offset:  # a gap between slices: not wanted
                skip = min(len(view), offset - at)
                view, at = view[skip:], at + skip
                continue
            n = min(len(view), offset + length - at)
            sink.feed(view[:n])
            view, at = view[n:], at + n
            if at == offset + length:  # whole: its buffer goes now, not with the file's end
                self._finish(self.at)

    def place(self, start: int, n: int) -> memoryview | None:
        """The destination memory of raw bytes [start, start+n) when one slice's tensor data
        holds them all and its destination is known (called on decoding threads)."""
        i = bisect.bisect_right(self.offsets, start) - 1
        if i < 0:
            return None
        offset, length, sink = self.slices[i]
        if start + n > offset + length or not isinstance(sink, TensorSlice):
            return None
        return sink.placement(start - offset, n)

    def _finish(self, i: int) -> None:
        if not self.finished[i]:
            self.finished[i] = True
            self.slices[i][2].finish()

    def finish(self) -> None:
        for i in range(len(self.slices)):
            self._finish(i)
