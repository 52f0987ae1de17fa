"""Objects larger than a part sent early as multipart uploads (`ckptd.stages.sending.big`),
against the real SeaweedFS server: taken over by the upload stage instead of sent again,
aborted (no object, no open multipart upload) when the step is abandoned, left to the upload
stage when the store fails, and skipped by a later process that finds them in the ledger."""

from __future__ import annotations

import json
import threading
import urllib.request
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from support.ckpts import flip_byte
from support.uploads import (
    ROOT,
    MiB,
    Recording,
    fail_on,
    keys_of,
    make_step,
    random_bytes,
    s3_backend,
    upload_cfg,
)
from support.wait import wait_until

from ckptd.remote.manifest import Manifest
from ckptd.stages.sending import big
from ckptd.stages.sending.early import EarlySender
from ckptd.stages.upload import upload_step

pytest_plugins = ["s3server"]

BIG = "optim/rank0.pt.zst"  # the multipart object of the step below


def _step(tmp_path: Path, step: int, size: int = 12 * MiB) -> tuple[Path, Manifest]:
    files = {"optim/rank0.pt": random_bytes(size, seed=step), "meta.json": b'{"step": 1}'}
    return make_step(tmp_path, step, files)


def _open_uploads(server: Any) -> list[str]:
    """Multipart uploads begun and neither completed nor aborted, as the server's filer holds
    them (`/buckets/<bucket>/.uploads/<id>`)."""
    url = f"http://127.0.0.1:{server.ports['filer']}/buckets/{server.bucket}/.uploads/"
    req = urllib.request.Request(url, headers={"Accept": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=5) as answer:
            doc = json.loads(answer.read() or b"{}")
    except urllib.error.HTTPError as exc:
        if exc.code == 404:
            return []
        raise
    return [e["FullPath"] for e in doc.get("Entries") or []]


def _recorded(objects: Path) -> bool:
    ledger = objects / ".upload-ledger.jsonl"
    return ledger.exists() and f'"key":"{BIG}"' in ledger.read_text()


def _puts_of(rec: Recording, key: str) -> int:
    return sum(1 for k in rec.puts() if k.endswith(key))



def _big_send_begun(s3_server: Any, rec: Recording, step: int, objects: Path
                    ) -> tuple[EarlySender, set[str]]:
    """An early sender of `step` offered BIG, once its multipart upload has begun on the
    server; with the open uploads there were before."""
    before = set(_open_uploads(s3_server))
    sender = EarlySender(rec, ROOT, step, objects, concurrency=2)
    sender.offer(BIG, objects / BIG, (objects / BIG).stat().st_size)
    wait_until(lambda: set(_open_uploads(s3_server)) - before, 10.0,
               "the multipart upload begun")
    return sender, before

def test_a_big_object_sent_early_is_taken_over_not_sent_again(
        s3_server: Any, s3_url: str, tmp_path: Path) -> None:
    objects, manifest = _step(tmp_path, 1)
    rec = Recording(s3_backend(s3_server, s3_url))
    sender = EarlySender(rec, ROOT, 1, objects, concurrency=2)
    sender.offer(BIG, objects / BIG, (objects / BIG).stat().st_size)
    sender.finish()  # does not wait for it: handed to the upload
    sender.installed(objects)
    result = upload_step(rec, ROOT, objects, manifest, concurrency=2)
    assert _puts_of(rec, BIG) == 1  # the early send only
    assert result.skipped_objects == 1 and result.uploaded_objects == 1  # meta.json
    assert {BIG, "MANIFEST.json"} <= keys_of(rec, 1)
    assert _recorded(objects)


def test_an_abandoned_step_leaves_no_object_and_no_open_upload(
        s3_server: Any, s3_url: str, tmp_path: Path) -> None:
    objects, _manifest = _step(tmp_path, 2, size=60 * MiB)
    rec = Recording(s3_backend(s3_server, s3_url))
    sender, before = _big_send_begun(s3_server, rec, 2, objects)
    sent = sender.abandon()
    assert BIG not in sent
    wait_until(lambda: rec.in_flight == 0, 15.0, "the multipart send stopped")
    assert keys_of(rec, 2) == set()
    wait_until(lambda: set(_open_uploads(s3_server)) <= before, 10.0,
               "the multipart upload aborted")


def test_a_completed_big_object_is_returned_for_discarding(
        s3_server: Any, s3_url: str, tmp_path: Path) -> None:
    objects, _manifest = _step(tmp_path, 3)
    rec = Recording(s3_backend(s3_server, s3_url))
    sender = EarlySender(rec, ROOT, 3, objects, concurrency=2)
    sender.offer(BIG, objects / BIG, (objects / BIG).stat().st_size)
    wait_until(lambda: BIG in keys_of(rec, 3), 20.0, "the multipart send complete")
    sent = sender.abandon()  # what the executor's discard_early is then given
    assert set(sent) == {BIG} and sent[BIG].size == (objects / BIG).stat().st_size


def test_a_failing_store_leaves_the_big_object_to_the_upload(
        s3_server: Any, s3_url: str, tmp_path: Path) -> None:
    objects, manifest = _step(tmp_path, 4)
    inner = s3_backend(s3_server, s3_url)
    failing = Recording(inner, fail=fail_on(BIG))
    sender = EarlySender(failing, ROOT, 4, objects, concurrency=2)
    sender.offer(BIG, objects / BIG, (objects / BIG).stat().st_size)
    sender.finish()
    sender.installed(objects)
    rec = Recording(inner)
    result = upload_step(rec, ROOT, objects, manifest, concurrency=2)
    assert _puts_of(failing, BIG) == 1 and _puts_of(rec, BIG) == 1  # sent as today
    assert result.uploaded_objects == 2
    assert BIG in keys_of(rec, 4)


def test_an_object_already_there_is_never_replaced_by_a_multipart_send(
        s3_server: Any, s3_url: str, tmp_path: Path) -> None:
    objects, _manifest = _step(tmp_path, 5)
    rec = Recording(s3_backend(s3_server, s3_url))
    rec.put(f"{ROOT}/step-5/{BIG}", b"an earlier try's object")
    sender = EarlySender(rec, ROOT, 5, objects, concurrency=2)
    sender.offer(BIG, objects / BIG, (objects / BIG).stat().st_size)
    sender.finish()
    sender.installed(objects)
    assert big.take_over(rec.url, ROOT, 5, timeout=20.0) == 0
    assert _puts_of(rec, BIG) == 1  # the test's own
    assert rec.get_bytes(f"{ROOT}/step-5/{BIG}") == b"an earlier try's object"


def test_a_later_process_skips_what_the_ledger_recorded(
        s3_server: Any, s3_url: str, tmp_path: Path) -> None:
    """A daemon stopped after the early send completed, before the upload: the next one (no
    hand-off in memory) finds the object in the listing and the ledger, and skips it."""
    objects, manifest = _step(tmp_path, 6)
    rec = Recording(s3_backend(s3_server, s3_url))
    sender = EarlySender(rec, ROOT, 6, objects, concurrency=2)
    sender.offer(BIG, objects / BIG, (objects / BIG).stat().st_size)
    sender.finish()
    sender.installed(objects)
    wait_until(lambda: _recorded(objects), 20.0, "the send recorded")
    big._handoffs.clear()  # what a restart loses
    rec2 = Recording(s3_backend(s3_server, s3_url))
    result = upload_step(rec2, ROOT, objects, manifest, concurrency=2)
    assert _puts_of(rec2, BIG) == 0 and result.skipped_objects == 1


def test_the_daemon_sends_a_big_object_early_and_commits_it_once(
        inproc_daemon: Any, s3_server: Any, s3_url: str, tmp_path: Path) -> None:
    d = inproc_daemon(roots=[{"name": "r1", "upload": upload_cfg(
        s3_url, s3_server, part_size="5MiB", concurrency=2)}])
    staged = tmp_path / "out" / "step-7"
    state = {"w": torch.randn(3 << 20, generator=torch.Generator().manual_seed(7))}  # 12 MiB
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(staged), thread_count=1))
    staged.rename(d.roots["r1"] / "step-7")  # committed as a trainer commits a save
    assert d.client.wait("r1", 7, until="uploaded", timeout=60)
    committed = d.wait_event("upload_committed")[0]
    assert committed["uploaded_objects"] == 0  # every object went up early, none again
    assert committed["skipped_objects"] == 2
    sent = d.wait_event("early_upload_multipart")[0]
    assert sent["step"] == 7 and sent["bytes"] > 5 * MiB
    assert sent["streamed"] is True  # begun while the object was still being written
    backend = s3_backend(s3_server, s3_url)
    sizes = {m.key.rsplit("/", 1)[-1]: m.size for m in backend.list("r1/step-7")}
    assert max(sizes.values()) > 5 * MiB and "MANIFEST.json" in sizes


def test_an_upload_of_the_step_cancels_an_early_send_and_none_starts_beside_it(
        s3_server: Any, s3_url: str, tmp_path: Path) -> None:
    objects, _manifest = _step(tmp_path, 8, size=60 * MiB)
    rec = Recording(s3_backend(s3_server, s3_url))
    sender, before = _big_send_begun(s3_server, rec, 8, objects)
    with big.uploading(rec.url, ROOT, 8):  # another save's upload of the same step
        assert rec.in_flight == 0  # the early send stopped before the upload went on
        again = EarlySender(rec, ROOT, 8, objects, concurrency=2)
        again.offer(BIG, objects / BIG, (objects / BIG).stat().st_size)
        again.finish()
        assert big.take_over(rec.url, ROOT, 8, timeout=10.0) == 0  # left to the upload
        assert keys_of(rec, 8) == set()
    wait_until(lambda: set(_open_uploads(s3_server)) <= before, 10.0,
               "the multipart upload aborted")
    assert sender.abandon() == {}


def test_an_invalid_step_leaves_no_big_object_and_no_open_upload(
        inproc_daemon: Any, s3_server: Any, s3_url: str, tmp_path: Path) -> None:
    d = inproc_daemon(roots=[{"name": "r1", "compress": {"codec": "none"}, "upload": upload_cfg(
        s3_url, s3_server, part_size="5MiB", concurrency=2)}])
    before = set(_open_uploads(s3_server))
    staged = tmp_path / "out" / "step-9"
    gen = torch.Generator().manual_seed(9)
    state = {"a": torch.randn(3 << 20, generator=gen), "b": torch.randn(6 << 20, generator=gen)}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(staged), thread_count=1,
                                                        single_file_per_rank=False))
    largest = max(staged.glob("*.distcp"), key=lambda p: p.stat().st_size)
    flip_byte(largest)  # read last: the 12 MiB object before it is already going up
    staged.rename(d.roots["r1"] / "step-9")
    assert d.wait_for("r1", 9)["state"] == "invalid"
    backend = s3_backend(s3_server, s3_url)
    wait_until(lambda: not list(backend.list("r1/step-9")), 20.0, "no object of the step")
    wait_until(lambda: set(_open_uploads(s3_server)) <= before, 20.0, "no open upload")


def test_a_handed_over_send_whose_upload_never_comes_stops_with_the_daemon(
        s3_server: Any, s3_url: str, tmp_path: Path) -> None:
    objects, _manifest = _step(tmp_path, 11, size=60 * MiB)
    earlier = set(threading.enumerate())
    rec = Recording(s3_backend(s3_server, s3_url))
    sender, before = _big_send_begun(s3_server, rec, 11, objects)
    sender.finish()  # handed to an upload that the stopping daemon never runs
    sender.installed(objects)
    big.stop_all()  # what the daemon's stop calls
    assert rec.in_flight == 0  # stopped, not left sending while the process exits
    wait_until(lambda: not [t for t in threading.enumerate()
                            if t.name.startswith("ckptd-early-big") and t not in earlier],
               5.0, "the sending thread ended")
    assert BIG not in keys_of(rec, 11)
    wait_until(lambda: set(_open_uploads(s3_server)) <= before, 10.0,
               "the multipart upload aborted")


def test_a_send_superseded_by_a_later_save_of_the_step_stops(
        s3_server: Any, s3_url: str, tmp_path: Path) -> None:
    first, _manifest = _step(tmp_path / "a", 12, size=60 * MiB)
    later, _manifest = _step(tmp_path / "b", 12, size=60 * MiB)
    rec = Recording(s3_backend(s3_server, s3_url))
    sender, before = _big_send_begun(s3_server, rec, 12, first)
    sender.finish()  # its upload is still queued when the step is saved again
    # the later save validated, with its own send of the object left to its upload
    again = big.BigSends(rec, sender.prefix, lambda key: False, (rec.url, ROOT, 12))
    again.offer(BIG, later / BIG, (later / BIG).stat().st_size)
    big.hand_over(rec.url, ROOT, 12, again)
    wait_until(lambda: rec.in_flight == 0, 10.0, "the superseded send stopped")
    assert BIG not in keys_of(rec, 12)  # not left to finish the earlier save's bytes
    wait_until(lambda: set(_open_uploads(s3_server)) <= before, 10.0,
               "the multipart upload aborted")
    big.take_over(rec.url, ROOT, 12, timeout=10.0)
