"""The `split` layout: one file per component, `step_<N>_{meta,model,ema,optim}.pt`.
No commit marker: complete when meta, model and optim are present and every member settled;
the anchor path is the model file, the one worth loading on its own."""

from __future__ import annotations

import re

from ckptd.layouts import common
from ckptd.model import Candidate, RootOptions, Snapshot

NAME = "split"
REQUIRED = ("meta", "model", "optim")
KNOWN = (*REQUIRED, "ema")
_FILE = re.compile(r"^step_(\d+)_(\w+)\.pt$", re.ASCII)


class SplitLayout:
    name = NAME

    def wants_content(self, rel: str) -> bool:
        return False

    def candidates(
        self, snap: Snapshot, opts: RootOptions, now: float, claimed: frozenset[str]
    ) -> list[Candidate]:
        out: list[Candidate] = []
        for (directory, step), parts in sorted(_groups(snap).items()):
            files = sorted(parts.values())
            if not any(k in parts for k in KNOWN) or common.touches(files, claimed):
                continue
            model = common.join(directory, f"step_{step}_model.pt")
            problems = [common.join(directory, f"step_{step}_{k}.pt")
                        for k in REQUIRED if k not in parts]
            problems.append(common.unfinished_problem(snap, model))
            problems.append(common.settle_problem(snap, files, opts, now))
            out.append(common.make(NAME, step, model, files, problems))
        return out


def _groups(snap: Snapshot) -> dict[tuple[str, int], dict[str, str]]:
    """(dir, step) -> component -> path; other `step_<N>_<x>.pt` files join a known group."""
    groups: dict[tuple[str, int], dict[str, str]] = {}
    for rel in snap.files:
        m = _FILE.match(common.name_of(rel))
        if m and not common.is_temp_path(rel):
            key = (common.parent_of(rel), int(m.group(1)))
            groups.setdefault(key, {})[m.group(2)] = rel
    return groups


LAYOUT = SplitLayout()
