"""`ckptd.dcp.StorageReader` given a hostile `.metadata` and hostile slices in the bucket, each
stored as the daemon stores it (zstd, the manifest's size and hash matching): what the file
says is hostile, not how it is stored. A memo bomb in a pickle, a storage, slice or chunk that
claims more than the object holds, an entry the metadata omits: each a `CorruptData` naming the
object (and the entry), raised before any memory of the claimed size is taken. A mutated slice
or `.metadata` reads back whole or is refused (hypothesis); a hostile load costs no more memory
than a good one of the same size (peak RSS, a process each) and seconds of CPU at most."""

from __future__ import annotations

import io
import json
import os
import pickle
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from support.published import publish
from support.remote_reads import (
    KINDS,
    ckptd_error,
    dcp_state,
    failure,
    load_error,
    manifest,
    replace_file,
    url_of,
)
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)

from ckptd.backends import LocalBackend
from ckptd.dcp import StorageReader
from ckptd.dcp.meta import read_metadata
from ckptd.dcp.slices import TensorSlice, Want
from ckptd.errors import CorruptData
from ckptd.remote.manifest import StoredFile

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]
K = KINDS["dcp"]  # root llm, step 1: big (3,000,000 floats), w (300 x 200), step (bytes)
STEP_DIR = "step-1"
BIG, W = MetadataIndex("big", [0]), MetadataIndex("w", [0, 0])
# LONG_BINPUT 10^8: Python's C unpickler sizes its memo by the largest index (800 MB for these
# 9 bytes of opcodes, the pickle's own size no guide).
MEMO_BOMB = b"\x80\x04N" + b"r" + struct.pack("<I", 10**8) + b"."
# What a hostile load may take beyond a good one of the same size (peak RSS) and its CPU.
EXTRA_RSS = 64 << 20
CPU_SECONDS = 5.0


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The step DCP saved (base/llm/step-1) and committed as the daemon does (base/remote)."""
    base = tmp_path_factory.mktemp("dcp-hostile")
    dcp.save(dcp_state(), checkpoint_id=base / K.root / STEP_DIR, no_dist=True)
    publish(base / K.root, K.root, K.step, LocalBackend(str(base / "remote")), codec="auto")
    return base


@pytest.fixture
def remote(source: Path, tmp_path: Path) -> Path:
    """A copy of the committed step for one test to make hostile."""
    shutil.copytree(source / "remote", tmp_path / "remote")
    return tmp_path / "remote"


def original(source: Path, name: str) -> bytes:
    return (source / K.root / STEP_DIR / name).read_bytes()


def metadata_of(source: Path) -> Metadata:
    """The step's Metadata, unpickled in full: this process wrote it (test fixture)."""
    md = pickle.loads(original(source, ".metadata"))
    assert isinstance(md, Metadata)
    return md


def put_metadata(remote: Path, md: Metadata) -> StoredFile:
    return replace_file(remote, K, K.small, pickle.dumps(md))


def data_entry(remote: Path) -> StoredFile:
    (f,) = [f for f in manifest(remote, K).files if f.path == K.data]
    return f


def slice_at(source: Path, index: MetadataIndex) -> tuple[int, int]:
    info = metadata_of(source).storage_data[index]
    return int(info.offset), int(info.length)


def local_record(name: bytes, body: bytes) -> bytes:
    """A zip local record as torch writes small ones: stored, sizes in the header."""
    return struct.pack("<IHHHHHIIIHH", 0x04034B50, 20, 0, 0, 0, 0, 0, len(body), len(body),
                       len(name), 0) + name + body


def with_slice(source: Path, index: MetadataIndex, body: bytes) -> bytes:
    """The data file with the slice of `index` replaced by `body`, padded to its length."""
    raw = bytearray(original(source, "__0_0.distcp"))
    offset, length = slice_at(source, index)
    assert len(body) <= length
    raw[offset : offset + length] = body + bytes(length - len(body))
    return bytes(raw)


def with_numel(source: Path, index: MetadataIndex, numel: int) -> bytes:
    """The data file with the storage numel in the slice's data.pkl replaced (same length)."""
    raw = bytearray(original(source, "__0_0.distcp"))
    offset, length = slice_at(source, index)
    real = original_numel(index)
    at = raw.find(b"J" + struct.pack("<i", real), offset, offset + 4096)
    assert at > 0, "the persistent id's numel, a BININT"
    raw[at + 1 : at + 5] = struct.pack("<i", numel)
    return bytes(raw)


def original_numel(index: MetadataIndex) -> int:
    t = dcp_state()[index.fqn]
    assert isinstance(t, torch.Tensor)
    return t.numel()


# -- hostile cases, each also measured in its own process below ----------------------------


def hostile(case: str, source: Path, remote: Path) -> tuple[StoredFile, tuple[str, ...]]:
    """Make the step in `remote` hostile `case`: the stored file whose key the error must
    name, and what else it must say."""
    md = metadata_of(source)
    if case == "memo-bomb-metadata":
        return replace_file(remote, K, K.small, MEMO_BOMB), ("memo index",)
    if case == "memo-bomb-slice":
        pkl = local_record(b"__0_0/data.pkl", MEMO_BOMB)
        replace_file(remote, K, K.data, with_slice(source, W, pkl))
        return data_entry(remote), ("data.pkl", "memo index")
    if case == "storage-claim":  # big's storage: 2^31-1 floats (8 GiB) in a 12 MB slice
        replace_file(remote, K, K.data, with_numel(source, BIG, 2**31 - 1))
        return data_entry(remote), ("claims a storage of 8589934588 bytes",)
    if case == "slice-length":
        md.storage_data[W].length = 1 << 60
        put_metadata(remote, md)
        return data_entry(remote), ("'w'", "past the file's")
    if case == "slice-offset":
        md.storage_data[W].offset = (1 << 62) - 1
        put_metadata(remote, md)
        return data_entry(remote), ("'w'", "past the file's")
    raise AssertionError(case)


HOSTILE = ["memo-bomb-metadata", "memo-bomb-slice", "storage-claim", "slice-length",
           "slice-offset"]


@pytest.mark.parametrize("case", HOSTILE)
def test_a_hostile_step_is_corrupt_data_naming_the_object(source: Path, remote: Path,
                                                         case: str) -> None:
    f, says = hostile(case, source, remote)
    ckptd_error(load_error(K, url_of(remote)), CorruptData, f.key, *says)


def test_a_metadata_that_omits_a_chunks_storage_entry(source: Path, remote: Path) -> None:
    md = metadata_of(source)
    del md.storage_data[W]
    f = put_metadata(remote, md)
    ckptd_error(load_error(K, url_of(remote)), CorruptData, f.key, "'w'", "no storage entry")
    md = metadata_of(source)
    del md.storage_data[MetadataIndex("step")]  # a bytes item
    f = put_metadata(remote, md)
    ckptd_error(load_error(K, url_of(remote)), CorruptData, f.key, "'step'", "no storage entry")


@pytest.mark.parametrize("rel", ["../../../step-2/__0_0.distcp", "/etc/passwd", ".."])
def test_a_storage_entry_naming_a_file_outside_the_checkpoint(source: Path, remote: Path,
                                                             rel: str) -> None:
    md = metadata_of(source)
    md.storage_data[W].relative_path = rel
    f = put_metadata(remote, md)
    ckptd_error(load_error(K, url_of(remote)), CorruptData, f.key, "'w'",
                "leaves the checkpoint directory")


@pytest.mark.parametrize("field", ["state_dict_metadata", "storage_data"])
def test_a_metadata_without_a_field(source: Path, field: str) -> None:
    """A Metadata pickled without a field (its BUILD state lacks the key): found by the
    fuzz below."""
    md = metadata_of(source)
    delattr(md, field)
    with pytest.raises(CorruptData, match="are not mappings"):
        read_metadata(pickle.dumps(md), "x/.metadata")


@pytest.mark.parametrize("offsets, sizes", [
    ([0, 0], [301, 200]),  # past the tensor's end: DCP would read 300 rows of it
    ([1000, 0], [300, 200]),  # wholly outside: DCP would read nothing, w left as it was
    ([0, 0], [-1, 200]),
    ([0], [300]),  # a dimension short
])
def test_a_chunk_outside_its_tensor(source: Path, remote: Path, offsets: list[int],
                                    sizes: list[int]) -> None:
    md = metadata_of(source)
    entry = md.state_dict_metadata["w"]
    assert isinstance(entry, TensorStorageMetadata)
    entry.chunks = [ChunkStorageMetadata(offsets, sizes)]  # type: ignore[arg-type]
    md.storage_data[MetadataIndex("w", offsets)] = md.storage_data.pop(W)
    f = put_metadata(remote, md)
    ckptd_error(load_error(K, url_of(remote)), CorruptData, f.key, "'w'",
                "is not inside its tensor")


def test_a_slice_holding_another_tensor_than_its_chunk(source: Path, remote: Path) -> None:
    """The metadata says w is 300 x 100; its slice holds the 300 x 200 saved: a narrow of the
    saved tensor would fill the destination with the wrong columns and say nothing."""
    md = metadata_of(source)
    entry = md.state_dict_metadata["w"]
    assert isinstance(entry, TensorStorageMetadata)
    entry.size = torch.Size([300, 100])
    entry.chunks = [ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([300, 100]))]
    put_metadata(remote, md)
    f = data_entry(remote)
    exc = failure(lambda: dcp.load({"w": torch.zeros(300, 100)},
                                   storage_reader=StorageReader(K.root, K.step,
                                                                remote=url_of(remote)),
                                   no_dist=True))
    ckptd_error(exc, CorruptData, f.key, "300, 200", "300, 100")


def test_a_slice_whose_view_repeats_its_storage(source: Path, remote: Path) -> None:
    """data.pkl's stride for w made (0, 1): every row the first one, 60,000 elements claimed
    from a storage of 60,000 read as 200: not a tensor DCP saves."""
    raw = bytearray(original(source, "__0_0.distcp"))
    offset, _length = slice_at(source, W)
    stride = b"K\xc8K\x01\x86"  # BININT1 200, BININT1 1, TUPLE2: (200, 1)
    at = raw.find(stride, offset, offset + 4096)
    assert at > 0
    raw[at + 1] = 0
    f = replace_file(remote, K, K.data, bytes(raw))
    ckptd_error(load_error(K, url_of(remote)), CorruptData, f.key, "stride (0, 1)")


def test_a_transformed_slice_that_undoes_to_more_than_its_chunk(tmp_path: Path) -> None:
    """A slice saved through DCP's zstd extension replaced by a frame of 512 MiB of zeros (a
    few kB): refused once it gives more than w's 240 kB and an archive's records, not read
    whole into memory first."""
    import zstandard
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint._extension import ZStandard

    step_dir, remote = tmp_path / "root" / STEP_DIR, tmp_path / "remote"
    dcp.save(dcp_state(), storage_writer=FileSystemWriter(step_dir, _extensions=[ZStandard()]),
             no_dist=True)
    publish(tmp_path / "root", K.root, K.step, LocalBackend(str(remote)))
    md = pickle.loads((step_dir / ".metadata").read_bytes())
    info = md.storage_data[W]
    assert info.transform_descriptors
    out = io.BytesIO()
    with zstandard.ZstdCompressor().stream_writer(out, closefd=False) as z:
        for _ in range(512):
            z.write(bytes(1 << 20))
    bomb = out.getvalue()
    raw = bytearray((step_dir / "__0_0.distcp").read_bytes())
    assert len(bomb) <= info.length
    raw[info.offset : info.offset + len(bomb)] = bomb
    info.length = len(bomb)
    replace_file(remote, K, K.data, bytes(raw))
    put_metadata(remote, md)
    ckptd_error(load_error(K, url_of(remote)), CorruptData, data_entry(remote).key,
                "gives more than")


# -- peak memory and CPU, each load in its own process ---------------------------------------

_MEASURE = r"""
import json, resource, sys, time, warnings
warnings.simplefilter("ignore")
import torch, torch.distributed.checkpoint as dcp
from ckptd.backends import LocalBackend
from ckptd.dcp import StorageReader
from ckptd.errors import CorruptData
root, step, url, cap = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
dest = {"big": torch.zeros(3_000_000), "w": torch.zeros(300, 200), "step": 0}
if cap:  # address space: what the process holds now plus what a good load needed, and a cap
    size = int(open("/proc/self/statm").read().split()[0]) * resource.getpagesize()
    resource.setrlimit(resource.RLIMIT_AS, (size + cap, size + cap))
cpu = time.process_time()
try:  # the metadata read as DCP's load begins it, then the load (whose wrapper of a failed
    # metadata read keeps only the message)
    StorageReader(root, step, remote=url).read_metadata()
    dcp.load(dest, storage_reader=StorageReader(root, step, remote=url), no_dist=True)
    error = ""
except BaseException as exc:
    error = f"{type(exc).__name__}: {exc}"
# this process's own peaks (getrusage's ru_maxrss would be the forking parent's when higher)
status = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in open("/proc/self/status")
          if line.startswith(("VmPeak:", "VmHWM:"))}
print(json.dumps({"error": error, "cpu": time.process_time() - cpu, "peak_vm": status["VmPeak"],
                  "rss": status["VmHWM"]}))
"""
# The address space a load may add to what the process held before it: a good load adds
# threads' stacks and malloc arenas (measured: well under this), a lie of 8 GiB does not fit.
ADDRESS_SPACE = 3 << 30


def measure(remote: Path, cap: int = ADDRESS_SPACE) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-c", _MEASURE, K.root, str(K.step), url_of(remote),
                          str(cap)], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    found: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return found


def test_a_hostile_load_costs_what_a_good_one_costs(source: Path, tmp_path: Path) -> None:
    good = measure(source / "remote")
    assert good["error"] == "", good
    for case in HOSTILE:
        remote = tmp_path / case
        shutil.copytree(source / "remote", remote)
        f, _says = hostile(case, source, remote)
        bad = measure(remote)
        assert "CorruptData" in bad["error"] and f.key in bad["error"], (case, bad)
        assert bad["rss"] <= good["rss"] + EXTRA_RSS, (case, bad, good)
        assert bad["cpu"] <= CPU_SECONDS, (case, bad)


# -- fuzz: mutations of real DCP-written bytes -----------------------------------------------

MUTATION = st.tuples(st.sampled_from(["flip", "set", "insert", "cut"]),
                     st.floats(0, 1, exclude_max=True), st.binary(min_size=1, max_size=8))


def mutate(data: bytes, plan: list[tuple[str, float, bytes]],
           protect: range | None = None) -> bytes:
    """`data` with each mutation of `plan` applied at a place outside `protect` (a cut
    anywhere). `protect` moves with the bytes inserted before it, so no flip, set or insert
    ever lands inside it, whatever came before."""
    out = bytearray(data)
    keep = protect if protect is not None else range(len(out), len(out))
    for how, where, value in plan:
        allowed = [range(0, keep.start), range(keep.stop, len(out))]
        total = sum(len(r) for r in allowed)
        if how == "cut":
            del out[int(where * len(out)) :]
            keep = range(min(keep.start, len(out)), min(keep.stop, len(out)))
            continue
        if total == 0:
            continue
        pos = int(where * total)
        r = allowed[0] if pos < len(allowed[0]) else allowed[1]
        at = r.start + (pos if r is allowed[0] else pos - len(allowed[0]))
        if how == "flip":
            out[at] ^= value[0] or 1
        elif how == "set":
            value = value[: r.stop - at]
            out[at : at + len(value)] = value
        elif how == "insert":
            out[at:at] = value
            if at <= keep.start:
                keep = range(keep.start + len(value), keep.stop + len(value))
    return bytes(out)


def _w_slice(source: Path) -> tuple[bytes, range]:
    """w's slice as DCP saved it and where its tensor bytes lie in it."""
    raw = original(source, "__0_0.distcp")
    offset, length = slice_at(source, W)
    piece = raw[offset : offset + length]
    want = dcp_state()["w"]
    data_at = piece.find(want.numpy().tobytes()[:64])
    assert data_at > 0
    return piece, range(data_at, data_at + want.numel() * 4)


@settings(max_examples=int(os.environ.get("CKPTD_FUZZ_EXAMPLES", "200")), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture,
                                 HealthCheck.too_slow])
@given(plan=st.lists(MUTATION, min_size=1, max_size=4),
       cuts=st.lists(st.integers(1, 1 << 16), max_size=6))
# A set that ends the header: it must stop at the tensor's first byte, not change it.
@example(plan=[("set", 0.4453125, b"\x00\x00\x00")], cuts=[])
# Bytes inserted before the tensor move it: a set in the trailer must not land in it.
@example(plan=[("insert", 0.1, b"\x01\x02\x03\x04"), ("set", 0.5, b"\x00" * 8)], cuts=[])
def test_a_mutated_slice_is_read_whole_or_refused(source: Path, plan: list[Any],
                                                  cuts: list[int]) -> None:
    """Header and trailer bytes of a real slice flipped, set, inserted or cut, fed in pieces of
    any size: the destination gets exactly the saved tensor, or the slice is CorruptData.
    (The tensor's own bytes are the block hashes' to check, not the parser's.)"""
    piece, data = _w_slice(source)
    bad = mutate(piece, plan, data)
    dest = torch.zeros(300, 200)
    done: list[torch.Tensor] = []
    ts = TensorSlice(len(bad), [Want((0, 0), (300, 200), lambda: dest, done.append,
                                     (300, 200), torch.float32)], "fuzz")
    cpu = time.process_time()
    try:
        view, at = memoryview(bad), 0
        for n in [*cuts, len(bad)]:
            ts.feed(view[at : at + n])
            at += n
        ts.finish()
    except CorruptData:
        assert not done
    else:
        assert done and torch.equal(dest, dcp_state()["w"])
    assert time.process_time() - cpu < CPU_SECONDS


@settings(max_examples=int(os.environ.get("CKPTD_FUZZ_EXAMPLES", "200")), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture,
                                 HealthCheck.too_slow])
@given(plan=st.lists(MUTATION, min_size=1, max_size=4))
def test_a_mutated_metadata_is_read_or_refused(source: Path, plan: list[Any]) -> None:
    """A real `.metadata` flipped, set, inserted or cut anywhere: Metadata whose every entry
    the checks passed, or CorruptData; nothing else, within seconds."""
    raw = original(source, ".metadata")
    bad = mutate(raw, plan)
    cpu = time.process_time()
    try:
        md = read_metadata(bad, "fuzz/.metadata")
    except CorruptData:
        pass
    else:
        assert isinstance(md, Metadata)
        assert bad != raw or md.state_dict_metadata.keys() == {"big", "w", "step"}
    assert time.process_time() - cpu < CPU_SECONDS


def feed_whole(piece: bytes) -> torch.Tensor:
    """w's destination after `piece` is fed to its slice parser in pieces of 4,093 bytes."""
    dest = torch.zeros(300, 200)
    ts = TensorSlice(len(piece), [Want((0, 0), (300, 200), lambda: dest, lambda t: None,
                                       (300, 200), torch.float32)], "fuzz")
    view = memoryview(piece)
    for at in range(0, len(piece), 4093):
        ts.feed(view[at : at + 4093])
    ts.finish()
    return dest


def test_a_slice_whose_tensor_record_is_shifted(source: Path) -> None:
    """The tensor record's extra-field length one more than torch wrote: its bytes would be
    read one late, ending inside the next record. Found by the fuzz above."""
    piece, data = _w_slice(source)
    name = piece.rfind(b"/data/0", 0, data.start)
    header = piece.rfind(b"PK\x03\x04", 0, name)
    xlen_at = header + 28
    (xlen,) = struct.unpack_from("<H", piece, xlen_at)
    bad = bytearray(piece)
    struct.pack_into("<H", bad, xlen_at, xlen + 1)
    with pytest.raises(CorruptData, match="no zip record follows the tensor's bytes"):
        feed_whole(bytes(bad))


def test_the_fuzzed_slice_reads_whole_unmutated(source: Path) -> None:
    """The fuzz's baseline: the real slice, fed in odd pieces, fills the destination."""
    piece, _data = _w_slice(source)
    assert torch.equal(feed_whole(piece), dcp_state()["w"])
