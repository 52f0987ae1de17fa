"""Async saves (`ckptd.torch.save(..., blocking=False)`) with real torch, a real daemon on a real
socket and real processes: snapshot semantics, the trainer killed after `save` returned, the
daemon killed mid-save, flush, skip, the fallback without a daemon, refused peers, two ranks."""

from __future__ import annotations

import array
import io
import json
import mmap
import os
import signal
import socket
import struct
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch
from support.async_save import post_persist, sealed_arena
from support.wait import wait_until

import ckptd.torch as ckpt
from ckptd import arena
from ckptd.client import Client
from ckptd.errors import NotFound
from ckptd.formats import zipcrc
from ckptd.torch import _arena_copy, _async

REPO = Path(__file__).resolve().parents[2]


def trained(seed: int = 0, width: int = 64) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU(),
                                torch.nn.Linear(width, 4))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model(torch.randn(8, width)).pow(2).mean().backward()
    opt.step()
    return model, opt


def clone(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in sd.items()}


def run_py(code: str, sock: Path, *args: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "CKPTD_SOCKET": str(sock)}
    return subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)


def test_async_save_is_a_snapshot_and_becomes_valid(inproc_daemon: Any) -> None:
    d = inproc_daemon(roots=[{"name": "r1"}])
    root = d.roots["r1"]
    model, opt = trained()
    before = clone(model.state_dict())
    h = ckpt.save(root, 10, model=model, optimizer=opt, metrics={"loss": 1.5},
                  client=d.client, blocking=False)
    with torch.no_grad():  # the training step right after save returned
        for p in model.parameters():
            p.add_(1.0)
    assert h.wait(30) and h.done() and h.error is None and not h.skipped
    assert h.path == root / "step-10"
    rec = d.wait_for("r1", 10)
    assert rec["state"] == "valid" and rec["layout"] == "native"
    meta = json.loads((root / "step-10" / "meta.json").read_text())
    assert {f["path"] for f in meta["files"]} == {"model.pt", "optim.rank0.pt", "rng.rank0.pt"}
    assert all(f["hash_alg"] == "xxh3-128" and len(f["hash"]) == 32 for f in meta["files"])
    fresh, fresh_opt = trained(seed=5)
    step, _ = ckpt.load(root, 10, model=fresh, optimizer=fresh_opt, client=d.client)
    assert step == 10
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in before.items())
    assert not (root / "step-10.tmp").exists()


def test_a_resave_replaces_the_earlier_save_only_behind_the_nets(inproc_daemon: Any) -> None:
    """The trainer saves a step again while a client reads it: the daemon's writer commits
    the new save over the earlier one through the executor, which waits while the reader
    holds the step (the earlier save stays whole meanwhile), then replaces it through the
    trash."""
    d = inproc_daemon(roots=[{"name": "r1"}])
    root = d.roots["r1"]
    model, opt = trained()
    assert ckpt.save(root, 10, model=model, optimizer=opt, client=d.client,
                     blocking=False).wait(30)
    first = json.loads((root / "step-10" / "meta.json").read_text())["save_id"]
    assert d.wait_for("r1", 10)["state"] == "valid"  # known to the daemon: a hold needs that
    model2, opt2 = trained(seed=3)
    with d.client.hold("r1", 10):
        h = ckpt.save(root, 10, model=model2, optimizer=opt2, client=d.client,
                      blocking=False)
        d.wait_event("save_replace_waiting", timeout=30)
        assert json.loads((root / "step-10" / "meta.json").read_text())["save_id"] == first
        assert not h.done()
    assert h.wait(30) and h.error is None, h.error
    assert json.loads((root / "step-10" / "meta.json").read_text())["save_id"] != first
    replaced = d.wait_event("earlier_save_replaced")[0]
    assert replaced["step"] == 10 and replaced["bytes_freed"] > 0
    assert sorted(p.name for p in root.iterdir() if p.name.startswith(".step")) == []
    assert os.listdir(root / ".ckptd" / "trash") == []


def test_arena_is_reused_and_flush_waits(inproc_daemon: Any) -> None:
    d = inproc_daemon(roots=[{"name": "r1"}])
    root = d.roots["r1"]
    model, opt = trained()
    handles = [ckpt.save(root, s, model=model, optimizer=opt, client=d.client, blocking=False)
               for s in (1, 2, 3)]
    assert ckpt.flush(30)
    assert all(h.done() and h.error is None for h in handles)
    for s in (1, 2, 3):
        assert d.wait_for("r1", s)["state"] == "valid"


SKIP_CODE = """
import sys, ckptd.torch as ckpt, torch
m = torch.nn.Linear(4, 4)
first = ckpt.save(sys.argv[1], 7, model=m, rank=0, world_size=2, timeout=3, blocking=False)
second = ckpt.save(sys.argv[1], 8, model=m, rank=0, world_size=2, if_busy="skip",
                   blocking=False)
print(second.skipped, second.done(), second.wait(0), first.done())
ok = ckpt.flush(30)
print(ok, first.done(), first.error is not None)
"""


def test_skip_while_busy_and_a_save_that_fails_reports_it(inproc_daemon: Any) -> None:
    """Rank 0 of two: the daemon writes its files, then waits for rank 1, which never comes."""
    d = inproc_daemon(roots=[{"name": "r1"}])
    p = run_py(SKIP_CODE, d.socket, str(d.roots["r1"]))
    out, err = p.communicate(timeout=60)
    assert p.returncode == 0, err[-3000:]
    lines = out.split("\n")
    assert lines[0] == "True True False False"
    assert lines[1] == "False True True"
    assert "timed out waiting for rank 1" in d.log_text()
    assert not (d.roots["r1"] / "step-7").exists()


def test_fallback_without_daemon(tmp_path: Path, short_dir: Path,
                                 caplog: pytest.LogCaptureFixture) -> None:
    client = Client(short_dir / "absent.sock", timeout=1.0)
    model, opt = trained()
    h = ckpt.save(tmp_path / "r", 4, model=model, optimizer=opt, client=client, blocking=False)
    assert h.done() and h.wait(0) and h.error is None
    assert "was not reached" in caplog.text
    fresh, fresh_opt = trained(seed=3)
    ckpt.load(tmp_path / "r", 4, model=fresh, optimizer=fresh_opt, client=client)
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in model.state_dict().items())


KILLED_CODE = """
import os, signal, sys, ckptd.torch as ckpt, torch
torch.manual_seed(1)
model = torch.nn.Linear(2048, 2048)  # 16 MiB of weights, 32 MiB of Adam state
opt = torch.optim.Adam(model.parameters())
model(torch.randn(2, 2048)).sum().backward()
opt.step()
torch.save(model.state_dict(), sys.argv[2])  # the values the checkpoint must hold
ckpt.save(sys.argv[1], 5, model=model, optimizer=opt, blocking=False)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_trainer_killed_right_after_save_returns(inproc_daemon: Any, tmp_path: Path) -> None:
    d = inproc_daemon(roots=[{"name": "r1"}])
    root = d.roots["r1"]
    p = run_py(KILLED_CODE, d.socket, str(root), str(tmp_path / "expected.pt"))
    _, err = p.communicate(timeout=60)
    assert p.returncode == -signal.SIGKILL, err[-3000:]
    assert d.wait_for("r1", 5)["state"] == "valid"
    expected = torch.load(tmp_path / "expected.pt", weights_only=True)
    model = torch.nn.Linear(2048, 2048)
    ckpt.load(root, 5, model=model, client=d.client)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in expected.items())


def test_daemon_killed_mid_save_never_yields_a_valid_step(daemon_factory: Any) -> None:
    """Rank 0 of two: the daemon has written rank 0's files and waits for rank 1 when it is
    killed; the handle reports it, and after a restart step 3 is neither valid nor complete:
    its files stay in step-3.tmp/, which no layout reads as a checkpoint."""
    d = daemon_factory(roots=[{"name": "r1"}])
    root = d.roots["r1"]
    model, opt = trained()
    h = ckpt.save(root, 3, model=model, optimizer=opt, rank=0, world_size=2,
                  client=d.client, blocking=False)
    wait_until(lambda: (root / "step-3.tmp" / ".done.rank0").exists(), 30,
               "rank 0's files written")
    (flight,) = d.client.status()["in_flight"]  # written, waiting for rank 1
    assert {k: flight[k] for k in ("root", "step", "stage", "rank")} == {
        "root": "r1", "step": 3, "stage": "persist", "rank": 0}
    assert flight["done_bytes"] == flight["total_bytes"] > 0
    d.kill9()
    assert h.wait(30) is False and h.done()
    assert h.error is not None and "ckptd went away" in h.error
    d.start()
    # A later save becomes valid: the scans after the restart have seen step-3.tmp too.
    later = ckpt.save(root, 4, model=model, client=d.client, blocking=False)
    assert later.wait(30)
    assert d.wait_for("r1", 4)["state"] == "valid"
    assert (root / "step-3.tmp").is_dir() and not (root / "step-3").exists()
    code, _ = d.client.request("GET", "/v1/roots/r1/checkpoints/3")
    assert code == 404
    with pytest.raises(NotFound, match="no complete native checkpoint"):
        ckpt.resolve(root, 3, client=d.client)


TWO_RANKS_CODE = """
import sys, ckptd.torch as ckpt, torch
rank = int(sys.argv[2])
torch.manual_seed(rank)
model = torch.nn.Linear(256, 256)
opt = torch.optim.Adam(model.parameters())
model(torch.randn(2, 256)).sum().backward()
opt.step()
h = ckpt.save(sys.argv[1], 9, model=model, optimizer=opt, rank=rank, world_size=2,
              blocking=False)
print(ckpt.flush(60), h.error)
"""


def test_two_ranks_save_at_once(inproc_daemon: Any) -> None:
    d = inproc_daemon(roots=[{"name": "r1"}])
    root = d.roots["r1"]
    procs = [run_py(TWO_RANKS_CODE, d.socket, str(root), str(r)) for r in (1, 0)]
    for p in procs:
        out, err = p.communicate(timeout=90)
        assert p.returncode == 0 and out.strip() == "True None", err[-3000:]
    assert d.wait_for("r1", 9)["state"] == "valid"
    meta = json.loads((root / "step-9" / "meta.json").read_text())
    assert sorted(f["path"] for f in meta["files"]) == [
        "model.pt", "optim.rank0.pt", "optim.rank1.pt", "rng.rank0.pt", "rng.rank1.pt"]


# -- the door ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("change", "status", "code"), [
    ({"files": [{"path": "../x.pt", "component": "model", "offset": 4096, "size": 1}]},
     400, "bad_arena"),
    ({"files": [{"path": "optim.rank1.pt", "component": "optimizer", "offset": 4096,
                 "size": 1}]}, 400, "bad_arena"),
    ({"files": [{"path": "model.pt", "component": "model", "offset": 4096, "size": 5000}]},
     400, "bad_arena"),
    ({"generation": 2}, 409, "not_sealed"),
    ({"root": "nope"}, 404, "no_root"),
    ({"dir": "/tmp"}, 422, "outside_root"),
    ({"head": {"format": "ckptd-native/1", "step": 1, "world_size": 1,
               "metrics": {"loss": "low"}}}, 400, "bad_arena"),
    ({"register": "yes"}, 400, "bad_arena"),
])
def test_bad_requests_are_refused(inproc_daemon: Any, change: dict[str, Any], status: int,
                                  code: str) -> None:
    d = inproc_daemon(roots=[{"name": "r1"}])
    fd, body = sealed_arena()
    body["dir"] = str(d.roots["r1"])
    try:
        got = post_persist(d.socket, {**body, **change}, fd)
    finally:
        os.close(fd)
    assert got[0] == status and got[1]["error"] == code, got
    assert [p.name for p in d.roots["r1"].iterdir()] == [".ckptd"]


def test_a_descriptor_that_is_not_a_memfd_or_none_is_refused(inproc_daemon: Any,
                                                             tmp_path: Path) -> None:
    d = inproc_daemon(roots=[{"name": "r1"}])
    _, body = sealed_arena()
    body["dir"] = str(d.roots["r1"])
    plain = tmp_path / "plain"
    plain.write_bytes(b"\0" * 8192)
    fd = os.open(plain, os.O_RDWR)
    try:
        assert post_persist(d.socket, body, fd)[1]["error"] == "bad_arena"
    finally:
        os.close(fd)
    assert post_persist(d.socket, body, None)[1]["error"] == "no_arena"
    # A descriptor sent with another request is closed by the daemon, never kept.
    status, _ = d.client.request("GET", "/v1/health")
    assert status == 200


def test_peer_credentials() -> None:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with a, b:
        pid, uid, gid = struct.unpack("3i", a.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                         struct.calcsize("3i")))
    assert pid == os.getpid() and uid == os.geteuid()
    groups = arena.peer_groups(pid, gid)
    assert gid in groups
    assert arena.peer_allowed(uid, groups, uid, None)
    assert not arena.peer_allowed(uid, groups, uid + 1, None)  # another user's daemon
    assert arena.peer_allowed(uid, groups, uid + 1, gid)  # ... whose socket group it is in
    assert not arena.peer_allowed(uid, groups, uid + 1, max(groups) + 1)


OTHER_USER_CODE = """
import json, os, sys
from ckptd import arena
from ckptd.torch import _async
os.setgroups([]); os.setgid(65534); os.setuid(65534)  # after the imports: /root is 0700
fd = arena.create_memfd(8192)
os.pwrite(fd, arena.pack_header(arena.State.SEALED, 1, 8192), 0)
body = json.loads(sys.argv[1])
answer, not_taken = _async._hand_over(sys.argv[2], body, fd)
print(not_taken if answer is None else f"taken: {answer}")
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a client as another user")
def test_a_peer_of_another_user_is_refused(inproc_daemon: Any) -> None:
    d = inproc_daemon(roots=[{"name": "r1"}])
    os.chmod(d.socket.parent, 0o755)
    os.chmod(d.socket, 0o666)  # let it connect: the check under test is SO_PEERCRED
    _, body = sealed_arena()
    body["dir"] = str(d.roots["r1"])
    p = run_py(OTHER_USER_CODE, d.socket, json.dumps(body), str(d.socket))
    out, err = p.communicate(timeout=60)
    assert p.returncode == 0, err[-3000:]
    assert out.startswith("403 forbidden: uid 65534"), out
    assert [p.name for p in d.roots["r1"].iterdir()] == [".ckptd"]


def test_crc_fields_are_filled_in_from_the_arena() -> None:
    """What the trainer writes without torch.save's CRC pass, with the CRCs filled in, is an
    archive whose every member checks, with the CRCs torch.save itself computes."""
    state = {"w": torch.randn(300, 70), "b": torch.arange(5), "n": 3}
    with_crc = io.BytesIO()
    torch.save(state, with_crc)
    torch.serialization.set_crc32_options(False)
    try:
        without = io.BytesIO()
        torch.save(state, without)
    finally:
        torch.serialization.set_crc32_options(True)
    raw = without.getvalue()
    assert {i.CRC for i in zipfile.ZipFile(io.BytesIO(raw)).infolist()} == {0}
    fd = arena.create_memfd(arena.aligned(arena.DATA_OFFSET + len(raw)))
    try:
        os.pwrite(fd, raw, arena.DATA_OFFSET)
        with mmap.mmap(fd, 0) as mm, memoryview(mm) as view:
            assert zipcrc.fill_crcs(view, fd, arena.DATA_OFFSET, arena.DATA_OFFSET + len(raw),
                                    "model.pt") == len(zipfile.ZipFile(with_crc).infolist())
            filled = bytes(view[arena.DATA_OFFSET:arena.DATA_OFFSET + len(raw)])
    finally:
        os.close(fd)
    z = zipfile.ZipFile(io.BytesIO(filled))
    assert z.testzip() is None
    def crcs(zf: zipfile.ZipFile) -> dict[str, int]:  # serialization_id is random per save
        return {i.filename.split("/", 1)[1]: i.CRC for i in zf.infolist()
                if not i.filename.endswith("serialization_id")}

    assert crcs(z) == crcs(zipfile.ZipFile(with_crc))
    loaded = torch.load(io.BytesIO(filled), weights_only=True)
    assert torch.equal(loaded["w"], state["w"]) and loaded["n"] == 3


def _tricky_state() -> dict[str, Any]:
    """Shared storages, views, non-contiguous tensors, several dtypes, 0-size tensors, a
    module's state dict (an OrderedDict with its _metadata), a tensor seen twice."""
    base = torch.randn(64, 48)
    ints = torch.arange(1000, dtype=torch.int64)
    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.LayerNorm(4))
    return {"model": model.state_dict(), "base": base, "view": base[3:9, 5:40],
            "t": base.t(), "strided": ints[::7], "again": ints, "tail": ints[900:],
            "bf16": torch.randn(33).to(torch.bfloat16), "fp16": torch.randn(5, 3).half(),
            "empty": torch.empty(0), "empty2": torch.empty(0, 4, dtype=torch.int64),
            "nested": [ints[:10], (base[0], {"x": 1.5})], "n": 7}


def _arena_bytes(state: Any) -> tuple[bytes, int]:
    """The component's bytes as an async save leaves them in the arena, CRCs filled in as the
    daemon fills them; and how many storages went through the second pass."""
    a = _async._Arena(_async.INITIAL_ARENA)
    try:
        copies: list[Any] = []
        end = a._serialise(state, arena.DATA_OFFSET, copies)
        _arena_copy.copy_storages(a.mm, copies, non_blocking=False)
        with memoryview(a.mm) as view:
            zipcrc.fill_crcs(view, a.fd, arena.DATA_OFFSET, end, "model.pt")
            return bytes(view[arena.DATA_OFFSET:end]), len(copies)
    finally:
        a.mm.close()
        os.close(a.fd)


def _same_id(raw: bytes, like: bytes) -> bytes:
    """`raw` with `like`'s serialization_id (random per save) and that member's CRCs."""
    mine, theirs = zipfile.ZipFile(io.BytesIO(raw)), zipfile.ZipFile(io.BytesIO(like))
    assert [(i.filename, i.header_offset, i.file_size) for i in mine.infolist()] == [
        (i.filename, i.header_offset, i.file_size) for i in theirs.infolist()]
    out = bytearray(raw)
    for info in theirs.infolist():
        if info.filename.endswith("serialization_id"):
            start = len(out) - len(raw)  # (same layout: offsets alike)
            n = struct.unpack_from("<HH", like, info.header_offset + 26)
            data = info.header_offset + 30 + n[0] + n[1] + start
            out[data:data + info.file_size] = like[data:data + info.file_size]
            out = bytearray(out.replace(struct.pack("<I", mine.getinfo(info.filename).CRC),
                                        struct.pack("<I", info.CRC)))
    return bytes(out)


@pytest.mark.parametrize("kind", ["placeholders", "plain"])
def test_arena_bytes_are_torch_saves_bytes(kind: str) -> None:
    """Both ways into the arena (placeholder storages + a copy of each storage into its record,
    and the plain torch.save a state they do not fit falls back to) give, CRCs filled in,
    exactly the bytes torch.save writes for the real tensors."""
    state = _tricky_state()
    if kind == "plain":  # a Parameter sharing a plain tensor's storage: no placeholders
        state["param"] = torch.nn.Parameter(state["base"][1:3], requires_grad=False)
    raw, copied = _arena_bytes(state)
    ref = io.BytesIO()
    torch.save(state, ref)
    assert _same_id(raw, ref.getvalue()) == ref.getvalue()
    assert copied == (0 if kind == "plain" else 8)  # base, ints, bf16, fp16 + the module's 4
    loaded = torch.load(io.BytesIO(raw), weights_only=True)
    assert torch.equal(loaded["view"], state["view"]) and loaded["view"].data_ptr() == (
        loaded["base"].data_ptr() + (3 * 48 + 5) * 4)


def test_an_arena_reopened_write_only_or_read_only_is_refused(inproc_daemon: Any) -> None:
    """The memfd reopened write-only (or read-only) through /proc: a 400 naming the access
    mode, never a 500 at mmap; the descriptor is closed and the daemon goes on."""
    d = inproc_daemon(roots=[{"name": "r1"}])
    fd, body = sealed_arena()
    body["dir"] = str(d.roots["r1"])
    try:
        for flags, how in ((os.O_WRONLY, "write-only"), (os.O_RDONLY, "read-only")):
            other = os.open(f"/proc/self/fd/{fd}", flags)
            try:
                status, doc = post_persist(d.socket, body, other)
            finally:
                os.close(other)
            assert (status, doc["error"]) == (400, "bad_arena"), doc
            assert how in doc["message"], doc
    finally:
        os.close(fd)
    assert [p.name for p in d.roots["r1"].iterdir()] == [".ckptd"]
    assert d.client.request("GET", "/v1/health")[0] == 200


def test_a_persist_body_that_never_comes_is_408(inproc_daemon: Any) -> None:
    """Headers with a Content-Length, the arena's descriptor, then no body: 408 once the read
    timeout passes (not a 500), the descriptor is closed, the daemon answers the next one."""
    d = inproc_daemon(roots=[{"name": "r1"}])
    fd, _ = sealed_arena()
    head = (b"POST /v1/persist HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 300\r\n\r\n")
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(30)
            s.connect(str(d.socket))
            s.sendmsg([head], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))])
            raw = b""
            while chunk := s.recv(65536):
                raw += chunk
    finally:
        os.close(fd)
    status_line, _, rest = raw.partition(b"\r\n\r\n")
    assert int(status_line.split()[1]) == 408, raw
    assert json.loads(rest)["error"] == "request_timeout"
    assert d.client.request("GET", "/v1/health")[0] == 200
