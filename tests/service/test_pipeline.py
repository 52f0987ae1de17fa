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


def test_a_resave_under_a_compressed_row_is_compressed_again(store_bench: Any) -> None:
    """A re-save writes a compressed step's originals again. Before the scan sees it, the
    in-place pass takes the rewritten file for a crash's half-finished replacement, refuses
    it (it is not the copy) and backs off. The back-off is the old row's: the re-save is a
    new row, and its own copy replaces its originals at once."""
    import threading

    from support.ckpts import save_single

    from ckptd.lifecycle.policy import policy_of
    from ckptd.retention.inplace import InPlace

    b = store_bench(roots=[{"name": "r1", "settle": "0s", "retention": {"local": {
        "compress_older": True, "keep_last": 1, "keep_best": 0, "min_free": "0"}}}])
    root = b.root()
    b.store.set_policies({"r1": policy_of(root)})  # the copy is made in the validation pass
    b.scan()  # the first scan: what it finds is adopted, and retention leaves adopted steps be
    save_single(root.path, 1, n=256)
    save_single(root.path, 2, n=256)  # the latest: the nets keep its originals
    b.scan()
    b.drain()
    inplace = InPlace(b.store, threading.RLock(), threading.RLock())
    assert inplace.replace_originals(root, 1)
    assert b.store.checkpoint("r1", 1).local.value == "compressed"

    save_single(root.path, 1, n=300)  # the re-save, not scanned yet
    inplace.finish(root)  # refuses the rewritten file: it is not the copy's original
    assert (root.path / "model_step_1.pt").exists()
    b.scan()
    b.drain()
    rec = b.store.checkpoint("r1", 1)
    assert (rec.state.value, rec.local.value) == ("valid", "present")
    assert inplace.replace_originals(root, 1), "the old row's back-off held back the re-save"
    assert b.store.checkpoint("r1", 1).local.value == "compressed"
    assert not (root.path / "model_step_1.pt").exists()
