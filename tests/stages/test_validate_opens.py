"""Validation opens each member of a step once, beneath its root, and reads everything else
(the first bytes that tell its kind, a zip's directories, the read pass) through that one
descriptor: no second open through /proc/self/fd per file, which on a 10,000-file step was a
path walk per file."""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from ckptd.model import Candidate
from ckptd.stages.validate import validate

FILES = 40

_OPENS: list[str] | None = None


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if event == "open" and _OPENS is not None and isinstance(args[0], str):
        _OPENS.append(args[0])


sys.addaudithook(_audit)  # records only while a test sets _OPENS


def test_each_member_is_opened_once_and_never_again_through_proc(tmp_path: Path) -> None:
    global _OPENS
    step = tmp_path / "step-3"
    state = {f"t{i:03d}": torch.full((64,), float(i)) for i in range(FILES)}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(step), single_file_per_rank=False,
                                                         thread_count=1))
    names = sorted(p.name for p in step.iterdir())
    cand = Candidate("dcp", 3, step.name, tuple(f"{step.name}/{n}" for n in names),
                     complete=True)
    _OPENS = []
    try:
        result = validate(tmp_path, cand)
    finally:
        opens, _OPENS = _OPENS, None
    assert result.valid, result
    assert len(result.files) == len(names) == FILES + 1
    by_name = Counter(opens)
    assert all(by_name[n] == 1 for n in names), by_name
    assert [p for p in opens if p.startswith("/proc/self/fd/")] == []
