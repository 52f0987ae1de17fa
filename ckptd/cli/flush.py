"""`ckptd flush`: the preemption flush (`POST /v1/flush`) and the wait until each flushed step
is uploaded, the daemon gave its flush up, or the time is out: what a container's preStop hook
runs before its node goes away. Talks to the daemon only through the socket API."""

from __future__ import annotations

import time
import urllib.parse
from dataclasses import dataclass
from typing import Any

from ckptd.cli.output import StepProgress, step_progress
from ckptd.client import Client, ClientError
from ckptd.lifecycle import answers

POLL_S = 2.0  # each long-poll; between two, a look at whether the flush still covers the step
DRAW_S = 1.0  # the same on a terminal, whose progress line is redrawn after each


@dataclass(frozen=True)
class Flushed:
    root: str
    step: int
    uploaded: bool | None  # None: not waited for
    message: str

    def as_json(self) -> dict[str, Any]:
        return {"root": self.root, "step": self.step, "uploaded": self.uploaded,
                "message": self.message}


def flush(client: Client, timeout: float, wait: bool = True, tty: bool = False) -> list[Flushed]:
    """Ask for the flush; with `wait`, wait (one deadline for all) for each step it chose,
    with `tty` drawing each one's upload progress on stderr when it is a terminal.
    A ClientError from the flush request itself (unreachable, 503 stopping) is raised."""
    doc = client.request_json("POST", "/v1/flush")
    targets = [(str(t["root"]), int(t["step"])) for t in doc["flushing"]]
    if not wait:
        return [Flushed(r, s, None, "put first") for r, s in targets]
    deadline = time.monotonic() + timeout
    out = []
    for r, s in targets:
        draw = step_progress(r, s) if tty else None
        try:
            out.append(_await(client, r, s, deadline, timeout, draw))
        finally:
            if draw is not None:
                draw.finish()
    return out


def _await(client: Client, root: str, step: int, deadline: float, timeout: float,
           draw: StepProgress | None = None) -> Flushed:
    base = _step_path(root, step)
    while True:
        left = deadline - time.monotonic()
        chunk = min(max(left, 0.0), POLL_S if draw is None else DRAW_S)
        status, data = client.request("GET", f"{base}/wait?until=uploaded&timeout={chunk:.3f}",
                                      timeout=chunk + client.timeout)
        if status == 200:
            return Flushed(root, step, True, "uploaded")
        message = data.get("message", "") if isinstance(data, dict) else str(data)
        if status == 409:  # it became invalid, or this daemon stands by for the root
            return Flushed(root, step, False, message)
        if status not in (404, 408):
            code = data.get("error", "") if isinstance(data, dict) else ""
            raise ClientError(status, code, message)
        gone = _left_behind(client, root, step, draw)
        if gone is not None:
            return gone
        if deadline - time.monotonic() <= 0:
            return Flushed(root, step, False, f"not uploaded after {timeout:g}s")


def _left_behind(client: Client, root: str, step: int,
                 draw: StepProgress | None = None) -> Flushed | None:
    """Why the flush no longer waits on the step (the daemon is stopping, or dropped the step
    from its flush), or None while it still does."""
    st = client.request_json("GET", "/v1/status")
    if draw is not None:
        draw(st)
    if st.get("status") == "stopping":
        return Flushed(root, step, False, "the daemon is stopping; the upload resumes after"
                                          " its next start")
    if {"root": root, "step": step} in st.get("flushing", []):
        return None
    status, rec = client.request("GET", _step_path(root, step))
    if status == 200 and isinstance(rec, dict) and answers.is_committed(answers.where_of(rec)):
        # uploaded between the two looks
        return Flushed(root, step, True, "uploaded")
    error = next((r.get("last_error") for r in st.get("roots", [])
                  if isinstance(r, dict) and r.get("name") == root), None)
    return Flushed(root, step, False, "no longer flushed: its upload failed (flush_abandoned"
                                      " in the daemon's log) or a later flush chose another"
                                      " step" + (f"; the root's last error: {error}"
                                                 if error else ""))


def _step_path(root: str, step: int) -> str:
    return f"/v1/roots/{urllib.parse.quote(root, safe='')}/checkpoints/{step}"
