"""The prune executor on a real directory tree: every safety net tried and holding, symlinks never
followed, rename-to-trash then purge with crashes (and kill -9) in between, remote deletes through
a real LocalBackend. Small real files; no torch.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import MutableMapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs
from support.nets import fixed

from ckptd.backends import Backend, LocalBackend
from ckptd.config import LocalRetention, RemoteRetention
from ckptd.errors import TransientError
from ckptd.model import Local, Remote, State
from ckptd.remote.manifest import MANIFEST_NAME, step_prefix
from ckptd.retention.executor import (
    Guards,
    Target,
    execute_local,
    execute_remote,
    trash,
)
from ckptd.retention.outcomes import Outcome
from ckptd.retention.planner import (
    Action,
    CheckpointView,
    Disk,
    Plan,
    PlanItem,
    plan,
)
from ckptd.retention.trash import TrashRecord, purge, purge_trash, restore, trash_dir_for

OPEN = Guards(
    latest_step=None,
    best_step=None,
    pinned=frozenset(),
    in_use=frozenset(),
    committed=frozenset(),
    upload_configured=False,
)
SRC = str(Path(__file__).resolve().parents[2])


# --- building real checkpoints ---------------------------------------------------------------


def write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


def dir_ckpt(root: Path, step: int) -> Target:
    """`step-<N>/` with two files and a nested one: 100 + 200 + 50 bytes."""
    names = {"model.pt": 100, "optim.pt": 200, "sub/extra.bin": 50}
    for name, size in names.items():
        write(root / f"step-{step}" / name, bytes([step % 256]) * size)
    files = tuple(f"step-{step}/{n}" for n in names)
    return Target(step, f"step-{step}", files, Local.PRESENT, Remote.NONE, is_dir=True)


def split_ckpt(root: Path, step: int) -> Target:
    """Sibling files `ckpt/step_<N>_{meta,model,optim}.pt`: 10 + 20 + 30 bytes."""
    files = tuple(f"ckpt/step_{step}_{part}.pt" for part in ("meta", "model", "optim"))
    for i, rel in enumerate(files):
        write(root / rel, b"x" * (10 * (i + 1)))
    return Target(step, files[1], files, Local.PRESENT, Remote.NONE, is_dir=False)


def deletes(*steps: int) -> Plan:
    items = tuple(PlanItem(s, Action.DELETE, Action.NONE, ("local:not_kept",)) for s in steps)
    return Plan(items)


def remote_deletes(*steps: int) -> Plan:
    items = tuple(PlanItem(s, Action.NONE, Action.DELETE, ("remote:not_kept",)) for s in steps)
    return Plan(items)


def presence(root: Path, target: Target) -> str:
    """"all" / "none" / "half" of the target's members at their original place."""
    here = [os.path.lexists(root / f) for f in target.files]
    return "all" if all(here) else "none" if not any(here) else "half"


def trash_entries(root: Path) -> list[Path]:
    t = trash_dir_for(root)
    return sorted(t.iterdir()) if t.exists() else []


def run_local(
    where: Path, p: Plan, targets: list[Target], guards: Guards = OPEN, **kw: Any
) -> list[Outcome]:
    by_step = {t.step: t for t in targets}
    return execute_local(where, p, by_step, fixed(guards), trash_dir_for(where), **kw).outcomes


def events(logs: Sequence[MutableMapping[str, Any]], name: str) -> list[MutableMapping[str, Any]]:
    return [e for e in logs if e["event"] == name]


@pytest.fixture
def root(tmp_path: Path) -> Path:
    r = tmp_path / "root"
    r.mkdir()
    return r


# --- deletes that go through -----------------------------------------------------------------


def test_deletes_a_directory_checkpoint_through_the_trash(root: Path) -> None:
    old, kept = dir_ckpt(root, 100), dir_ckpt(root, 200)
    seen: list[tuple[int, Path, bool, bool]] = []

    def on_trashed(step: int, entry: Path) -> None:
        # The store records "trashed" while the data sits whole in the trash, gone from its place.
        seen.append((step, entry, entry.is_dir(), (root / "step-100").exists()))

    with capture_logs() as logs:
        out = run_local(root, deletes(100), [old, kept], on_trashed=on_trashed, root="llm")
    assert out == [Outcome(100, "local", "deleted", "local:not_kept", 350)]
    assert seen and seen[0][0] == 100 and seen[0][2] and not seen[0][3]
    assert seen[0][1].parent == trash_dir_for(root).resolve()
    assert seen[0][1].name.startswith("step-100.")
    assert not (root / "step-100").exists() and presence(root, kept) == "all"
    assert trash_entries(root) == []
    [ev] = events(logs, "checkpoint_pruned")
    assert ev["root"] == "llm" and ev["step"] == 100 and ev["tier"] == "local"
    assert ev["reason"] == "local:not_kept" and ev["bytes_freed"] == 350


def test_deletes_a_sibling_file_checkpoint_and_nothing_beside_it(root: Path) -> None:
    old, kept = split_ckpt(root, 1), split_ckpt(root, 2)
    write(root / "ckpt" / "notes.txt", b"mine")
    out = run_local(root, deletes(1), [old, kept])
    assert [(o.action, o.bytes_freed) for o in out] == [("deleted", 60)]
    assert presence(root, old) == "none" and presence(root, kept) == "all"
    assert (root / "ckpt" / "notes.txt").read_bytes() == b"mine"
    assert trash_entries(root) == []


def test_a_local_compressed_copy_is_deleted_as_its_directory(root: Path) -> None:
    write(root / ".ckptd/objects/step-7/model.pt.zst", b"z" * 40)
    write(root / ".ckptd/objects/step-7/MANIFEST.json", b"{}")
    t = Target(7, ".ckptd/objects/step-7", (), Local.COMPRESSED, Remote.UPLOADED, is_dir=True)
    out = run_local(root, deletes(7), [t])
    assert [(o.action, o.bytes_freed) for o in out] == [("deleted", 42)]
    assert not (root / ".ckptd/objects/step-7").exists()


def test_compress_is_deferred_and_keep_is_left_alone(root: Path) -> None:
    a, b = dir_ckpt(root, 1), dir_ckpt(root, 2)
    p = Plan((PlanItem(1, Action.COMPRESS, Action.NONE, ("local:pinned",)),
              PlanItem(2, Action.KEEP, Action.NONE, ("local:latest",))))
    done = execute_local(root, p, {1: a, 2: b}, fixed(OPEN), trash_dir_for(root))
    assert done.compress == (1,)  # the caller's to compress in place
    assert done.outcomes == [Outcome(1, "local", "deferred", "compress")]  # the report of it
    assert presence(root, a) == presence(root, b) == "all"


def test_already_gone_is_deleted_with_nothing_freed(root: Path) -> None:
    t = Target(5, "step-5", ("step-5/model.pt",), Local.PRESENT, Remote.NONE, is_dir=True)
    assert run_local(root, deletes(5), [t]) == [Outcome(5, "local", "deleted", "already gone")]


def test_valid_and_uploaded_or_invalid_copies_pass_the_upload_net(root: Path) -> None:
    a, b = dir_ckpt(root, 1), dir_ckpt(root, 2)
    g = replace(OPEN, upload_configured=True, committed=frozenset({1}),
                invalid=frozenset({2}))
    out = run_local(root, deletes(1, 2), [a, b], g)
    assert [o.action for o in out] == ["deleted", "deleted"]


# --- safety nets ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("guards", "reason"),
    [
        (replace(OPEN, latest_step=100), "latest"),
        (replace(OPEN, best_step=100), "best"),
        (replace(OPEN, pinned=frozenset({100})), "pinned"),
        (replace(OPEN, in_use=frozenset({100})), "in_use"),
        (replace(OPEN, upload_configured=True, committed=frozenset({99})), "not_uploaded"),
    ],
)
def test_each_net_refuses_and_logs_why(root: Path, guards: Guards, reason: str) -> None:
    t = dir_ckpt(root, 100)
    with capture_logs() as logs:
        out = run_local(root, deletes(100), [t], guards, root="llm")
    assert out == [Outcome(100, "local", "refused", reason)]
    assert presence(root, t) == "all" and trash_entries(root) == []
    [ev] = events(logs, "prune_refused")
    assert (ev["root"], ev["step"], ev["tier"], ev["reason"]) == ("llm", 100, "local", reason)
    assert ev["log_level"] == "warning"
    assert not events(logs, "checkpoint_pruned")


def test_fresh_guards_beat_a_stale_plan_from_the_real_planner(root: Path) -> None:
    targets = [dir_ckpt(root, s) for s in (1, 2, 3, 4)]
    views = [CheckpointView(s, State.VALID, Local.PRESENT, Remote.NONE, float(s), 350)
             for s in (1, 2, 3, 4)]
    disk = Disk(free_bytes=1 << 40, total_bytes=1 << 41, min_free_bytes=0)
    p = plan(views, LocalRetention(keep_last=2, keep_best=0), RemoteRetention(), disk, now=10.0)
    assert p.steps("local", Action.DELETE) == (1, 2)
    # Since planning, a user pinned 1 and a client started loading 2.
    g = replace(OPEN, latest_step=4, pinned=frozenset({1}), in_use=frozenset({2}))
    out = run_local(root, p, targets, g)
    assert [(o.step, o.action, o.reason) for o in out] == [
        (1, "refused", "pinned"), (2, "refused", "in_use")]
    assert all(presence(root, t) == "all" for t in targets)
    out = run_local(root, p, targets, replace(OPEN, latest_step=4))
    assert [(o.step, o.action) for o in out] == [(1, "deleted"), (2, "deleted")]
    assert [presence(root, t) for t in targets] == ["none", "none", "all", "all"]


def test_missing_or_already_pruned_targets_are_refused(root: Path) -> None:
    t = replace(dir_ckpt(root, 3), local=Local.PRUNED)
    out = run_local(root, deletes(3, 4), [t])
    assert [(o.step, o.action, o.reason.split(":")[0]) for o in out] == [
        (3, "refused", "not_on_disk"), (4, "refused", "no_target")]
    assert presence(root, t) == "all"


@pytest.mark.parametrize("anchor", ["../outside.pt", "ABS", "sub/../../outside.pt", ".", ""])
def test_a_path_outside_the_root_is_refused(root: Path, anchor: str) -> None:
    outside = root.parent / "outside.pt"
    outside.write_bytes(b"not yours")
    anchor = str(outside) if anchor == "ABS" else anchor
    for is_dir in (True, False):
        t = Target(9, anchor, (anchor,), Local.PRESENT, Remote.NONE, is_dir=is_dir)
        [out] = run_local(root, deletes(9), [t])
        assert (out.action, out.reason.split(":")[0]) == ("refused", "unsafe_path")
    assert outside.read_bytes() == b"not yours"


def test_one_bad_member_refuses_the_whole_checkpoint(root: Path) -> None:
    outside = root.parent / "outside.pt"
    outside.write_bytes(b"not yours")
    t = split_ckpt(root, 1)
    t = replace(t, files=(*t.files, "../outside.pt"))
    [out] = run_local(root, deletes(1), [t])
    assert (out.action, out.reason.split(":")[0]) == ("refused", "unsafe_path")
    assert presence(root, replace(t, files=t.files[:3])) == "all" and outside.exists()
    # A directory checkpoint whose member list reaches beyond its directory: refused too.
    d = dir_ckpt(root, 2)
    d = replace(d, files=(*d.files, "ckpt/step_1_meta.pt"))
    [out] = run_local(root, deletes(2), [d])
    assert out.action == "refused" and (root / "step-2" / "model.pt").exists()


def test_ckptd_own_files_are_refused(root: Path) -> None:
    write(root / ".ckptd" / "latest.json", b"{}")
    trash_dir_for(root).mkdir(parents=True)
    for path, is_dir in [(".ckptd", True), (".ckptd/trash", True), (".ckptd/latest.json", False)]:
        t = Target(1, path, (), Local.PRESENT, Remote.NONE, is_dir=is_dir)
        [out] = run_local(root, deletes(1), [t])
        assert (out.action, out.reason.split(":")[0]) == ("refused", "unsafe_path")
    assert (root / ".ckptd" / "latest.json").exists()


def test_symlinks_inside_a_checkpoint_are_unlinked_never_followed(root: Path) -> None:
    """Decision: a link that is part of a checkpoint goes with it; only the link is removed."""
    outside = root.parent / "shared"
    write(outside / "pretrained.pt", b"P" * 64)
    write(outside / "dir" / "keep.bin", b"K")
    t = dir_ckpt(root, 5)
    os.symlink(outside / "pretrained.pt", root / "step-5" / "base.pt")
    os.symlink(outside / "dir", root / "step-5" / "linked_dir")
    os.symlink(root / "step-5" / "model.pt", root / "step-5" / "alias.pt")
    os.symlink("/nonexistent/dangling", root / "step-5" / "dangling")
    [out] = run_local(root, deletes(5), [t])
    assert (out.action, out.bytes_freed) == ("deleted", 350)  # links count for nothing
    assert not os.path.lexists(root / "step-5")
    assert (outside / "pretrained.pt").read_bytes() == b"P" * 64
    assert (outside / "dir" / "keep.bin").read_bytes() == b"K"


def test_a_member_file_that_is_a_symlink_out_of_the_root_loses_only_the_link(root: Path) -> None:
    outside = root.parent / "weights.pt"
    outside.write_bytes(b"W" * 30)
    t = split_ckpt(root, 3)
    (root / t.files[1]).unlink()
    os.symlink(outside, root / t.files[1])
    [out] = run_local(root, deletes(3), [t])
    assert (out.action, out.bytes_freed) == ("deleted", 40)
    assert presence(root, t) == "none" and outside.read_bytes() == b"W" * 30


def test_a_symlinked_checkpoint_directory_is_refused(root: Path) -> None:
    real = root.parent / "elsewhere" / "step-8"
    write(real / "model.pt", b"M")
    os.symlink(real, root / "step-8")
    t = Target(8, "step-8", ("step-8/model.pt",), Local.PRESENT, Remote.NONE, is_dir=True)
    with capture_logs() as logs:
        [out] = run_local(root, deletes(8), [t])
    assert (out.action, out.reason.split(":")[0]) == ("refused", "symlink")
    assert os.path.islink(root / "step-8") and (real / "model.pt").read_bytes() == b"M"
    assert events(logs, "prune_refused")[0]["reason"].startswith("symlink")


def test_a_parent_symlink_leaving_the_root_is_refused(root: Path) -> None:
    outside = root.parent / "other_run"
    write(outside / "step-4" / "model.pt", b"M")
    write(outside / "step_4_model.pt", b"M")
    os.symlink(outside, root / "runs")
    d = Target(4, "runs/step-4", ("runs/step-4/model.pt",), Local.PRESENT, Remote.NONE, True)
    f = Target(4, "runs/step_4_model.pt", (), Local.PRESENT, Remote.NONE, False)
    for t in (d, f):
        [out] = run_local(root, deletes(4), [t])
        assert (out.action, out.reason.split(":")[0]) == ("refused", "symlink")
    assert (outside / "step-4" / "model.pt").exists() and (outside / "step_4_model.pt").exists()


def test_a_trash_dir_outside_the_root_is_a_caller_error(root: Path, tmp_path: Path) -> None:
    t = dir_ckpt(root, 1)
    with pytest.raises(ValueError):
        execute_local(root, deletes(1), {1: t}, fixed(OPEN), tmp_path / "trash")
    assert presence(root, t) == "all"


# --- crash safety -----------------------------------------------------------------------------


@pytest.mark.parametrize("make", [dir_ckpt, split_ckpt])
def test_crash_between_trash_and_purge_then_startup_purges(root: Path, make: Any) -> None:
    t, other = make(root, 10), make(root, 11)
    record = trash(root, t, fixed(OPEN), trash_dir_for(root))
    assert isinstance(record, TrashRecord) and record.bytes in (350, 60)
    # "Crash" here: nothing purged. The checkpoint is wholly gone from its place.
    assert presence(root, t) == "none" and presence(root, other) == "all"
    assert [p.name for p in trash_entries(root)] == [record.entry.name]
    assert purge_trash(trash_dir_for(root)) == 1
    assert trash_entries(root) == [] and presence(root, t) == "none"
    assert presence(root, other) == "all"


def test_trash_then_purge_by_hand(root: Path) -> None:
    t = split_ckpt(root, 1)
    record = trash(root, t, fixed(OPEN), trash_dir_for(root))
    assert isinstance(record, TrashRecord) and sorted(record.moved) == sorted(t.files)
    assert purge(record) == 60 and trash_entries(root) == []


def test_trash_refuses_like_the_executor(root: Path) -> None:
    t = dir_ckpt(root, 1)
    got = trash(root, t, fixed(replace(OPEN, pinned=frozenset({1}))), trash_dir_for(root))
    assert got == Outcome(1, "local", "refused", "pinned") and presence(root, t) == "all"


def test_failing_to_record_the_trash_puts_the_checkpoint_back(root: Path) -> None:
    t = split_ckpt(root, 1)

    def on_trashed(step: int, entry: Path) -> None:
        raise RuntimeError("database is locked")

    with capture_logs() as logs:
        [out] = run_local(root, deletes(1), [t], on_trashed=on_trashed)
    assert out.action == "failed" and "database is locked" in out.reason
    assert presence(root, t) == "all" and trash_entries(root) == []
    assert events(logs, "prune_failed")[0]["step"] == 1


def test_a_failed_removal_after_recording_reports_trashed(root: Path) -> None:
    t = dir_ckpt(root, 1)
    moved_away = root / "moved-trash"

    def on_trashed(step: int, entry: Path) -> None:
        # Whatever removal then meets (here: the trash replaced by a file) must not undo it.
        trash_dir_for(root).rename(moved_away)
        trash_dir_for(root).write_bytes(b"")

    with capture_logs() as logs:
        [out] = run_local(root, deletes(1), [t], on_trashed=on_trashed)
    assert out.action == "trashed" and "purge_trash" in out.reason
    assert presence(root, t) == "none" and events(logs, "prune_failed")
    assert len(list(moved_away.iterdir())) == 1


def test_restore_puts_every_member_back(root: Path) -> None:
    t = dir_ckpt(root, 2)
    record = trash(root, t, fixed(OPEN), trash_dir_for(root))
    assert isinstance(record, TrashRecord)
    restore(record)
    assert presence(root, t) == "all" and trash_entries(root) == []


def test_purge_trash_without_a_trash_dir(root: Path) -> None:
    assert purge_trash(trash_dir_for(root)) == 0


def test_purge_trash_puts_nothing_back_outside_the_root(root: Path) -> None:
    outside = root.parent / "outside.pt"
    outside.write_bytes(b"not yours")
    entry = trash_dir_for(root) / "step-1.abc"
    write(entry / "data" / "x.pt", b"x")
    names = [str(outside), "../outside.pt", "../../x.pt"]
    doc = {"format": "ckptd-trash/1", "step": 1, "state": "moving", "names": names}
    (entry / "journal.json").write_text(json.dumps(doc))
    write(trash_dir_for(root) / "stray", b"s")
    os.symlink(outside, trash_dir_for(root) / "link")
    assert purge_trash(trash_dir_for(root)) == 2  # the stray file and the link
    assert trash_entries(root) == [] and outside.read_bytes() == b"not yours"
    assert sorted(p.name for p in root.iterdir()) == [".ckptd"]


CHILD = """
import contextlib, os, sys
from pathlib import Path
from ckptd.log import configure
from ckptd.model import Local, Remote
from ckptd.retention import executor, trash

configure("json", stream=sys.stderr)  # stdout is the line to the parent

root, mode = Path(sys.argv[1]), sys.argv[2]
files = tuple(f"ckpt/step_10_{p}.pt" for p in ("meta", "model", "optim"))
target = executor.Target(10, files[1], files, Local.PRESENT, Remote.NONE, is_dir=False)
guards = executor.Guards(None, None, frozenset(), frozenset(), frozenset(), False)

class Nets:
    @contextlib.contextmanager
    def held(self):
        yield guards

def block(word):
    print(word, flush=True)
    sys.stdin.read()  # the parent SIGKILLs us here

if mode == "mid-move":
    real_rename = os.rename
    def rename(src, dst):
        real_rename(src, dst)
        if "/.ckptd/trash/" in str(dst) and "/data/" in str(dst):
            block("moved-one")
    os.rename = rename

record = executor.trash(root, target, Nets(), trash.trash_dir_for(root))
block("trashed")
"""


def kill_child_at(root: Path, tmp_path: Path, mode: str, expect: str) -> None:
    script = tmp_path / "child.py"
    script.write_text(textwrap.dedent(CHILD))
    env = {**os.environ, "PYTHONPATH": SRC}
    child = subprocess.Popen([sys.executable, str(script), str(root), mode], env=env,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == expect
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=10)
    assert child.returncode == -signal.SIGKILL


def test_kill_9_after_the_rename_then_startup_purges(root: Path, tmp_path: Path) -> None:
    t = split_ckpt(root, 10)
    kill_child_at(root, tmp_path, "after-trash", "trashed")
    assert presence(root, t) == "none" and len(trash_entries(root)) == 1
    assert purge_trash(trash_dir_for(root)) == 1
    assert presence(root, t) == "none" and trash_entries(root) == []


def test_kill_9_halfway_through_the_moves_puts_everything_back(
    root: Path, tmp_path: Path
) -> None:
    t = split_ckpt(root, 10)
    kill_child_at(root, tmp_path, "mid-move", "moved-one")
    assert presence(root, t) == "half"  # what a naive startup purge would leave for good
    [entry] = trash_entries(root)
    assert json.loads((entry / "journal.json").read_text())["state"] == "moving"
    with capture_logs() as logs:
        assert purge_trash(trash_dir_for(root)) == 0
    assert presence(root, t) == "all" and trash_entries(root) == []
    assert [(root / f).stat().st_size for f in t.files] == [10, 20, 30]
    assert events(logs, "trash_restored")


# --- remote ---------------------------------------------------------------------------------


def upload(backend: Backend, step: int) -> None:
    prefix = step_prefix("llm", step)
    backend.put(f"{prefix}/model.pt.zst", b"m" * 70)
    backend.put(f"{prefix}/optim.pt.zst", b"o" * 30)
    backend.put(f"{prefix}/{MANIFEST_NAME}", b'{"format": "ckptd-manifest/1"}')


def remote_steps(backend: Backend) -> dict[int, int]:
    """step -> object count, for steps that still have a manifest."""
    counts: dict[int, int] = {}
    for m in backend.list("llm"):
        counts[int(m.key.split("/")[1].removeprefix("step-"))] = 0
    for m in backend.list("llm"):
        counts[int(m.key.split("/")[1].removeprefix("step-"))] += 1
    return counts


class ManifestFirst:
    """The upload stage's contract for deleting a step: the commit goes first, then the data."""

    def __init__(self) -> None:
        self.deleted: list[str] = []

    def __call__(self, backend: Backend, root: str, step: int) -> None:
        prefix = step_prefix(root, step)
        keys = [m.key for m in backend.list(prefix)]
        for key in sorted(keys, key=lambda k: not k.endswith(MANIFEST_NAME)):
            backend.delete(key)
            self.deleted.append(key)


@pytest.fixture
def remote(tmp_path: Path) -> Backend:
    backend = LocalBackend(tmp_path / "bucket")
    for step in (100, 200, 300, 400, 500):
        upload(backend, step)
    return backend


def test_remote_deletes_manifest_first_and_reports_bytes(remote: Backend) -> None:
    g = replace(OPEN, latest_step=500, committed=frozenset({100, 200, 300, 400, 500}))
    delete = ManifestFirst()
    with capture_logs() as logs:
        out = execute_remote(remote, "llm", remote_deletes(100, 200), fixed(g), delete)
    assert [(o.step, o.tier, o.action, o.reason) for o in out] == [
        (100, "remote", "deleted", "remote:not_kept"),
        (200, "remote", "deleted", "remote:not_kept"),
    ]
    assert out[0].bytes_freed == 100 + len(b'{"format": "ckptd-manifest/1"}')
    assert delete.deleted[0] == f"llm/step-100/{MANIFEST_NAME}"
    assert delete.deleted[3] == f"llm/step-200/{MANIFEST_NAME}"
    assert sorted(remote_steps(remote)) == [300, 400, 500]
    assert [e["step"] for e in events(logs, "checkpoint_pruned")] == [100, 200]


@pytest.mark.parametrize(
    ("guards", "reason"),
    [
        (replace(OPEN, latest_step=300), "latest"),
        (replace(OPEN, best_step=300), "best"),
        (replace(OPEN, pinned=frozenset({300})), "pinned"),
        (replace(OPEN, in_use=frozenset({300})), "in_use"),
    ],
)
def test_remote_nets_hold(remote: Backend, guards: Guards, reason: str) -> None:
    g = replace(guards, committed=frozenset({100, 200, 300, 400, 500}))
    with capture_logs() as logs:
        [out] = execute_remote(remote, "llm", remote_deletes(300), fixed(g), ManifestFirst())
    assert (out.action, out.reason) == ("refused", reason)
    assert remote_steps(remote)[300] == 3
    assert events(logs, "prune_refused")[0]["tier"] == "remote"


def test_remote_never_deletes_the_newest_verified_or_an_unverified_step(remote: Backend) -> None:
    # 500 is uploading (objects there, not verified): an upload may be writing it.
    g = replace(OPEN, committed=frozenset({100, 200, 300, 400}))
    out = execute_remote(remote, "llm", remote_deletes(400, 500), fixed(g), ManifestFirst())
    assert [(o.step, o.action, o.reason) for o in out] == [
        (400, "refused", "latest"), (500, "refused", "not_uploaded")]
    assert sorted(remote_steps(remote)) == [100, 200, 300, 400, 500]


def test_a_failing_remote_delete_is_reported(remote: Backend) -> None:
    def broken(backend: Backend, root: str, step: int) -> None:
        raise TransientError("503 slow down")

    g = replace(OPEN, committed=frozenset({100, 500}))
    with capture_logs() as logs:
        [out] = execute_remote(remote, "llm", remote_deletes(100), fixed(g), broken)
    assert (out.action, out.reason) == ("failed", "503 slow down")
    assert events(logs, "prune_failed")[0]["tier"] == "remote"
