"""The `hf` layout (Hugging Face Trainer): `checkpoint-<N>/`, `trainer_state.json` written last.
Trainer writes in place (its tmp-dir rename was reverted): complete once that file is present
and the whole dir has settled."""

from __future__ import annotations

import re
from typing import Any

from ckptd.errors import Malformed
from ckptd.layouts import common, dcp
from ckptd.model import Candidate, Reason, RootOptions, Snapshot

NAME = "hf"
STATE = "trainer_state.json"
_DIR = re.compile(r"^checkpoint-(\d+)$", re.ASCII)


ARGS = "training_args.bin"


def step_of_dir(name: str) -> int | None:
    m = _DIR.match(name)
    return int(m.group(1)) if m else None


class HfLayout:
    name = NAME

    def wants_content(self, rel: str) -> bool:
        return (common.name_of(rel) == STATE
                and step_of_dir(common.name_of(common.parent_of(rel))) is not None
                and not common.is_temp_path(rel))

    def candidates(
        self, snap: Snapshot, opts: RootOptions, now: float, claimed: frozenset[str]
    ) -> list[Candidate]:
        out: list[Candidate] = []
        for directory, (step, under) in sorted(common.group_dirs(snap, step_of_dir).items()):
            files = common.members(under)
            if not files or common.touches(files, claimed) or _plain_dcp(directory, files):
                continue
            out.append(_candidate(snap, opts, now, directory, step, under, files))
        return out


def _plain_dcp(directory: str, files: list[str]) -> bool:
    """A DCP dir that happens to be named `checkpoint-<N>` (DCP files at its top, no Trainer
    state) belongs to the dcp layout; Trainer's own FSDP saves put DCP in subdirectories."""
    top = [f for f in files if common.parent_of(f) == directory]
    return common.join(directory, STATE) not in top and any(dcp.is_dcp_file(f) for f in top)


def _candidate(snap: Snapshot, opts: RootOptions, now: float, directory: str, step: int,
               under: list[str], files: list[str]) -> Candidate:
    state_rel = common.join(directory, STATE)
    problems = [common.unfinished_problem(snap, directory, under)]
    if state_rel not in snap.files:
        problems.append(f"{state_rel} (written last)")
    problems.append(common.settle_problem(snap, under, opts, now))
    # Trainer pickles its TrainingArguments object here and never loads it on resume.
    extra: dict[str, Any] = {"opaque": tuple(f for f in files if f.endswith("/" + ARGS))}
    if bad := common.bad_content(snap, state_rel):
        extra.update(invalid_reason=str(Reason.BAD_METADATA), invalid_message=bad)
    elif not any(problems) and state_rel in snap.contents:
        try:
            extra["metrics"] = metrics_of(common.load_json(snap.contents[state_rel]))
        except ValueError as exc:
            extra.update(invalid_reason=str(Reason.BAD_METADATA),
                         invalid_message=f"{state_rel}: {exc}")
    elif not any(problems):
        problems.append(f"{state_rel} to be readable")
    return common.make(NAME, step, directory, files, problems, **extra)


def metrics_of(state: object) -> dict[str, float]:
    """`best_metric`, plus the `eval_*` numbers of the newest `log_history` entry with any."""
    if not isinstance(state, dict):
        raise Malformed("not a JSON object")
    out = common.numeric_metrics({"best_metric": state.get("best_metric")})
    history = state.get("log_history")
    for entry in reversed(history if isinstance(history, list) else []):
        evals = common.numeric_metrics(entry, keep=lambda k: k.startswith("eval_"))
        if evals:
            out.update(evals)
            break
    return out


LAYOUT = HfLayout()
