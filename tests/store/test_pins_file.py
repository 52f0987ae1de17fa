"""A root's pins file (`.ckptd/pins.json`) as input: a FIFO never blocks, a `.ckptd` that is a
link is never read through, a step past any integer's range reads as no pins. Real files."""

from __future__ import annotations

import os
import threading
from pathlib import Path

from support.numbers import HUGE

from ckptd.store import pins


def test_a_pins_file_that_is_a_fifo_never_blocks(tmp_path: Path) -> None:
    (tmp_path / ".ckptd").mkdir()
    os.mkfifo(pins.pins_path(tmp_path))
    got: list[set[int]] = []
    t = threading.Thread(target=lambda: got.append(pins.read_pins(tmp_path)), daemon=True)
    t.start()
    t.join(10)
    assert got == [set()]  # the old read_bytes() waited for a writer forever


def test_pins_are_never_read_through_a_ckptd_dir_that_is_a_link(tmp_path: Path) -> None:
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    (outside / "pins.json").write_text('{"format": "ckptd-pins/1", "steps": [3]}')
    assert pins.read_pins(outside.parent / "outside" / "..") == set()  # no .ckptd there
    (root / ".ckptd").symlink_to(outside)
    assert pins.read_pins(root) == set()
    (root / ".ckptd").unlink()
    (root / ".ckptd").mkdir()
    (outside / "pins.json").rename(root / ".ckptd" / "pins.json")
    assert pins.read_pins(root) == {3}


def test_a_pins_file_with_a_huge_step_is_read_as_no_pins(tmp_path: Path) -> None:
    (tmp_path / ".ckptd").mkdir()
    pins.pins_path(tmp_path).write_text(f'{{"format": "ckptd-pins/1", "steps": [1, {HUGE}]}}')
    assert pins.read_pins(tmp_path) == set()
