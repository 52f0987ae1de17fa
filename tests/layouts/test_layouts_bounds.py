"""A root's metadata, bounded where it enters the layouts: a metric of 400 digits in a
`meta.json`, metadata that is a link or over its cap, a pointer file over its cap, a world
size or a rank of tens of millions in file names or metadata, any bytes in any metadata file.
Each is one bad or waiting item; the root's other checkpoints carry on. Against a real daemon
(in-process, real socket, real SQLite) and the pure layouts."""

from __future__ import annotations

import json
import os
import time
import tracemalloc
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support import Harness
from support.harness import checkpoints
from support.numbers import HUGE
from support.wait import wait_until
from writers import save_torch

from ckptd import layouts
from ckptd.model import FileInfo, RootOptions, Snapshot


def message(h: Harness, step: int) -> str:
    rec = h.daemon.store.checkpoint("r", step)
    assert rec is not None
    return rec.message


def native_step(root: Path, step: int, metrics_json: str = "{}") -> Path:
    """A `step-N/` dir as `ckptd.torch.save` leaves it, its meta.json written by hand."""
    d = root / f"step-{step}"
    save_torch(d / "model.pt")
    size = (d / "model.pt").stat().st_size
    (d / "meta.json").write_text(
        f'{{"format": "ckptd-native/1", "step": {step}, "world_size": 1, "files": [{{"path":'
        f' "model.pt", "size": {size}}}], "metrics": {metrics_json}}}')
    return d


# -- on disk ----------------------------------------------------------------------------------


def test_a_400_digit_metric_in_a_meta_json_is_one_bad_step(h: Harness) -> None:
    native_step(h.root, 5, f'{{"loss": {HUGE}}}')
    native_step(h.root, 6, '{"loss": 0.5}')
    assert h.client.wait("r", 6, until="valid", timeout=30)
    wait_until(lambda: checkpoints(h).get(5, {}).get("state") == "invalid", 30)
    rec = checkpoints(h)
    assert rec[5]["state"] == "invalid" and rec[5]["reason"] == "bad_metadata", rec[5]
    assert "400 digits" in message(h, 5)
    assert rec[6]["metrics"] == {"loss": 0.5}
    save_torch(h.root / "model_step_7.pt")  # later scans go on
    assert h.client.wait("r", 7, until="valid", timeout=30)
    assert h.client.status()["roots"][0]["last_error"] is None  # type: ignore[index]


def test_a_meta_json_that_is_a_link_or_over_its_cap_is_a_bad_step(h: Harness) -> None:
    d = native_step(h.root, 5)
    real = d / "real-meta"
    (d / "meta.json").rename(real)
    (d / "meta.json").symlink_to(real.name)  # inside the root, still never read through
    big = native_step(h.root, 6)
    with (big / "meta.json").open("a") as f:
        f.write(" " * (1024 * 1024))
    native_step(h.root, 7)
    assert h.client.wait("r", 7, until="valid", timeout=30)
    for step, words in ((5, "symlink"), (6, "cap")):
        wait_until(lambda s=step: checkpoints(h).get(s, {}).get("state") == "invalid", 30)
        assert checkpoints(h)[step]["reason"] == "bad_metadata"
        assert words in message(h, step)
    # counted in the metric at every scan (two refused files), gone once they are fixed
    sample = h.daemon.metrics.registry.get_sample_value
    wait_until(lambda: sample("ckptd_bad_inputs", {"root": "r", "kind": "metadata"}) == 2, 30)
    (d / "meta.json").unlink()
    real.rename(d / "meta.json")
    wait_until(lambda: sample("ckptd_bad_inputs", {"root": "r", "kind": "metadata"}) == 1, 30)


def test_a_pointer_file_over_its_cap_is_reported_and_the_root_goes_on(h: Harness) -> None:
    """DeepSpeed's `latest` of 10 KiB: the tag waits for a readable one, `latest` is listed as
    unrecognised in status, the root's other checkpoints carry on."""
    tag = h.root / "ds" / "global_step5"
    save_torch(tag / "mp_rank_00_model_states.pt")
    (h.root / "ds" / "latest").write_text("global_step5" + " " * 10_000)
    save_torch(h.root / "model_step_9.pt")
    assert h.client.wait("r", 9, until="valid", timeout=30)
    root = h.client.status()["roots"][0]  # type: ignore[index]
    assert "ds/latest" in root["unrecognised"], root
    assert checkpoints(h)[5]["state"] == "pending"


# -- world sizes and ranks ----------------------------------------------------------------------


def _snap(files: dict[str, int], contents: dict[str, bytes] | None = None) -> Snapshot:
    infos = {rel: FileInfo(rel, size, 0.0, 0.0, False) for rel, size in files.items()}
    return Snapshot(files=infos, contents=contents or {})


def _detect_bounded(snap: Snapshot, opts: RootOptions | None = None) -> list[Any]:
    """Detect, and assert it took well under a second and 16 MiB at peak."""
    tracemalloc.start()
    t0 = time.monotonic()
    try:
        found = layouts.detect(snap, opts or RootOptions(settle=1.0), now=1e6)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert time.monotonic() - t0 < 2.0
    assert peak < 16 * 1024 * 1024, f"{peak} bytes at peak"
    return found


@pytest.mark.parametrize("multi_node", [False, True])
def test_a_40_byte_meta_claiming_2e7_ranks_is_bad_metadata(multi_node: bool) -> None:
    meta = json.dumps({"world_size": 2 * 10**7}).encode()
    snap = _snap({"model_5.pt": 100, "meta_5.json": len(meta), "optim_5_rank0.pt": 100},
                 {"meta_5.json": meta})
    (cand,) = _detect_bounded(snap, RootOptions(settle=1.0, multi_node=multi_node))
    assert cand.invalid_reason == "bad_metadata"
    assert "world_size 20000000" in cand.invalid_message


def test_a_large_but_possible_world_size_lists_a_few_missing_ranks() -> None:
    meta = json.dumps({"world_size": 1 << 20}).encode()
    snap = _snap({"model_5.pt": 100, "meta_5.json": len(meta), "optim_5_rank0.pt": 100},
                 {"meta_5.json": meta})
    (cand,) = _detect_bounded(snap)
    assert not cand.complete and not cand.invalid_reason
    assert "ranks 1, 2, 3, 4, 5, 6, 7, 8 and 1048567 more" in cand.waiting_for


@pytest.mark.parametrize("files", [
    {"model_5.pt": 100, "meta_5.json": 2, "optim_5_rank0.pt": 1, "optim_5_rank99999999.pt": 1},
    {"global_step5/mp_rank_00_model_states.pt": 1,
     "global_step5/zero_pp_rank_99999999_mp_rank_00_optim_states.pt": 1, "latest": 12},
    {"global_step5/mp_rank_99999999_model_states.pt": 1,
     "global_step5/mp_rank_00_model_states.pt": 1, "latest": 12},
], ids=["ranked", "deepspeed dp", "deepspeed mp"])
def test_a_rank_of_1e8_in_a_file_name_is_bad_metadata(files: dict[str, int]) -> None:
    snap = _snap(files, {"meta_5.json": b"{}", "latest": b"global_step5"})
    (cand,) = _detect_bounded(snap)
    assert cand.invalid_reason == "bad_metadata", cand
    assert "99999999" in cand.invalid_message


# -- the layouts' metadata readers, fuzzed ------------------------------------------------------

_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(10**30), max_value=10**30)
    | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=20),
    lambda kids: st.lists(kids, max_size=5) | st.dictionaries(
        st.sampled_from(["world_size", "step", "format", "files", "metrics", "path", "size",
                         "log_history", "best_metric", "eval_loss", "global_step",
                         "commit_timestamp_nsecs"]) | st.text(max_size=8), kids, max_size=6),
    max_leaves=30)
_DOC = (_JSON.map(lambda doc: json.dumps(doc).encode())
        | st.binary(max_size=200)
        | st.sampled_from([b"{" * 5000, b"[" * 5000, HUGE.encode(), b'{"a": 1, "a": 2}',
                           b'{"world_size": 20000000}', b"\xff\xfe", b"global_step5", b"5"]))
_METADATA = ["step-5/meta.json", "meta_5.json", "checkpoint-5/trainer_state.json",
             "latest", "latest_checkpointed_iteration.txt", "5/_CHECKPOINT_METADATA",
             "5/metrics/metrics"]


@settings(max_examples=int(os.environ.get("CKPTD_FUZZ_EXAMPLES", "300")), deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(docs=st.dictionaries(st.sampled_from(_METADATA), _DOC, min_size=1),
       multi_node=st.booleans())
def test_the_layouts_metadata_readers_never_raise(docs: dict[str, bytes],
                                                 multi_node: bool) -> None:
    """Any bytes in any metadata file a layout reads: detection returns (a candidate is
    complete, pending or bad_metadata), in bounded time and memory, never raises."""
    files = {rel: len(data) for rel, data in docs.items()}
    files.update({"step-5/model.pt": 10, "model_5.pt": 10, "optim_5_rank0.pt": 10,
                  "checkpoint-5/model.safetensors": 10, "iter_0000005/common.pt": 10,
                  "global_step5/mp_rank_00_model_states.pt": 10, "5/default/x": 10})
    for cand in _detect_bounded(_snap(files, docs),
                                RootOptions(settle=1.0, multi_node=multi_node)):
        assert cand.invalid_reason in ("", "bad_metadata"), cand
        assert len(cand.waiting_for) < 10_000
