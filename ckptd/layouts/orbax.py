"""The `orbax` layout (JAX CheckpointManager): bare-number step dirs `<N>/`.
Orbax commits by renaming `<N>.orbax-checkpoint-tmp[-<ts>]/` to `<N>/` (local disks) or by
writing `commit_success.txt` into `<N>/` (GCS); both first set `commit_timestamp_nsecs`."""

from __future__ import annotations

import re
from typing import Any

from ckptd.layouts import common
from ckptd.model import Candidate, RootOptions, Snapshot

NAME = "orbax"
COMMIT_FILE = "commit_success.txt"
STEP_METADATA = "_CHECKPOINT_METADATA"
# CheckpointManager(..., metrics=...) saves them as an item of their own: `<step>/metrics/metrics`
# (JSON, by its JsonCheckpointHandler); `_CHECKPOINT_METADATA`'s own `metrics` stays empty.
METRICS_ITEM = "metrics/metrics"
_FINAL = re.compile(r"^(\d+)$", re.ASCII)
_TMP = re.compile(r"^(\d+)\.orbax-checkpoint-tmp", re.ASCII)
# Files Orbax writes in its item dirs (`<N>/default/_METADATA`, ...).
_ITEM_TELLS = ("_METADATA", "_sharding", "manifest.ocdbt")


def _final_step(name: str) -> int | None:
    m = _FINAL.match(name)
    return int(m.group(1)) if m else None


def _tmp_step(name: str) -> int | None:
    m = _TMP.match(name)
    return int(m.group(1)) if m else None


class OrbaxLayout:
    name = NAME

    def wants_content(self, rel: str) -> bool:
        if rel.endswith("/" + METRICS_ITEM):
            step_dir = rel[: -len(METRICS_ITEM) - 1]
        elif common.name_of(rel) == STEP_METADATA:
            step_dir = common.parent_of(rel)
        else:
            return False
        return _final_step(common.name_of(step_dir)) is not None

    def candidates(
        self, snap: Snapshot, opts: RootOptions, now: float, claimed: frozenset[str]
    ) -> list[Candidate]:
        tree = common.Tree(snap)
        finals = {d: (step, tree.under(d)) for d, step in _final_dirs(snap).items()}
        finals = {d: v for d, v in finals.items() if not common.touches(v[1], claimed)}
        commit_parents = {common.parent_of(d) for d in finals
                          if common.join(d, COMMIT_FILE) in snap.files}
        out = [_final(snap, d, step, files, common.parent_of(d) in commit_parents)
               for d, (step, files) in sorted(finals.items())]
        done = {(common.parent_of(d), step) for d, (step, _) in finals.items()}
        for d, (step, files) in sorted(common.group_dirs_any(snap, _tmp_step).items()):
            # A leftover tmp dir beside its finished step is junk, not a second checkpoint.
            if (common.parent_of(d), step) in done or common.touches(files, claimed):
                continue
            final = common.join(common.parent_of(d), str(step))
            out.append(common.make(NAME, step, d, files, [f"rename to {final}"]))
        return out


def _final_dirs(snap: Snapshot) -> dict[str, int]:
    """Bare-number dirs holding an Orbax file: `_CHECKPOINT_METADATA` or the commit file
    directly, or an item dir's `_METADATA`/`_sharding`/`manifest.ocdbt` one level down."""
    out: dict[str, int] = {}
    for rel in snap.files:
        name, parent = common.name_of(rel), common.parent_of(rel)
        if name in (STEP_METADATA, COMMIT_FILE):
            directory = parent
        elif name in _ITEM_TELLS and parent:
            directory = common.parent_of(parent)
        else:
            continue
        step = _final_step(common.name_of(directory)) if directory else None
        if step is not None and not common.is_temp_path(rel):
            out[directory] = step
    return out


def _final(snap: Snapshot, directory: str, step: int, under: list[str],
           commit_mode: bool) -> Candidate:
    """A final-named dir is committed unless it is an in-place (commit-file) save still under
    way: its `_CHECKPOINT_METADATA` has no `commit_timestamp_nsecs` yet, or its sibling steps
    carry `commit_success.txt` and it does not."""
    files = common.members(under)
    problems = [common.open_problem(snap, files),
                common.unfinished_problem(snap, directory, under)]
    meta = _step_metadata(snap, directory)
    if common.join(directory, COMMIT_FILE) not in snap.files:
        if meta.get("commit_timestamp_nsecs", 0) is None:
            problems.append(f"{common.join(directory, COMMIT_FILE)} (in-place save, not committed)")
        elif commit_mode:
            problems.append(f"{common.join(directory, COMMIT_FILE)} (as its sibling steps have)")
    metrics = {**common.numeric_metrics(meta.get("metrics")),
               **common.numeric_metrics(_json(snap, common.join(directory, METRICS_ITEM)))}
    return common.make(NAME, step, directory, files, problems, metrics=metrics)


def _step_metadata(snap: Snapshot, directory: str) -> dict[str, Any]:
    """`_CHECKPOINT_METADATA` as a dict; {} when absent or unreadable (older Orbax had none)."""
    return _json(snap, common.join(directory, STEP_METADATA))


def _json(snap: Snapshot, rel: str) -> dict[str, Any]:
    try:
        obj = common.load_json(snap.contents.get(rel))
    except ValueError:
        return {}
    return obj if isinstance(obj, dict) else {}


LAYOUT = OrbaxLayout()
