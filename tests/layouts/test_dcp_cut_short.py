"""A DCP save whose `.metadata` is there but whose shard was cut short: `invalid` (truncated)
once its files have settled, whether found at the first scan (adopted) or seen arriving, never
`pending` for good. Real `dcp.save` output, an in-process daemon on its real socket."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import writers


def _cut_save(where: Path) -> Path:
    """A real single-process DCP save in `where`, its shard then cut to half its bytes."""
    writers.save_dcp(where)
    shard = where / "__0_0.distcp"
    writers.truncate(shard, shard.stat().st_size // 2)
    return where


def test_a_cut_short_dcp_shard_is_invalid_once_settled(inproc_daemon: Any,
                                                       tmp_path: Path) -> None:
    d = inproc_daemon(roots=[{"name": "r1", "settle": "1s"}], start=False)
    root = d.roots["r1"]
    _cut_save(root / "step-1")  # there before the daemon's first scan: adopted
    writers.save_dcp(root / "step-3")  # a whole one beside it
    d.start()
    rec = d.wait_for("r1", 1, "invalid")
    assert (rec["state"], rec["reason"], rec["adopted"]) == ("invalid", "truncated", True), rec
    assert d.wait_for("r1", 3)["state"] == "valid"
    # One seen arriving: `.metadata` first, then the shard's first half (an interrupted copy).
    src = _cut_save(tmp_path / "src")
    (root / "step-2").mkdir()
    shutil.copy(src / ".metadata", root / "step-2" / ".metadata")
    shutil.copy(src / "__0_0.distcp", root / "step-2" / "__0_0.distcp")
    rec = d.wait_for("r1", 2, "invalid")
    assert (rec["state"], rec["reason"], rec["adopted"]) == ("invalid", "truncated", False), rec
    _, doc = d.client.request("GET", "/v1/roots/r1/checkpoints")
    assert {c["step"]: c["state"] for c in doc["checkpoints"]} == {
        1: "invalid", 2: "invalid", 3: "valid"}
