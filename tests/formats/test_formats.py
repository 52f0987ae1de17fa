"""Format checkers on real torch-written files: zip CRCs, pickle scanning, safetensors framing,
DCP metadata through the restricted unpickler."""

from __future__ import annotations

import io
import mmap
import os
import pickle
import struct
import threading
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import writers

from ckptd import arena
from ckptd.errors import ValidationFailed
from ckptd.fileio import read_pass
from ckptd.formats import (
    dcpmeta,
    picklescan,
    safetensors,
    torchhead,
    torchpickle,
    zipcheck,
    zipcrc,
)


def _zip_check(path: Path, chunk: int = 1 << 20) -> zipcheck.ZipCrcSink:
    sink = zipcheck.ZipCrcSink.for_file(path)
    read_pass(path, [sink], chunk_size=chunk)
    return sink


def _reason(fn: object, *args: object, **kw: object) -> str:
    with pytest.raises(ValidationFailed) as err:
        fn(*args, **kw)  # type: ignore[operator]
    return str(err.value.reason)


# --- zip ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("chunk", [1, 13, 4096, 1 << 20])
def test_zip_torch_file_passes_at_any_chunk_size(tmp_path: Path, chunk: int) -> None:
    p = writers.save_torch(tmp_path / "m.pt")
    sink = _zip_check(p, chunk)
    with zipfile.ZipFile(p) as z:
        assert sink.members_checked == len(z.infolist())
    [(entry, data)] = sink.captured
    assert entry.name.endswith("/data.pkl") and data == zipfile.ZipFile(p).read(entry.name)


def test_zip_flipped_tensor_byte_is_crc_mismatch_though_torch_load_works(tmp_path: Path) -> None:
    p = writers.save_torch(tmp_path / "m.pt")
    offset, size = writers.member_data_offset(p, "/data/0")
    writers.flip_byte(p, offset + size // 2)
    torch.load(p, weights_only=True)  # torch does not notice
    assert _reason(_zip_check, p) == "crc_mismatch"


def test_zip_truncated_is_truncated(tmp_path: Path) -> None:
    p = writers.save_torch(tmp_path / "m.pt")
    writers.truncate(p, p.stat().st_size // 2)
    assert _reason(zipcheck.ZipCrcSink.for_file, p) == "truncated"


def test_zip_garbage_and_bad_directory_are_bad_header(tmp_path: Path) -> None:
    garbage = tmp_path / "g.pt"
    garbage.write_bytes(b"not a zip at all" * 100)
    assert _reason(zipcheck.ZipCrcSink.for_file, garbage) == "bad_header"
    p = writers.save_torch(tmp_path / "m.pt")
    with zipfile.ZipFile(p) as z:
        cd_offset = z.start_dir
    writers.flip_byte(p, cd_offset)  # central directory signature
    assert _reason(zipcheck.ZipCrcSink.for_file, p) == "bad_header"


def test_zip_prepended_junk_is_bad_header(tmp_path: Path) -> None:
    p = writers.save_torch(tmp_path / "m.pt")
    p.write_bytes(b"JUNK" * 10 + p.read_bytes())
    assert _reason(zipcheck.ZipCrcSink.for_file, p) == "bad_header"


def test_zip_directory_pointing_past_the_data_is_truncated(tmp_path: Path) -> None:
    p = tmp_path / "z.zip"
    with zipfile.ZipFile(p, "w") as z:
        z.writestr("a", b"x" * 1000)
        z.writestr("b", b"y" * 10)
    raw = bytearray(p.read_bytes())
    with zipfile.ZipFile(p) as z:
        cd = z.start_dir
    # Directory entry of "a": claim a bigger compressed/uncompressed size than is there.
    raw[cd + 20 : cd + 28] = (5000).to_bytes(4, "little") * 2
    p.write_bytes(bytes(raw))
    assert _reason(_zip_check, p) == "truncated"


def test_zip_deflated_members_are_inflated_and_checked(tmp_path: Path) -> None:
    p = tmp_path / "d.zip"
    payload = bytes(range(256)) * 4000
    with zipfile.ZipFile(p, "w", compression=zipfile.ZIP_DEFLATED) as z:
        z.writestr("x/data.pkl", pickle.dumps({"a": 1}, protocol=2))
        z.writestr("x/data/0", payload)
    assert _zip_check(p, 999).members_checked == 2
    offset, size = writers.member_data_offset(p, "data/0")
    writers.flip_byte(p, offset + size // 2)
    assert _reason(_zip_check, p) in {"crc_mismatch", "size_mismatch"}


def test_zip64_records_are_understood(tmp_path: Path) -> None:
    p = tmp_path / "z64.zip"
    with zipfile.ZipFile(p, "w") as z:
        for i in range(3):
            with z.open(f"m{i}", "w", force_zip64=True) as f:
                f.write(bytes([i]) * 5000)
    old = zipfile.ZIP64_LIMIT
    # Make the stdlib write zip64 directory fields for small files.
    zipfile.ZIP64_LIMIT = 100  # type: ignore[misc]
    try:
        with zipfile.ZipFile(p, "a") as z:
            z.writestr("last", b"z" * 200)
    finally:
        zipfile.ZIP64_LIMIT = old  # type: ignore[misc]
    assert b"PK\x06\x06" in p.read_bytes()
    assert _zip_check(p, 777).members_checked == 4


def test_concatenated_archives_are_each_checked(tmp_path: Path) -> None:
    buf = io.BytesIO()
    for i in range(3):
        torch.save({"t": torch.full((10,), float(i))}, buf)
    p = tmp_path / "__0_0.distcp"
    p.write_bytes(buf.getvalue())
    sink = _zip_check(p, 100)
    assert len(sink.archives) == 3 and len(sink.captured) == 3
    assert sink.archives[0].start == 0 and sink.archives[-1].end == p.stat().st_size


def test_zip_members_and_read_member(tmp_path: Path) -> None:
    p = writers.save_torch(tmp_path / "m.pt")
    members = zipcheck.zip_members(p)
    with zipfile.ZipFile(p) as z:
        assert [m.name for m in members] == [i.filename for i in z.infolist()]
        pkl = next(m for m in members if m.name.endswith("data.pkl"))
        assert zipcheck.read_member(p, pkl.name) == z.read(pkl.name)
        assert p.read_bytes()[pkl.offset : pkl.offset + pkl.size] == z.read(pkl.name)
    assert _reason(zipcheck.read_member, p, pkl.name, max_size=10) == "bad_header"
    with zipcheck.open_stored_member(p, zipcheck.find_entry(p, pkl.name)) as f:
        assert f.read() == zipfile.ZipFile(p).read(pkl.name)



def _claiming(raw: bytes, suffix: str, size: int) -> bytes:
    """`raw` (a zip) with its central directory rewritten so that the member ending in `suffix`
    claims `size` bytes (zip64 sizes), as a hostile writer's directory can."""
    z = zipfile.ZipFile(io.BytesIO(raw))
    body, cd = raw[: z.start_dir], bytearray()
    for i in z.infolist():
        name, csize, usize, extra = i.filename.encode(), i.compress_size, i.file_size, b""
        if i.filename.endswith(suffix):
            csize = usize = 0xFFFFFFFF
            extra = struct.pack("<HHQQ", 1, 16, size, size)
        cd += struct.pack("<4sHHHHHHIIIHHHHHII", b"PK\x01\x02", 0x031E, 45, i.flag_bits,
                          i.compress_type, 0, 0, i.CRC, csize, usize, len(name), len(extra),
                          0, 0, 0, i.external_attr, i.header_offset) + name + extra
    n = len(z.infolist())
    return body + bytes(cd) + struct.pack("<4sHHHHIIH", b"PK\x05\x06", 0, 0, n, n, len(cd),
                                          len(body), 0)


def _bounded(fn: Any, seconds: float = 10.0) -> BaseException | None:
    """What `fn()` raised (None if it returned), failing if it has not ended in `seconds`
    (a spin is left to a daemon thread rather than hanging the suite)."""
    out: list[BaseException | None] = []

    def run() -> None:
        try:
            fn()
            out.append(None)
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            out.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    assert out, f"still running after {seconds} s"
    return out[0]


@pytest.mark.parametrize("size", [2**62, 2**64 - 1, 10**7])
def test_a_member_claiming_more_than_the_file_is_refused_at_once(tmp_path: Path,
                                                                 size: int) -> None:
    """Member sizes are bounded by the file's real size where the directory is read: every
    reader refuses at once, whatever the entry claims."""
    p = tmp_path / "m.pt"
    p.write_bytes(_claiming(writers.save_torch(tmp_path / "src.pt").read_bytes(), "data/0",
                            size))
    assert _reason(zipcheck.read_archives, p) == "truncated"
    for fn in (zipcheck.zip_members, lambda q: _zip_check(q),
               lambda q: zipcheck.read_member(q, "archive/data/0", max_size=2**64)):
        err = _bounded(lambda fn=fn: fn(p))
        assert isinstance(err, ValidationFailed) and err.reason == "truncated", err


def test_an_arena_member_claiming_2_62_bytes_is_refused_at_once() -> None:
    """The async-save door fills in CRCs from the arena's zip: a directory entry claiming a
    2^62-byte member once spun a core for ever (holding a save slot); now refused at once."""
    torch.serialization.set_crc32_options(False)
    try:
        buf = io.BytesIO()
        torch.save({"w": torch.randn(100)}, buf)
    finally:
        torch.serialization.set_crc32_options(True)
    raw = _claiming(buf.getvalue(), "data/0", 2**62)
    fd = arena.create_memfd(arena.aligned(arena.DATA_OFFSET + len(raw)))
    try:
        os.pwrite(fd, raw, arena.DATA_OFFSET)
        with mmap.mmap(fd, 0) as mm:
            view = memoryview(mm)
            err = _bounded(lambda: zipcrc.fill_crcs(view, fd, arena.DATA_OFFSET,
                                                    arena.DATA_OFFSET + len(raw), "model.pt"))
            view.release()
    finally:
        os.close(fd)
    assert isinstance(err, ValidationFailed) and err.reason == "truncated", err
    assert "archive/data/0" in err.message


def test_the_persist_door_refuses_such_an_arena_and_frees_its_slot(inproc_daemon: Any) -> None:
    """Through the real door: the save fails at once naming the member, the arena is marked
    failed, and nothing holds a save slot or lands in the root."""
    from support.async_save import post_persist

    d = inproc_daemon(roots=[{"name": "r1"}])
    torch.serialization.set_crc32_options(False)
    try:
        buf = io.BytesIO()
        torch.save({"w": torch.randn(100)}, buf)
    finally:
        torch.serialization.set_crc32_options(True)
    raw = _claiming(buf.getvalue(), "data/0", 2**62)
    fd = arena.create_memfd(arena.aligned(arena.DATA_OFFSET + len(raw)))
    try:
        os.pwrite(fd, raw, arena.DATA_OFFSET)
        os.pwrite(fd, arena.pack_header(arena.State.SEALED, 1, len(raw)), 0)
        body = {"root": "r1", "dir": str(d.roots["r1"]), "step": 1, "rank": 0,
                "world_size": 1, "generation": 1,
                "files": [{"path": "model.pt", "component": "model",
                           "offset": arena.DATA_OFFSET, "size": len(raw)}],
                "head": {"format": "ckptd-native/1", "step": 1, "world_size": 1}}
        status, job = post_persist(d.socket, body, fd)
        assert status == 202, job
        status, outcome = d.client.request("GET", f"/v1/persist/{job['id']}?timeout=10")
        assert status == 200 and outcome["state"] == "failed", outcome
        assert "archive/data/0" in outcome["error"], outcome
        with mmap.mmap(fd, arena.DATA_OFFSET, prot=mmap.PROT_READ) as head:
            assert arena.read_header(head).state is arena.State.FAILED
    finally:
        os.close(fd)
    assert d.client.request("GET", "/v1/status")[1]["in_flight"] == []
    assert [p.name for p in d.roots["r1"].iterdir()] == [".ckptd"]


def test_a_directory_claiming_more_entries_than_it_holds_is_bad_header(tmp_path: Path) -> None:
    p = writers.save_torch(tmp_path / "m.pt")
    raw = bytearray(p.read_bytes())
    eocd64 = raw.rfind(b"PK\x06\x06")
    raw[eocd64 + 24 : eocd64 + 40] = struct.pack("<QQ", 2**62, 2**62)  # entry counts
    p.write_bytes(bytes(raw))
    err = _bounded(lambda: zipcheck.read_archives(p))
    assert isinstance(err, ValidationFailed) and err.reason == "bad_header", err


# --- pickles -----------------------------------------------------------------------------------


def test_allow_list_matches_torch_weights_only(tmp_path: Path) -> None:
    from torch._weights_only_unpickler import _get_allowed_globals

    assert set(_get_allowed_globals()) == set(picklescan.TORCH_SAFE_GLOBALS)


def _data_pkl(path: Path) -> bytes:
    with zipfile.ZipFile(path) as z:
        return z.read(next(n for n in z.namelist() if n.endswith("data.pkl")))


def test_state_dict_pickle_is_safe(tmp_path: Path) -> None:
    p = writers.save_torch(tmp_path / "m.pt")
    found = picklescan.scan_pickle(_data_pkl(p), "m.pt")
    assert "torch._utils._rebuild_tensor_v2" in found and found <= picklescan.SAFE_GLOBALS


def test_numpy_data_is_safe(tmp_path: Path) -> None:
    state = {"rng": np.random.get_state(), "metric": np.float64(0.5), "dt": np.dtype("f4")}
    p = writers.save_torch(tmp_path / "rng.pt", state)
    picklescan.scan_pickle(_data_pkl(p))


@pytest.mark.parametrize("protocol", [2, 4])
def test_os_system_payload_is_unsafe(tmp_path: Path, protocol: int) -> None:
    marker = tmp_path / "pwned"
    p = tmp_path / "evil.pt"
    torch.save(writers.hostile_state(writers.RunsShell(f"touch {marker}")), p,
               pickle_protocol=protocol)
    with pytest.raises(ValidationFailed) as err:
        picklescan.scan_pickle(_data_pkl(p), "evil.pt")
    assert err.value.reason == "unsafe_pickle" and "system" in err.value.message
    assert not marker.exists()


def test_exec_payload_is_unsafe(tmp_path: Path) -> None:
    data = pickle.dumps(writers.RunsExec("open('x','w')"), protocol=2)
    assert _reason(picklescan.scan_pickle, data) == "unsafe_pickle"


def test_call_on_a_non_global_is_unsafe() -> None:
    # REDUCE whose callee is the result of another call, not a named allowed global.
    data = b"\x80\x02cbuiltins\nset\n)R)R."
    assert _reason(picklescan.scan_pickle, data) == "unsafe_pickle"


def test_stack_global_names_from_the_memo_are_resolved() -> None:
    ok = pickle.dumps(frozenset({1}), protocol=4)  # STACK_GLOBAL builtins.frozenset
    picklescan.scan_pickle(ok)
    evil = b"\x80\x04\x8c\x02os\x94\x8c\x06system\x94h\x00h\x01\x93\x8c\x02id\x85R."
    assert _reason(picklescan.scan_pickle, evil) == "unsafe_pickle"


def test_build_on_a_global_is_unsafe() -> None:
    # Setting state on a class would patch it in the process that loads the file.
    assert _reason(picklescan.scan_pickle, b"\x80\x02ccollections\nOrderedDict\n}b.") == (
        "unsafe_pickle"
    )


def test_big_data_pkl_is_scanned_from_the_file(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    p = tmp_path / "evil.pt"
    torch.save(writers.hostile_state(writers.RunsShell(f"touch {marker}")), p)
    sink = zipcheck.ZipCrcSink(str(p), zipcheck.read_archives(p), capture_limit=10)
    read_pass(p, [sink])
    [entry] = sink.uncaptured
    assert not sink.captured
    with zipcheck.open_stored_member(p, entry) as f:
        assert _reason(picklescan.scan_pickle, f) == "unsafe_pickle"
    assert not marker.exists()


def test_extension_registry_is_unsafe() -> None:
    assert _reason(picklescan.scan_pickle, b"\x80\x02\x82\x01)R.") == "unsafe_pickle"


def test_several_untrusted_globals_are_named_in_one_message() -> None:
    # GLOBAL a.One, GLOBAL b.Two (twice), STACK_GLOBAL os.system: every one, once, in order.
    data = (b"\x80\x04ca\nOne\n)\x81cb\nTwo\n)\x81cb\nTwo\n)\x81"
            b"\x8c\x02os\x8c\x06system\x93\x8c\x02id\x85R\x87.")
    with pytest.raises(ValidationFailed) as err:
        picklescan.scan_pickle(data, "x.pt")
    assert err.value.reason == "unsafe_pickle"
    assert err.value.message == ("x.pt references a.One, b.Two, os.system, which are not on"
                                 " the allow-list")
    # An unsafe construct after them is reported too, with the names met so far.
    with pytest.raises(ValidationFailed) as err:
        picklescan.scan_pickle(b"\x80\x02ca\nOne\n)\x81ccollections\nOrderedDict\n}b.")
    assert "a.One, which is not" in err.value.message and "BUILD" in err.value.message
    # Structure only: no allow-list, the globals returned.
    assert picklescan.scan_pickle(data, allowed=None) >= {"a.One", "b.Two", "os.system"}


def test_a_memo_index_far_beyond_the_memo_is_a_bomb() -> None:
    # Python's own unpickler would size its memo by this index (1.5 GiB for 10^8).
    data = b"\x80\x02K\x01r" + (10**8).to_bytes(4, "little") + b"."
    assert _reason(picklescan.scan_pickle, data) == "bad_header"


def test_plain_top_level_fields_of_a_torch_pickle(tmp_path: Path) -> None:
    p = tmp_path / "mp_rank_00_model_states.pt"
    torch.save({"module": {"w": torch.ones(3)}, "dp_world_size": 4, "ds_version": "0.19.8",
                "optimizer": None, "lr": 0.5, "flag": True, "long": "x" * 5000,
                "shapes": [torch.Size([3])]}, p)
    want = {"dp_world_size": 4, "ds_version": "0.19.8", "optimizer": None, "lr": 0.5,
            "flag": True}
    read = torchpickle.read_torch_pickle(_data_pkl(p), "m")
    assert read.fields == want and [kind for _, kind, _ in read.refs] == ["Float"]
    # From the file's first bytes only: data.pkl is its first member, stored.
    assert torchhead.read_leading_fields(p) == want
    size = len(_data_pkl(p))
    assert torchhead.read_leading_fields(p, limit=size) is None  # the pickle cut short
    assert torchhead.leading_fields(b"") is None
    assert torchhead.leading_fields(b"PK\x03\x04" + b"\0" * 40) is None
    legacy = tmp_path / "old.pt"
    torch.save({"dp_world_size": 4}, legacy, _use_new_zipfile_serialization=False)
    assert torchhead.read_leading_fields(legacy) is None
    assert torchhead.read_leading_fields(tmp_path / "absent.pt") is None


@pytest.mark.parametrize("data", [b"", b"\x80\x02}q\x00(", b"\xff\xfe garbage", b"\x80\x02h\x09."])
def test_broken_pickles_are_bad_header(data: bytes) -> None:
    assert _reason(picklescan.scan_pickle, data) == "bad_header"


def test_legacy_torch_files_are_scanned(tmp_path: Path) -> None:
    good = writers.save_torch(tmp_path / "old.pt", _use_new_zipfile_serialization=False)
    with open(good, "rb") as f:
        assert "torch._utils._rebuild_tensor_v2" in picklescan.scan_torch_pickle_file(f, "old")
    marker = tmp_path / "pwned"
    evil = writers.save_torch(
        tmp_path / "evil.pt", writers.hostile_state(writers.RunsShell(f"touch {marker}")),
        _use_new_zipfile_serialization=False,
    )
    with open(evil, "rb") as f:
        assert _reason(picklescan.scan_torch_pickle_file, f, "evil") == "unsafe_pickle"
    assert not marker.exists()


# --- safetensors -------------------------------------------------------------------------------


def _st_check(path: Path, chunk: int = 1 << 20) -> safetensors.SafetensorsSink:
    sink = safetensors.SafetensorsSink(str(path))
    read_pass(path, [sink], chunk_size=chunk)
    return sink


def _tensors() -> dict[str, np.ndarray]:
    return {"w": np.arange(12, dtype=np.float32).reshape(3, 4), "b": np.ones(5, np.float16),
            "steps": np.arange(3, dtype=np.int64)}


@pytest.mark.parametrize("chunk", [1, 5, 64, 1 << 20])
def test_safetensors_passes(tmp_path: Path, chunk: int) -> None:
    p = writers.write_safetensors(tmp_path / "m.safetensors", _tensors(), {"format": "pt"})
    sink = _st_check(p, chunk)
    assert sink.header is not None
    assert [t.name for t in sink.header.tensors] == ["w", "b", "steps"]
    assert sink.header.metadata == {"format": "pt"}


def test_safetensors_truncated_or_padded(tmp_path: Path) -> None:
    p = writers.write_safetensors(tmp_path / "m.safetensors", _tensors())
    size = p.stat().st_size
    with open(p, "ab") as f:
        f.write(b"\0")
    assert _reason(_st_check, p) == "size_mismatch"
    writers.truncate(p, size - 1)
    assert _reason(_st_check, p) == "truncated"
    writers.truncate(p, 20)
    assert _reason(_st_check, p) == "truncated"
    writers.truncate(p, 3)
    assert _reason(_st_check, p) == "truncated"


def test_safetensors_bad_headers(tmp_path: Path) -> None:
    p = tmp_path / "x.safetensors"
    p.write_bytes(len(b"{not json").to_bytes(8, "little") + b"{not json")
    assert _reason(_st_check, p) == "bad_header"
    p.write_bytes((1 << 40).to_bytes(8, "little") + b"{}")
    assert _reason(_st_check, p) == "bad_header"
    gap = {"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}
    p.write_bytes(writers.st_header_bytes(gap) + b"\0" * 8)
    assert _reason(_st_check, p) == "bad_header"
    overlap = {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
               "b": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}
    p.write_bytes(writers.st_header_bytes(overlap) + b"\0" * 8)
    assert _reason(_st_check, p) == "bad_header"
    unknown = {"a": {"dtype": "F33", "shape": [1], "data_offsets": [0, 4]}}
    p.write_bytes(writers.st_header_bytes(unknown) + b"\0" * 4)
    assert _reason(_st_check, p) == "bad_header"


def test_safetensors_shape_disagreeing_with_offsets_is_size_mismatch(tmp_path: Path) -> None:
    p = tmp_path / "x.safetensors"
    wrong = {"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}
    p.write_bytes(writers.st_header_bytes(wrong) + b"\0" * 8)
    assert _reason(_st_check, p) == "size_mismatch"


# --- DCP metadata ------------------------------------------------------------------------------


def test_dcp_metadata_of_a_real_save(tmp_path: Path) -> None:
    d = writers.save_dcp(tmp_path / "ckpt")
    data = (d / ".metadata").read_bytes()
    assert data[:2] == b"\x80\x04"  # torch 2.13 writes a bare protocol-4 pickle, no prefix
    meta = dcpmeta.parse_dcp_metadata(data)
    files = sorted(p.name for p in d.iterdir() if p.suffix == ".distcp")
    assert sorted(meta.references) == files
    for name, least in meta.references.items():
        assert least == (d / name).stat().st_size
    assert meta.version == "1.0.0" and meta.entries > 10 and not meta.transformed


def test_dcp_metadata_malicious_pickle_is_unsafe_and_never_runs(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    data = pickle.dumps(writers.RunsShell(f"touch {marker}"), protocol=4)
    assert _reason(dcpmeta.parse_dcp_metadata, data) == "unsafe_pickle"
    assert not marker.exists()


@pytest.mark.parametrize("data", [b"", b"garbage", pickle.dumps({"a": 1}), pickle.dumps([1, 2])])
def test_dcp_metadata_unparsable_or_wrong_shape_is_bad_metadata(data: bytes) -> None:
    assert _reason(dcpmeta.parse_dcp_metadata, data) == "bad_metadata"


def test_dcp_metadata_build_on_a_stand_in_leaves_later_parses_alone(tmp_path: Path) -> None:
    # BUILD on the torch.Size global: a real unpickler would rewrite the class. The opcode scan
    # (run first) refuses it; the stand-in of a later parse is left alone either way.
    hostile = b"\x80\x04\x8c\x05torch\x8c\x04Size\x93}\x8c\x01aK\x01sb."
    assert _reason(dcpmeta.parse_dcp_metadata, hostile) == "unsafe_pickle"
    d = writers.save_dcp(tmp_path / "ckpt")
    assert dcpmeta.parse_dcp_metadata((d / ".metadata").read_bytes()).entries > 10


# megatron-core 0.16.1 (torch_dist) keeps every rank's save plan in `.metadata`: one written by
# it (tests/frameworks/scripts/megatron_train.py: TP=2 on two ranks, iteration 10).
MEGATRON_METADATA = Path(__file__).parent.parent / "golden" / "megatron" / "iter_0000010.metadata"
PLAN_GLOBALS = {f"torch.distributed.checkpoint.planner.{n}"
                for n in ("SavePlan", "WriteItem", "WriteItemType", "TensorWriteData")}


def test_dcp_metadata_written_by_megatron_core() -> None:
    data = MEGATRON_METADATA.read_bytes()
    found = picklescan.scan_pickle(data, ".metadata", dcpmeta._SCAN_ALLOWED)
    assert {g for g in found if ".planner." in g} == PLAN_GLOBALS
    meta = dcpmeta.parse_dcp_metadata(data)
    assert meta.references == {"__0_0.distcp": 168147, "__0_1.distcp": 177763,
                               "__1_0.distcp": 157512, "__1_1.distcp": 143007}
    assert meta.version == "1.0.0" and meta.entries == 27 and not meta.transformed


def _with_plans(tmp_path: Path, *items: object) -> bytes:
    """A real DCP save's metadata carrying save plans as megatron-core adds them
    (`Metadata.all_local_plans`), with `items` as the plan items."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.planner import SavePlan

    md = FileSystemReader(str(writers.save_dcp(tmp_path / "ckpt"))).read_metadata()
    md.all_local_plans = [SavePlan(items=list(items), planner_data={})]  # type: ignore[attr-defined]
    return pickle.dumps(md, protocol=4)


def test_dcp_metadata_with_save_plans_parses_as_without(tmp_path: Path) -> None:
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        MetadataIndex,
        TensorProperties,
    )
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

    shard = WriteItem(MetadataIndex("w", torch.Size([0, 0])), WriteItemType.SHARD,
                      tensor_data=TensorWriteData(
                          ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([4, 4])),
                          TensorProperties(dtype=torch.bfloat16), torch.Size([8, 4])))
    blob = WriteItem(MetadataIndex("rng_state/shard_0_2"), WriteItemType.BYTE_IO)
    data = _with_plans(tmp_path / "a", shard, blob)
    without = dcpmeta.parse_dcp_metadata((tmp_path / "a" / "ckpt" / ".metadata").read_bytes())
    assert dcpmeta.parse_dcp_metadata(data) == without


class _Calls:
    """Pickles as a call of `fn(*args)`: what a hostile `.metadata` puts among the plan items."""

    def __init__(self, fn: object, *args: object) -> None:
        self.fn, self.args = fn, args

    def __reduce__(self) -> tuple[object, ...]:
        return (self.fn, self.args)


def _near_misses() -> dict[str, tuple[object, ...]]:
    """Globals that look like the allowed plan classes, or sit beside them, and are not data."""
    from torch.distributed.checkpoint import filesystem, planner, planner_helpers

    return {
        "os.system": (__import__("os").system, "touch {marker}"),
        "builtins.exec": (exec, "open({marker!r}, 'w')"),
        "a DCP function beside the plan classes": (planner_helpers._create_write_items, "w", 1),
        "a method of an allowed class": (planner.WriteItem.tensor_storage_size, None),
        "a DCP dataclass no save writes": (planner.LoadPlan, []),
        "a DCP class that does I/O": (filesystem.FileSystemWriter, "{marker}"),
    }


@pytest.mark.parametrize("name", list(_near_misses()))
def test_dcp_metadata_with_plans_naming_other_globals_is_unsafe(tmp_path: Path,
                                                                name: str) -> None:
    marker = tmp_path / "pwned"
    fn, *args = _near_misses()[name]
    args = [a.format(marker=str(marker)) if isinstance(a, str) else a for a in args]
    data = _with_plans(tmp_path, _Calls(fn, *args))
    assert _reason(dcpmeta.parse_dcp_metadata, data) == "unsafe_pickle"
    assert not marker.exists()


def test_dcp_metadata_path_escape_is_unsafe_path() -> None:
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex

    md = Metadata(state_dict_metadata={},
                  storage_data={MetadataIndex("x"): _StorageInfo("../../etc/passwd", 0, 10)})
    assert _reason(dcpmeta.parse_dcp_metadata, pickle.dumps(md)) == "unsafe_path"
