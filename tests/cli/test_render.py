"""The terminal renderings of status and ls show sizes and durations through ckptd.units."""

from __future__ import annotations

from typing import Any

from ckptd.cli.render import render_ls, render_status


def _checkpoint(step: int, size: int, stored: int) -> dict[str, Any]:
    return {"step": step, "state": "valid", "local": "present", "remote": "none",
            "layout": "single", "bytes": size, "stored_bytes": stored, "pinned": False,
            "metrics": {}, "reason": None}


def test_ls_shows_sizes_in_the_one_human_form() -> None:
    doc = {"root": "job", "checkpoints": [_checkpoint(1, 3 << 29, 0), _checkpoint(2, 512, 300)]}
    lines = render_ls(doc).splitlines()
    assert lines[2].split()[5:7] == ["1.5GiB", "-"]  # nothing stored yet reads "-"
    assert lines[3].split()[5:7] == ["512B", "300B"]


def test_status_shows_uptime_and_progress_in_the_one_human_form() -> None:
    doc = {"version": "1", "status": "ok", "uptime_s": 5400.4, "roots": [], "in_flight": [
        {"root": "job", "step": 7, "stage": "upload", "done_bytes": 1536, "total_bytes": 3072}]}
    text = render_status(doc)
    assert text.splitlines()[0] == "ckptd 1  ok  up 1h30m"
    assert text.rstrip().endswith(" 50.0% 1.5KiB/3KiB")
