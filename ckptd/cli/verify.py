"""Offline validation of one checkpoint path (`ckptd verify`): recognise it with the layouts,
then validate it with the validate stage. No daemon, no store."""

from __future__ import annotations

import os
import re
import time
from pathlib import Path
from typing import Any

from ckptd.model import Candidate, RootOptions, ValidationResult
from ckptd.stages.validate import validate
from ckptd.watch.scanner import RootScanner

_STEP = re.compile(r"(?:step[_=-]?|iter_|global_step|checkpoint-|_)(\d+)(?:\D*$|\.)")


def verify_path(path: Path, deep: bool = False,
                trusted: frozenset[str] = frozenset()) -> dict[str, Any]:
    """Validate the checkpoint at `path` (a file or a directory): the verify JSON of docs/CLI.md."""
    path = Path(os.path.abspath(path))
    if not path.exists():
        return _doc(path, "unknown", None, ValidationResult(False, "missing_file",
                                                            f"{path} does not exist"))
    root = path.parent
    rel = path.name
    cand = _recognise(root, rel)
    if not cand.complete:
        reason = cand.invalid_reason or "missing_file"
        return _doc(path, cand.layout, cand.step,
                    ValidationResult(False, reason, f"incomplete: {cand.waiting_for}"))
    return _doc(path, cand.layout, cand.step, validate(root, cand, deep=deep, trusted=trusted))


def _recognise(root: Path, rel: str) -> Candidate:
    # Only the target and the loose files beside it (marker files like DeepSpeed's `latest`,
    # sibling shards): never the rest of the parent directory.
    scanner = RootScanner("verify", root, "auto", RootOptions(settle=0.0),
                          top=lambda name, is_dir: name == rel or not is_dir)
    _, found = scanner.scan(now=time.time())
    matches = [c for c, _ in found if c.path == rel or rel in c.files
               or any(f.startswith(rel + "/") for f in c.files)]
    exact = [c for c in matches if c.path == rel]
    if exact or matches:
        return (exact or matches)[0]
    files = tuple(sorted(r for r in _files_under(root, rel)))
    m = _STEP.search(rel)
    return Candidate("unknown", int(m.group(1)) if m else -1, rel, files, complete=True)


def _files_under(root: Path, rel: str) -> list[str]:
    target = root / rel
    if target.is_file() or target.is_symlink():
        return [rel]
    out = []
    for dirpath, _dirs, names in os.walk(target):
        for n in names:
            out.append(os.path.relpath(os.path.join(dirpath, n), root).replace(os.sep, "/"))
    return out


def _doc(path: Path, layout: str, step: int | None, res: ValidationResult) -> dict[str, Any]:
    return {
        "path": str(path), "layout": layout, "step": None if step is None or step < 0 else step,
        "valid": res.valid, "reason": res.reason or None, "message": res.message or None,
        "files": [{"path": f.path, "size": f.size, "hash": f.hash} for f in res.files],
    }
