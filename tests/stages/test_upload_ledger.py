"""The upload ledger (`.upload-ledger.jsonl`): appended one line per object, read back after a
torn write, only a hint when foreign or damaged; against a directory and a real SeaweedFS.

file:// objects carry no etag, so there a skip can only come from the ledger: those cases
prove what the ledger alone decides. Run alone with
`python -m pytest tests/stages/test_upload_ledger.py`.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from structlog.testing import capture_logs
from support.uploads import (
    PART,
    ROOT,
    Recording,
    fail_on,
    keys_of,
    make_step,
    random_bytes,
    s3_backend,
)

from ckptd.backends import Backend, LocalBackend
from ckptd.errors import PermanentError, TransientError
from ckptd.remote.keys import list_steps
from ckptd.remote.manifest import Manifest
from ckptd.stages.sending.ledger import LEDGER_NAME, Ledger
from ckptd.stages.upload import upload_step

if TYPE_CHECKING:
    from s3server import S3Server

pytest_plugins = ["s3server"]  # fixtures: s3_server, s3_url

FILES = 24
LAST = "shard00.bin"  # the smallest object: sent last, so failing it interrupts at the end


def many_files() -> dict[str, bytes]:
    # Sizes fall with the index: sent biggest first, so LAST goes last.
    return {f"shard{i:02d}.bin": random_bytes(4096 + 512 * i, i) for i in range(FILES)}


@pytest.fixture(params=["local", "s3"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Backend:
    if request.param == "local":
        return LocalBackend(tmp_path / "remote", part_size=PART)
    server: S3Server = request.getfixturevalue("s3_server")
    return s3_backend(server, request.getfixturevalue("s3_url"))


def interrupted(backend: Backend, tmp_path: Path, step: int) -> tuple[Path, Manifest]:
    """A step whose upload failed on its last object: every other object landed."""
    objects, manifest = make_step(tmp_path, step, many_files(), codec="none")
    with pytest.raises(TransientError):
        upload_step(Recording(backend, fail_on(LAST)), ROOT, objects, manifest, concurrency=1)
    assert list_steps(backend, ROOT) == []
    assert len(keys_of(backend, step)) == FILES - 1
    return objects, manifest


def lines(objects: Path) -> list[bytes]:
    return (objects / LEDGER_NAME).read_bytes().splitlines(keepends=True)


def puts_after(backend: Backend, objects: Path, manifest: Manifest) -> list[str]:
    """The keys a re-run puts, relative to the step, objects only."""
    rec = Recording(backend)
    upload_step(rec, ROOT, objects, manifest)
    prefix = f"{ROOT}/step-{manifest.step}/"
    return sorted(k.removeprefix(prefix) for k in rec.puts() if k.startswith(prefix)
                  and not k.endswith("MANIFEST.json"))


def test_the_ledger_grows_by_one_line_per_object_and_is_never_rewritten(
    backend: Backend, tmp_path: Path
) -> None:
    objects, manifest = interrupted(backend, tmp_path, 1)
    before = (objects / LEDGER_NAME).read_bytes()
    head, *records = before.splitlines()
    assert json.loads(head) == {"format": "ckptd-upload-ledger/2", "url": backend.url}
    assert len(records) == FILES - 1  # one line per object put, the failed one has none
    assert {json.loads(r)["key"] for r in records} == {f.key for f in manifest.files} - {LAST}
    assert puts_after(backend, objects, manifest) == [LAST]
    after = (objects / LEDGER_NAME).read_bytes()
    assert after.startswith(before)  # appended to, not rewritten
    assert json.loads(after[len(before):])["key"] == LAST  # exactly one more line


def test_a_torn_last_line_is_ignored_and_cut_before_the_next_record(
    backend: Backend, tmp_path: Path
) -> None:
    objects, manifest = interrupted(backend, tmp_path, 2)
    whole = (objects / LEDGER_NAME).read_bytes()
    last = lines(objects)[-1]
    # A kill in the middle of writing the last line: half of it made it to the file.
    (objects / LEDGER_NAME).write_bytes(whole + last[: len(last) // 2])
    assert puts_after(backend, objects, manifest) == [LAST]  # the whole lines still vouch
    got = lines(objects)
    assert (objects / LEDGER_NAME).read_bytes().startswith(whole)
    assert [json.loads(r)["key"] for r in got[len(whole.splitlines()):]] == [LAST]
    assert all(r.endswith(b"\n") for r in got)


def test_a_torn_line_never_vouches_for_its_object(tmp_path: Path) -> None:
    """file://: the object whose line was torn is sent again; the others are skipped."""
    backend = LocalBackend(tmp_path / "remote", part_size=PART)
    objects, manifest = interrupted(backend, tmp_path, 3)
    *kept, last = lines(objects)
    (objects / LEDGER_NAME).write_bytes(b"".join(kept) + last[:-1])  # only the newline lost
    assert puts_after(backend, objects, manifest) == sorted([json.loads(last)["key"], LAST])


def test_a_rerun_resends_only_the_missing_objects(backend: Backend, tmp_path: Path) -> None:
    objects, manifest = interrupted(backend, tmp_path, 4)
    gone = ["shard05.bin", "shard17.bin"]
    for key in gone:  # lost remotely since (a lifecycle rule, a manual delete)
        backend.delete(f"{ROOT}/step-4/{key}")
    assert puts_after(backend, objects, manifest) == sorted([*gone, LAST])
    assert list_steps(backend, ROOT) == [4]


def test_a_damaged_line_hides_only_its_own_entry(tmp_path: Path) -> None:
    backend = LocalBackend(tmp_path / "remote", part_size=PART)
    objects, manifest = interrupted(backend, tmp_path, 5)
    got = lines(objects)
    damaged = json.loads(got[3])["key"]
    replaced = json.loads(got[4])["key"]
    got[3] = b'{"key": "' + damaged.encode() + b'", "local": \x00garbage}\n'
    got[4] = b'["not", "an", "entry"]\n'  # JSON, but no entry
    (objects / LEDGER_NAME).write_bytes(b"".join(got))
    assert puts_after(backend, objects, manifest) == sorted([damaged, replaced, LAST])


def test_a_foreign_or_unreadable_ledger_is_only_a_hint(tmp_path: Path) -> None:
    backend = LocalBackend(tmp_path / "remote", part_size=PART)
    objects, manifest = interrupted(backend, tmp_path, 6)
    head, *records = lines(objects)
    other = json.dumps({"format": "ckptd-upload-ledger/2", "url": "file:///elsewhere"})
    (objects / LEDGER_NAME).write_bytes(other.encode() + b"\n" + b"".join(records))
    assert len(puts_after(backend, objects, manifest)) == FILES  # vouches for nothing
    assert lines(objects)[0] == head  # started afresh for this URL
    assert len(lines(objects)) == 1 + FILES


def test_a_ledger_of_the_earlier_whole_document_format_is_read_and_folded_in(
    tmp_path: Path,
) -> None:
    backend = LocalBackend(tmp_path / "remote", part_size=PART)
    objects, manifest = interrupted(backend, tmp_path, 7)
    entries = {}
    for raw in lines(objects)[1:]:
        entry = json.loads(raw)
        entries[entry.pop("key")] = entry
    (objects / LEDGER_NAME).unlink()
    old = {"format": "ckptd-upload-ledger/1", "url": backend.url, "objects": entries}
    (objects / ".upload-ledger.json").write_text(json.dumps(old, sort_keys=True))
    assert puts_after(backend, objects, manifest) == [LAST]
    assert not (objects / ".upload-ledger.json").exists()
    assert len(lines(objects)) == 1 + FILES
    assert Ledger.load(objects / LEDGER_NAME, backend.url).objects.keys() == {
        f.key for f in manifest.files
    }


# -- where each object is read from -------------------------------------------------------------


@pytest.mark.parametrize("link", ["file", "dir"])
def test_a_link_leading_out_of_the_objects_dir_is_refused(tmp_path: Path, link: str) -> None:
    """Local paths are checked once per directory, then one lstat per file: a link, to a file
    or to a directory, outside the step's copy is still refused, and what it leads to never sent."""
    backend = LocalBackend(tmp_path / "remote", part_size=PART)
    files = {f"rank{r}/shard{i}.bin": random_bytes(1000 + i, i) for r in range(2) for i in range(3)}
    objects, manifest = make_step(tmp_path, 8, files, codec="none")
    outside = tmp_path / "outside"
    shutil.copytree(objects / "rank1", outside)
    if link == "dir":
        shutil.rmtree(objects / "rank1")
        (objects / "rank1").symlink_to(outside)
    else:
        (objects / "rank1/shard2.bin").unlink()
        (objects / "rank1/shard2.bin").symlink_to(outside / "shard2.bin")
    with pytest.raises(PermanentError, match="leads out of"):
        upload_step(backend, ROOT, objects, manifest)
    assert list_steps(backend, ROOT) == []
    linked = "rank1/" if link == "dir" else "rank1/shard2.bin"
    assert not [k for k in keys_of(backend, 8) if k.startswith(linked)]


def test_an_unwritable_ledger_never_fails_the_upload(tmp_path: Path) -> None:
    backend = LocalBackend(tmp_path / "remote", part_size=PART)
    objects, manifest = make_step(tmp_path, 9, many_files(), codec="none")
    (objects / LEDGER_NAME).mkdir()  # neither readable nor writable as a file
    with capture_logs() as logs:
        result = upload_step(backend, ROOT, objects, manifest)
    assert result.uploaded_objects == FILES and list_steps(backend, ROOT) == [9]
    assert len([e for e in logs if e["event"] == "upload_ledger_unwritable"]) == FILES


@pytest.mark.parametrize("kind", ["fifo", "link", "legacy_fifo"])
def test_a_ledger_that_is_no_regular_file_is_neither_waited_on_nor_followed(
    tmp_path: Path, kind: str
) -> None:
    """The ledger lies in the root, where the training job (or anyone who writes there) can put
    anything: a FIFO is not waited on (reading or appending), a link is never followed, and
    what it points at is left exactly as it was."""
    backend = LocalBackend(tmp_path / "remote", part_size=PART)
    objects, manifest = make_step(tmp_path, 10, many_files(), codec="none")
    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"precious\n")
    if kind == "fifo":
        os.mkfifo(objects / LEDGER_NAME)
    elif kind == "legacy_fifo":
        os.mkfifo(objects / ".upload-ledger.json")
    else:
        (objects / LEDGER_NAME).symlink_to(victim)
    result = upload_step(backend, ROOT, objects, manifest)  # the test's timeout: never blocks
    assert result.uploaded_objects == FILES and list_steps(backend, ROOT) == [10]
    assert victim.read_bytes() == b"precious\n"
