"""One cause, one error class, on every read path of a remote step, on file:// and on S3
(SeaweedFS): an object the manifest names that is gone is `NotFound` naming it; one replaced
after the read's first look is `ObjectReplaced` (a NotFound) naming it, never a mix of two
versions; bytes that fail their check are `CorruptData` naming it. The manifest's sizes are
compared with the object before anything of their size is allocated.

The replacement (or the delete) is made by a backend of the same protocol wrapped around the
real one, at a fixed point of the read: after the first ranged read of the object (its block
index), or as its first download starts, so the timing is forced, not raced. The table these
tests hold is in docs/REMOTE_LOAD.md ("Errors")."""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

import pytest
from support.passthrough import PassThrough
from support.remote_reads import (
    KINDS,
    STREAMED,
    Kind,
    ckptd_error,
    failure,
    lie_in_manifest,
    list_in_meta,
    load,
    load_error,
    manifest,
    remote,
    replace_file,
    source,
    stored,
    url_of,
)
from support.uploads import s3_backend
from torch.distributed.checkpoint import FileSystemReader

import ckptd
from ckptd.backends import Backend, LocalBackend
from ckptd.backends.base import COPY_CHUNK, SMALL_OBJECT_MAX
from ckptd.errors import CorruptData, NotFound, ObjectReplaced, PermanentError
from ckptd.fetch.openfile import RemoteFile
from ckptd.fetch.source import read_remote_manifest
from ckptd.fetch.step import RemoteStep
from ckptd.remote.manifest import step_prefix
from ckptd.restore.files import restore_remote

pytest_plugins = ["s3server"]  # fixtures: s3_server, s3_url
pytestmark = [pytest.mark.timeout(120),
              pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]
__all__ = ["remote", "source"]  # fixtures of support.remote_reads, used here by name

DCP = KINDS["dcp"]


class Changing(PassThrough):
    """`inner`, passed through, except that object `key` is changed once, at a fixed point:
    after the first ranged read of it (the block index), or as its first download starts
    (the reader's first look, a HEAD, is made by then). `how`: "rename" puts other bytes of
    the same size through the backend (a new object, as a re-upload makes); "in-place"
    rewrites one byte of the file where it is (file:// only), in the middle of a download
    that takes more than one read (after its first bytes reached the reader); "delete"
    removes it."""

    def __init__(self, inner: Backend, key: str, how: str, file: Path | None) -> None:
        super().__init__(inner)
        self.key, self.how, self.file = key, how, file
        self.changed = False

    def change(self) -> None:
        if self.changed:
            return
        self.changed = True
        if self.how == "delete":
            self.inner.delete(self.key)
            return
        buf = io.BytesIO()
        self.inner.get(self.key, buf)
        data = bytearray(buf.getvalue())
        data[len(data) // 2] ^= 0x40
        if self.how == "rename":
            self.inner.put(self.key, bytes(data))
        else:
            assert self.file is not None
            fd = os.open(self.file, os.O_WRONLY)
            try:
                os.pwrite(fd, bytes(data[len(data) // 2 : len(data) // 2 + 1]), len(data) // 2)
            finally:
                os.close(fd)

    def get(self, key: str, dst: BinaryIO, etag: str | None = None) -> int:
        if key != self.key:
            return self.inner.get(key, dst, etag=etag)
        if self.how != "in-place" or self.inner.stat(key).size <= COPY_CHUNK:
            self.change()
            return self.inner.get(key, dst, etag=etag)
        return self.inner.get(key, _AfterFirstWrite(dst, self.change), etag=etag)

    def get_range(self, key: str, start: int, end: int, etag: str | None = None
                  ) -> bytes | memoryview:
        data = self.inner.get_range(key, start, end, etag)
        if key == self.key:
            self.change()
        return data


class _AfterFirstWrite:
    def __init__(self, dst: BinaryIO, then: Callable[[], None]) -> None:
        self.dst, self.then, self.writes = dst, then, 0

    def write(self, data: Any) -> int:
        n = self.dst.write(data)
        self.writes += 1
        if self.writes == 1:
            self.then()
        return n


# -- the read paths: each reads one file of a step through `backend` -----------------------


def read_blocks(backend: Backend, kind: Kind, path: str, to: Path) -> None:
    """ObjectReader by its block index (a file over 4 MiB stored): the DCP reader's way."""
    with RemoteStep(backend, kind.root, kind.step, manifest_at(backend, kind)) as step:
        step.reader(path).read(None, lambda _at, _view: None)


def read_stream(backend: Backend, kind: Kind, path: str, to: Path) -> None:
    """ObjectReader as one download (a file of 4 MiB or less stored): `.metadata`,
    `meta.json`."""
    read_blocks(backend, kind, path, to)


def read_open(backend: Backend, kind: Kind, path: str, to: Path) -> None:
    """ckptd.open's file object, front to back (by blocks, or streamed where no index)."""
    with RemoteStep(backend, kind.root, kind.step, manifest_at(backend, kind)) as step:
        with io.BufferedReader(RemoteFile(step, path), buffer_size=1 << 20) as f:
            while f.read(1 << 20):
                pass


def read_restore(backend: Backend, kind: Kind, path: str, to: Path) -> None:
    """`ckptd restore`'s download of one file."""
    m = manifest_at(backend, kind)
    restore_remote(backend, dataclasses.replace(m, files=tuple(
        f for f in m.files if f.path == path)), to)


def manifest_at(backend: Backend, kind: Kind) -> Any:
    from ckptd.fetch.source import read_remote_manifest

    return read_remote_manifest(backend, kind.root, kind.step)


# (path, the kind and file it reads: over 4 MiB with an index, or small, or without index)
PATHS: dict[str, tuple[Callable[[Backend, Kind, str, Path], None], Kind, str]] = {
    "blocks": (read_blocks, DCP, DCP.data),
    "stream": (read_stream, DCP, DCP.small),
    "open-blocks": (read_open, DCP, DCP.data),
    "open-stream": (read_open, STREAMED, STREAMED.data),
    "restore": (read_restore, DCP, DCP.data),
    "restore-small": (read_restore, DCP, DCP.small),
}
CAUSES = {"delete": NotFound, "rename": ObjectReplaced, "in-place": ObjectReplaced}


@pytest.fixture(params=["file", "s3"])
def store(request: pytest.FixtureRequest, remote: Path) -> tuple[Backend, Path | None]:
    """The step's objects on a backend; for file://, the directory that holds them."""
    if request.param == "file":
        return LocalBackend(remote), remote
    backend = s3_backend(request.getfixturevalue("s3_server"),
                         request.getfixturevalue("s3_url"))
    for kind in (DCP, STREAMED):
        prefix = step_prefix(kind.root, kind.step)
        for p in sorted((remote / prefix).rglob("*")):
            if p.is_file():
                backend.put(p.relative_to(remote).as_posix(), p.read_bytes())
    return backend, None


@pytest.mark.parametrize("cause", sorted(CAUSES))
@pytest.mark.parametrize("path", sorted(PATHS))
def test_one_cause_one_error_class_on_every_read_path(store: tuple[Backend, Path | None],
                                                       path: str, cause: str,
                                                       tmp_path: Path) -> None:
    backend, base = store
    if cause == "in-place" and base is None:
        pytest.skip("an object store has no in-place rewrite")
    read, kind, name = PATHS[path]
    (f,) = [f for f in manifest_at(backend, kind).files if f.path == name]
    key = f"{step_prefix(kind.root, kind.step)}/{f.key}"
    changing = Changing(backend, key, cause, base / key if base else None)
    with pytest.raises(NotFound) as info:
        read(changing, kind, name, tmp_path / "to")
    assert changing.changed
    ckptd_error(info.value, CAUSES[cause], f.key,
                "missing" if cause == "delete" else "replaced")
    assert (cause == "delete") != isinstance(info.value, ObjectReplaced), info.value
    assert not (tmp_path / "to" / name).exists()


@pytest.mark.parametrize("path", sorted(PATHS))
def test_bytes_that_fail_their_check_are_corrupt_on_every_read_path(
        store: tuple[Backend, Path | None], path: str, tmp_path: Path) -> None:
    backend, _base = store
    read, kind, name = PATHS[path]
    (f,) = [f for f in manifest_at(backend, kind).files if f.path == name]
    key = f"{step_prefix(kind.root, kind.step)}/{f.key}"
    buf = io.BytesIO()
    backend.get(key, buf)
    data = bytearray(buf.getvalue())
    data[len(data) // 2] ^= 0x40
    backend.put(key, bytes(data))  # before the read: the version the read sees is bad
    with pytest.raises(CorruptData) as info:
        read(backend, kind, name, tmp_path / "to")
    ckptd_error(info.value, CorruptData, f.key)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_missing_small_object_is_not_found_on_every_loader(remote: Path, kind: str) -> None:
    """`.metadata` and `meta.json` are read as one download: gone, they are NotFound naming
    the object, as a missing data object is (test_remote_read_damaged)."""
    k = KINDS[kind]
    obj, f = stored(remote, k, k.small)
    obj.unlink()
    ckptd_error(load_error(k, url_of(remote)), NotFound, f.key, "missing")


def test_a_missing_object_is_not_found_to_restore_from_a_local_copy(remote: Path,
                                                                   tmp_path: Path) -> None:
    from ckptd.restore.files import restore_from_dir

    m = manifest(remote, DCP)
    objects = remote / step_prefix(DCP.root, DCP.step)
    (objects / m.files[0].key).unlink()
    with pytest.raises(NotFound, match="missing"):
        restore_from_dir(objects, m, tmp_path / "to")


class _Denied(Changing):
    """`inner`, except that reading `key` is denied, as a store refuses a credential."""

    def get_bytes(self, key: str, limit: int = SMALL_OBJECT_MAX) -> bytes:
        if key == self.key:
            raise PermanentError(f"{self.url}/{key}: access denied")
        return self.inner.get_bytes(key, limit)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_manifest_that_cannot_be_read_keeps_its_class_on_every_path(remote: Path,
                                                                      kind: str) -> None:
    """A denied manifest is the store's error on the loaders' way in as on restore's, never
    called corrupt on one of them; a malformed one is CorruptData on both."""
    k = KINDS[kind]
    key = f"{step_prefix(k.root, k.step)}/MANIFEST.json"
    denied = _Denied(LocalBackend(remote), key, "delete", None)
    for read in (lambda: RemoteStep.at(denied, k.root, k.step),
                 lambda: read_remote_manifest(denied, k.root, k.step)):
        with pytest.raises(PermanentError, match="access denied"):
            read()
    (remote / key).write_text('{"format": "ckptd-manifest/1", "files": 7}')
    plain = LocalBackend(remote)
    for read in (lambda: RemoteStep.at(plain, k.root, k.step),
                 lambda: read_remote_manifest(plain, k.root, k.step)):
        with pytest.raises(CorruptData, match="MANIFEST.json"):
            read()


# -- the manifest's sizes against the object -----------------------------------------------


def test_a_native_file_claiming_a_petabyte_is_refused_before_any_memory(remote: Path) -> None:
    """The memory file a native component is decoded into is sized only after the claim is
    held against the object: CorruptData naming it, not an allocator's error. The bucket's
    owner lies in `meta.json` too (its hash sealed in the manifest), so the claim gets past the
    loader's check that the two agree and reaches the object's own."""
    k = KINDS["native"]
    list_in_meta(remote, k, k.data, 1 << 50)
    lie_in_manifest(remote, k, k.data, size=1 << 50)
    _obj, f = stored(remote, k, k.data)
    ckptd_error(load_error(k, url_of(remote)), CorruptData, f.key, str(1 << 50))


@pytest.mark.parametrize(("kind", "field", "value"), [
    (STREAMED, "size", 1 << 50),  # codec none: the stored bytes are the file
    (STREAMED, "size", None),  # one byte more than stored
    (DCP, "size", 1 << 50),  # past what the stored bytes can hold
    (DCP, "stored_size", 1 << 40),  # the object is not that long
    (DCP, "stored_size", None),
])
def test_open_refuses_sizes_the_object_does_not_hold(remote: Path, kind: Kind, field: str,
                                                     value: int | None) -> None:
    """ckptd.open's size (what a caller sizes its buffers by) is checked at open."""
    _obj, f = stored(remote, kind, kind.data)
    claim = value if value is not None else getattr(f, field) + 1
    lie_in_manifest(remote, kind, kind.data, **{field: claim})
    exc = failure(lambda: ckptd.open(kind.root, kind.step, kind.data, remote=url_of(remote)))
    ckptd_error(exc, CorruptData, f.key, str(claim))


def test_a_good_step_still_loads(remote: Path) -> None:
    for kind in sorted(KINDS):
        load(KINDS[kind], url_of(remote))


def test_a_slice_past_its_file_is_corrupt_naming_the_object(source: Path, remote: Path) -> None:
    """A `.metadata` whose slice reaches past its data file: the range it makes is refused
    as CorruptData naming the data object, before anything is fetched for it."""
    meta = FileSystemReader(str(source / DCP.root / "step-1")).read_metadata()
    (index, info), *_ = sorted(meta.storage_data.items(), key=lambda kv: -kv[1].length)
    meta.storage_data[index] = dataclasses.replace(info, offset=1 << 40)
    replace_file(remote, DCP, DCP.small, pickle.dumps(meta))
    _obj, f = stored(remote, DCP, DCP.data)
    ckptd_error(load_error(DCP, url_of(remote)), CorruptData, f.key, str(1 << 40))


def test_a_replaced_object_keeps_its_class_across_the_restore_process() -> None:
    """`ckptd.torch.load` of a compressed or remote-only step restores in a child process:
    the child's ObjectReplaced reaches the training process as ObjectReplaced."""
    from ckptd.restore import answer

    back = answer.error_of(answer.failed(ObjectReplaced("s3://b/r/step-1/x: replaced")))
    assert type(back) is ObjectReplaced and "step-1/x" in str(back)
