"""kill -9 twice through a step of a thousand files (a real `dcp.save`, one file per tensor):
once while it is validated and sent early, once while the upload stage sends the rest. What
the daemon promises (docs/UPLOAD.md, "Crash safety with many files"): nothing is lost (the
trainer's files are untouched, the step ends committed and restores byte for byte), nothing
is committed early, and little is repeated (each object is put about once across the three
runs: what an earlier run left is compared, not sent again)."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from support.wait import wait_until

from ckptd.backends import make_backend
from ckptd.client import Client
from ckptd.dcp import StorageReader

pytest_plugins = ["s3server"]

FILES = 1000  # tensors; with the .metadata, FILES + 1 files
CONCURRENCY = 4


def _state() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(25)
    return {f"t{i:04d}": torch.randn(1536, generator=gen) for i in range(FILES)}  # 6 KiB each


def _digests(path: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in path.iterdir()}


def _stage(d: Any) -> str:
    st = Client(d.socket, timeout=2).status() or {}
    return ",".join(sorted({w["stage"] for w in st.get("in_flight", [])})) or "none"


def test_kill9_twice_through_a_thousand_file_step_loses_nothing_and_repeats_little(
        daemon_factory: Any, s3_server: Any, s3_url: str, fault_proxy: Any,
        tmp_path: Path) -> None:
    counted = type("S", (), {"endpoint": fault_proxy.endpoint, "region": s3_server.region,
                             "access_key": s3_server.access_key,
                             "secret_key": s3_server.secret_key})()
    upload = {"url": s3_url, "endpoint": counted.endpoint, "region": counted.region,
              "access_key_id": counted.access_key, "secret_access_key": counted.secret_key,
              "concurrency": CONCURRENCY, "max_bandwidth": "1MB/s"}  # sending outlasts reading
    d = daemon_factory(roots=[{"name": "r1", "upload": upload}])
    direct = make_backend(s3_url, endpoint=s3_server.endpoint, region=s3_server.region,
                          access_key_id=s3_server.access_key,
                          secret_access_key=s3_server.secret_key)

    def remote() -> list[str]:
        return [m.key for m in direct.list("r1/step-7")]

    state = _state()
    step = tmp_path / "out" / "step-7"
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(step), single_file_per_rank=False,
                                                         thread_count=1))
    before = _digests(step)
    assert len(before) == FILES + 1
    step.rename(d.roots["r1"] / "step-7")  # committed as a trainer commits a save
    step = d.roots["r1"] / "step-7"

    # 1. Killed while the step is read and its first objects go up early.
    wait_until(lambda: len(remote()) >= 30, 60, "30 objects sent early",
               detail=lambda: d.log_text()[-3000:])
    first = _stage(d)
    d.kill9()
    sent_first = len(remote())
    assert "validate" in first, first  # the kill landed before validation ended
    assert sent_first < FILES + 1 and not any(k.endswith("MANIFEST.json") for k in remote())

    # 2. Killed while the upload stage sends the rest.
    d.start()
    wait_until(lambda: len(remote()) >= (FILES + 1) * 6 // 10, 120, "60% of the objects up",
               detail=lambda: d.log_text()[-3000:])
    second = _stage(d)
    d.kill9()
    assert not any(k.endswith("MANIFEST.json") for k in remote())

    # 3. The third run finishes it.
    d.start()
    assert d.client.wait("r1", 7, until="uploaded", timeout=180), d.log_text()[-3000:]
    keys = remote()
    assert "r1/step-7/MANIFEST.json" in keys
    assert _digests(step) == before  # the trainer's files, untouched

    # Little repeated: each data object was put about once over the three runs, the repeats
    # bounded by the puts in flight at each kill.
    puts: dict[str, int] = {}
    for line in fault_proxy.stats()["log"]:
        method, target = line.split(" ")[:2]
        path = target.split("?")[0]
        if method == "PUT" and "/r1/step-7/" in path and not path.endswith("MANIFEST.json"):
            puts[path] = puts.get(path, 0) + 1
    objects = len([k for k in keys if not k.endswith("MANIFEST.json")])
    assert len(puts) == objects == FILES + 1
    repeated = sum(puts.values()) - objects
    assert repeated <= 4 * CONCURRENCY, (repeated, first, second, sent_first)

    # Read back from the bucket alone, every tensor checked against what was saved.
    back = {k: torch.zeros_like(v) for k, v in state.items()}
    dcp.load(back, storage_reader=StorageReader("r1", 7, config=d.config), no_dist=True)
    assert all(torch.equal(back[k], v) for k, v in state.items())
