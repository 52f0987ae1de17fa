"""`ckptd.open`: one original file of a committed remote step as a read-only, seekable binary
file, for loaders that want a file object (safetensors, a framework's own reader). Blocks are
fetched by ranges with read-ahead, each checked as it is decoded; a read from the first byte to
the last is also checked against the manifest hash. Holds a few blocks; writes nothing.
"""

from __future__ import annotations

import io
import os
import queue
import threading
from collections import OrderedDict
from concurrent.futures import Future
from typing import Any

from ckptd.codec.index import Block, BlockIndex
from ckptd.errors import CorruptData
from ckptd.fetch.objects import ObjectReader
from ckptd.fetch.step import RemoteStep, StepArg
from ckptd.fileio import HashSink

READ_AHEAD = 4  # blocks fetched ahead of a sequential reader
_CACHED = READ_AHEAD + 2


class RemoteFile(io.RawIOBase):
    """See the module docstring. `step` is the step opened; `name` the file's path in it."""

    def __init__(self, step: RemoteStep, path: str, own_step: bool = False) -> None:
        super().__init__()
        self.step, self.name = step, path
        self._own = own_step
        self._reader: ObjectReader = step.reader(path)
        # The first look (NotFound, CorruptData) before the size is believed or read by.
        self.size = self._reader.check()
        self._pos = 0
        self._hashed = 0  # bytes hashed in order from the start
        self._hasher: HashSink | None = HashSink()
        self._index: BlockIndex | None = self._reader.index() if self.size else None
        self._blocks: OrderedDict[int, Future[tuple[Block, Any]]] = OrderedDict()
        self._stream: _Stream | None = None
        self.error: BaseException | None = None  # the first read error, for the caller

    # -- io.RawIOBase ------------------------------------------------------------------------

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self._pos, os.SEEK_END: self.size}[whence]
        if base + offset < 0:
            raise OSError(f"seek to {base + offset} before the start of {self.name}")
        self._pos = base + offset
        return self._pos

    def readinto(self, buf: Any) -> int:
        out = memoryview(buf).cast("B")
        if self._pos >= self.size or not len(out):
            return 0
        n = min(len(out), self.size - self._pos)
        try:
            if self._index is None:
                got = self._stream_read(self._pos, out[:n])
            else:
                got = self._block_read(self._index, self._pos, out[:n])
            self._account(self._pos, out[:got])
        except BaseException as exc:
            # Kept: a caller's reader (torch's zip reader) may swallow it and fail otherwise.
            self.error = self.error or exc
            raise
        self._pos += got
        return got

    def close(self) -> None:
        if not self.closed:
            for fut in self._blocks.values():
                fut.cancel()
            self._blocks.clear()
            if self._stream is not None:
                self._stream.stop()
            if self._own:
                self.step.close()
        super().close()

    # -- indexed objects ---------------------------------------------------------------------

    def _block_read(self, index: BlockIndex, pos: int, out: memoryview) -> int:
        (block,) = index.covering(pos, pos + 1)
        self._ahead(index, block.index)
        _b, data = self._blocks[block.index].result()
        lo = pos - block.raw_start
        n = min(len(out), block.raw_len - lo)
        out[:n] = memoryview(data)[lo : lo + n]
        return n

    def _ahead(self, index: BlockIndex, first: int) -> None:
        last = min(first + READ_AHEAD, len(index.blocks) - 1)
        for i in range(first, last + 1):
            if i not in self._blocks:
                self._blocks[i] = self._reader.pool.submit(
                    self._reader._fetch_block, index.blocks[i], index)
            self._blocks.move_to_end(i)
        while len(self._blocks) > _CACHED:
            _i, fut = self._blocks.popitem(last=False)
            fut.cancel()

    # -- objects read as one stream (codec none, or written before block indexes) ------------

    def _stream_read(self, pos: int, out: memoryview) -> int:
        if self._stream is None or pos < self._stream.pos:
            if self._stream is not None:
                self._stream.stop()
            self._stream = _Stream(self._reader)
        return self._stream.read_at(pos, out)

    # -- the whole-file check ----------------------------------------------------------------

    def _account(self, pos: int, data: memoryview) -> None:
        if self._hasher is None or pos > self._hashed or pos + len(data) <= self._hashed:
            return
        fresh = data[self._hashed - pos :]
        self._hasher.update(self._hashed, fresh)
        self._hashed += len(fresh)
        if self._hashed == self.size:
            hasher, self._hasher = self._hasher, None
            hasher.finish(self.size)
            if hasher.digest != self._reader.f.hash:
                raise CorruptData(f"{self._reader.where}: content hash mismatch (read "
                                  f"{hasher.digest}, the manifest says {self._reader.f.hash})")


class _Stream:
    """The object decoded front to back on a thread, its bytes handed over in order through a
    small queue; reads ask for positions at or after the last one."""

    def __init__(self, reader: ObjectReader) -> None:
        self.pos = 0
        self._q: queue.Queue[tuple[int, bytes] | BaseException | None] = queue.Queue(8)
        self._pending = b""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(reader,), daemon=True,
                                        name="ckptd-open-stream")
        self._thread.start()

    def _run(self, reader: ObjectReader) -> None:
        def sink(at: int, view: memoryview) -> None:
            if self._stop.is_set():
                raise _Stopped()
            self._put((at, bytes(view)))

        try:
            reader._stream([(0, reader.f.size)], sink)
            self._put(None)
        except _Stopped:
            pass
        except BaseException as exc:
            self._put(exc)

    def _put(self, item: tuple[int, bytes] | BaseException | None) -> None:
        while not self._stop.is_set():
            try:
                self._q.put(item, timeout=0.1)
                return
            except queue.Full:
                continue
        raise _Stopped()

    def read_at(self, pos: int, out: memoryview) -> int:
        while True:
            if self._pending and self.pos <= pos < self.pos + len(self._pending):
                lo = pos - self.pos
                n = min(len(out), len(self._pending) - lo)
                out[:n] = self._pending[lo : lo + n]
                return n
            if self._pending:
                self.pos += len(self._pending)
                self._pending = b""
            item = self._q.get()
            if item is None:
                return 0
            if isinstance(item, BaseException):
                raise item
            self.pos, self._pending = item

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


class _Stopped(Exception):
    """The reader went away: the stream thread unwinds out of the decoder."""


def open_remote(root: str, step: StepArg, path: str, *, config: Any = None,
                remote: str | None = None) -> io.BufferedReader:
    """`ckptd.open`: see the module docstring."""
    opened = RemoteStep.open(root, step, config=config, remote=remote)
    try:
        raw = RemoteFile(opened, path, own_step=True)
    except BaseException:
        opened.close()
        raise
    return io.BufferedReader(raw, buffer_size=1 << 20)

