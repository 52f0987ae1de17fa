"""Objects larger than a part sent while the compress stage is still writing them
(`ckptd.stages.sending.growing`, `BigSends.stream`), against the real SeaweedFS server: the
stored object is exactly the finished local file; an invalid step, a failed writer or a cancel
while the send waits for bytes leave no object and no open multipart upload."""

from __future__ import annotations

import hashlib
import io
import json
import random
import threading
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from support.uploads import ROOT, MiB, Recording, keys_of, s3_backend
from support.wait import wait_until

from ckptd.errors import CorruptData
from ckptd.stages import compress
from ckptd.stages.sending import big
from ckptd.stages.sending.early import EarlySender
from ckptd.stages.sending.ledger import LEDGER_NAME, Ledger

pytest_plugins = ["s3server"]

REL = "optim/rank0.pt"
KEY = REL + ".zst"
CHUNK = 1 * MiB


def _open_uploads(server: Any) -> list[str]:
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


class _Save:
    """A step's compressed copy staged with an early sender, its one file fed by hand as the
    validation read pass feeds it."""

    def __init__(self, server: Any, url: str, tmp: Path, step: int) -> None:
        self.rec = Recording(s3_backend(server, url))
        self.step = step
        self.stager = compress.Stager(tmp, ROOT, step, "single", "zstd", 1, 1, 0.0)
        self.sender = EarlySender(self.rec, ROOT, step, self.stager.staging, concurrency=2)
        self.discarded: list[Any] = []
        self.stager.send_early(self.sender, self.discarded.append)
        self.sink = self.stager.sinks_for(REL)[0]
        self.data = random.Random(step).randbytes(14 * MiB)  # incompressible: ~14 MiB stored
        self.fed = 0
        self.before = set(_open_uploads(server))

    def feed(self, upto: int) -> None:
        while self.fed < upto:
            self.sink.update(self.fed, memoryview(self.data)[self.fed:self.fed + CHUNK])
            self.fed += len(self.data[self.fed:self.fed + CHUNK])

    def wait_sending(self, server: Any) -> None:
        """The multipart upload has begun on the server while the object is being written."""
        self.feed(8 * MiB)
        wait_until(lambda: self.rec.in_flight == 1 and set(_open_uploads(server)) - self.before,
                   15.0, "the streamed multipart upload begun")

    def no_trace(self, server: Any) -> None:
        wait_until(lambda: self.rec.in_flight == 0, 15.0, "the send stopped")
        assert KEY not in keys_of(self.rec, self.step)
        wait_until(lambda: set(_open_uploads(server)) <= self.before, 15.0,
                   "the multipart upload aborted")


def test_a_send_begun_mid_write_stores_exactly_the_finished_object(
        s3_server: Any, s3_url: str, tmp_path: Path) -> None:
    save = _Save(s3_server, s3_url, tmp_path, 21)
    save.wait_sending(s3_server)
    save.feed(len(save.data))
    save.sink.finish(len(save.data))
    local = save.sink.tmp.read_bytes()
    save.sender.finish()  # the send goes on, handed to the step's upload
    save.sender.installed(save.stager.staging)
    assert big.take_over(save.rec.url, ROOT, 21, timeout=60.0) == 1
    out = io.BytesIO()
    save.rec.get(f"{ROOT}/step-21/{KEY}", out)
    assert hashlib.sha256(out.getvalue()).digest() == hashlib.sha256(local).digest()
    assert save.rec.puts() == [f"{ROOT}/step-21/{KEY}"]  # one put: nothing offered again
    st = save.sink.tmp.stat()  # the ledger vouches for it by the finished file's fingerprint
    ledger = Ledger.load(save.stager.staging / LEDGER_NAME, save.rec.url)
    assert ledger.vouches(KEY, [st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev],
                          save.rec.stat(f"{ROOT}/step-21/{KEY}"))
    ledger.close()
    save.stager.abort()


def test_an_invalid_step_mid_write_leaves_no_object_and_no_open_upload(
        s3_server: Any, s3_url: str, tmp_path: Path) -> None:
    save = _Save(s3_server, s3_url, tmp_path, 22)
    save.wait_sending(s3_server)
    save.stager.abort()  # validation found the step invalid before this file was finished
    save.no_trace(s3_server)
    assert save.discarded == []  # nothing completed: nothing for the executor


def test_a_failed_writer_aborts_the_send(s3_server: Any, s3_url: str, tmp_path: Path) -> None:
    save = _Save(s3_server, s3_url, tmp_path, 23)
    save.wait_sending(s3_server)
    save.feed(len(save.data))
    try:
        save.sink.finish(len(save.data) + 1)  # the file changed while it was read
    except CorruptData:
        pass
    save.no_trace(s3_server)
    save.stager.abort()


@pytest.mark.parametrize("how", ["cancel", "daemon stop"])
def test_a_cancel_while_waiting_for_bytes_ends_the_send(
        s3_server: Any, s3_url: str, tmp_path: Path, how: str) -> None:
    """The writer stops writing (a slow read pass) with the send waiting for its next bytes:
    a cancel, or the daemon stopping, ends the send, with nothing stored and the multipart
    upload aborted."""
    save = _Save(s3_server, s3_url, tmp_path, 24 if how == "cancel" else 25)
    save.wait_sending(s3_server)
    sends = save.sender._big
    ended = threading.Event()
    stop = (lambda: sends.cancel(timeout=30.0)) if how == "cancel" else big.stop_all
    threading.Thread(target=lambda: (stop(), sends.wait(30.0), ended.set())).start()
    wait_until(ended.is_set, 30.0, "the cancel returned")
    assert sends.wait(0.0)  # the send ended, not left waiting for the rest of the object
    save.no_trace(s3_server)
    save.stager.abort()
