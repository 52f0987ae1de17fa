"""A replica's bytes: one rank's persisted files, compressed with the root's codec, as one body
a daemon sends to a peer and a replaced node fetches back. The peer stores the body verbatim.

Owns the body's layout, its encoder (streamed from the arena, hashed as it is read) and its
strict, bounded decoder (straight into the caller's memory, hash checked). Does no network or
file I/O of its own and never decides which peer gets what.

The body, every integer a little-endian u32 unless said otherwise:

    L | head JSON (L bytes, at most 1 MiB) | u64 xxh3-64 of the head JSON
    then for each file, in the head's order:
        P | prelude JSON {"codec": c}            (P at most 4 KiB)
        n | n bytes                              (a frame: 1 <= n <= MAX_FRAME), repeated
        0                                        (the file's frames end)
        T | trailer JSON {"codec": c, "stored": s}  (T at most 4 KiB)

A file's frames, concatenated, are its stored object in codec `c` (what `make_encoder`
wrote; `auto` resolved to none, zstd or zstd-bytegroup), named before the first frame so the
decoder streams, and again after with `s`, the stored length. The head JSON holds format
"ckptd-replica/1", root, node, step, rank, world_size, generation, files ([{path, component,
size, hash}], hash the xxh3-128 hex of the raw bytes) and head (the save's meta.json head).
The body ends after the last trailer: `decode_files` reads its stream to the end.
"""

from __future__ import annotations

import io
import json
import re
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, BinaryIO, cast

import xxhash

from ckptd import inputs
from ckptd.arena import MAX_ARENA, MAX_FILES, MAX_STEP, MAX_WORLD, file_component
from ckptd.codec import BLOCK_SIZE, CODECS, decode_stream, make_encoder
from ckptd.errors import BadInput, BadValue, CorruptData, InternalError, Malformed

FORMAT = "ckptd-replica/1"
MAX_HEAD = 1 << 20
MAX_SMALL = 4096  # a file's prelude or trailer
MAX_FRAME = 16 << 20  # the most bytes one frame may hold (the encoder writes <= FRAME_OUT)
FRAME_OUT = 8 << 20
CHUNK = 8 << 20  # raw bytes read, hashed and encoded at a time
MAX_TOTAL = MAX_ARENA  # all files of one replica together: 1 TiB
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}", re.ASCII)
_HASH = re.compile(r"[0-9a-f]{32}", re.ASCII)
_U32 = struct.Struct("<I")
_BIG = 256 << 10  # an output piece this big is sent as it is rather than joined into a frame
_HEAD_KEYS = set("format root node step rank world_size generation files head".split())
_FILE_KEYS = {"path", "component", "size", "hash"}


@dataclass(frozen=True)
class ReplicaFile:
    """One native file of the replica: its bytes hash (xxh3-128 hex) to `hash`."""

    path: str
    component: str
    size: int
    hash: str


@dataclass(frozen=True)
class ReplicaHead:
    """Whose state a replica is (root, node, rank of a save of step `step`, arena generation
    `generation`), its files in body order, and the save's meta.json head."""

    root: str
    node: str
    step: int
    rank: int
    world_size: int
    generation: int
    files: tuple[ReplicaFile, ...]
    head: dict[str, Any]


# -- the head -----------------------------------------------------------------------------------


def head_bytes(h: ReplicaHead) -> bytes:
    """The head's JSON as the body carries it; BadValue if the receiver would refuse it."""
    doc = {"format": FORMAT, "root": h.root, "node": h.node, "step": h.step, "rank": h.rank,
           "world_size": h.world_size, "generation": h.generation,
           "files": [{"path": f.path, "component": f.component, "size": f.size,
                      "hash": f.hash} for f in h.files],
           "head": h.head}
    try:
        data = json.dumps(doc, allow_nan=False, separators=(",", ":")).encode()
    except (TypeError, ValueError, RecursionError) as exc:
        raise BadValue(f"replica head is not JSON: {exc}") from None
    try:
        parse_head(data)
    except CorruptData as exc:
        raise BadValue(str(exc)) from None
    return data


def parse_head(data: bytes) -> ReplicaHead:
    """A replica head from its JSON, every field checked and bounded; Malformed otherwise."""
    if len(data) > MAX_HEAD:
        raise Malformed(f"replica head: {len(data)} bytes, over {MAX_HEAD}")
    try:
        doc = inputs.loads(data, "replica head")
    except BadInput as exc:
        raise Malformed(str(exc)) from None
    if not isinstance(doc, dict) or set(doc) != _HEAD_KEYS:
        raise Malformed(f"replica head: an object with exactly {sorted(_HEAD_KEYS)}")
    if doc["format"] != FORMAT:
        raise Malformed(f"replica head: format {_show(doc['format'])}, not {FORMAT}")
    root, node = _name(doc["root"], "root"), _name(doc["node"], "node")
    try:
        step = inputs.check_int(doc["step"], "replica head: step", 0, MAX_STEP - 1)
        world = inputs.check_int(doc["world_size"], "replica head: world_size", 1, MAX_WORLD)
        rank = inputs.check_int(doc["rank"], "replica head: rank", 0, world - 1)
        generation = inputs.check_int(doc["generation"], "replica head: generation", 1)
    except BadInput as exc:
        raise Malformed(str(exc)) from None
    files = _files(doc["files"], rank)
    head = doc["head"]
    if not isinstance(head, dict) or not isinstance(head.get("format"), str) or not (
            head["format"].startswith("ckptd-native/")):
        raise Malformed("replica head: head must be a meta.json head of format ckptd-native/*")
    if (type(head.get("step")) is not int or head["step"] != step
            or type(head.get("world_size")) is not int or head["world_size"] != world):
        raise Malformed("replica head: head's step and world_size differ from the replica's")
    return ReplicaHead(root, node, step, rank, world, generation, files, head)


def _files(listing: Any, rank: int) -> tuple[ReplicaFile, ...]:
    if not isinstance(listing, list) or not 0 < len(listing) <= MAX_FILES:
        raise Malformed(f"replica head: files must be a list of 1 to {MAX_FILES} entries")
    out: list[ReplicaFile] = []
    total = 0
    for entry in listing:
        if not isinstance(entry, dict) or set(entry) != _FILE_KEYS:
            raise Malformed(f"replica head: each file an object with exactly {sorted(_FILE_KEYS)}")
        path, component = entry["path"], entry["component"]
        if not isinstance(path, str) or file_component(path, rank) is None or (
                component != file_component(path, rank)):
            raise Malformed(f"replica head: {_show(path)} is not a native file of rank {rank}"
                            f" holding {_show(component)}")
        try:
            size = inputs.check_int(entry["size"], f"replica head: {path} size", 0, MAX_TOTAL)
        except BadInput as exc:
            raise Malformed(str(exc)) from None
        total += size
        digest = entry["hash"]
        if not isinstance(digest, str) or not _HASH.fullmatch(digest):
            raise Malformed(f"replica head: {path} hash {_show(digest)} is not xxh3-128 hex")
        out.append(ReplicaFile(path, component, size, digest))
    if total > MAX_TOTAL:
        raise Malformed(f"replica head: {total} bytes of files, over {MAX_TOTAL}")
    if len({f.path for f in out}) != len(out):
        raise Malformed("replica head: a file is named twice")
    return tuple(out)


def _name(value: Any, what: str) -> str:
    if not isinstance(value, str) or not _NAME.fullmatch(value):
        raise Malformed(f"replica head: {what} {_show(value)} is not 1 to 128 of [A-Za-z0-9._-]"
                        " starting with a letter or digit")
    return value


def _show(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


# -- encoding -------------------------------------------------------------------------------------


def encode(h: ReplicaHead, raw: Callable[[ReplicaFile], memoryview], codec: str, level: int,
           min_saving: float) -> Iterator[bytes]:
    """The whole body of `h`, streamed. Each file's bytes come from `raw(f)` (a view of exactly
    f.size bytes), copied CHUNK at a time into a private buffer that is hashed and encoded: a
    file whose hash is not `f.hash` "changed while it was sent" (CorruptData, raised before
    its frames end, so the body is never whole). Memory: the chunk, the encoder's blocks and
    one chunk's output. BadValue for a head the receiver would refuse or a bad codec."""
    data = head_bytes(h)
    make_encoder(codec, io.BytesIO(), level=level, min_saving=min_saving).close()  # the args
    yield _U32.pack(len(data)) + data + xxhash.xxh3_64_intdigest(data).to_bytes(8, "little")
    buf = bytearray(min(CHUNK, max((f.size for f in h.files), default=0)))
    for f in h.files:
        yield from _encode_file(f, raw(f), buf, codec, level, min_saving)


def _encode_file(f: ReplicaFile, source: memoryview, buf: bytearray, codec: str, level: int,
                 min_saving: float) -> Iterator[bytes]:
    view = memoryview(source).cast("B")
    if view.nbytes != f.size:
        raise CorruptData(f"{f.path}: {view.nbytes} bytes to send, {f.size} recorded")
    out = _Out()
    hasher = xxhash.xxh3_128()
    sent: str | None = None  # the codec the prelude named
    own = memoryview(buf)
    # The codec only calls read, readinto or write on its streams: these objects have them.
    with make_encoder(codec, cast(BinaryIO, out), level=level, min_saving=min_saving) as enc:
        for at in range(0, f.size, CHUNK):
            n = min(CHUNK, f.size - at)
            own[:n] = view[at:at + n]  # copied first: what is hashed is what is encoded
            hasher.update(own[:n])
            enc.update(at, own[:n])
            if out.size:
                if sent is None:
                    sent = enc.codec
                    yield _small({"codec": sent})
                yield from out.frames()
        enc.finish(f.size)
    if hasher.hexdigest() != f.hash:
        raise CorruptData(f"{f.path}: changed while it was sent (xxh3-128 "
                          f"{hasher.hexdigest()}, recorded {f.hash})")
    if sent is None:
        sent = enc.codec
        yield _small({"codec": sent})
    elif sent != enc.codec:
        raise InternalError(f"{f.path}: codec {codec} wrote {sent} data, then named {enc.codec}")
    yield from out.frames()
    yield _U32.pack(0) + _small({"codec": sent, "stored": enc.stored_size})


def _small(doc: dict[str, Any]) -> bytes:
    data = json.dumps(doc, separators=(",", ":")).encode()
    return _U32.pack(len(data)) + data


class _Out:
    """An encoder's output, kept as written until `frames` hands it on (bounded by what one
    chunk's update writes)."""

    def __init__(self) -> None:
        self.pieces: list[bytes] = []
        self.size = 0

    def write(self, data: bytes | memoryview) -> int:
        piece = bytes(data)  # a view of a buffer the encoder reuses is copied; bytes are not
        if piece:
            self.pieces.append(piece)
            self.size += len(piece)
        return len(piece)

    def frames(self) -> Iterator[bytes]:
        """What was written, as frames of at most FRAME_OUT bytes; then empty."""
        pieces, self.pieces, self.size = self.pieces, [], 0
        group: list[bytes] = []
        held = 0
        for piece in pieces:
            for at in range(0, len(piece), FRAME_OUT):
                part = piece if len(piece) <= FRAME_OUT else piece[at:at + FRAME_OUT]
                if held + len(part) > FRAME_OUT:
                    yield from _frame(group, held)
                    group, held = [], 0
                group.append(part)
                held += len(part)
        if group:
            yield from _frame(group, held)


def _frame(group: list[bytes], size: int) -> Iterator[bytes]:
    pending = [_U32.pack(size)]
    for piece in group:
        if len(piece) >= _BIG:
            if pending:
                yield b"".join(pending)
            pending = []
            yield piece
        else:
            pending.append(piece)
    if pending:
        yield b"".join(pending)


# -- decoding -----------------------------------------------------------------------------------


def read_head(stream: BinaryIO) -> ReplicaHead:
    """The head at the start of a body read from `stream`; CorruptData (Malformed for a head
    that does not parse) otherwise. Leaves `stream` at the first file."""
    size = _u32(stream, "replica head length")
    if size > MAX_HEAD:
        raise CorruptData(f"replica head: {size} bytes, over {MAX_HEAD}")
    data = _read_exact(stream, size, "replica head")
    check = _read_exact(stream, 8, "replica head checksum")
    if xxhash.xxh3_64_intdigest(data) != int.from_bytes(check, "little"):
        raise CorruptData("replica head: checksum mismatch")
    return parse_head(data)


def decode_files(stream: BinaryIO, h: ReplicaHead,
                 dest: Callable[[ReplicaFile], memoryview], *, threads: int = 1) -> None:
    """After `read_head`: decode each file of `h` into `dest(f)` (a writable view of exactly
    f.size bytes) and check its xxh3-128, then that the stream ends. CorruptData naming the
    file for anything wrong (framing, lengths, codec, hash); BadValue for a bad `dest` view.
    `threads` > 1 decodes a zstd-bytegroup file's blocks on that many threads."""
    for f in h.files:
        _decode_file(stream, f, _target(dest(f), f), threads)
    if stream.read(1):
        raise CorruptData("replica: bytes after the last file")


def _target(view: memoryview, f: ReplicaFile) -> memoryview:
    out = memoryview(view)
    if out.readonly or out.nbytes != f.size or not out.c_contiguous:
        raise BadValue(f"{f.path}: the destination must be a writable view of {f.size} bytes")
    return out.cast("B")


def _decode_file(stream: BinaryIO, f: ReplicaFile, view: memoryview, threads: int) -> None:
    codec = _codec(_small_doc(stream, f, "prelude", {"codec"}), f)
    frames = _Frames(stream, f, stored_bound(codec, f.size))
    into = _Into(view, f)
    try:
        decode_stream(codec, cast(BinaryIO, frames), cast(BinaryIO, into), threads=threads)
        if frames.read(1):
            raise CorruptData("frames left after the stored object's end")
    except CorruptData as exc:
        raise CorruptData(f"{f.path}: {exc}") from None
    if into.pos != f.size:
        raise CorruptData(f"{f.path}: decoded {into.pos} bytes, recorded {f.size}")
    trailer = _small_doc(stream, f, "trailer", {"codec", "stored"})
    if trailer["codec"] != codec or trailer["stored"] != frames.stored:
        raise CorruptData(f"{f.path}: trailer says {_show(trailer['codec'])} of "
                          f"{_show(trailer['stored'])} stored bytes, read {codec} of "
                          f"{frames.stored}")
    if into.hasher.hexdigest() != f.hash:
        raise CorruptData(f"{f.path}: hash mismatch (xxh3-128 {into.hasher.hexdigest()}, "
                          f"recorded {f.hash})")


def stored_bound(codec: str, size: int) -> int:
    """The most stored bytes the encoder writes for `size` raw bytes in `codec` (zstd's and
    the container's per-block bounds, with room to spare); a longer stream is refused."""
    if codec == "none":
        return size
    return size + size // 64 + 4096 * (size // BLOCK_SIZE + 2)


def _codec(doc: dict[str, Any], f: ReplicaFile) -> str:
    codec = doc["codec"]
    if not isinstance(codec, str) or codec not in CODECS or codec == "auto":
        raise CorruptData(f"{f.path}: stored in an unknown codec {_show(codec)}")
    return codec


def _small_doc(stream: BinaryIO, f: ReplicaFile, what: str, keys: set[str]) -> dict[str, Any]:
    size = _u32(stream, f"{f.path}: {what} length")
    if size > MAX_SMALL:
        raise CorruptData(f"{f.path}: {what} of {size} bytes, over {MAX_SMALL}")
    try:
        doc = inputs.loads(_read_exact(stream, size, f"{f.path}: {what}"), f"{f.path}: {what}")
    except BadInput as exc:
        raise CorruptData(str(exc)) from None
    if not isinstance(doc, dict) or set(doc) != keys:
        raise CorruptData(f"{f.path}: {what} is not an object with exactly {sorted(keys)}")
    return doc


def _u32(stream: BinaryIO, what: str) -> int:
    return int.from_bytes(_read_exact(stream, 4, what), "little")


def _read_exact(stream: BinaryIO, size: int, what: str) -> bytes:
    parts: list[bytes] = []
    got = 0
    while got < size:
        more = stream.read(size - got)
        if not more:
            raise CorruptData(f"{what}: truncated ({got} of {size} bytes)")
        parts.append(more)
        got += len(more)
    return parts[0] if len(parts) == 1 else b"".join(parts)


class _Frames:
    """One file's frames as the stored object's stream (read/readinto; b"" after the end
    mark), each length checked before its bytes are read."""

    def __init__(self, stream: BinaryIO, f: ReplicaFile, bound: int) -> None:
        self.stream, self.path, self.bound = stream, f.path, bound
        self.frame = memoryview(b"")
        self.pos = 0
        self.stored = 0
        self.ended = False

    def _next(self) -> bool:
        if self.ended:
            return False
        n = _u32(self.stream, f"frame {self.stored} length")
        if n == 0:
            self.ended = True
            return False
        if n > MAX_FRAME:
            raise CorruptData(f"a frame of {n} bytes, over {MAX_FRAME}")
        if self.stored + n > self.bound:
            raise CorruptData(f"over {self.bound} stored bytes, more than its codec writes")
        self.frame = memoryview(_read_exact(self.stream, n, f"frame at {self.stored}"))
        self.pos = 0
        self.stored += n
        return True

    def _ready(self) -> bool:
        while self.pos == len(self.frame):
            if not self._next():
                return False
        return True

    def read(self, size: int = -1) -> bytes:
        if not self._ready():
            return b""
        left = len(self.frame) - self.pos
        take = left if size < 0 else min(size, left)
        piece = self.frame[self.pos:self.pos + take]
        self.pos += take
        if take == len(self.frame):
            return bytes(self.frame.obj)  # the frame's own bytes: no copy
        return piece.tobytes()

    def readinto(self, buf: memoryview) -> int:
        if not self._ready():
            return 0
        out = memoryview(buf).cast("B")
        take = min(len(out), len(self.frame) - self.pos)
        out[:take] = self.frame[self.pos:self.pos + take]
        self.pos += take
        return take


class _Into:
    """The decoder's `dst`: writes into the file's view, hashing, never past its end."""

    def __init__(self, view: memoryview, f: ReplicaFile) -> None:
        self.view, self.path = view, f.path
        self.pos = 0
        self.hasher = xxhash.xxh3_128()

    def write(self, data: bytes | memoryview) -> int:
        piece = memoryview(data).cast("B")
        end = self.pos + piece.nbytes
        if end > len(self.view):
            raise CorruptData(f"decodes to more than its {len(self.view)} bytes")
        self.view[self.pos:end] = piece
        self.hasher.update(piece)
        self.pos = end
        return piece.nbytes
