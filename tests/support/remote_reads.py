"""A DCP and a native step committed to a file:// remote as the daemon does it, damaged in
place, and loaded back through each loader with its error checked. Holds no tests."""

from __future__ import annotations

import dataclasses
import io
import json
import shutil
import tracemalloc
from collections.abc import Callable
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import ckptd
import ckptd.torch as ckpt
from ckptd.backends import LocalBackend
from ckptd.codec import make_encoder
from ckptd.dcp import StorageReader
from ckptd.errors import CkptdError
from ckptd.fileio import HashSink
from ckptd.remote.manifest import MANIFEST_NAME, Manifest, StoredFile, parse_manifest, step_prefix
from support.published import publish

# What a failed load may allocate on the Python side (tracemalloc: bytes objects, numpy
# buffers): a few blocks and spans in flight, far below what a lying size would ask for.
MEMORY_BOUND = 192 << 20


@dataclasses.dataclass(frozen=True)
class Kind:
    """A published step: root, step, a big data file (read by ranges) and a small one."""

    root: str
    step: int
    data: str
    small: str


KINDS = {
    "dcp": Kind("llm", 1, "step-1/__0_0.distcp", "step-1/.metadata"),  # zstd-bytegroup
    "dcp-zstd": Kind("llmz", 1, "step-1/__0_0.distcp", "step-1/.metadata"),
    "native": Kind("r", 3, "step-3/model.pt", "step-3/meta.json"),
}


STREAMED = Kind("llmn", 1, "step-1/__0_0.distcp", "step-1/.metadata")  # codec none: no index


def dcp_state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    return {"big": torch.randn(3_000_000, generator=g),  # 12 MB: three 4 MiB blocks
            "w": torch.randn(300, 200, generator=g), "step": 5}


def blank_dcp() -> dict[str, Any]:
    return {"big": torch.zeros(3_000_000), "w": torch.zeros(300, 200), "step": 0}


def native_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(1024, 2048), torch.nn.Linear(2048, 16))  # 8 MB


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every kind's step committed to one file:// remote (base/remote), built once."""
    base = tmp_path_factory.mktemp("hostile")
    backend = LocalBackend(str(base / "remote"))
    for kind, codec in ((KINDS["dcp"], "auto"), (KINDS["dcp-zstd"], "zstd"), (STREAMED, "none")):
        dcp.save(dcp_state(), checkpoint_id=base / kind.root / "step-1", no_dist=True)
        publish(base / kind.root, kind.root, 1, backend, codec=codec)
    native = KINDS["native"]
    ckpt.save(base / native.root, native.step, model=native_model(0), register=False)
    publish(base / native.root, native.root, native.step, backend)
    return base


@pytest.fixture
def remote(source: Path, tmp_path: Path) -> Path:
    """A copy of the source remote for one test to damage."""
    shutil.copytree(source / "remote", tmp_path / "remote")
    return tmp_path / "remote"


def url_of(remote: Path) -> str:
    return f"file://{remote}"


def manifest(remote: Path, kind: Kind) -> Manifest:
    path = remote / step_prefix(kind.root, kind.step) / MANIFEST_NAME
    return parse_manifest(path.read_bytes())


def stored(remote: Path, kind: Kind, path: str) -> tuple[Path, StoredFile]:
    """The stored object of original file `path` and its manifest entry."""
    (f,) = [f for f in manifest(remote, kind).files if f.path == path]
    return remote / step_prefix(kind.root, kind.step) / f.key, f


def load(kind: Kind, url: str) -> None:
    if kind.root == "r":
        ckpt.load(Path("/nonexistent/nowhere") / kind.root, step=kind.step,
                  model=native_model(1), source="remote", remote=url)
    else:
        dcp.load(blank_dcp(), storage_reader=StorageReader(kind.root, kind.step, remote=url),
                 no_dist=True)


def failure(fn: Callable[[], Any]) -> BaseException:
    """The error `fn` ended with, taken out of DCP's CheckpointException (one rank), with the
    Python-side memory it held at its peak checked against MEMORY_BOUND."""
    tracemalloc.start()
    try:
        with pytest.raises((CkptdError, CheckpointException)) as info:
            fn()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < MEMORY_BOUND, f"the failed load held {peak} bytes at its peak"
    exc: BaseException = info.value
    if isinstance(exc, CheckpointException):
        (exc,) = [e for e, _trace in exc.failures.values()]
    return exc


def load_error(kind: Kind, url: str) -> BaseException:
    """The error loading `kind` from `url` ends with. DCP turns a failed metadata read into an
    AssertionError carrying the reader's message (and its type lost): then the reader's own
    error, from reading the metadata directly, must be the one that message carried."""
    exc = failure(lambda: load(kind, url))
    if isinstance(exc, AssertionError) and "global metadata read failed:" in str(exc):
        direct = failure(StorageReader(kind.root, kind.step, remote=url).read_metadata)
        assert f"global metadata read failed: {direct};" in str(exc), (direct, exc)
        return direct
    return exc


def ckptd_error(exc: BaseException, kind_of: type[CkptdError], *names: str) -> None:
    """`exc` is a `kind_of` whose message names each of `names`."""
    assert isinstance(exc, kind_of), f"{type(exc).__name__}: {exc}"
    for name in names:
        assert name in str(exc), f"{name!r} not in: {exc}"


def replace_file(remote: Path, kind: Kind, path: str, data: bytes) -> StoredFile:
    """Commit `data` as file `path` of the step in place of what was there, the way the daemon
    would have stored it (zstd, the manifest's size and hash matching): only what the file
    holds is hostile, not how it is stored."""
    prefix = remote / step_prefix(kind.root, kind.step)
    old = manifest(remote, kind)
    out = io.BytesIO()
    enc = make_encoder("zstd", out)
    enc.update(0, memoryview(data))
    enc.finish(len(data))
    h = HashSink()
    h.update(0, memoryview(data))
    h.finish(len(data))
    files, new = [], None
    for f in old.files:
        if f.path == path:
            (prefix / f.key).unlink()
            new = f = dataclasses.replace(f, size=len(data), hash=h.digest, codec=enc.codec,
                                          stored_size=enc.stored_size, key=path + enc.suffix)
            (prefix / f.key).write_bytes(out.getvalue())
        files.append(f)
    assert new is not None
    (prefix / MANIFEST_NAME).write_bytes(
        dataclasses.replace(old, files=tuple(files)).to_bytes())
    return new


def list_in_meta(remote: Path, kind: Kind, path: str, size: int) -> None:
    """A native step's `meta.json` made to list `path` at `size` (its hash sealed in the
    manifest): a hostile bucket's owner keeps the two agreeing, so what the test puts in the
    file reaches the loader's check of the file itself."""
    with ckptd.open(kind.root, kind.step, kind.small, remote=url_of(remote)) as f:
        meta = json.loads(f.read())
    (listed,) = [e for e in meta["files"] if e["path"] == PurePosixPath(path).name]
    listed["size"] = size
    replace_file(remote, kind, kind.small, json.dumps(meta).encode())


def lie_in_manifest(remote: Path, kind: Kind, path: str, **fields: Any) -> None:
    prefix = remote / step_prefix(kind.root, kind.step)
    doc = json.loads((prefix / MANIFEST_NAME).read_text())
    (entry,) = [f for f in doc["files"] if f["path"] == path]
    entry.update(fields)
    (prefix / MANIFEST_NAME).write_text(json.dumps(doc))
