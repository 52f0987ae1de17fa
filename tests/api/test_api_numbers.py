"""Numbers at the socket, bounded where they enter: a 400-digit metric in a registration or in an
async save's head, a huge integer anywhere in the head, each refused at the door (a 400); the
root's checkpoints carry on. A real daemon in the test process, its real socket."""

from __future__ import annotations

import os
from typing import Any

from support import Harness, raw
from support.async_save import post_persist, sealed_arena
from support.harness import checkpoints
from support.numbers import HUGE
from writers import save_torch


def test_a_400_digit_metric_in_a_registration_is_a_400_and_scans_go_on(h: Harness) -> None:
    save_torch(h.root / "model_step_1.pt")
    body = b'{"step": 1, "metrics": {"loss": %s}}' % HUGE.encode()
    status, doc = raw(h.daemon.config.daemon.socket, "POST", "/v1/roots/r/checkpoints", body)
    assert status == 400 and doc["error"] == "bad_field", doc
    assert "metric 'loss'" in doc["message"]
    save_torch(h.root / "model_step_2.pt")
    assert h.client.wait("r", 2, until="valid", timeout=30)
    assert h.client.wait("r", 1, until="valid", timeout=30)
    assert checkpoints(h)[1]["metrics"] == {}
    assert h.client.health()["status"] == "ok"  # type: ignore[index]


def test_a_400_digit_metric_in_an_async_saves_head_is_refused(inproc_daemon: Any) -> None:
    d = inproc_daemon(roots=[{"name": "r1"}])
    fd, body = sealed_arena()
    body["dir"] = str(d.roots["r1"])
    body["head"]["metrics"] = {"loss": 10**400}
    try:
        got = post_persist(d.socket, body, fd)
    finally:
        os.close(fd)
    assert got[0] == 400 and got[1]["error"] == "bad_arena", got
    assert "loss" in got[1]["message"]
    assert [p.name for p in d.roots["r1"].iterdir()] == [".ckptd"]


def test_a_huge_integer_anywhere_in_an_async_saves_head_is_refused(inproc_daemon: Any) -> None:
    """The head becomes meta.json, read back as strict JSON: refused at the door, not later."""
    d = inproc_daemon(roots=[{"name": "r1"}])
    fd, body = sealed_arena()
    body["dir"] = str(d.roots["r1"])
    body["head"]["config"] = {"lr_steps": [1, 2**70]}
    try:
        got = post_persist(d.socket, body, fd)
    finally:
        os.close(fd)
    assert got[0] == 400 and got[1]["error"] == "bad_arena", got
