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
    seek table (ckptd writes one last) checked against the frames it describes.

    Only frame lists ckptd's encoder writes are read: every frame but the last holds as many
    raw bytes as the first (the block size, at least MIN_FULL_FRAME), the last 1 to that many
    (an empty frame only alone), each in at most `stored_bound` of its content bytes; at most
    one skippable frame more than the frames before it. So the work is bounded by the bytes
    written, and input is consumed through an offset into the buffered chunk, never by copying
    what is left of it, so many small frames cost no more than few large ones."""

    def __init__(self, src: BinaryIO, dst: BinaryIO, cb: Callable[[int], None]) -> None:
        self.src, self.dst, self.cb = src, dst, cb
        self.dctx = zstandard.ZstdDecompressor()
        self.buf, self.pos = b"", 0  # the input read and not yet consumed: buf[pos:]
        self.eof = False
        self.total = self.frames = self.unchecked = self.skipped = 0
        self.first = 0  # raw bytes of the first frame: the block size, if more frames follow
        self.ended = False  # a frame that must be the last one was decoded
        self.rows = bytearray()  # what a seek table must say: 12 bytes per frame
        self.table_seen = False

    def run(self) -> int:
        while self._fill(ZSTD_HEADER_MAX):
            if self.table_seen:
                raise CorruptData("zstd: data after the seek table")
            skip = seektable.skippable(self._view(seektable.SKIP_HEADER_SIZE))
            if skip is None:
                self._frame()
            else:
                self._skippable(*skip)
        if self.frames == 0:
            raise CorruptData("zstd: no frame (empty or truncated object)")
        return self.total

    def _fill(self, size: int) -> bool:
        """Buffer at least `size` bytes if the input has them; whether any are buffered. Only
        called with less than `size` left, so what is kept is a few bytes, not a chunk."""
        while len(self.buf) - self.pos < size and not self.eof:
            more = self.src.read(COPY_CHUNK)
            self.eof = not more
            self.buf, self.pos = self.buf[self.pos :] + more, 0
        return len(self.buf) > self.pos

    def _view(self, most: int) -> memoryview:
        """Up to `most` buffered bytes, not consumed."""
        return memoryview(self.buf)[self.pos : self.pos + most]

    def _frame(self) -> None:
        where = f"zstd: frame {self.frames} (raw offset {self.total})"
        params = frame_params(self._view(ZSTD_HEADER_MAX), where)
        self._check_content(params.content_size, where)
        room = stored_bound(params.content_size)  # no frame ckptd writes is longer
        dobj = self.dctx.decompressobj()
        stored, written, last = 0, 0, b""
        while True:
            if stored == room:
                raise CorruptData(f"{where}: over {room} stored bytes for its content")
            if not self._fill(1):
                raise CorruptData(f"{where}: truncated")
            data = self._view(room - stored)
            try:
                out = dobj.decompress(data)
            except zstandard.ZstdError as err:
                raise CorruptData(f"{where}: {err}") from err
            if out:
                self.dst.write(out)
                self.cb(len(out))
                written += len(out)
            used = len(data) - len(dobj.unused_data) if dobj.eof else len(data)
            self.pos += used
            stored += used
            last = (last + bytes(data[max(0, used - 4) : used]))[-4:]
            if dobj.eof:
                break
        if written != params.content_size:
            raise CorruptData(f"{where}: decoded {written} bytes, declared {params.content_size}")
        check = int.from_bytes(last, "little") if params.has_checksum else 0
        self.unchecked += 0 if params.has_checksum else 1
        self.rows += seektable.row(stored, written, check)
        self.frames += 1
        self.total += written

    def _check_content(self, size: int, where: str) -> None:
        """A frame of `size` raw bytes where the encoder could have written it."""
        if self.frames == 0:
            self.first = size
            self.ended = size < MIN_FULL_FRAME  # smaller than any block size: the only frame
        elif self.ended:
            raise CorruptData(f"{where}: a frame of {size} bytes after the last frame")
        elif not 0 < size <= self.first:
            raise CorruptData(f"{where}: a frame of {size} bytes after frames of {self.first}")
        else:
            self.ended = size < self.first

    def _skippable(self, magic: int, size: int) -> None:
        """Skip a skippable frame in bounded memory; a seek table's is checked on the way."""
        self.skipped += 1
        if self.skipped > self.frames + 1:
            raise CorruptData(
                f"zstd: skippable frame {self.skipped} after {self.frames} frames: more than "
                "one besides the frames"
            )
        self.pos += seektable.SKIP_HEADER_SIZE
        digest, last, left = xxhash.xxh64(), b"", size
        while left:
            if not self._fill(1):
                raise CorruptData(f"zstd: skippable frame after frame {self.frames}: truncated")
            piece = self._view(left)
            self.pos += len(piece)
            digest.update(piece)
            last = (last + bytes(piece[-seektable.FOOTER_SIZE :]))[-seektable.FOOTER_SIZE :]
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
