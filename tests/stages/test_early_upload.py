"""Sending early: a step's objects go up while the rest of it is still being validated
(`ckptd.stages.sending.early`), the upload stage skips what the ledger vouches for, and a step that
turns out invalid leaves no commit and none of the objects sent for it."""

from __future__ import annotations

import filecmp
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from support.ckpts import flip_byte
from support.wait import wait_until

from ckptd.backends import make_backend
from ckptd.remote.keys import manifest_key
from ckptd.stages.sending import big, early
from ckptd.stages.sending.early import EarlySender

FILES = 24


def _step(path: Path, files: int = FILES) -> Path:
    """A real dcp.save with one file per tensor, each larger than the one before (validation
    reads the smallest first, so the largest is the last one read)."""
    state = {f"t{i:03d}": torch.arange(256 * (i + 1), dtype=torch.float32) for i in range(files)}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(path), single_file_per_rank=False,
                                                         thread_count=1))
    return path


def _largest(path: Path) -> Path:
    return max((p for p in path.iterdir() if p.suffix == ".distcp"), key=lambda p: p.stat().st_size)


def test_objects_go_up_during_validation_and_the_upload_sends_none_again(
        inproc_daemon: Any, tmp_path: Path) -> None:
    remote = tmp_path / "remote"
    d = inproc_daemon(roots=[{"name": "r1", "upload": {"url": f"file://{remote}"}}])
    staged = _step(tmp_path / "out" / "step-5")
    staged.rename(d.roots["r1"] / "step-5")  # committed as a trainer commits a save
    assert d.client.wait("r1", 5, until="uploaded", timeout=60)
    sent = d.wait_event("early_upload_done")[0]
    committed = d.wait_event("upload_committed")[0]
    assert sent["step"] == committed["step"] == 5
    # At least the first: how many more go up before validation ends depends on the machine
    # (validation never waits for the store; what is still queued then is the upload's).
    assert sent["objects"] >= 1
    assert committed["skipped_objects"] == sent["objects"]  # vouched for: not sent again
    assert committed["uploaded_objects"] == FILES + 1 - sent["objects"]
    out = tmp_path / "restored"
    done = subprocess.run([sys.executable, "-m", "ckptd", "restore", "--config", str(d.config),
                           "r1", "5", "--to", str(out)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    back = next(p for p in out.rglob(".metadata")).parent
    names = sorted(p.name for p in (d.roots["r1"] / "step-5").iterdir())
    assert sorted(p.name for p in back.iterdir()) == names
    assert filecmp.cmpfiles(back, d.roots["r1"] / "step-5", names, shallow=False)[0] == names


def test_an_invalid_step_leaves_no_commit_and_none_of_its_early_objects(
        inproc_daemon: Any, tmp_path: Path) -> None:
    remote = tmp_path / "remote"
    d = inproc_daemon(roots=[{"name": "r1", "upload": {"url": f"file://{remote}"}}])
    staged = _step(tmp_path / "out" / "step-6")
    flip_byte(_largest(staged))  # found only when the last file is read
    staged.rename(d.roots["r1"] / "step-6")
    assert d.wait_for("r1", 6)["state"] == "invalid"
    discarded = d.wait_event("early_objects_discarded")[0]
    assert discarded["step"] == 6 and discarded["objects"] == discarded["of"] > 0
    assert not (remote / manifest_key("r1", 6)).exists()
    left = [p for p in (remote / "r1").rglob("*") if p.is_file()] if (remote / "r1").exists() \
        else []
    assert left == []


def _idle(sender: EarlySender) -> None:
    """Every offer put or given up: what `finish` records is then all there is."""
    wait_until(lambda: sender.pending() == 0, 10.0, "the early puts done")


def _object(tmp_path: Path, name: str, data: bytes) -> Path:
    path = tmp_path / name
    path.write_bytes(data)
    return path


def test_a_committed_step_is_never_written_into(tmp_path: Path) -> None:
    remote = tmp_path / "remote"
    backend = make_backend(f"file://{remote}")
    backend.put(manifest_key("r", 3), b"{}")
    sender = EarlySender(backend, "r", 3, tmp_path, concurrency=2)
    sender.offer("a.bin", _object(tmp_path, "a", b"x" * 100), 100)
    _idle(sender)
    assert sender.finish() == 0
    assert not (remote / "r" / "step-3" / "a.bin").exists()


def test_an_object_already_there_is_left_as_it_is(tmp_path: Path) -> None:
    remote = tmp_path / "remote"
    backend = make_backend(f"file://{remote}")
    backend.put("r/step-4/a.bin", b"older")
    sender = EarlySender(backend, "r", 4, tmp_path, concurrency=2)
    sender.offer("a.bin", _object(tmp_path, "a", b"newer bytes"), 11)
    sender.offer("b.bin", _object(tmp_path, "b", b"b" * 10), 10)
    _idle(sender)
    assert sender.finish() == 1  # b only: a create-only put never replaces
    assert (remote / "r" / "step-4" / "a.bin").read_bytes() == b"older"
    assert (remote / "r" / "step-4" / "b.bin").read_bytes() == b"b" * 10
    assert (tmp_path / ".upload-ledger.jsonl").read_text().count('"key":"b.bin"') == 1


def test_objects_larger_than_a_part_are_handed_to_the_upload_stage(tmp_path: Path) -> None:
    remote = tmp_path / "remote"
    backend = make_backend(f"file://{remote}", part_size=64)
    sender = EarlySender(backend, "r", 5, tmp_path, concurrency=2)
    sender.offer("big.bin", _object(tmp_path, "big", b"x" * 65), 65)
    sender.offer("small.bin", _object(tmp_path, "small", b"x" * 64), 64)
    _idle(sender)
    assert sender.finish() == 1  # the small one, in one request; the big one is not waited for
    sender.installed(tmp_path)
    assert big.take_over(backend.url, "r", 5, timeout=10.0) == 1  # what the upload waits for
    assert (remote / "r" / "step-5" / "big.bin").read_bytes() == b"x" * 65
    assert (tmp_path / ".upload-ledger.jsonl").read_text().count('"key":"big.bin"') == 1


def test_a_failing_store_stops_early_sending_and_never_holds_the_step(tmp_path: Path) -> None:
    remote = tmp_path / "remote"
    remote.write_text("a file where the remote directory should be")
    backend = make_backend(f"file://{remote}")
    sender = EarlySender(backend, "r", 6, tmp_path, concurrency=2)
    started = time.monotonic()
    for i in range(50):
        sender.offer(f"o{i}.bin", _object(tmp_path, f"o{i}", b"x" * 10), 10)
    _idle(sender)
    assert sender.finish() == 0
    assert time.monotonic() - started < early.FINISH_WAIT_S + 5
    assert remote.read_text().startswith("a file")


def _other_step(path: Path, files: int) -> Path:
    """A re-save of a step: other values, fewer files (so what only the first save sent would
    be left over)."""
    state = {f"t{i:03d}": torch.full((512 * (i + 1),), float(i) + 0.5) for i in range(files)}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(path), single_file_per_rank=False,
                                                         thread_count=1))
    return path


def _objects(remote: Path, step: int) -> dict[str, bytes]:
    top = remote / "r1" / f"step-{step}"
    return {p.relative_to(top).as_posix(): p.read_bytes()
            for p in sorted(top.rglob("*")) if p.is_file()} if top.exists() else {}


def _sent_but_not_committed(d: Any, remote: Path, tmp_path: Path) -> tuple[Path, int]:
    """Step 5 sent early, its upload failed for good (one object's name is taken in the bucket
    by a directory): the first save will never commit as it is. Returns the step's dir in the
    root and how many objects went early."""
    root = d.roots["r1"]
    first = _step(tmp_path / "out" / "step-5")
    (remote / "r1" / "step-5" / "step-5" / f"{_largest(first).name}.zst").mkdir(parents=True)
    first.rename(root / "step-5")
    sent = next(e for e in d.wait_event("early_upload_done", count=2) if e["step"] == 5)
    wait_until(lambda: any(e["step"] == 5 for e in d.events("stage_failed")), 60,
               "the first save's upload to fail", detail=lambda: d.log_text()[-3000:])
    # Some went early (how many before validation ended depends on the machine): those are
    # what the tests built on this must see discarded.
    assert sent["objects"] >= 1 and len(_objects(remote, 5)) >= sent["objects"]
    return root / "step-5", int(sent["objects"])


def _a_committed_step(d: Any, remote: Path, tmp_path: Path) -> dict[str, bytes]:
    _step(tmp_path / "out" / "step-4", files=4).rename(d.roots["r1"] / "step-4")
    assert d.client.wait("r1", 4, until="uploaded", timeout=60)
    return _objects(remote, 4)


def test_a_superseded_save_leaves_none_of_its_early_objects(
        inproc_daemon: Any, tmp_path: Path) -> None:
    """A save sent early whose upload cannot finish, then saved again in place with fewer
    files: the decision that the first save will never commit hands what it sent to the
    executor, and the step holds only the re-save's objects once that commits. A committed
    step beside it is not touched."""
    remote = tmp_path / "remote"
    d = inproc_daemon(roots=[{"name": "r1", "upload": {"url": f"file://{remote}"},
                              "compress": {"codec": "zstd"}}])
    committed = _a_committed_step(d, remote, tmp_path)
    step_dir, _ = _sent_but_not_committed(d, remote, tmp_path)
    # The trainer saves the step again (after the scan saw the old files go: a save of fewer
    # files in place is otherwise a delete caught halfway).
    step_dir.rename(tmp_path / "gone-step-5")
    d.wake_scan()
    wait_until(lambda: any(e["step"] == 5 for e in d.events("checkpoint_vanished")), 30,
               "the first save's files seen gone")
    _other_step(tmp_path / "out2" / "step-5", files=4).rename(step_dir)
    d.wake_scan()
    assert d.client.wait("r1", 5, until="uploaded", timeout=90), d.log_text()[-4000:]
    manifest = json.loads((remote / manifest_key("r1", 5)).read_bytes())
    named = {f["key"] for f in manifest["files"]} | {"MANIFEST.json"}
    assert set(_objects(remote, 5)) == named, sorted(set(_objects(remote, 5)) - named)
    assert [e["objects"] > 0 for e in d.events("early_objects_discarded") if e["step"] == 5] \
        == [True]
    assert _objects(remote, 4) == committed


def test_a_save_judged_damaged_later_leaves_none_of_its_early_objects(
        inproc_daemon: Any, tmp_path: Path) -> None:
    """The same first save, whose copy is then lost and whose originals a later read pass
    finds damaged (a flipped byte, size and mtime kept): judged invalid, it will never commit,
    and what it sent early goes. The committed step beside it is not touched."""
    remote = tmp_path / "remote"
    d = inproc_daemon(roots=[{"name": "r1", "upload": {"url": f"file://{remote}"},
                              "compress": {"codec": "zstd"}}])
    committed = _a_committed_step(d, remote, tmp_path)
    step_dir, _ = _sent_but_not_committed(d, remote, tmp_path)
    victim = _largest(step_dir)
    st = victim.stat()
    flip_byte(victim)
    os.utime(victim, ns=(st.st_atime_ns, st.st_mtime_ns))
    (d.roots["r1"] / ".ckptd" / "objects" / "step-5" / "MANIFEST.json").unlink()
    assert d.reload() is True  # the upload is tried again at once: its copy is gone
    wait_until(lambda: {c["step"]: c["state"] for c in d.client.checkpoints("r1")}[5]
               == "invalid", 60, "step 5 judged damaged", detail=lambda: d.log_text()[-4000:])
    wait_until(lambda: any(e["step"] == 5 for e in d.events("early_objects_discarded")), 30,
               "the early objects discarded", detail=lambda: d.log_text()[-3000:])
    assert _objects(remote, 5) == {}
    assert not (remote / manifest_key("r1", 5)).exists()
    assert _objects(remote, 4) == committed


def test_a_forged_ledger_names_no_object_outside_its_step(tmp_path: Path) -> None:
    """The ledger a discard reads lies in the root: an entry naming a key that climbs out, is
    absolute or malformed is left out, and the executor deletes only what is still the very
    object put, under the step's own prefix."""
    from support.nets import no_nets

    from ckptd.backends.base import ObjectMeta
    from ckptd.retention import executor
    from ckptd.stages.sending.ledger import LEDGER_NAME, Ledger

    backend = make_backend(f"file://{tmp_path / 'remote'}")
    kept = backend.put("r1/step-4/a.zst", b"committed elsewhere", 19)
    mine = backend.put("r1/step-5/b.zst", b"sent early", 10)
    path = tmp_path / LEDGER_NAME
    ledger = Ledger.load(path, backend.url)
    ledger.record("b.zst", [1, 2, 3, 4], mine)
    ledger.close()
    forged = [{"key": "../step-4/a.zst", "local": [], "size": kept.size, "mtime": kept.mtime,
               "etag": kept.etag},
              {"key": "/etc/passwd", "local": [], "size": 1, "mtime": 0.0, "etag": None},
              {"key": "c.zst", "local": [], "size": "big", "mtime": 0.0, "etag": None},
              {"key": 7}, "not an object"]
    with open(path, "a") as f:
        f.writelines(json.dumps(doc) + "\n" for doc in forged)
    sent = Ledger.load(path, backend.url).sent()
    assert sent == {"b.zst": ObjectMeta("b.zst", mine.size, mine.mtime, mine.etag)}
    sent = {**sent, "../step-4/a.zst": ObjectMeta("../step-4/a.zst", kept.size, kept.mtime,
                                                  kept.etag)}
    assert executor.discard_early(backend, "r1", 5, sent, nets=no_nets()) == 1
    assert (tmp_path / "remote" / "r1" / "step-4" / "a.zst").read_bytes() == b"committed elsewhere"
    assert [m.key for m in backend.list("r1/step-5")] == []
