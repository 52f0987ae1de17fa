"""Bounded property tests of the doors that read what ckptd does not write itself: the bounded
reader (`ckptd.inputs`, every kind: regular files, FIFOs, links, directories, devices, sizes
around each cap; strict JSON from any bytes and from hostile JSON), the remote manifest and
part parsers given hostile JSON, the async-save door (the arena header, the persist request
and the zip whose CRCs the daemon fills in) and the layouts' meta readers (ranked
`meta_<N>.json`, native `meta.json`) through layout detection. Each ends in a value or in the
error its module documents, never another exception, in bounded time. A few hundred cases a
run (`CKPTD_FUZZ_EXAMPLES` for more)."""

from __future__ import annotations

import io
import json
import math
import mmap
import os
import stat
import struct
import tempfile
import threading
import time
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptd import arena, inputs, layouts
from ckptd.cluster import commit as cc
from ckptd.errors import BadInput, BadPart, CorruptData, ValidationFailed
from ckptd.formats import zipcrc
from ckptd.model import Candidate, FileInfo, Reason, RootOptions, Snapshot
from ckptd.remote.manifest import Manifest, StoredFile, parse_manifest
from ckptd.watch.scanner import RootScanner

EXAMPLES = int(os.environ.get("CKPTD_FUZZ_EXAMPLES", "200"))
BOUND_S = 5.0  # any one parse, on the shared CI cores
REASONS = {r.value for r in Reason} | {""}
KINDS = sorted((v for v in vars(inputs).values() if isinstance(v, inputs.Kind)),
               key=lambda k: k.name)


def fuzz(n: int = EXAMPLES) -> Callable[[Any], Any]:
    return settings(max_examples=n, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow,
                                           HealthCheck.function_scoped_fixture])


@contextmanager
def bounded(what: str) -> Iterator[None]:
    started = time.monotonic()
    yield
    took = time.monotonic() - started
    assert took < BOUND_S, f"{what} took {took:.1f} s"


def ends_within(fn: Callable[[], Any], what: str) -> Any:
    """`fn()`'s result or the exception it raised, failing if it has not ended in BOUND_S (a
    spin is left to a daemon thread instead of hanging the suite)."""
    out: list[Any] = []

    def run() -> None:
        try:
            out.append(fn())
        except Exception as exc:  # noqa: BLE001 - handed to the test
            out.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(BOUND_S)
    assert out, f"{what} still running after {BOUND_S} s"
    return out[0]


# -- hostile JSON ------------------------------------------------------------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner,
                                                                 max_size=4),
    max_leaves=12)

# Literal JSON text that a lenient parser takes and a strict one must refuse (or bound).
hostile_literals = st.sampled_from([
    "NaN", "-Infinity", "Infinity", "1e999", "-1e999", "9" * 400, "-" + "9" * 4000,
    "1" + "0" * 19, str(2**63), str(-(2**63)), str(2**63 - 1), "0." + "1" * 100,
    "1" * 5000 + ".5", "[" * 100 + "]" * 100, "[" * 100_000, '{"a":' * 70 + "1" + "}" * 70,
    '{"a": 1, "a": 2}', '"\\ud800"', '"' + "x" * 10_000 + '"', "[1,]", "{}", "[]",
    "true", "null", "-0", "1E400", "0e-400",
])


def _splice(source: Any, path: list[int], literal: str) -> bytes:
    """`source` serialised with the node reached by `path` replaced by `literal` (raw text)."""
    marker = "\x00SPLICE\x00"
    doc = _replace(source, path, marker)
    return json.dumps(doc).replace(json.dumps(marker), literal).encode()


def _replace(doc: Any, path: list[int], value: Any) -> Any:
    if not path or not isinstance(doc, dict | list) or not doc:
        return value
    keys = list(doc) if isinstance(doc, dict) else list(range(len(doc)))
    key = keys[path[0] % len(keys)]
    out = dict(doc) if isinstance(doc, dict) else list(doc)
    out[key] = _replace(doc[key], path[1:], value)  # type: ignore[index]
    return out


def _depth(doc: Any) -> int:
    if isinstance(doc, dict):
        return 1 + max((_depth(v) for v in doc.values()), default=0)
    if isinstance(doc, list):
        return 1 + max((_depth(v) for v in doc), default=0)
    return 1


def _strict(doc: Any) -> None:
    """What `loads` promises of every document it returns."""
    todo = [doc]
    while todo:
        node = todo.pop()
        if isinstance(node, bool) or node is None or isinstance(node, str):
            continue
        if isinstance(node, int):
            assert -inputs.INT_LIMIT < node < inputs.INT_LIMIT
        elif isinstance(node, float):
            assert math.isfinite(node)
        elif isinstance(node, dict):
            todo.extend(node.values())
        else:
            assert isinstance(node, list)
            todo.extend(node)
    assert _depth(doc) <= inputs.MAX_DEPTH


# -- the bounded reader: loads -----------------------------------------------------------------


@fuzz()
@given(st.binary(max_size=300) | st.text(max_size=300).map(str.encode))
def test_loads_of_any_bytes_is_strict_json_or_bad_input(data: bytes) -> None:
    with bounded("loads"):
        try:
            doc = inputs.loads(data, "item")
        except BadInput as exc:
            assert "item" in str(exc)
            return
    _strict(doc)


@fuzz()
@given(json_values, st.lists(st.integers(0, 50), max_size=5), hostile_literals)
def test_loads_of_hostile_json_is_strict_json_or_bad_input(doc: Any, path: list[int],
                                                           literal: str) -> None:
    data = _splice(doc, path, literal)
    with bounded("loads"):
        try:
            got = inputs.loads(data, "item")
        except BadInput as exc:
            assert "item" in str(exc)
            return
    _strict(got)


@pytest.mark.parametrize("text", [
    "NaN", "[Infinity]", '{"x": -Infinity}', "1e999", "9" * 400, "[" * 1_000_000,
    '{"a": 1, "a": 1}', "[" * (inputs.MAX_DEPTH + 1) + "]" * (inputs.MAX_DEPTH + 1),
    "1" * 100_000, "0." + "1" * 100_000, b"\xff\xfe{}".decode("latin-1"),
])
def test_loads_refuses_what_strict_json_is_not(text: str) -> None:
    with bounded("loads"), pytest.raises(BadInput, match="item"):
        inputs.loads(text.encode("latin-1"), "item")


@fuzz()
@given(st.one_of(st.integers(), st.floats(), st.booleans(), st.none(), st.text(max_size=5),
                 st.integers(min_value=10**300, max_value=10**400)),
       st.integers(-10, 10), st.integers(-10, 10))
def test_check_int_and_float_are_a_value_or_bad_input(value: Any, lo: int, hi: int) -> None:
    try:
        got = inputs.check_int(value, "n", lo, hi)
        assert lo <= got <= hi and type(got) is int
    except BadInput:
        pass
    try:
        f = inputs.check_float(value, "x", lo, hi)
        assert math.isfinite(f) and lo <= f <= hi
    except BadInput:
        pass


# -- the bounded reader: read_file over every kind of file --------------------------------------


def _make(where: Path, shape: str, size: int) -> Path:
    """A file of `shape` at `where`: a regular file of `size` bytes (sparse: cheap at any
    size), a FIFO with no writer, a link to a regular file or to nothing, a directory."""
    target = where.parent / (where.name + ".target")
    if shape == "regular":
        with open(where, "wb") as f:
            f.truncate(size)
            f.write(b"{}"[: min(size, 2)])
    elif shape == "fifo":
        os.mkfifo(where)
    elif shape == "link":
        target.write_bytes(b"{}")
        where.symlink_to(target)
    elif shape == "dangling":
        where.symlink_to(target)
    elif shape == "dir":
        where.mkdir()
    elif shape == "dev_link":
        where.symlink_to("/dev/zero")
    return where


@fuzz(150)
@given(st.sampled_from(KINDS), st.sampled_from(["regular", "fifo", "link", "dangling", "dir",
                                                "dev_link"]),
       st.sampled_from([-1, 0, 1]), st.integers(0, 64), st.booleans())
def test_read_file_is_bytes_within_the_cap_or_bad_input(kind: inputs.Kind, shape: str,
                                                        near: int, small: int,
                                                        at_cap: bool) -> None:
    size = kind.cap + near if at_cap else small
    with tempfile.TemporaryDirectory() as tmp:
        path = _make(Path(tmp) / "item", shape, size)
        dir_fd = os.open(tmp, os.O_RDONLY | os.O_DIRECTORY)
        try:
            for how in ("path", "dir_fd"):
                with bounded(f"read_file of a {shape}"):
                    try:
                        data = (inputs.read_file(path, kind) if how == "path"
                                else inputs.read_file("item", kind, dir_fd=dir_fd))
                    except BadInput as exc:
                        assert shape != "regular" or size > kind.cap, exc
                        assert kind.name in str(exc) and "item" in str(exc)
                        continue
                assert shape == "regular" and size <= kind.cap
                assert len(data) == size
        finally:
            os.close(dir_fd)


def test_read_file_of_a_device_and_a_missing_file() -> None:
    with pytest.raises(BadInput, match="not a regular file"):
        inputs.read_file("/dev/zero", inputs.LATEST)
    with pytest.raises(FileNotFoundError):
        inputs.read_file("/nonexistent/ckptd/item", inputs.LATEST)


def test_read_fd_stops_at_the_cap_whatever_the_file_grows_to(tmp_path: Path) -> None:
    """A regular file that grows past the cap between fstat and read is refused after reading
    at most cap + 1 bytes (a memfd, as the async-save door hands over, is one too)."""
    fd = os.memfd_create("item")
    try:
        os.write(fd, b"x" * (inputs.LATEST.cap + 5000))
        with pytest.raises(BadInput, match="cap"):
            inputs.read_fd(fd, inputs.LATEST, "item")
        os.ftruncate(fd, 10)
        assert inputs.read_fd(fd, inputs.LATEST, "item") == b"x" * 10
    finally:
        os.close(fd)


# -- the remote documents: manifest and part ----------------------------------------------------

MANIFEST = Manifest("r1", 7, "single", (
    StoredFile("model.pt", 10, "ab", "xxh3-128", "zstd", 8, "model.pt.zst"),
    StoredFile("sub/opt.pt", 20, "cd", "xxh3-128", "none", 20, "sub/opt.pt")),
    created="2026-01-01T00:00:00Z", metrics={"loss": 0.5},
    nodes=(("n1", "100-abc", "model.pt"),))
PART = cc.Part("n1", "100-abc", "single", (
    cc.PartFile("model.pt", 10, 100.5, "ab", "xxh3-128", "zstd", 8, "n1.100-abc/model.pt.zst"),),
    cc.CommitRecord("model.pt", 100.5, {"model.pt": 10}))


@fuzz(300)
@given(st.sampled_from(["manifest", "part"]), st.lists(st.integers(0, 50), max_size=5),
       hostile_literals | json_values.map(json.dumps))
def test_manifest_and_part_with_hostile_json_are_parsed_or_refused(which: str, path: list[int],
                                                                   literal: str) -> None:
    """The manifest parser raises CorruptData (BadInput is one), the part parser BadPart (a
    ValueError), for JSON a lenient parser would take: NaN, 400-digit numbers, duplicate keys,
    deep nesting, anywhere in an otherwise good document."""
    source = MANIFEST.as_json() if which == "manifest" else PART.as_json()
    data = _splice(source, path, literal)
    with bounded(which):
        if which == "manifest":
            try:
                m = parse_manifest(data)
            except CorruptData:
                return
            assert all(0 <= f.size < 2**63 for f in m.files)
            assert all(math.isfinite(v) for v in m.metrics.values())
        else:
            try:
                p = cc.parse_part(data, "p")
            except cc.BadPart:
                return
            assert all(0 <= f.size < 2**63 and math.isfinite(f.mtime) for f in p.files)


@fuzz(50)
@given(st.sampled_from(["manifest", "part"]), st.integers(0, 3))
def test_manifest_and_part_over_their_caps_are_refused_unparsed(which: str, extra: int) -> None:
    cap = inputs.MANIFEST.cap if which == "manifest" else inputs.PART.cap
    data = b" " * (cap + 1 + extra) + b"{}"
    with bounded(which):
        if which == "manifest":
            with pytest.raises(CorruptData):
                parse_manifest(inputs.check_size(data, inputs.MANIFEST, "m"))
        else:
            with pytest.raises(BadPart):
                cc.parse_part(data, "p")


# -- the async-save door ------------------------------------------------------------------------


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


# -- the layouts' meta readers ------------------------------------------------------------------

NOW = 10_000.0
NATIVE_META = {"format": "ckptd-native/1", "step": 5, "world_size": 2,
               "created": "2025-01-01T00:00:00Z", "metrics": {"val_loss": 1.5}, "config": {},
               "files": [{"path": "model.pt", "size": 10, "component": "model"},
                         {"path": "optim.rank0.pt", "size": 10, "component": "optimizer"},
                         {"path": "optim.rank1.pt", "size": 10, "component": "optimizer"}]}
RANKED_META = {"step": 5, "world_size": 2, "metrics": {"loss": 0.5}}
LAYOUT_FILES = {
    "native": {"step-5/model.pt": 10, "step-5/optim.rank0.pt": 10, "step-5/optim.rank1.pt": 10,
               "step-5/meta.json": 300},
    "ranked": {"model_5.pt": 10, "meta_5.json": 40, "optim_5_rank0.pt": 10,
               "optim_5_rank1.pt": 10},
}
META_OF = {"native": ("step-5/meta.json", NATIVE_META), "ranked": ("meta_5.json", RANKED_META)}


def _snapshot(files: dict[str, int], contents: dict[str, bytes]) -> Snapshot:
    infos = {rel: FileInfo(rel, size, NOW - 100, NOW - 100, False, None)
             for rel, size in files.items()}
    dirs = {"/".join(rel.split("/")[:i]) for rel in files for i in range(1, rel.count("/") + 1)}
    return Snapshot(files=infos, dirs=frozenset(dirs), contents=contents, registrations={})


@fuzz(300)
@given(st.sampled_from(["native", "ranked"]), st.booleans(),
       st.lists(st.integers(0, 50), max_size=4),
       hostile_literals | json_values.map(json.dumps) | st.sampled_from(
           ["20000000", "-1", "4294967296", str(2**63 - 1), "1e300", '"2"', "0"]),
       st.sampled_from([0, 2, 20_000_000]))
def test_a_layouts_meta_file_makes_a_candidate_never_an_exception(
        layout: str, multi_node: bool, path: list[int], literal: str, world: int) -> None:
    """Layout detection over a snapshot whose `meta.json` / `meta_<N>.json` holds hostile JSON
    (a world size of 2·10^7, 400-digit numbers, NaN, deep nesting): candidates, each complete
    or waiting or invalid with a known reason, in bounded time, never an exception."""
    rel, meta = META_OF[layout]
    data = _splice(meta, path, literal)
    snap = _snapshot(LAYOUT_FILES[layout], {rel: data})
    opts = RootOptions(settle=5.0, world_size=world, multi_node=multi_node)
    with bounded(f"{layout} detection"):
        found = layouts.detect(snap, opts, NOW)
    assert all(isinstance(c, Candidate) and c.invalid_reason in REASONS for c in found), found
    assert all(len(c.files) <= len(LAYOUT_FILES[layout]) for c in found)


@fuzz(100)
@given(st.sampled_from(["native", "ranked"]), st.binary(max_size=200))
def test_a_layouts_meta_file_of_any_bytes_makes_a_candidate(layout: str, data: bytes) -> None:
    rel, _ = META_OF[layout]
    snap = _snapshot(LAYOUT_FILES[layout], {rel: data})
    with bounded(f"{layout} detection"):
        found = layouts.detect(snap, RootOptions(), NOW)
    assert all(c.invalid_reason in REASONS for c in found), found


def test_the_fuzzed_files_are_what_the_readers_expect(tmp_path: Path) -> None:
    """The shapes the read_file property builds are what their names say."""
    for shape, want in (("regular", stat.S_ISREG), ("fifo", stat.S_ISFIFO),
                        ("link", stat.S_ISLNK), ("dir", stat.S_ISDIR)):
        p = _make(tmp_path / shape, shape, 3)
        assert want(os.lstat(p).st_mode), shape


@fuzz(60)
@given(st.sampled_from(["native", "ranked"]),
       st.sampled_from(["json", "fifo", "link", "over_cap", "dir"]),
       st.lists(st.integers(0, 50), max_size=4), hostile_literals | json_values.map(json.dumps))
def test_a_real_scan_of_a_root_with_a_hostile_meta_file_goes_on(
        layout: str, shape: str, path: list[int], literal: str) -> None:
    """The same through a real scanner over a real root: the meta file hostile, a FIFO, a link,
    a directory or over its cap is one bad item (a candidate with a known reason, or listed
    as refused), the scan returns in bounded time, and a good checkpoint beside it is found."""
    rel, meta = META_OF[layout]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for name in LAYOUT_FILES[layout]:
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            if name != rel:
                (root / name).write_bytes(b"x" * 10)
        (root / "model_step_9.pt").write_bytes(b"x" * 10)  # a single-file checkpoint beside
        target = root / rel
        if shape == "json":
            target.write_bytes(_splice(meta, path, literal))
        elif shape == "fifo":
            os.mkfifo(target)
        elif shape == "link":
            (root / "elsewhere.json").write_bytes(json.dumps(meta).encode())
            target.symlink_to(root / "elsewhere.json")
        elif shape == "dir":
            target.mkdir()
        else:
            with open(target, "wb") as f:
                f.truncate(inputs.ROOT_META.cap + 1)
        scanner = RootScanner("r1", root, "auto", RootOptions(settle=5.0))
        for now in (time.time(), time.time() + 100):
            with bounded("scan"):
                snap, found = scanner.scan(now)
        assert all(c.invalid_reason in REASONS for c, _ in found), found
        assert 9 in {c.step for c, _ in found}
