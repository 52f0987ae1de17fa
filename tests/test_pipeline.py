"""Pipeline level, no daemon: a real Store on a SQLite file, real torch-written checkpoints in a
root, scans run in the test thread and real stage workers (StoreBench). What the daemon tests
show end to end, here step by step: discovery, validation, damage, a re-save."""

from __future__ import annotations

from typing import Any

import layout_writers as lw
import torch
from writers import flip_byte, member_data_offset

ROOT = [{"name": "r1", "settle": "0s"}]


def test_a_scan_finds_and_a_stage_validates(store_bench: Any) -> None:
    b = store_bench(roots=ROOT)
    root = b.root().path
    lw.write_single(root, 5)
    assert [(c.event, c.step, c.layout) for c in b.scan()] == [
        ("checkpoint_discovered", 5, "single")]
    assert b.store.checkpoint("r1", 5).state.value == "complete"
    b.drain()
    rec = b.store.checkpoint("r1", 5)
    assert (rec.state.value, rec.local.value) == ("valid", "present")
    assert rec.bytes == (root / "model_step_5.pt").stat().st_size
    assert b.store.latest("r1").step == 5
    assert b.scan() == []  # nothing changed: a rescan records nothing


def test_damage_is_invalid_and_never_latest(store_bench: Any) -> None:
    b = store_bench(roots=ROOT)
    root = b.root().path
    lw.write_single(root, 1)
    flip_byte(lw.write_single(root, 2), member_data_offset(root / "model_step_2.pt", "data/0")[0])
    lw.write_single(root, 3, stop="finish")  # a torn write: half its bytes
    b.scan()
    b.drain()
    states = {r.step: (r.state.value, r.reason) for r in b.store.checkpoints("r1")}
    assert states[1] == ("valid", "")
    assert states[2][0] == "invalid" and states[2][1] == "crc_mismatch"
    assert states[3][0] == "invalid"
    assert b.store.latest("r1").step == 1


def test_a_resave_supersedes_and_is_validated_again(store_bench: Any) -> None:
    b = store_bench(roots=ROOT)
    root = b.root().path
    path = lw.write_single(root, 8)
    b.scan()
    b.drain()
    first = b.store.checkpoint("r1", 8)
    torch.save({"w": torch.arange(4096.0)}, path)
    assert [c.event for c in b.scan()] == ["checkpoint_superseded"]
    assert b.store.checkpoint("r1", 8).state.value == "complete"  # settled (settle 0s)
    b.drain()
    rec = b.store.checkpoint("r1", 8)
    assert rec.state.value == "valid" and rec.bytes == path.stat().st_size != first.bytes
