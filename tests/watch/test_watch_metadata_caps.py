"""The scanner's reads of a root's metadata: each kind read up to its cap, refused one byte over
(with why), and a FIFO at the name never waited on. Real files, sparse past the cap."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from ckptd.model import RootOptions
from ckptd.watch.scanner import RootScanner


@pytest.mark.parametrize(("rel", "cap"), [
    ("step-5/meta.json", 1 << 20),
    ("checkpoint-5/trainer_state.json", 16 << 20),
    ("step-5/.metadata", 64 << 20),
    ("latest", 4 << 10),
    ("latest_checkpointed_iteration.txt", 4 << 10),
    ("meta_5.json", 1 << 20),
])
def test_the_scanner_reads_each_metadata_kind_up_to_its_cap(tmp_path: Path, rel: str,
                                                            cap: int) -> None:
    """At the cap the file is read; one byte over (a sparse file: nothing is read to learn
    it) it is refused, with why, and the snapshot says so; a FIFO at the name is never
    waited on (the walk lists regular files only)."""
    path = tmp_path / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("wb") as f:
        f.truncate(cap)
    scanner = RootScanner("r", tmp_path, "auto", RootOptions(settle=0.0))
    snap, _ = scanner.scan(time.time())
    assert len(snap.contents[rel]) == cap and rel not in snap.bad_contents
    with path.open("ab") as f:
        f.truncate(cap + 1)
    snap, _ = scanner.scan(time.time())
    assert rel not in snap.contents and "cap" in snap.bad_contents[rel]
    path.unlink()
    os.mkfifo(path)
    t0 = time.monotonic()
    snap, _ = scanner.scan(time.time())
    assert time.monotonic() - t0 < 5 and rel not in snap.contents
