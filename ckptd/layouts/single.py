"""The `single` layout: one weights file with a step in its name (`model_step_100.pt`, ...).
No commit marker: complete when closed and settled. Framing (zip end record, safetensors header)
is validation's job: layouts never read bytes."""

from __future__ import annotations

from ckptd.layouts import common
from ckptd.model import Candidate, RootOptions, Snapshot

NAME = "single"
SUFFIXES = (".pt", ".pth", ".ckpt", ".safetensors", ".bin")


class SingleLayout:
    name = NAME

    def wants_content(self, rel: str) -> bool:
        return False

    def candidates(
        self, snap: Snapshot, opts: RootOptions, now: float, claimed: frozenset[str]
    ) -> list[Candidate]:
        out: list[Candidate] = []
        for rel in sorted(snap.files):
            name = common.name_of(rel)
            if rel in claimed or not name.endswith(SUFFIXES) or common.is_temp_path(rel):
                continue
            step = common.file_step(name)
            if step is None:
                continue
            problems = [common.unfinished_problem(snap, rel),
                        common.settle_problem(snap, [rel], opts, now)]
            out.append(common.make(NAME, step, rel, [rel], problems))
        return out


LAYOUT = SingleLayout()
