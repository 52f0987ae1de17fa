"""What ckptd reads from the bucket is input too (issue 22): remote reads are bounded, a FIFO
in a file:// remote never blocks a worker or a restore, one bad remote item costs only itself
(discovery, `ckptd ls`, `ckptd status`, `ckptd restore ROOT latest`), and a restore is
all-or-nothing for any manifest. Real daemons, real files and FIFOs, a real `ckptd` process."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
import tracemalloc
from pathlib import Path
from typing import Any

import pytest
from support.ckpts import save_single
from support.wait import wait_until

from ckptd import inputs
from ckptd.backends import LocalBackend, make_backend
from ckptd.cluster import commit as cc
from ckptd.errors import BadInput, CorruptData, ObjectNotFound, UnsafePath
from ckptd.remote import keys as remote
from ckptd.remote.manifest import parse_manifest
from ckptd.restore.files import all_or_nothing
from ckptd.stages.multinode import parts

MiB = 1024 * 1024


def upload_cfg(url: str) -> dict[str, Any]:
    return {"url": url}


def cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ckptd", *args], capture_output=True,
                          text=True, timeout=timeout)


def error_lines(r: subprocess.CompletedProcess[str]) -> list[str]:
    """stderr without the line saying which config was used."""
    return [line for line in r.stderr.strip().splitlines()
            if not line.startswith("ckptd: config ")]


def sparse(path: Path, size: int) -> Path:
    """A file of `size` bytes that takes no disk (reading it whole would take `size` of RAM)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.truncate(size)
    return path


def peak_while(fn: Any) -> tuple[Any, int]:
    """`fn()`'s result (or exception) and the peak of Python allocations while it ran."""
    tracemalloc.start()
    try:
        try:
            out: Any = fn()
        except Exception as exc:  # noqa: BLE001 - returned for the test to inspect
            out = exc
        return out, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def release_fifo(path: Path) -> None:
    """Open a FIFO for writing once, so a reader blocked in open() (the defect) gets EOF."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
    except OSError:
        return  # nobody is blocked on it
    os.close(fd)


# -- bounded reads ------------------------------------------------------------------------------


def test_an_oversized_latest_is_refused_unread_and_replaced(tmp_path: Path) -> None:
    backend = LocalBackend(tmp_path / "remote")
    latest = sparse(tmp_path / "remote" / "r1" / "LATEST", 256 * MiB)
    out, peak = peak_while(lambda: remote.read_latest(backend, "r1"))
    assert isinstance(out, BadInput) and "r1/LATEST" in str(out)
    assert peak < 1 * MiB, f"read {peak} bytes of an oversized LATEST"
    backend.put("r1/step-5/MANIFEST.json", b"{}")
    assert remote.advance_latest(backend, "r1", 5)  # the unreadable pointer is replaced
    assert json.loads(latest.read_bytes()) == {"step": 5}


def test_an_oversized_manifest_is_refused_before_its_body_is_read(tmp_path: Path) -> None:
    backend = LocalBackend(tmp_path / "remote")
    sparse(tmp_path / "remote" / "r1" / "step-3" / "MANIFEST.json", inputs.MANIFEST.cap + 1)
    out, peak = peak_while(lambda: remote.read_manifest(backend, "r1", 3))
    assert isinstance(out, BadInput) and "r1/step-3/MANIFEST.json" in str(out)
    assert peak < 1 * MiB


def test_a_forged_part_costs_no_memory_and_the_parts_cache_is_bounded(tmp_path: Path) -> None:
    backend = LocalBackend(tmp_path / "remote")
    sparse(tmp_path / "remote" / "r1" / "step-1" / cc.PARTS_DIR / "n1.1-a.json", 52 * MiB)
    out, peak = peak_while(lambda: parts.read_parts(backend, "r1", 1))
    assert out == [] and peak < 2 * MiB, f"{out!r}, peak {peak}"
    cache = parts._PartCache(entries=3, size=1000)
    part = cc.Part("n1", "1-a", "single", ())
    for i in range(10):
        cache.put(("u", f"k{i}"), part, 100)
    assert len(cache) == 3 and cache.get(("u", "k9")) is part and cache.get(("u", "k0")) is None
    cache.put(("u", "big"), part, 950)
    assert cache.held_bytes <= 1000 and cache.get(("u", "big")) is part


def test_strict_json_and_bounded_numbers_in_remote_documents(tmp_path: Path) -> None:
    backend = LocalBackend(tmp_path / "remote")
    backend.put("r1/LATEST", b'{"step": ' + b"9" * 400 + b"}")
    with pytest.raises(BadInput, match="digits"):
        remote.read_latest(backend, "r1")
    backend.put("r1/LATEST", b'{"step": 3, "step": 4}')
    with pytest.raises(BadInput, match="twice"):
        remote.read_latest(backend, "r1")
    good = {"format": "ckptd-manifest/1", "root": "r1", "step": 1, "layout": "single",
            "created": "x", "files": [{"path": "a", "size": 1, "hash": "h", "hash_alg": "xx",
                                       "codec": "none", "stored_size": 1, "key": "a"}]}
    parse_manifest(json.dumps(good).encode())
    for bad in (b'{"size": NaN}', json.dumps({**good, "step": 10**30}).encode()):
        with pytest.raises(CorruptData):
            parse_manifest(bad)


# -- a FIFO in a file:// remote -----------------------------------------------------------------


def test_a_fifo_at_latest_blocks_no_upload_worker(inproc_daemon: Any, tmp_path: Path) -> None:
    """Two checkpoints upload although LATEST is a FIFO (it blocked both workers for good)."""
    rdir = tmp_path / "remote"
    fifo = rdir / "r1" / "LATEST"
    fifo.parent.mkdir(parents=True)
    os.mkfifo(fifo)
    d = inproc_daemon(roots=[{"name": "r1", "upload": upload_cfg(f"file://{rdir}")}])
    try:
        save_single(d.roots["r1"], 10)
        assert d.client.wait("r1", 10, until="uploaded", timeout=60)
        save_single(d.roots["r1"], 20)
        assert d.client.wait("r1", 20, until="uploaded", timeout=60)
        assert d.client.health()["status"] == "ok"
        assert d.events("latest_update_failed")
        assert (rdir / "r1" / "step-20" / "MANIFEST.json").is_file()
    finally:
        release_fifo(fifo)


def test_a_fifo_object_fails_a_restore_at_once(tmp_path: Path) -> None:
    rdir = tmp_path / "remote"
    backend = LocalBackend(rdir)
    fifo = rdir / "r1" / "step-1" / "obj"
    fifo.parent.mkdir(parents=True)
    os.mkfifo(fifo)
    try:
        result: list[Any] = []
        t = threading.Thread(target=lambda: result.append(peak_while(
            lambda: backend.get_bytes("r1/step-1/obj"))[0]), daemon=True)
        t.start()
        t.join(10)
        assert not t.is_alive(), "get_bytes of a FIFO blocked"
        assert isinstance(result[0], ObjectNotFound) and "regular" in str(result[0])
    finally:
        release_fifo(fifo)


# -- one bad item costs only itself: a fresh node ------------------------------------------------


def two_good_steps(inproc_daemon: Any, tmp_path: Path) -> tuple[Any, Path]:
    """A daemon that uploaded steps 10 and 20 to a file:// remote, then stopped."""
    rdir = tmp_path / "remote"
    d = inproc_daemon(roots=[{"name": "r1", "upload": upload_cfg(f"file://{rdir}")}])
    for step in (10, 20):
        save_single(d.roots["r1"], step)
        assert d.client.wait("r1", step, until="uploaded", timeout=60)
    d.stop()
    return d, rdir


def fresh_node(d: Any) -> None:
    """Same config, empty disk and state dir."""
    shutil.rmtree(d.state_dir)
    shutil.rmtree(d.roots["r1"])
    d.roots["r1"].mkdir()


def test_bad_manifests_beside_good_ones_on_a_fresh_node(inproc_daemon: Any,
                                                        tmp_path: Path) -> None:
    d, rdir = two_good_steps(inproc_daemon, tmp_path)
    (rdir / "r1" / "step-30").mkdir()
    (rdir / "r1" / "step-30" / "MANIFEST.json").write_bytes(b"{not json")
    sparse(rdir / "r1" / "step-40" / "MANIFEST.json", inputs.MANIFEST.cap + 1)
    fresh_node(d)
    d.start()
    c = d.client
    ls = wait_until(lambda: (c.checkpoints("r1") or [])[1:] and c.checkpoints("r1"), 30,
                    "r1 listing its two good remote steps")
    assert [(x["step"], x["remote"]) for x in ls] == [(10, "uploaded"), (20, "uploaded")]
    # The listing adds the good steps as it reads them; the bad ones are reported at its end.
    bad = wait_until(lambda: c.status()["roots"][0]["bad_remote"], 30, "the bad steps reported")
    assert sorted(b["key"] for b in bad) == ["r1/step-30/MANIFEST.json",
                                             "r1/step-40/MANIFEST.json"]
    assert all(b["error"] for b in bad)
    listing = c.request_json("GET", "/v1/roots/r1/checkpoints")
    assert len(listing["bad_remote"]) == 2
    assert 'ckptd_bad_inputs{kind="remote",root="r1"} 2.0' in c.request("GET", "/metrics")[1]
    assert {e["key"] for e in d.events("bad_remote_item")} >= {"r1/step-30/MANIFEST.json"}
    assert c.latest("r1", tier="remote")["step"] == 20
    shown = cli("ls", "r1", "--config", str(d.config))
    assert shown.returncode == 0 and "skipped remote r1/step-30/MANIFEST.json" in shown.stdout


def test_restore_latest_skips_a_bad_newest_manifest(inproc_daemon: Any, tmp_path: Path) -> None:
    d, rdir = two_good_steps(inproc_daemon, tmp_path)
    (rdir / "r1" / "step-30").mkdir()
    (rdir / "r1" / "step-30" / "MANIFEST.json").write_bytes(b'{"format": 1}')
    fresh_node(d)
    out = tmp_path / "restored"
    r = cli("restore", "r1", "latest", "--to", str(out), "--config", str(d.config))
    assert r.returncode == 0, r.stderr
    assert (out / "model_step_20.pt").is_file()
    assert remote.list_steps(make_backend(f"file://{rdir}"), "r1") == [10, 20, 30]


# -- restore is all-or-nothing for any manifest --------------------------------------------------


def forge(rdir: Path, src: int, dst: int, edit: Any) -> None:
    """Copy remote step `src` to `dst` with its manifest changed by `edit(doc)`."""
    shutil.copytree(rdir / "r1" / f"step-{src}", rdir / "r1" / f"step-{dst}")
    path = rdir / "r1" / f"step-{dst}" / "MANIFEST.json"
    doc = json.loads(path.read_bytes())
    doc["step"] = dst
    edit(doc)
    path.write_text(json.dumps(doc))


def test_a_manifest_naming_a_path_twice_leaves_the_target_untouched(inproc_daemon: Any,
                                                                     tmp_path: Path) -> None:
    d, rdir = two_good_steps(inproc_daemon, tmp_path)

    def twice(doc: dict[str, Any]) -> None:
        f = doc["files"][0]
        other = dict(f, key=f["key"] + ".b")
        step_dir = rdir / "r1" / "step-50"
        shutil.copy(step_dir / f["key"], step_dir / other["key"])
        doc["files"].append(other)

    forge(rdir, 10, 50, twice)
    target = tmp_path / "target"
    target.mkdir()
    name = json.loads((rdir / "r1" / "step-50" / "MANIFEST.json").read_bytes())["files"][0]
    (target / name["path"]).write_bytes(b"the user's own file")
    r = cli("restore", "r1", "50", "--to", str(target), "--config", str(d.config))
    assert r.returncode != 0
    assert "Traceback" not in r.stderr and len(error_lines(r)) == 1, r.stderr
    assert "named twice" in error_lines(r)[0]
    assert sorted(p.name for p in target.iterdir()) == [name["path"]]
    assert (target / name["path"]).read_bytes() == b"the user's own file"


def test_conflicting_paths_are_a_malformed_manifest() -> None:
    base = {"format": "ckptd-manifest/1", "root": "r1", "step": 1, "layout": "single",
            "created": "x"}

    def entry(p: str) -> dict[str, Any]:
        return {"path": p, "size": 1, "hash": "h", "hash_alg": "xx", "codec": "none",
                "stored_size": 1, "key": p + ".k"}

    for paths in (["a", "a/b"], ["x/y/z", "x/y"], ["a", "a"]):
        doc = {**base, "files": [entry(p) for p in paths]}
        with pytest.raises(CorruptData, match="twice|directory"):
            parse_manifest(json.dumps(doc).encode())


def test_a_path_through_a_symlink_in_the_target_is_refused(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    target = tmp_path / "target"
    target.mkdir()
    (target / "sub").symlink_to(outside)

    def fill(staging: Path) -> list[Path]:
        (staging / "sub").mkdir()
        (staging / "sub" / "x").write_bytes(b"restored")
        (staging / "y").write_bytes(b"restored")
        return [staging / "sub" / "x", staging / "y"]

    with pytest.raises(UnsafePath, match="symlink"):
        all_or_nothing(target, fill)
    assert list(outside.iterdir()) == []
    assert sorted(p.name for p in target.iterdir()) == ["sub"]


def test_a_restore_from_a_fifo_object_fails_fast(inproc_daemon: Any, tmp_path: Path) -> None:
    d, rdir = two_good_steps(inproc_daemon, tmp_path)
    forge(rdir, 10, 60, lambda doc: None)
    key = json.loads((rdir / "r1" / "step-60" / "MANIFEST.json").read_bytes())["files"][0]
    obj = rdir / "r1" / "step-60" / key["key"]
    obj.unlink()
    os.mkfifo(obj)
    target = tmp_path / "target"
    try:
        started = time.monotonic()
        r = cli("restore", "r1", "60", "--to", str(target), "--config", str(d.config),
                timeout=60)
        assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr
        assert len(error_lines(r)) == 1 and key["path"] in error_lines(r)[0], r.stderr
        assert time.monotonic() - started < 30
        assert not target.exists()
    finally:
        release_fifo(obj)
