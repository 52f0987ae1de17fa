"""Loading from a hostile remote: a DCP step (both block codecs) and a native step, committed
as the daemon does it, then damaged in the bucket (a missing, cut, lengthened or flipped
object, a garbage block index, a pickle that would run code, a lost or lying manifest) or
served by a stalled store. Each load ends in a ckptd error naming the object (inside DCP's
CheckpointException for DCP), within bounded time and memory; nothing named by a file runs.
`ckptd.open` reads back what it read, and fails at the block that is corrupt."""

from __future__ import annotations

import io
import os
import pickle
import re
import struct
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from s3server import S3Server
from support.published import publish
from support.remote_reads import (
    KINDS,
    STREAMED,
    ckptd_error,
    failure,
    lie_in_manifest,
    list_in_meta,
    load_error,
    remote,
    replace_file,
    source,
    stored,
    url_of,
)

import ckptd
from ckptd.codec import TAIL_PROBE, Block, read_index
from ckptd.dcp import StorageReader
from ckptd.errors import CkptdError, CorruptData, NotFound, TransientError, ValidationFailed
from ckptd.remote.manifest import MANIFEST_NAME, StoredFile, step_prefix

pytest_plugins = ["s3server"]  # fixtures: s3_server, s3_url, fault_proxy
# A hang is a failure, not a wait for the suite's timeout; DCP warns when it runs without a
# process group, which is what these loads mean.
pytestmark = [pytest.mark.timeout(90),
              pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]
__all__ = ["remote", "source"]  # fixtures of support.remote_reads, used here by name


def flip_block(obj: Path, f: StoredFile, i: int) -> Block:
    """Flip a byte in the middle of block `i` of stored object `obj` (found by its index)."""
    raw = bytearray(obj.read_bytes())
    index = read_index(f.codec, f.stored_size, f.size, bytes(raw[-TAIL_PROBE:]),
                       lambda s, e: bytes(raw[s:e]))
    assert index is not None
    b = index.blocks[i]
    raw[b.stored_start + b.stored_len // 2] ^= 0x10
    obj.write_bytes(raw)
    return b


# -- damaged data objects ----------------------------------------------------------------------


def damage(obj: Path, f: StoredFile, how: str) -> str:
    """Damage stored object `obj` (manifest entry `f`) `how`; what the error must also say."""
    raw = bytearray(obj.read_bytes())
    many = 0xFFFFFFFF
    footer = 28 if f.codec == "zstd-bytegroup" else 9  # the container's; the seek table's
    if how == "missing":
        obj.unlink()
        return "missing"
    if how == "flipped-block":
        return f"(raw offset {flip_block(obj, f, 1).raw_start})"
    if how in ("cut-1", "cut-half"):
        del raw[len(raw) - 1 if how == "cut-1" else len(raw) // 2 :]
    elif how == "appended":
        raw += b"\0" * 17
    elif how == "garbage-footer":  # no index magic left
        raw[-28:] = bytes(range(100, 128))
    elif how == "ones-footer":  # the magic kept, all ones before it
        raw[-footer:-4] = b"\xff" * (footer - 4)
    elif how == "lying-footer":  # well formed, claiming 2**32-1 blocks: 32 GiB if believed
        if f.codec == "zstd-bytegroup":  # index length, blocks, block size, version, flags
            raw[-28:-8] = struct.pack("<QIIBBH", many * 8, many, 4 << 20, 3, 0, 0)
        else:  # frames, descriptor (checksums present)
            raw[-9:-4] = struct.pack("<IB", many, 0x80)
    obj.write_bytes(raw)
    return ""


@pytest.mark.parametrize("how", [
    "missing", "cut-1", "cut-half", "garbage-footer", "ones-footer", "lying-footer",
    "flipped-block", "appended"])
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_damaged_data_object(remote: Path, kind: str, how: str) -> None:
    k = KINDS[kind]
    obj, f = stored(remote, k, k.data)
    also = damage(obj, f, how)
    error = NotFound if how == "missing" else CorruptData
    ckptd_error(load_error(k, url_of(remote)), error, f.key, also)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_bytes_appended_to_a_small_object(remote: Path, kind: str) -> None:
    """Read whole as one stream (no index), a small object is checked to its last byte."""
    k = KINDS[kind]
    obj, f = stored(remote, k, k.small)
    obj.write_bytes(obj.read_bytes() + b"\0" * 17)
    ckptd_error(load_error(k, url_of(remote)), CorruptData, f.key)


def test_a_manifest_size_far_past_the_object(remote: Path) -> None:
    """The manifest says the data file is a petabyte: refused before anything that size."""
    k = KINDS["dcp"]
    lie_in_manifest(remote, k, k.data, size=1 << 50)
    _obj, f = stored(remote, k, k.data)
    ckptd_error(load_error(k, url_of(remote)), CorruptData, f.key)


# -- a pickle that would run code ------------------------------------------------------------


class Boom:
    """Unpickled by an unchecked loader, this runs `touch <marker>`."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


def test_dcp_metadata_that_names_os_system_is_refused(remote: Path, tmp_path: Path) -> None:
    k = KINDS["dcp"]
    marker = tmp_path / "ran"
    f = replace_file(remote, k, k.small, pickle.dumps(Boom(marker)))
    exc = load_error(k, url_of(remote))
    ckptd_error(exc, CorruptData, f.key, "not DCP metadata", "system")
    assert not marker.exists()


def test_a_native_file_that_names_os_system_is_refused(remote: Path, tmp_path: Path) -> None:
    k = KINDS["native"]
    marker = tmp_path / "ran"
    buf = io.BytesIO()
    torch.save({"weight": torch.zeros(2), "x": Boom(marker)}, buf)
    replace_file(remote, k, k.data, buf.getvalue())
    list_in_meta(remote, k, k.data, len(buf.getvalue()))
    exc = load_error(k, url_of(remote))
    ckptd_error(exc, ValidationFailed, k.data, "refused")
    assert not marker.exists()


# -- the manifest ----------------------------------------------------------------------------


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_step_without_its_manifest_is_not_committed(remote: Path, kind: str) -> None:
    k = KINDS[kind]
    (remote / step_prefix(k.root, k.step) / MANIFEST_NAME).unlink()
    exc = load_error(k, url_of(remote))
    ckptd_error(exc, NotFound, f"step {k.step}", f"{step_prefix(k.root, k.step)}/{MANIFEST_NAME}")
    # nor is it "latest": the root has no committed step at all now
    with pytest.raises(NotFound, match="no committed step"):
        ckptd.open(k.root, "latest", k.data, remote=url_of(remote))


@pytest.mark.parametrize("key", ["../step-2/x.zbg", "/etc/passwd", "step-1/../../../x",
                                 "step-1/./x.zbg", "step-1//x.zbg"])
@pytest.mark.parametrize("kind", ["dcp", "native"])
def test_a_manifest_naming_a_key_outside_the_step(remote: Path, kind: str, key: str) -> None:
    k = KINDS[kind]
    lie_in_manifest(remote, k, k.data, key=key)
    exc = load_error(k, url_of(remote))
    ckptd_error(exc, CorruptData, f"{step_prefix(k.root, k.step)}/{MANIFEST_NAME}",
                "unsafe path")


# -- ckptd.open ------------------------------------------------------------------------------


def test_open_a_file_the_step_does_not_have(remote: Path) -> None:
    k = KINDS["dcp"]
    with pytest.raises(NotFound, match="step-1/__9_0.distcp"):
        ckptd.open(k.root, k.step, "step-1/__9_0.distcp", remote=url_of(remote))


@pytest.mark.parametrize("kind", [*sorted(KINDS), "streamed"])
def test_open_reads_the_same_bytes_again_after_a_seek_back(source: Path, kind: str) -> None:
    k = STREAMED if kind == "streamed" else KINDS[kind]
    want = (source / k.root / k.data).read_bytes()
    with ckptd.open(k.root, k.step, k.data, remote=url_of(source / "remote")) as f:
        assert f.read() == want
        assert f.read() == b""
        f.seek(0)
        assert f.read() == want
        f.seek(len(want) // 2 + 3)
        assert f.read(100) == want[len(want) // 2 + 3 :][:100]
        f.seek(7)
        assert f.read(5) == want[7:12]


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_open_fails_at_the_corrupt_block(source: Path, remote: Path, kind: str) -> None:
    k = KINDS[kind]
    obj, f = stored(remote, k, k.data)
    b = flip_block(obj, f, 1)
    want = (source / k.root / k.data).read_bytes()
    with ckptd.open(k.root, k.step, k.data, remote=url_of(remote)) as fh:
        assert fh.read(b.raw_start) == want[: b.raw_start]  # block 0 is whole
        with pytest.raises(CorruptData, match=re.escape(f.key)):
            fh.read(4096)
        fh.seek(b.raw_start + b.raw_len)  # past it: the blocks after it still read
        assert fh.read(4096) == want[b.raw_start + b.raw_len :][:4096]


# -- a stalled store -------------------------------------------------------------------------

READ_TIMEOUT_S, ATTEMPTS, STALL_S = 0.5, 2, 60.0


@pytest.fixture
def behind_proxy(tmp_path: Path, s3_server: S3Server, s3_url: str, fault_proxy: Any) -> Path:
    """A DCP step (40 MB: five 8 MiB spans) committed to the S3 server, and a config whose
    root reads it through the fault proxy with a short read timeout and few attempts."""
    from support.uploads import s3_backend

    root = tmp_path / "root"
    g = torch.Generator().manual_seed(1)
    dcp.save({"big": torch.randn(10_000_000, generator=g)}, checkpoint_id=root / "step-1",
             no_dist=True)
    publish(root, "llm", 1, s3_backend(s3_server, s3_url))
    conf = tmp_path / "ckptd.toml"
    conf.write_text(
        f'[daemon]\nstate_dir = "{tmp_path / "state"}"\n'
        f'[[roots]]\nname = "llm"\npath = "{root}"\n'
        f'[roots.upload]\nurl = "{s3_url}"\nendpoint = "{fault_proxy.endpoint}"\n'
        f'region = "{s3_server.region}"\naccess_key_id = "{s3_server.access_key}"\n'
        f'secret_access_key = "{s3_server.secret_key}"\n'
        f'read_timeout = "{int(READ_TIMEOUT_S * 1000)}ms"\nattempts = {ATTEMPTS}\n')
    return conf


def stalled_load(reader: StorageReader, fault_proxy: Any) -> str:
    """Stall every new connection, load: the message the load failed with, in bounded time."""
    fault_proxy.set("stall", count=1000, stall_s=STALL_S)
    started = time.monotonic()
    exc = failure(lambda: dcp.load({"big": torch.zeros(10_000_000)}, storage_reader=reader,
                                   no_dist=True))
    took = time.monotonic() - started
    assert fault_proxy.stats()["faults"] >= ATTEMPTS
    # Each try waits one read timeout (3 x attempts tries: see the last test);
    # far less than the stall, and than the default read timeout of a minute.
    assert took < STALL_S / 3, f"the load took {took:.1f} s to fail behind a stalled store"
    # The metadata read failed: DCP's AssertionError carries the reader's message.
    assert isinstance(exc, AssertionError), f"{type(exc).__name__}: {exc}"
    return str(exc).split("global metadata read failed:", 1)[1].split(";")[0]


def test_a_store_stalled_from_the_start_fails_the_load_in_time(
        behind_proxy: Path, fault_proxy: Any) -> None:
    message = stalled_load(StorageReader("llm", 1, config=behind_proxy), fault_proxy)
    key = f"llm/step-1/{MANIFEST_NAME}"
    assert key in message and "timed out" in message, message
    with pytest.raises(TransientError, match=re.escape(key)):  # the type DCP's wrapping lost
        assert StorageReader("llm", 1, config=behind_proxy).step


def test_a_store_that_stalls_once_the_step_is_open_fails_the_load_in_time(
        behind_proxy: Path, fault_proxy: Any) -> None:
    reader = StorageReader("llm", 1, config=behind_proxy)
    assert reader.step == 1  # the step opened through the proxy
    # Every connection it has answers a 500 with "Connection: close", so the reads that
    # follow need new connections, and each of those stalls.
    fault_proxy.set("status", count=1000, status=500)
    with pytest.raises(CkptdError, match=r"\.metadata"):
        reader.read_metadata()
    message = stalled_load(reader, fault_proxy)
    key = "llm/step-1/step-1/.metadata"
    assert key in message and "timed out" in message, message
    with pytest.raises(TransientError, match=re.escape(key)):
        reader.read_metadata()
    reader.close()


def test_a_stalled_store_is_tried_attempts_times_in_all(
        behind_proxy: Path, fault_proxy: Any) -> None:
    from ckptd.fetch.step import RemoteStep

    fault_proxy.set("stall", count=1000, stall_s=STALL_S)
    with pytest.raises(CkptdError, match="timed out"):
        RemoteStep.open("llm", 1, config=behind_proxy)
    # each attempt's request is retried twice at once by the store client (config.example.toml)
    assert fault_proxy.stats()["faults"] == 3 * ATTEMPTS
