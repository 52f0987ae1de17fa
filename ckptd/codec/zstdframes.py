"""Decoding codec `zstd`: concatenated frames, skippable frames, and the seek table checked.

Owns reading frames one at a time (streamed, or one block at random) and raising CorruptData
that names the frame; never holds more than one frame's output, whatever the input declares.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import BinaryIO

import xxhash
import zstandard

from ckptd.codec import frame, seektable
from ckptd.errors import CorruptData

COPY_CHUNK = 1 << 20
ZSTD_HEADER_MAX = 18
# Our zstd frames each hold one block; refusing bigger ones keeps memory bounded on hostile input.
MAX_FRAME_CONTENT = frame.MAX_BLOCK
# Every frame but the last holds the encoder's block size, which is at least this.
MIN_FULL_FRAME = frame.MIN_BLOCK
_BOUND_MARGIN = 128 << 10


def stored_bound(raw: int) -> int:
    """The most stored bytes a zstd frame of `raw` content bytes takes, header and checksum
    included: zstd's own ZSTD_COMPRESSBOUND, which every frame ckptd writes stays within."""
    return raw + (raw >> 8) + ((_BOUND_MARGIN - raw) >> 11 if raw < _BOUND_MARGIN else 0)


def frame_params(data: bytes | memoryview, where: str) -> zstandard.FrameParameters:
    """A frame's header, which must declare a content size of at most MAX_FRAME_CONTENT."""
    try:
        params = zstandard.get_frame_parameters(data)
    except zstandard.ZstdError as err:
        raise CorruptData(f"{where}: bad frame header: {err}") from err
    if params.content_size > MAX_FRAME_CONTENT:
        raise CorruptData(f"{where}: frame content size missing or over {MAX_FRAME_CONTENT}")
    return params


class FrameStream:
    """One pass over a `zstd` object: frames decoded in order, skippable frames skipped, and a
    seek table (ckptd writes one last) checked against the frames it describes."""

    def __init__(self, src: BinaryIO, dst: BinaryIO, cb: Callable[[int], None]) -> None:
        self.src, self.dst, self.cb = src, dst, cb
        self.dctx = zstandard.ZstdDecompressor()
        self.data = b""
        self.eof = False
        self.total = self.frames = self.unchecked = 0
        self.rows = bytearray()  # what a seek table must say: 12 bytes per frame
        self.table_seen = False

    def run(self) -> int:
        while self._fill(ZSTD_HEADER_MAX):
            if self.table_seen:
                raise CorruptData("zstd: data after the seek table")
            skip = seektable.skippable(self.data[: seektable.SKIP_HEADER_SIZE])
            if skip is None:
                self._frame()
            else:
                self._skippable(*skip)
        if self.frames == 0:
            raise CorruptData("zstd: no frame (empty or truncated object)")
        return self.total

    def _fill(self, size: int) -> bool:
        """Buffer at least `size` bytes if the input has them; whether any are buffered."""
        while len(self.data) < size and not self.eof:
            more = self.src.read(COPY_CHUNK)
            self.eof = not more
            self.data += more
        return bool(self.data)

    def _frame(self) -> None:
        where = f"zstd: frame {self.frames} (raw offset {self.total})"
        params = frame_params(self.data, where)
        dobj = self.dctx.decompressobj()
        data, stored, written, last = self.data, 0, 0, b""
        while True:
            try:
                out = dobj.decompress(data)
            except zstandard.ZstdError as err:
                raise CorruptData(f"{where}: {err}") from err
            if out:
                self.dst.write(out)
                self.cb(len(out))
                written += len(out)
            used = len(data) - len(dobj.unused_data) if dobj.eof else len(data)
            stored += used
            last = (last + data[max(0, used - 4) : used])[-4:]
            if dobj.eof:
                self.data = dobj.unused_data
                break
            data = self.src.read(COPY_CHUNK)
            if not data:
                raise CorruptData(f"{where}: truncated")
        if written != params.content_size:
            raise CorruptData(f"{where}: decoded {written} bytes, declared {params.content_size}")
        check = int.from_bytes(last, "little") if params.has_checksum else 0
        self.unchecked += 0 if params.has_checksum else 1
        self.rows += seektable.row(stored, written, check)
        self.frames += 1
        self.total += written

    def _skippable(self, magic: int, size: int) -> None:
        """Skip a skippable frame in bounded memory; a seek table's is checked on the way."""
        self.data = self.data[seektable.SKIP_HEADER_SIZE :]
        digest, last, left = xxhash.xxh64(), b"", size
        while left:
            if not self._fill(1):
                raise CorruptData(f"zstd: skippable frame after frame {self.frames}: truncated")
            piece, self.data = self.data[:left], self.data[left:]
            digest.update(piece)
            last = (last + piece[-seektable.FOOTER_SIZE :])[-seektable.FOOTER_SIZE :]
            left -= len(piece)
        if magic == seektable.TABLE_MAGIC:
            self._check_table(size, digest, last)
            self.table_seen = True

    def _check_table(self, size: int, digest: xxhash.xxh64, footer: bytes) -> None:
        if size < seektable.FOOTER_SIZE:
            raise CorruptData(f"zstd: seek table of {size} bytes")
        frames, checked = seektable.parse_footer(footer)
        if frames != self.frames or size + seektable.SKIP_HEADER_SIZE != seektable.table_size(
            frames, checked
        ):
            raise CorruptData(f"zstd: seek table lists {frames} frames, decoded {self.frames}")
        if checked and self.unchecked:
            raise CorruptData("zstd: seek table has checksums for frames that carry none")
        want = xxhash.xxh64(seektable.strip_checks(self.rows, checked))
        want.update(footer)
        if want.intdigest() != digest.intdigest():
            raise CorruptData("zstd: seek table disagrees with the frames decoded")


class _Local(threading.local):
    def __init__(self) -> None:
        self.dctx = zstandard.ZstdDecompressor()


_local = _Local()


def decode_frame(
    stored: memoryview,
    out: memoryview,
    where: str,
    check: int | None,
) -> None:
    """Exactly one frame with a content size and a checksum, decoded into all of `out`."""
    params = frame_params(stored, where)
    if params.content_size != len(out):
        raise CorruptData(f"{where}: frame declares {params.content_size} bytes, not {len(out)}")
    if not params.has_checksum:
        raise CorruptData(f"{where}: frame carries no checksum")
    if check is not None and int.from_bytes(stored[-4:], "little") != check:
        raise CorruptData(f"{where}: frame checksum disagrees with the seek table")
    dctx = _local.dctx
    try:
        if len(out):
            data = dctx.decompress(stored, max_output_size=len(out), allow_extra_data=False)
        else:  # decompress() returns at once for an empty frame, checking nothing after it
            dobj = dctx.decompressobj()
            data = dobj.decompress(stored)
            if not dobj.eof or dobj.unused_data:
                raise CorruptData(f"{where}: not exactly one frame")
    except zstandard.ZstdError as err:
        raise CorruptData(f"{where}: {err}") from err
    if len(data) != len(out):
        raise CorruptData(f"{where}: decoded {len(data)} bytes, expected {len(out)}")
    out[:] = data
