"""Hostile pickles that once passed the scan: each would run a command under a full
`torch.load`; each must now be judged invalid, and nothing from it may ever run. Real files,
written with pickle/zipfile/torch; the payload would create a marker file if it ever ran."""

from __future__ import annotations

import io
import os
import pickle
import zipfile
from pathlib import Path

import pytest
import torch
from writers import save_torch

from ckptd.formats.picklescan import LEGACY_MAGIC
from ckptd.model import Candidate
from ckptd.stages.validate import validate


class Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, ...]:
        return (os.system, (f"touch {self.marker}",))


def judge(root: Path, name: str) -> tuple[bool, str]:
    r = validate(root, Candidate("single", 1, name, (name,), True))
    return r.valid, r.reason


@pytest.mark.parametrize("protocol", [0, 1, 2, 4])
@pytest.mark.parametrize("name", ["model_step_1.pt", "pytorch_model.bin", "weights_step_1.pkl"])
def test_a_plain_pickle_of_any_protocol_is_scanned(tmp_path: Path, protocol: int,
                                                   name: str) -> None:
    marker = tmp_path / "ran"
    (tmp_path / name).write_bytes(pickle.dumps({"w": Payload(marker)}, protocol=protocol))
    assert judge(tmp_path, name) == (False, "unsafe_pickle")
    assert not marker.exists()


def test_a_zip_pickle_member_differing_only_in_case_is_scanned(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    good = tmp_path / "good.pt"
    save_torch(good)
    bad = tmp_path / "model_step_1.pt"
    with zipfile.ZipFile(good) as src, zipfile.ZipFile(bad, "w", zipfile.ZIP_STORED) as dst:
        for info in src.infolist():
            data = src.read(info)
            if info.filename.endswith("/data.pkl"):
                dst.writestr(info.filename[:-len("data.pkl")] + "DATA.PKL",
                             pickle.dumps(Payload(marker), protocol=2))
            else:
                dst.writestr(info, data)
    valid, reason = judge(tmp_path, "model_step_1.pt")
    assert not valid and reason == "unsafe_pickle", reason
    assert not marker.exists()


def _legacy_file(magic_pickle: bytes, payload: object) -> bytes:
    buf = io.BytesIO()
    buf.write(magic_pickle)
    pickle.dump(1001, buf, protocol=2)  # protocol version
    pickle.dump({"protocol_version": 1001, "little_endian": True}, buf, protocol=2)
    pickle.dump(payload, buf, protocol=2)
    pickle.dump([], buf, protocol=2)  # storage keys
    return buf.getvalue()


@pytest.mark.parametrize("padding", [0, 200, 2 * 1024 * 1024])
def test_a_legacy_file_with_its_magic_number_moved_is_scanned_whole(tmp_path: Path,
                                                                   padding: int) -> None:
    """The magic number's pickle padded (a string pushed and popped first): torch still reads
    it as the magic and then unpickles the object pickle."""
    marker = tmp_path / "ran"
    body = pickle.dumps(LEGACY_MAGIC, protocol=2)[2:]  # without PROTO
    pad = b""
    if padding:
        pad = b"B" + len(b"A" * padding).to_bytes(4, "little") + b"A" * padding + b"0"
    magic = b"\x80\x02" + pad + body
    assert pickle.loads(magic) == LEGACY_MAGIC
    (tmp_path / "model_step_1.pt").write_bytes(_legacy_file(magic, {"w": Payload(marker)}))
    assert judge(tmp_path, "model_step_1.pt") == (False, "unsafe_pickle")
    assert not marker.exists()


def test_a_real_legacy_torch_file_is_still_valid(tmp_path: Path) -> None:
    torch.save({"w": torch.ones(3)}, tmp_path / "model_step_1.pt",
               _use_new_zipfile_serialization=False)
    assert judge(tmp_path, "model_step_1.pt") == (True, "")


def test_a_raw_bin_that_is_not_a_pickle_stays_opaque(tmp_path: Path) -> None:
    (tmp_path / "tokenizer.bin").write_bytes(b"(not a pickle at all" + bytes(range(256)))
    assert judge(tmp_path, "tokenizer.bin") == (True, "")


def _edit_sizes(path: Path, size: bytes, stride: bytes) -> None:
    """Rewrite the size and stride tuples of the one tensor in a torch zip's data.pkl, as a
    hostile writer would (`size`/`stride`: a pickled int, e.g. b"K\\xc8" for 200)."""
    with zipfile.ZipFile(path) as z:
        entries = [(i, z.read(i)) for i in z.infolist()]
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        for info, data in entries:
            if info.filename.endswith("data.pkl"):
                old = b"K\x10\x85q\x08K\x01\x85q\t"  # (16,) q8 (1,) q9
                assert old in data
                data = data.replace(old, size + b"\x85q\x08" + stride + b"\x85q\t", 1)
            z.writestr(info, data)


@pytest.mark.parametrize(("size", "stride", "reason"), [
    (b"K\xc8", b"K\x01", "bad_metadata"),  # 200 elements of a storage of 16
    (b"\x8a\x06" + (2**40).to_bytes(6, "little"), b"K\x00", ""),  # stride 0: 2^40 views
])
def test_deep_validation_checks_a_tensors_extent_before_its_data(
        tmp_path: Path, size: bytes, stride: bytes, reason: str) -> None:
    path = tmp_path / "model_step_1.pt"
    torch.save({"w": torch.arange(16, dtype=torch.float32)}, path)
    _edit_sizes(path, size, stride)
    r = validate(tmp_path, Candidate("single", 1, path.name, (path.name,), True), deep=True)
    if reason:  # torch's loader refuses it first (bad_header), or the extent check does
        assert not r.valid and r.reason in ("bad_header", "bad_metadata"), r
    else:  # scanned through its one stored element, not 2^40 copies of it
        assert r.valid, r


def test_a_zip_member_name_that_is_not_its_declared_utf8_is_bad_header(tmp_path: Path) -> None:
    path = tmp_path / "model_step_1.pt"
    save_torch(path)
    with zipfile.ZipFile(path, "a") as z:
        z.writestr("model_step_1/extra-\u00e1.bin", b"x")  # zipfile flags a UTF-8 name
    raw = path.read_bytes()
    assert raw.count("\u00e1".encode()) == 2  # local header and central directory
    path.write_bytes(raw.replace("\u00e1".encode(), b"\xff\xfe"))
    assert judge(tmp_path, path.name) == (False, "bad_header")


def test_a_memo_bomb_is_refused_with_bounded_work(tmp_path: Path) -> None:
    """8 MiB of MEMOIZE opcodes: 8 million memo entries if kept (682 MiB peak RSS when it was);
    the scan stops at its bound and says why."""
    from ckptd.errors import ValidationFailed
    from ckptd.formats import picklescan

    bomb = b"\x80\x04N" + b"\x94" * (8 << 20) + b"."
    with pytest.raises(ValidationFailed) as err:
        picklescan.scan_pickle(bomb, "bomb")
    assert err.value.reason == "bad_header" and "memory bomb" in err.value.message


@pytest.mark.parametrize(("drop", "reason"), [(True, "missing_file"), (False, "truncated")])
def test_a_crc_clean_zip_whose_storage_is_missing_or_short_is_invalid(
        tmp_path: Path, drop: bool, reason: str) -> None:
    """Every member's CRC is right, but the pickle references a storage that has no member
    (or fewer bytes than it needs): torch.load would fail, so it is never a valid checkpoint."""
    good = tmp_path / "good.pt"
    torch.save({"w": torch.ones(64)}, good)
    bad = tmp_path / "model_step_1.pt"
    with zipfile.ZipFile(good) as src, zipfile.ZipFile(bad, "w", zipfile.ZIP_STORED) as dst:
        for info in src.infolist():
            data = src.read(info)
            if info.filename.endswith("/data/0"):
                if drop:
                    continue
                data = data[:16]
            dst.writestr(info, data)
    assert judge(tmp_path, bad.name) == (False, reason)


def test_a_metadata_memo_bomb_is_refused_before_the_unpickler_runs() -> None:
    from ckptd.formats import dcpmeta

    bomb = b"\x80\x04N" + b"\x94" * (4 << 20) + b"."
    with pytest.raises(Exception) as err:
        dcpmeta.parse_dcp_metadata(bomb, ".metadata")
    assert getattr(err.value, "reason", "") == "bad_metadata"
    assert "memory bomb" in str(err.value)


def test_a_symlink_member_in_a_torch_zip_is_bad_header(tmp_path: Path) -> None:
    path = tmp_path / "model_step_1.pt"
    save_torch(path)
    with zipfile.ZipFile(path, "a") as z:
        info = zipfile.ZipInfo("model_step_1/link")
        info.create_system = 3
        info.external_attr = (0o120777 << 16)  # S_IFLNK
        z.writestr(info, "/etc/passwd")
    assert judge(tmp_path, path.name) == (False, "bad_header")
