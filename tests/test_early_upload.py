"""Sending early: a step's objects go up while the rest of it is still being validated
(`ckptd.stages.early`), the upload stage skips what the ledger vouches for, and a step that
turns out invalid leaves no commit and none of the objects sent for it."""

from __future__ import annotations

import filecmp
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
from ckptd.remote.layout import manifest_key
from ckptd.stages import early
from ckptd.stages.early import EarlySender

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
    assert sent["objects"] >= FILES - 4  # all but the few still in flight as validation ended
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


def test_objects_larger_than_a_part_are_left_to_the_upload_stage(tmp_path: Path) -> None:
    remote = tmp_path / "remote"
    backend = make_backend(f"file://{remote}", part_size=64)
    sender = EarlySender(backend, "r", 5, tmp_path, concurrency=2)
    sender.offer("big.bin", _object(tmp_path, "big", b"x" * 65), 65)
    sender.offer("small.bin", _object(tmp_path, "small", b"x" * 64), 64)
    _idle(sender)
    assert sender.finish() == 1
    assert not (remote / "r" / "step-5" / "big.bin").exists()


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
