"""Bounded work whatever the input: a junk `.metadata` is parsed once, not on every scan."""

from __future__ import annotations

import random
import time
from pathlib import Path

from ckptd.layouts import dcp
from ckptd.model import RootOptions
from ckptd.watch import RootScanner


def test_a_junk_metadata_is_parsed_once_across_rescans(tmp_path: Path) -> None:
    d = tmp_path / "step-3"
    d.mkdir()
    (d / "__0_0.distcp").write_bytes(b"\0" * 1024)
    # 8 MiB of junk, seeded and led by a byte that is no pickle opcode (random bytes may begin
    # with one and read as a protocol-0 pickle: unsafe_pickle rather than bad_metadata)
    (d / ".metadata").write_bytes(b"\xff" + random.Random(3).randbytes((8 << 20) - 1))
    scanner = RootScanner("r", tmp_path, "dcp", RootOptions(settle=0.0))
    t0 = time.monotonic()
    _, found = scanner.scan(t0)
    first = dict(dcp._PARSED)  # noqa: SLF001 - the parse memo is what this test is about
    for i in range(5):
        _, again = scanner.scan(t0 + i + 1)
    assert dict(dcp._PARSED) == first  # noqa: SLF001 - no new parse, the same verdict object
    (cand, _), = again
    assert cand.invalid_reason == "bad_metadata"
