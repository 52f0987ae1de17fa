"""`ckptd wait`: block until a step is valid or uploaded, waiting for the daemon to come up
too; on a terminal, `--until uploaded` draws the upload's progress on stderr meanwhile. Talks to
the daemon only through `ckptd.client`."""

from __future__ import annotations

import argparse
import sys

from ckptd.cli.output import StepProgress, call, print_json, step_progress, translate
from ckptd.client import Client, ClientError, DaemonUnavailable
from ckptd.errors import UsageError

EXIT_NO = 1


def wait(args: argparse.Namespace, socket: str) -> int:
    import math
    import time

    if not (math.isfinite(args.timeout) and 0 <= args.timeout <= 7 * 86400):
        raise UsageError("ckptd wait: --timeout must be from 0 to 604800 seconds")
    c = Client(socket, timeout=10.0, strict=True)
    deadline = time.monotonic() + args.timeout
    draw = step_progress(args.root, args.step) if args.until == "uploaded" else None
    try:
        reached, why = _wait_loop(args, c, deadline, draw)
    finally:
        if draw is not None:
            draw.finish()
    return _waited(args, reached, why)


def _wait_loop(args: argparse.Namespace, c: Client, deadline: float,
               draw: StepProgress | None) -> tuple[bool, str]:
    import time

    while True:
        left = deadline - time.monotonic()
        try:  # on a terminal, in short waits, each followed by a look at the upload's progress
            reached = c.wait(args.root, args.step, until=args.until,
                             timeout=max(0.0, left if draw is None else min(left, 1.0)))
            if reached or draw is None or deadline <= time.monotonic():
                return reached, f"not {args.until} after {args.timeout:g}s"
            draw(call(lambda: c.request_json("GET", "/v1/status")))
        except DaemonUnavailable as exc:  # not up yet (just started): try until the deadline
            if exc.code == "permission_denied":
                raise translate(exc) from None
            if left <= 0:
                raise translate(DaemonUnavailable(0, "unreachable", f"ckptd at {c.socket}"
                                                   " did not answer")) from None
            time.sleep(min(0.2, left))
        except ClientError as exc:
            if exc.status != 409:
                raise translate(exc) from exc
            return False, exc.message  # it became invalid: the answer is no


def _waited(args: argparse.Namespace, reached: bool, why: str) -> int:
    if args.json:
        print_json({"root": args.root, "step": args.step, "until": args.until,
                    "reached": reached, "message": args.until if reached else why})
    elif reached:
        print(f"{args.root} step {args.step} {args.until}")
    else:
        print(f"{args.root} step {args.step}: {why}", file=sys.stderr)
    return 0 if reached else EXIT_NO
