"""Bounded work whatever the input: a `.metadata`, junk or real, is parsed once, not on every
scan and not again by its validation."""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as tdcp

from ckptd.cli.verify import verify_path
from ckptd.formats import dcpmeta
from ckptd.model import RootOptions
from ckptd.watch.scanner import RootScanner


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
    first = dict(dcpmeta._PARSED)  # noqa: SLF001 - the parse memo is what this test is about
    for i in range(5):
        _, again = scanner.scan(t0 + i + 1)
    assert dict(dcpmeta._PARSED) == first  # noqa: SLF001 - no new parse, the same verdict object
    (cand, _), = again
    assert cand.invalid_reason == "bad_metadata"


def test_a_step_s_scans_and_its_validation_parse_its_metadata_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    step = tmp_path / "step-4"
    tdcp.save({f"t{i}": torch.arange(64.0) + i for i in range(50)},
              storage_writer=tdcp.FileSystemWriter(str(step), single_file_per_rank=False))
    parses: list[str] = []
    real = dcpmeta.parse_dcp_metadata

    def counted(data: bytes, path: str = ".metadata") -> dcpmeta.DcpMetadata:
        parses.append(path)
        return real(data, path)

    monkeypatch.setattr(dcpmeta, "parse_dcp_metadata", counted)
    scanner = RootScanner("r", tmp_path, "auto", RootOptions(settle=0.0))
    for i in range(3):
        scanner.scan(time.monotonic() + i)
    assert verify_path(step)["valid"]  # its own scan, then the read pass over every file
    assert parses == ["step-4/.metadata"]


def test_each_path_is_classified_once_while_it_exists(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A scan of a large root asks the layouts about each file name once, not at every scan
    (a 10,000-file step rescanned every few seconds while it is validated)."""
    from ckptd import layouts

    step = tmp_path / "step-2"
    step.mkdir()
    for i in range(100):
        (step / f"__0_{i}.distcp").write_bytes(b"x")
    asked: list[str] = []
    real = layouts.wants_content
    monkeypatch.setattr(layouts, "wants_content",
                        lambda rel, layout="auto": asked.append(rel) or real(rel, layout))
    scanner = RootScanner("r", tmp_path, "auto", RootOptions(settle=0.0))
    for i in range(3):
        scanner.scan(time.monotonic() + i)
    assert sorted(asked) == sorted(f"step-2/__0_{i}.distcp" for i in range(100))
    (step / "__0_0.distcp").rename(step / "__0_100.distcp")  # a new name is asked about once
    scanner.scan(time.monotonic() + 3)
    assert asked[100:] == ["step-2/__0_100.distcp"]
