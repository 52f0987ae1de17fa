"""fileio.open_beneath: a root's file is opened beneath the root without following any link,
so a file swapped for a symlink (to /etc/passwd, to another root) is refused, never read."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from ckptd import fileio
from ckptd.errors import UnsafePath
from ckptd.model import RootOptions
from ckptd.watch.scanner import RootScanner


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


def test_a_file_swapped_for_a_link_before_validation_is_unsafe_never_read(tmp_path: Path
                                                                         ) -> None:
    """The scan saw a real file; by the time validation opens it, it is a symlink to a file
    outside the root (e.g. /etc/passwd). It is refused, never hashed, copied or uploaded."""
    from writers import save_torch

    from ckptd.model import Candidate
    from ckptd.stages.validate import validate

    root = tmp_path / "root"
    root.mkdir()
    save_torch(root / "model_step_1.pt")
    secret = tmp_path / "secret.pt"
    save_torch(secret)
    (root / "model_step_1.pt").unlink()
    (root / "model_step_1.pt").symlink_to(secret)
    seen: list[str] = []

    class Spy:
        def update(self, offset: int, view: memoryview) -> None:
            seen.append("read")

        def finish(self, total: int) -> None:
            pass

    result = validate(root, Candidate("single", 1, "model_step_1.pt", ("model_step_1.pt",),
                                      True), extra_sinks=lambda rel: [Spy()])
    assert not result.valid and result.reason == "unsafe_path", result
    assert seen == []  # not a byte of it reached a sink (hash, copy, upload)


def test_the_scanner_reads_no_pickle_header_through_a_link_below_the_root(tmp_path: Path
                                                                          ) -> None:
    """The scan's look at a DeepSpeed model-states file's leading values (`dp_world_size`)
    opens the file beneath the root: a link in its place, even to a file inside the root, is
    not read (a linked file is not a step's own), while the real file beside it is."""
    own, linked = tmp_path / "global_step5", tmp_path / "global_step6"
    own.mkdir()
    linked.mkdir()
    torch.save({"dp_world_size": 2, "ds_version": "0.19.8"}, own / "mp_rank_00_model_states.pt")
    torch.save({"dp_world_size": 4, "ds_version": "0.19.8"}, tmp_path / "elsewhere.pt")
    (linked / "mp_rank_00_model_states.pt").symlink_to(tmp_path / "elsewhere.pt")
    snap, _ = RootScanner("r", tmp_path, "auto", RootOptions(settle=0.0)).scan(0.0)
    assert snap.files["global_step6/mp_rank_00_model_states.pt"].symlink
    assert snap.torch_fields.get("global_step5/mp_rank_00_model_states.pt", {}).get(
        "dp_world_size") == 2
    assert "global_step6/mp_rank_00_model_states.pt" not in snap.torch_fields
