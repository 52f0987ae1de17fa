"""The async-save door's inputs (`ckptd.arena`): any arena header page, any persist request
(hostile JSON included) and the arena's zip with bytes flipped, cut or replaced and 2^62-byte
sizes in its directory end in a value or ValueError (a bad_arena), in bounded time. Bounded
property tests: a few hundred cases a run (`CKPTD_FUZZ_EXAMPLES` for more)."""

from __future__ import annotations

import io
import json
import mmap
import os
import struct
import zipfile

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from support.fuzzing import (
    REASONS,
    _splice,
    bounded,
    ends_within,
    fuzz,
    hostile_literals,
    json_values,
)

from ckptd import arena, inputs
from ckptd.errors import BadInput, ValidationFailed
from ckptd.formats import zipcrc


@fuzz()
@given(st.binary(min_size=0, max_size=64), st.sampled_from([None, *arena.State]),
       st.integers(0, 2**64 - 1), st.integers(0, 2**64 - 1))
def test_an_arena_header_is_read_or_value_error(raw: bytes, state: arena.State | None,
                                                generation: int, used: int) -> None:
    """Any page the trainer left, of any length: a header within range, or ValueError."""
    buf = bytearray(raw)
    if state is not None and len(buf) >= 32:  # a well-formed magic with any numbers
        buf[:32] = arena.MAGIC + arena.VERSION.to_bytes(4, "little") + int(state).to_bytes(
            4, "little") + generation.to_bytes(8, "little") + used.to_bytes(8, "little")
    try:
        h = arena.read_header(bytes(buf))
    except ValueError:
        return
    assert h.generation < 2**63 and 0 <= h.used <= arena.MAX_ARENA


REQUEST = {"root": "r1", "dir": "/x", "step": 1, "rank": 0, "world_size": 1, "generation": 1,
           "timeout": 30.0, "register": True,
           "files": [{"path": "model.pt", "component": "model", "offset": 4096, "size": 10}],
           "head": {"format": "ckptd-native/1", "step": 1, "world_size": 1,
                    "metrics": {"loss": 0.5}}}


@fuzz(300)
@given(st.lists(st.integers(0, 50), max_size=4), hostile_literals | json_values.map(json.dumps),
       st.integers(0, 2**41))
def test_a_persist_request_is_parsed_or_value_error(path: list[int], literal: str,
                                                    arena_size: int) -> None:
    """The request as the door gets it (the socket's strict JSON first, then the checks)."""
    data = _splice(REQUEST, path, literal)
    with bounded("persist request"):
        try:
            body = inputs.loads(data, "body")
            req = arena.parse_request(body, arena_size)
        except ValueError:  # BadInput from the body's JSON is a CorruptData, not a ValueError
            return
        except BadInput:
            return
    assert all(arena.DATA_OFFSET <= f.offset and f.offset + f.size <= arena_size
               for f in req.files)
    assert 0 <= req.rank < req.world_size <= arena.MAX_WORLD


def _arena_zip() -> bytes:
    """A torch.save archive as the trainer leaves it in the arena (no CRCs yet)."""
    torch.serialization.set_crc32_options(False)
    try:
        buf = io.BytesIO()
        torch.save({"w": torch.arange(64, dtype=torch.float32), "n": 3}, buf)
    finally:
        torch.serialization.set_crc32_options(True)
    return buf.getvalue()


def _zip64_directory(raw: bytes) -> bytes:
    """`raw` with a central directory whose every entry keeps its sizes and offset in a zip64
    extra field (8 bytes each, as for members past 4 GiB): where a 2^62 claim can be written."""
    z = zipfile.ZipFile(io.BytesIO(raw))
    body, cd = raw[: z.start_dir], bytearray()
    for i in z.infolist():
        name = i.filename.encode()
        extra = struct.pack("<HHQQQ", 1, 24, i.file_size, i.compress_size, i.header_offset)
        cd += struct.pack("<4sHHHHHHIIIHHHHHII", b"PK\x01\x02", 0x031E, 45, i.flag_bits,
                          i.compress_type, 0, 0, i.CRC, 0xFFFFFFFF, 0xFFFFFFFF, len(name),
                          len(extra), 0, 0, 0, i.external_attr, 0xFFFFFFFF) + name + extra
    n = len(z.infolist())
    return body + bytes(cd) + struct.pack("<4sHHHHIIH", b"PK\x05\x06", 0, 0, n, n, len(cd),
                                          len(body), 0)


ARENA_ZIPS = {"torch": _arena_zip(), "zip64": _zip64_directory(_arena_zip())}


def _claim(raw: bytearray, where: float, number: int) -> None:
    """Make one directory entry (picked by `where`) claim `number` bytes, both sizes alike (a
    stored member's two sizes must agree): in its zip64 extra if it has one, else capped to
    the 32-bit fields."""
    entries = [i for i in range(len(raw) - 46) if raw[i:i + 4] == b"PK\x01\x02"]
    if not entries:  # (a cut may have taken the directory)
        return
    pos = entries[int(where * len(entries)) % len(entries)]
    n, m = struct.unpack_from("<HH", raw, pos + 28)
    extra = pos + 46 + n
    if m >= 20 and raw[extra:extra + 2] == b"\x01\x00" and extra + 20 <= len(raw):
        struct.pack_into("<QQ", raw, extra + 4, number % 2**64, number % 2**64)
    else:
        small = min(number, 0xFFFFFFFE)
        struct.pack_into("<II", raw, pos + 20, small, small)


_ZIP_TAIL = 900  # an arena zip's directory and end records lie in its last bytes


@fuzz()
@given(st.sampled_from(sorted(ARENA_ZIPS)),
       st.lists(st.tuples(st.sampled_from(["flip", "put", "cut", "number", "claim"]),
                          st.floats(0, 1),
                          st.binary(min_size=1, max_size=8),
                          st.sampled_from([2**62, 2**64 - 1, 2**32 - 1, 2**31, 10**7])),
                min_size=1, max_size=4))
def test_the_arenas_zip_is_filled_in_or_refused(
        sample: str, plan: list[tuple[str, float, bytes, int]]) -> None:
    """The CRC fill the door runs over the trainer's zip: any bytes flipped, replaced or cut,
    or a huge number (a 2^62-byte size, an offset) written into its directory, ends in a member
    count or in ValidationFailed, at once."""
    raw = bytearray(ARENA_ZIPS[sample])
    for kind, where, blob, number in plan:
        at = min(len(raw) - 1, int(where * len(raw)))
        if kind == "flip":
            raw[at] ^= blob[0] or 1
        elif kind == "put":
            raw[at:at + len(blob)] = blob
        elif kind == "number":
            at = max(0, len(raw) - 8 - int(where * min(_ZIP_TAIL, len(raw))))
            width = 8 if number >= 2**32 else 4
            raw[at:at + width] = number.to_bytes(width, "little")
        elif kind == "claim":
            _claim(raw, where, number)
        elif at > 0:
            del raw[at:]
    fd = arena.create_memfd(arena.aligned(arena.DATA_OFFSET + len(raw)))
    os.pwrite(fd, bytes(raw), arena.DATA_OFFSET)
    mm = mmap.mmap(fd, 0)
    view = memoryview(mm)
    got = ends_within(lambda: zipcrc.fill_crcs(view, fd, arena.DATA_OFFSET,
                                               arena.DATA_OFFSET + len(raw), "model.pt"),
                      "fill_crcs")
    view.release()
    mm.close()
    os.close(fd)
    assert isinstance(got, int) or (isinstance(got, ValidationFailed)
                                    and got.reason in REASONS), got


def test_an_arena_header_out_of_range_is_refused() -> None:
    assert arena.read_header(arena.pack_header(arena.State.SEALED, 2**63 - 1, 8192))
    for generation, used in ((2**63, 8192), (1, arena.MAX_ARENA + 1)):
        with pytest.raises(ValueError, match="out of range"):
            arena.read_header(arena.pack_header(arena.State.SEALED, generation, used))
