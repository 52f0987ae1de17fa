"""A root's members are opened only beneath the root (fileio.open_beneath): validation's size
check of a file DCP's metadata names, and the copy store's check of an original before it is
replaced by its compressed copy. A link there, even to a file inside the root, is refused."""

from __future__ import annotations

import os
from functools import partial
from pathlib import Path

import pytest
import writers
from support.ckpts import save_single
from support.nets import no_nets

from ckptd.copies.store import check_replaceable
from ckptd.errors import UnsafePath
from ckptd.model import Candidate, ValidationResult
from ckptd.remote.manifest import Manifest
from ckptd.retention import executor
from ckptd.stages import compress
from ckptd.stages.validate import validate


def _invalid(res: ValidationResult, reason: str) -> None:
    assert not res.valid and res.reason == reason, res


def test_a_file_dcp_metadata_names_is_opened_beneath_the_root(tmp_path: Path) -> None:
    src = writers.save_dcp(tmp_path / "src" / "step-5")
    root = tmp_path / "root"
    (root / "step-5").mkdir(parents=True)
    for p in src.iterdir():
        (root / "step-5" / p.name).write_bytes(p.read_bytes())
    # The candidate lists .metadata only: the data file is reached through what it names.
    cand = Candidate("dcp", 5, "step-5", ("step-5/.metadata",), complete=True)
    assert validate(root, cand).valid
    data = root / "step-5" / "__0_0.distcp"
    data.rename(root / "elsewhere.distcp")
    data.symlink_to(root / "elsewhere.distcp")
    _invalid(validate(root, cand), "unsafe_path")
    data.unlink()
    _invalid(validate(root, cand), "missing_file")


def _staged(root: Path) -> tuple[str, Manifest]:
    rel = save_single(root, 1).name
    cand = Candidate("single", 1, rel, (rel,), complete=True)
    st = compress.Stager(root, "r", 1, "single", "zstd", 3, 1, 0.03,
                         install=partial(executor.install_copy, root, 1, nets=no_nets()))
    result = validate(root, cand, extra_sinks=st.sinks_for)
    assert result.valid, result
    return rel, st.commit(result.files, result.metrics)


def test_an_original_is_checked_through_a_descriptor_opened_beneath_the_root(
    tmp_path: Path,
) -> None:
    root = tmp_path / "root"
    root.mkdir()
    rel, manifest = _staged(root)
    assert check_replaceable(root, manifest, [rel]) == [rel]
    # Swapped for a link to the same bytes inside the root: refused, not followed.
    (root / rel).rename(root / "same.pt")
    (root / rel).symlink_to(root / "same.pt")
    with pytest.raises(UnsafePath, match="symlink.*refusing to delete it"):
        check_replaceable(root, manifest, [rel])
    # A FIFO is no regular file: refused at once, never opened for a read that would block.
    (root / rel).unlink()
    os.mkfifo(root / rel)
    with pytest.raises(UnsafePath, match="not a regular file"):
        check_replaceable(root, manifest, [rel])
    # Gone: nothing to check, nothing present.
    (root / rel).unlink()
    assert check_replaceable(root, manifest, [rel]) == []
