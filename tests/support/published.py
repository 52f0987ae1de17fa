"""A checkpoint directory put into a remote exactly as the daemon puts it: found by the
scanner, validated and compressed in one read pass, then uploaded and committed."""

from __future__ import annotations

import json
import time
from pathlib import Path

from ckptd.backends import Backend
from ckptd.model import RootOptions
from ckptd.remote.manifest import Manifest
from ckptd.stages import compress
from ckptd.stages.upload import upload_step
from ckptd.stages.validate import validate
from ckptd.watch.scanner import RootScanner
from support.wait import WaitTimeout, wait_until


def publish(root_dir: Path, root_name: str, step: int, backend: Backend,
            codec: str = "auto", layout: str = "auto") -> Manifest:
    """Compress step `step` of the checkpoint root at `root_dir` with `codec` and commit it
    under `root_name` at `backend`; the manifest uploaded."""
    _, found = RootScanner(root_name, root_dir, layout, RootOptions(settle=0)).scan(time.time())
    matches = [c for c, _fp in found if c.step == step]
    assert matches, f"no complete step {step} under {root_dir}: {found}"
    cand = matches[0]
    stager = compress.Stager(root_dir, root_name, step, cand.layout, codec, 3, 1, 0.03)
    result = validate(root_dir, cand, extra_sinks=stager.sinks_for)
    assert result.valid, result
    manifest = stager.commit(result.files, result.metrics)
    upload_step(backend, root_name, stager.final, manifest)
    return manifest


def published_step(root: Path, timeout: float = 10.0) -> int | None:
    """The step in `<root>/.ckptd/latest.json`, once the daemon has written it (else None)."""
    def read() -> tuple[int] | None:  # a tuple: step 0 is an answer too
        try:
            return (int(json.loads((root / ".ckptd" / "latest.json").read_text())["step"]),)
        except (OSError, ValueError, KeyError, TypeError):
            return None

    try:
        return wait_until(read, timeout, f"{root}/.ckptd/latest.json")[0]
    except WaitTimeout:
        return None
