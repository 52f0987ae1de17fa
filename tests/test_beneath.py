"""fileio.open_beneath: a root's file is opened beneath the root without following any link,
so a file swapped for a symlink (to /etc/passwd, to another root) is refused, never read."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ckptd import fileio
from ckptd.errors import UnsafePath


def test_a_plain_file_is_opened_and_read_from_its_descriptor(tmp_path: Path) -> None:
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a.pt").write_bytes(b"weights")
    fd = fileio.open_beneath(tmp_path, "d/a.pt")
    try:
        assert os.pread(fd, 100, 0) == b"weights"
        assert fileio.read_pass("d/a.pt", [fileio.HashSink()], fd=fd) == 7
    finally:
        os.close(fd)


@pytest.mark.parametrize("swap", ["file", "dir"])
def test_a_link_anywhere_along_the_path_is_refused(tmp_path: Path, swap: str) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "a.pt").write_bytes(b"secret")
    root = tmp_path / "root"
    root.mkdir()
    if swap == "file":
        (root / "d").mkdir()
        (root / "d" / "a.pt").symlink_to(outside / "a.pt")
    else:
        (root / "d").symlink_to(outside)
    with pytest.raises(UnsafePath, match="symbolic link"):
        fileio.open_beneath(root, "d/a.pt")


@pytest.mark.parametrize("rel", ["../x", "a/../../x", "/etc/passwd", "", "a\x00b"])
def test_climbs_and_absolute_paths_are_refused(tmp_path: Path, rel: str) -> None:
    with pytest.raises(UnsafePath):
        fileio.open_beneath(tmp_path, rel)


def test_a_fifo_is_not_a_regular_file_and_never_blocks(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "p.pt")
    with pytest.raises(UnsafePath, match="not a regular file"):
        fileio.open_beneath(tmp_path, "p.pt")


def test_a_missing_file_is_file_not_found(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        fileio.open_beneath(tmp_path, "nope.pt")
