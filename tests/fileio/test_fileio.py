"""fileio: the single streaming read pass, atomic writes, and safe joins under a root."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import xxhash

from ckptd import fileio
from ckptd.errors import UnsafePath, ValidationFailed


class Recorder:
    """A sink that remembers every (offset, length) it saw and which buffer held it."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, int]] = []
        self.buffers: set[int] = set()
        self.data = bytearray()
        self.finished: int | None = None

    def update(self, offset: int, view: memoryview) -> None:
        self.calls.append((offset, len(view)))
        self.buffers.add(id(view.obj))
        self.data += view

    def finish(self, total: int) -> None:
        self.finished = total


def _file(tmp_path: Path, size: int, name: str = "f.bin") -> Path:
    p = tmp_path / name
    p.write_bytes(os.urandom(size))
    return p


@pytest.mark.parametrize("size,chunk", [(0, 16), (1, 16), (1000, 7), (4096, 4096), (10_000, 1024)])
def test_read_pass_sees_each_byte_once_in_order(tmp_path: Path, size: int, chunk: int) -> None:
    p = _file(tmp_path, size)
    a, b = Recorder(), Recorder()
    assert fileio.read_pass(p, [a, b], chunk_size=chunk) == size
    expected_offset = 0
    for offset, length in a.calls:  # contiguous, no overlap, no gap, never over one chunk
        assert offset == expected_offset and 0 < length <= chunk
        expected_offset += length
    assert expected_offset == size
    assert a.calls == b.calls and bytes(a.data) == bytes(b.data) == p.read_bytes()
    assert a.finished == b.finished == size


def test_read_pass_reuses_one_buffer(tmp_path: Path) -> None:
    p = _file(tmp_path, 50_000)
    rec = Recorder()
    fileio.read_pass(p, [rec], chunk_size=1000)
    assert len(rec.calls) == 50 and len(rec.buffers) == 1


def test_hash_sink_is_xxh3_128_of_the_content(tmp_path: Path) -> None:
    p = _file(tmp_path, 123_457)
    h = fileio.HashSink()
    fileio.read_pass(p, [h], chunk_size=4096)
    assert h.digest == xxhash.xxh3_128(p.read_bytes()).hexdigest()
    assert h.size == 123_457 and fileio.HASH_ALG == "xxh3-128" == h.alg


class Grower:
    """A sink that appends to the file it is reading: a writer racing the pass."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def update(self, offset: int, view: memoryview) -> None:
        if offset == 0:
            with open(self.path, "ab") as f:
                f.write(b"more")

    def finish(self, total: int) -> None:
        raise AssertionError("finish must not be called for a file that changed")


def test_read_pass_detects_a_file_growing_during_the_pass(tmp_path: Path) -> None:
    p = _file(tmp_path, 10_000)
    with pytest.raises(ValidationFailed) as err:
        fileio.read_pass(p, [Grower(p)], chunk_size=100_000)
    assert err.value.reason == "changed"


class Shrinker(Grower):
    def update(self, offset: int, view: memoryview) -> None:
        if offset == 0:
            os.truncate(self.path, 10)


def test_read_pass_detects_a_file_shrinking_during_the_pass(tmp_path: Path) -> None:
    p = _file(tmp_path, 10_000)
    with pytest.raises(ValidationFailed) as err:
        fileio.read_pass(p, [Shrinker(p)], chunk_size=1000)
    assert err.value.reason == "changed"


def test_read_pass_missing_file_is_oserror(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        fileio.read_pass(tmp_path / "nope", [])


@pytest.mark.skipif(shutil.which("fincore") is None, reason="needs util-linux fincore")
def test_read_pass_leaves_no_pages_in_cache(tmp_path: Path) -> None:
    p = _file(tmp_path, 4 << 20)
    os.sync()  # dirty pages cannot be dropped; make them clean first
    fileio.read_pass(p, [fileio.HashSink()], chunk_size=1 << 20)
    out = subprocess.run(["fincore", "-nb", "-o", "RES", str(p)], capture_output=True, text=True)
    if out.returncode != 0:
        pytest.skip(f"fincore failed: {out.stderr}")
    assert int(out.stdout.split()[0]) < (1 << 20)


# --- atomic writes -------------------------------------------------------------------------


def test_atomic_write_bytes_replaces_and_leaves_no_temp(tmp_path: Path) -> None:
    target = tmp_path / "latest.json"
    target.write_text("old")
    fileio.atomic_write_bytes(target, b"new")
    assert target.read_bytes() == b"new"
    assert [p.name for p in tmp_path.iterdir()] == ["latest.json"]


def test_atomic_write_json_round_trips(tmp_path: Path) -> None:
    import json

    target = tmp_path / "x.json"
    fileio.atomic_write_json(target, {"step": 3, "path": "a/b"})
    assert json.loads(target.read_text()) == {"step": 3, "path": "a/b"}


def test_atomic_write_json_beneath_a_dir_fd_replaces_a_link_never_writes_through_it(
    tmp_path: Path,
) -> None:
    import json

    outside = tmp_path / "outside"
    outside.write_text("keep")
    d = tmp_path / "d"
    d.mkdir()
    (d / "meta.json").symlink_to(outside)
    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fileio.atomic_write_json("meta.json", {"step": 3}, dir_fd=fd)
        with pytest.raises(ValueError, match="plain name"):
            fileio.atomic_write_json("sub/meta.json", {}, dir_fd=fd)
    finally:
        os.close(fd)
    assert json.loads((d / "meta.json").read_text()) == {"step": 3}
    assert not (d / "meta.json").is_symlink() and outside.read_text() == "keep"
    assert os.listdir(d) == ["meta.json"]


def test_fsync_dir_quietly_ignores_what_it_cannot_open(tmp_path: Path) -> None:
    fileio.fsync_dir(tmp_path / "gone", quiet=True)
    with pytest.raises(FileNotFoundError):
        fileio.fsync_dir(tmp_path / "gone")


def test_temp_names_carry_the_recovery_prefix(tmp_path: Path) -> None:
    t = fileio.temp_name(tmp_path / "latest.json")
    assert t.parent == tmp_path and t.name.startswith(fileio.TEMP_PREFIX)
    assert "latest.json" in t.name and t != fileio.temp_name(tmp_path / "latest.json")


def test_atomic_write_into_missing_dir_fails_cleanly(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        fileio.atomic_write_bytes(tmp_path / "no" / "x", b"1")


def test_fsync_helpers_accept_files_and_dirs(tmp_path: Path) -> None:
    p = _file(tmp_path, 10)
    fileio.fsync_file(p)
    fileio.fsync_dir(tmp_path)


# --- safe_join -----------------------------------------------------------------------------


def test_safe_join_plain_and_nested(tmp_path: Path) -> None:
    assert fileio.safe_join(tmp_path, "a/b.pt") == tmp_path / "a" / "b.pt"
    assert fileio.safe_join(tmp_path, "./a/../c") == tmp_path / "c"


@pytest.mark.parametrize("rel", ["/etc/passwd", "..", "../x", "a/../../x", "", "a\x00b"])
def test_safe_join_refuses_escapes(tmp_path: Path, rel: str) -> None:
    with pytest.raises(UnsafePath):
        fileio.safe_join(tmp_path, rel)


def test_safe_join_refuses_symlinks_out_of_root(tmp_path: Path) -> None:
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    (outside / "secret").write_text("x")
    (root / "file_link").symlink_to(outside / "secret")
    (root / "dir_link").symlink_to(outside)
    for rel in ("file_link", "dir_link/secret", "dir_link"):
        with pytest.raises(UnsafePath):
            fileio.safe_join(root, rel)


def test_safe_join_allows_symlinks_inside_root(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "real" / "w.pt").write_text("x")
    (tmp_path / "alias").symlink_to(tmp_path / "real")
    assert fileio.safe_join(tmp_path, "alias/w.pt").read_text() == "x"


def test_safe_join_refuses_symlink_loops(tmp_path: Path) -> None:
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    with pytest.raises(UnsafePath):
        fileio.safe_join(tmp_path, "a/x")


# --- remove_tree ---------------------------------------------------------------------------


def _outside(tmp_path: Path) -> Path:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_text("k")
    return outside


def test_remove_tree_unlinks_links_and_keeps_their_targets(tmp_path: Path) -> None:
    outside = _outside(tmp_path)
    top = tmp_path / "top"
    (top / "a" / "b").mkdir(parents=True)
    (top / "a" / "b" / "f").write_text("x")
    (top / "a" / "dir_link").symlink_to(outside)
    (top / "file_link").symlink_to(outside / "keep")
    os.mkfifo(top / "a" / "fifo")
    fileio.remove_tree(top)
    assert not top.exists() and not top.is_symlink()
    assert (outside / "keep").read_text() == "k"


def test_remove_tree_of_a_link_removes_only_the_link(tmp_path: Path) -> None:
    outside = _outside(tmp_path)
    (tmp_path / "link").symlink_to(outside)
    fileio.remove_tree(tmp_path / "link")
    assert not (tmp_path / "link").is_symlink() and (outside / "keep").exists()


def test_remove_tree_beneath_a_dir_fd(tmp_path: Path) -> None:
    (tmp_path / "d" / "e").mkdir(parents=True)
    (tmp_path / "d" / "e" / "f").write_text("x")
    (tmp_path / "file").write_text("y")
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fileio.remove_tree("d", dir_fd=fd)
        fileio.remove_tree("file", dir_fd=fd)
        fileio.remove_tree("gone", dir_fd=fd)  # already gone: not an error
    finally:
        os.close(fd)
    assert sorted(os.listdir(tmp_path)) == []


def test_remove_tree_walks_deep_trees_without_recursion(tmp_path: Path) -> None:
    top = tmp_path / "deep"
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.mkdir("deep", dir_fd=fd)
        cur = os.open("deep", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
        for _ in range(600):  # deeper than a path can name: only an fd walk reaches the end
            os.mkdir("dddddddddd", dir_fd=cur)
            nxt = os.open("dddddddddd", os.O_RDONLY | os.O_DIRECTORY, dir_fd=cur)
            os.close(cur)
            cur = nxt
        os.close(os.open("f", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=cur))
        os.close(cur)
    finally:
        os.close(fd)
    fileio.remove_tree(top)
    assert not top.exists()


def test_remove_tree_raises_what_it_cannot_remove(tmp_path: Path) -> None:
    locked = tmp_path / "locked"
    (locked / "sub").mkdir(parents=True)
    locked.chmod(0o500)
    try:
        if os.access(locked, os.W_OK):
            pytest.skip("running as root: permissions do not stop a delete")
        with pytest.raises(PermissionError):
            fileio.remove_tree(locked)
    finally:
        locked.chmod(0o700)
    assert (locked / "sub").is_dir()


def test_fsync_many_syncs_paths_and_descriptors_and_reports_the_first_error(
        tmp_path: Path) -> None:
    paths = []
    for i in range(20):
        p = tmp_path / f"f{i}"
        p.write_bytes(b"x" * 100)
        paths.append(p)
    fd = os.open(paths[0], os.O_RDONLY)
    try:
        fileio.fsync_many([fd, *paths[1:]], drop=True)
        fileio.fsync_many([])
        with pytest.raises(FileNotFoundError):
            fileio.fsync_many([*paths, tmp_path / "gone", *paths])
    finally:
        os.close(fd)
    with pytest.raises(OSError):  # a descriptor no file is open on (EBADF)
        fileio.fsync_many([paths[0], 1 << 20])


def test_real_path_agrees_with_resolve_along_links(tmp_path: Path) -> None:
    """safe_join's quick resolution names every path as Path.resolve does: links inside and
    out, dangling and looping links, names not there yet, a file where a directory should be."""
    from itertools import product

    from ckptd.fileio.paths import real_path

    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "a" / "f").write_text("x")
    (tmp_path / "a" / "in").symlink_to("b")
    (tmp_path / "a" / "out").symlink_to("/etc")
    (tmp_path / "a" / "dangling").symlink_to("nowhere")
    (tmp_path / "a" / "up").symlink_to("../..")
    (tmp_path / "a" / "loop1").symlink_to("loop2")
    (tmp_path / "a" / "loop2").symlink_to("loop1")
    names = ["a", "b", "in", "out", "dangling", "up", "f", "new", "loop1"]
    for depth in (1, 2, 3):
        for parts in product(names, repeat=depth):
            path = str(tmp_path.joinpath(*parts))
            try:
                want: str = str(Path(path).resolve())
            except (OSError, RuntimeError):
                want = "loop"
            try:
                got = real_path(path)
            except (OSError, RuntimeError):
                got = "loop"
            assert got == want, path


def test_fsync_many_attempts_every_item_and_raises_the_first_in_order(tmp_path: Path) -> None:
    """Past a failing item the rest are still synced, and what is raised is the failure of
    the earliest item, whichever thread met it first."""
    paths = [tmp_path / f"f{i}" for i in range(200)]
    for p in paths:
        p.write_bytes(b"x")
    items: list[Path] = [*paths]
    items[150] = tmp_path / "gone-late"
    items[40] = tmp_path / "gone-early"
    with pytest.raises(FileNotFoundError) as info:
        fileio.fsync_many(items, drop=True)
    assert info.value.filename == str(tmp_path / "gone-early")
