"""ckptd.dcp.StorageReader: a real dcp.save, compressed and committed as the daemon does it,
loaded back with dcp.load straight from the remote (file:// and the S3 server), checked tensor
by tensor; only the wanted ranges fetched; every failure an error naming the object."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from support.dcp_state import ROOT, blank_like, same, saved, state
from support.published import publish
from torch.distributed.checkpoint.api import CheckpointException

from ckptd.backends import LocalBackend
from ckptd.dcp import StorageReader
from ckptd.errors import NotFound
from ckptd.remote.manifest import step_prefix

pytest_plugins = ["s3server"]  # fixtures: s3_server, s3_url


@pytest.fixture
def local_remote(tmp_path: Path) -> tuple[LocalBackend, str]:
    where = tmp_path / "remote"
    return LocalBackend(str(where)), f"file://{where}"


@pytest.mark.parametrize("codec", ["auto", "zstd", "zstd-bytegroup", "none"])
def test_a_dcp_step_loads_from_a_file_remote(tmp_path: Path, local_remote: Any,
                                             codec: str) -> None:
    backend, url = local_remote
    saved(tmp_path, backend, 3, codec=codec)
    dest = blank_like(state(3))
    reader = StorageReader(ROOT, step=3, remote=url)
    dcp.load(dest, storage_reader=reader, no_dist=True)
    assert same(dest, state(3))
    assert reader.step == 3


def test_latest_is_the_newest_committed_step_on_s3(tmp_path: Path, s3_server: Any, s3_url: str,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from support.uploads import s3_backend

    backend = s3_backend(s3_server, s3_url)
    saved(tmp_path, backend, 1, 2)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_server.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_server.secret_key)
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server.endpoint)
    monkeypatch.setenv("AWS_REGION", s3_server.region)
    dest = blank_like(state(2))
    reader = StorageReader(ROOT, remote=s3_url)
    dcp.load(dest, storage_reader=reader, no_dist=True)
    assert reader.step == 2 and same(dest, state(2))
    # an uncommitted step (objects, no manifest) is not "latest"
    backend.delete(f"{step_prefix(ROOT, 2)}/MANIFEST.json")
    again = blank_like(state(1))
    dcp.load(again, storage_reader=StorageReader(ROOT, remote=s3_url), no_dist=True)
    assert same(again, state(1))


def test_a_partial_load_fetches_only_its_blocks(tmp_path: Path, local_remote: Any) -> None:
    backend, url = local_remote
    saved(tmp_path, backend, 5)
    stored = sum(f.stored_size for f in StorageReader(ROOT, 5, remote=url)._open().files())
    want = {"model": {"ids": torch.zeros(5000, dtype=torch.int64)}}
    reader = StorageReader(ROOT, 5, remote=url)
    dcp.load(want, storage_reader=reader, no_dist=True)
    assert torch.equal(want["model"]["ids"], state(5)["model"]["ids"])
    assert reader.stats.stored_bytes < 0.3 * stored, (reader.stats, stored)


def test_into_a_non_contiguous_destination(tmp_path: Path, local_remote: Any) -> None:
    backend, url = local_remote
    saved(tmp_path, backend, 6)
    holder = torch.zeros(300, 200)
    dest = {"model": {"w": holder.t()}}  # a transposed view: filled through a copy
    dcp.load(dest, storage_reader=StorageReader(ROOT, 6, remote=url), no_dist=True)
    assert torch.equal(holder.t(), state(6)["model"]["w"])


def test_errors_name_the_object(tmp_path: Path, local_remote: Any) -> None:
    backend, url = local_remote
    saved(tmp_path, backend, 7)
    reader = StorageReader(ROOT, 7, remote=url)
    files = reader._open().files()
    data = max(files, key=lambda f: f.stored_size)
    obj = Path(backend.base) / step_prefix(ROOT, 7) / data.key
    raw = bytearray(obj.read_bytes())
    raw[len(raw) // 2] ^= 0x40
    obj.write_bytes(raw)
    # DCP wraps a reader's error in its CheckpointException, keeping the message
    key = data.key.replace(".", r"\.")
    with pytest.raises(CheckpointException, match=f"CorruptData: .*{key}.*checksum mismatch"):
        dcp.load(blank_like(state(7)), storage_reader=StorageReader(ROOT, 7, remote=url),
                 no_dist=True)
    os.unlink(obj)
    with pytest.raises(CheckpointException, match=f"NotFound: .*{key}.*missing"):
        dcp.load(blank_like(state(7)), storage_reader=StorageReader(ROOT, 7, remote=url),
                 no_dist=True)
    with pytest.raises(NotFound, match="step 8"):
        assert StorageReader(ROOT, 8, remote=url).step


def test_a_step_from_the_config(tmp_path: Path, local_remote: Any) -> None:
    backend, url = local_remote
    root = saved(tmp_path, backend, 9)
    conf = tmp_path / "ckptd.toml"
    conf.write_text(f'[daemon]\nstate_dir = "{tmp_path / "state"}"\n'
                    f'[[roots]]\nname = "{ROOT}"\npath = "{root}"\n'
                    f'[roots.upload]\nurl = "{url}"\n')
    dest = blank_like(state(9))
    dcp.load(dest, storage_reader=StorageReader(ROOT, config=conf), no_dist=True)
    assert same(dest, state(9))


def test_a_step_saved_through_dcp_stream_transforms(tmp_path: Path, local_remote: Any) -> None:
    """DCP's own zstd extension compresses each item: the reader undoes it as DCP does."""
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint._extension import ZStandard

    backend, url = local_remote
    root = tmp_path / "root"
    writer = FileSystemWriter(root / "step-4", _extensions=[ZStandard()])
    dcp.save(state(4), storage_writer=writer, no_dist=True)
    publish(root, ROOT, 4, backend)
    dest = blank_like(state(4))
    dcp.load(dest, storage_reader=StorageReader(ROOT, 4, remote=url), no_dist=True)
    assert same(dest, state(4))
