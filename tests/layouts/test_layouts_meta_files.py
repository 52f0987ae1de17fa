"""The layouts' meta readers (ranked `meta_<N>.json`, native `meta.json`) given hostile JSON
and any bytes, through layout detection and through a real scan of a real root: a candidate
(complete, pending or bad_metadata), never an exception, in bounded time. Bounded property
tests: a few hundred cases a run (`CKPTD_FUZZ_EXAMPLES` for more)."""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st
from support.fuzzing import (
    REASONS,
    _splice,
    bounded,
    fuzz,
    hostile_literals,
    json_values,
)

from ckptd import inputs, layouts
from ckptd.model import Candidate, FileInfo, RootOptions, Snapshot
from ckptd.watch.scanner import RootScanner

NOW = 10_000.0


NATIVE_META = {"format": "ckptd-native/1", "step": 5, "world_size": 2,
               "created": "2025-01-01T00:00:00Z", "metrics": {"val_loss": 1.5}, "config": {},
               "files": [{"path": "model.pt", "size": 10, "component": "model"},
                         {"path": "optim.rank0.pt", "size": 10, "component": "optimizer"},
                         {"path": "optim.rank1.pt", "size": 10, "component": "optimizer"}]}


RANKED_META = {"step": 5, "world_size": 2, "metrics": {"loss": 0.5}}


LAYOUT_FILES = {
    "native": {"step-5/model.pt": 10, "step-5/optim.rank0.pt": 10, "step-5/optim.rank1.pt": 10,
               "step-5/meta.json": 300},
    "ranked": {"model_5.pt": 10, "meta_5.json": 40, "optim_5_rank0.pt": 10,
               "optim_5_rank1.pt": 10},
}


META_OF = {"native": ("step-5/meta.json", NATIVE_META), "ranked": ("meta_5.json", RANKED_META)}


def _snapshot(files: dict[str, int], contents: dict[str, bytes]) -> Snapshot:
    infos = {rel: FileInfo(rel, size, NOW - 100, NOW - 100, False, None)
             for rel, size in files.items()}
    dirs = {"/".join(rel.split("/")[:i]) for rel in files for i in range(1, rel.count("/") + 1)}
    return Snapshot(files=infos, dirs=frozenset(dirs), contents=contents, registrations={})


@fuzz(300)
@given(st.sampled_from(["native", "ranked"]), st.booleans(),
       st.lists(st.integers(0, 50), max_size=4),
       hostile_literals | json_values.map(json.dumps) | st.sampled_from(
           ["20000000", "-1", "4294967296", str(2**63 - 1), "1e300", '"2"', "0"]),
       st.sampled_from([0, 2, 20_000_000]))
def test_a_layouts_meta_file_makes_a_candidate_never_an_exception(
        layout: str, multi_node: bool, path: list[int], literal: str, world: int) -> None:
    """Layout detection over a snapshot whose `meta.json` / `meta_<N>.json` holds hostile JSON
    (a world size of 2·10^7, 400-digit numbers, NaN, deep nesting): candidates, each complete
    or waiting or invalid with a known reason, in bounded time, never an exception."""
    rel, meta = META_OF[layout]
    data = _splice(meta, path, literal)
    snap = _snapshot(LAYOUT_FILES[layout], {rel: data})
    opts = RootOptions(settle=5.0, world_size=world, multi_node=multi_node)
    with bounded(f"{layout} detection"):
        found = layouts.detect(snap, opts, NOW)
    assert all(isinstance(c, Candidate) and c.invalid_reason in REASONS for c in found), found
    assert all(len(c.files) <= len(LAYOUT_FILES[layout]) for c in found)


@fuzz(100)
@given(st.sampled_from(["native", "ranked"]), st.binary(max_size=200))
def test_a_layouts_meta_file_of_any_bytes_makes_a_candidate(layout: str, data: bytes) -> None:
    rel, _ = META_OF[layout]
    snap = _snapshot(LAYOUT_FILES[layout], {rel: data})
    with bounded(f"{layout} detection"):
        found = layouts.detect(snap, RootOptions(), NOW)
    assert all(c.invalid_reason in REASONS for c in found), found


@fuzz(60)
@given(st.sampled_from(["native", "ranked"]),
       st.sampled_from(["json", "fifo", "link", "over_cap", "dir"]),
       st.lists(st.integers(0, 50), max_size=4), hostile_literals | json_values.map(json.dumps))
def test_a_real_scan_of_a_root_with_a_hostile_meta_file_goes_on(
        layout: str, shape: str, path: list[int], literal: str) -> None:
    """The same through a real scanner over a real root: the meta file hostile, a FIFO, a link,
    a directory or over its cap is one bad item (a candidate with a known reason, or listed
    as refused), the scan returns in bounded time, and a good checkpoint beside it is found."""
    rel, meta = META_OF[layout]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for name in LAYOUT_FILES[layout]:
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            if name != rel:
                (root / name).write_bytes(b"x" * 10)
        (root / "model_step_9.pt").write_bytes(b"x" * 10)  # a single-file checkpoint beside
        target = root / rel
        if shape == "json":
            target.write_bytes(_splice(meta, path, literal))
        elif shape == "fifo":
            os.mkfifo(target)
        elif shape == "link":
            (root / "elsewhere.json").write_bytes(json.dumps(meta).encode())
            target.symlink_to(root / "elsewhere.json")
        elif shape == "dir":
            target.mkdir()
        else:
            with open(target, "wb") as f:
                f.truncate(inputs.ROOT_META.cap + 1)
        scanner = RootScanner("r1", root, "auto", RootOptions(settle=5.0))
        for now in (time.time(), time.time() + 100):
            with bounded("scan"):
                snap, found = scanner.scan(now)
        assert all(c.invalid_reason in REASONS for c, _ in found), found
        assert 9 in {c.step for c, _ in found}
