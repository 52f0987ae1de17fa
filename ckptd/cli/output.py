"""What the command line prints besides a command's own answer: `--json` documents (an error
included: one `{"error": {...}}` object on stdout), and the progress line drawn on a terminal
while `wait` and `flush` wait for an upload. Never decides an exit code (`cli.main` does) and
never draws anything when stderr is not a terminal."""

from __future__ import annotations

import json
import re
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, TextIO

from ckptd.client import ClientError, DaemonUnavailable
from ckptd.errors import CkptdError, DaemonUnreachable, NotFound, ServiceUnavailable, UsageError
from ckptd.units import progress_line


class SocketRefused(DaemonUnreachable):
    """The socket exists but refused this user (EACCES/EPERM on connect): a group to join, not
    a daemon to start. Exit 69 like any unreachable daemon."""


def print_json(doc: Any) -> None:
    print(json.dumps(doc, indent=2, default=str))


def wants_json(argv: Sequence[str] | None) -> bool:
    """Whether the command line asked for `--json`, read from argv itself, so that an error
    raised while parsing it is answered in JSON too."""
    words = sys.argv[1:] if argv is None else list(argv)
    return "--json" in words[: words.index("--")] if "--" in words else "--json" in words


def error_kind(err: BaseException) -> str:
    """The error's class in snake case, less `Error` ("usage", "daemon_unreachable",
    "config", "not_found", "socket_refused"); the base class is "error"."""
    name = type(err).__name__
    name = name[: -len("Error")] if name.endswith("Error") and name != "Error" else name
    if name in ("Ckptd", "Exception"):
        return "error"
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


def error_document(message: str, kind: str, code: int) -> dict[str, Any]:
    """`{"error": {"message", "kind", "exit_code"}}`: what `--json` prints on stdout for an
    error, with the exit code the command exits with."""
    return {"error": {"message": message, "kind": kind, "exit_code": code}}


def print_error(message: str, kind: str, code: int) -> None:
    print(json.dumps(error_document(message, kind, code)))


# -- the daemon's answers as ckptd's errors -----------------------------------------------

def call(fn: Callable[[], Any]) -> Any:
    """Run a strict client call, translating its errors into ckptd's."""
    try:
        return fn()
    except ClientError as exc:
        raise translate(exc) from exc


def translate(exc: ClientError) -> CkptdError:
    if isinstance(exc, DaemonUnavailable) and exc.code == "permission_denied":
        return SocketRefused(exc.message)  # the daemon may run: the socket refused this user
    if isinstance(exc, DaemonUnavailable):
        return DaemonUnreachable(f"{exc.message}\n  is the daemon running? (ckptd run)")
    if exc.status == 404:
        return NotFound(exc.message)
    if exc.status == 503:  # shutting down, or a service of it could not run the request in time
        return ServiceUnavailable(f"{exc.message}\n  the daemon cannot do it now; try again later")
    if exc.status in (400, 413, 422):
        return UsageError(f"ckptd: {exc.message}")
    return CkptdError(f"daemon answered {exc.status}: {exc.message}")


# -- progress on a terminal ---------------------------------------------------------------------

class StepProgress:
    """One step's upload drawn on a terminal, fed `GET /v1/status` documents: the step's
    in-flight bytes with their rate and the time left at that rate."""

    def __init__(self, root: str, step: int, out: TextIO) -> None:
        self.root, self.step, self.out = root, step, out
        self.start = time.monotonic()
        self.drawn = False

    def __call__(self, status: dict[str, Any]) -> None:
        work = [w for w in status.get("in_flight") or []
                if isinstance(w, dict) and w.get("root") == self.root
                and w.get("step") == self.step]
        if not work:
            return
        done = sum(int(w.get("done_bytes") or 0) for w in work)
        total = sum(int(w.get("total_bytes") or 0) for w in work)
        stages = "+".join(sorted({str(w.get("stage")) for w in work}))
        line = progress_line(done, total, time.monotonic() - self.start)
        self.out.write(f"\r{self.root} step {self.step} {stages} {line}\x1b[K")
        self.out.flush()
        self.drawn = True

    def finish(self) -> None:
        """Leave the line drawn on, if one was."""
        if self.drawn:
            self.out.write("\n")
            self.out.flush()
            self.drawn = False


def step_progress(root: str, step: int, stream: TextIO | None = None) -> StepProgress | None:
    """A StepProgress on `stream` (stderr) when it is a terminal; None otherwise: a pipe or a
    file gets nothing."""
    out = sys.stderr if stream is None else stream
    return StepProgress(root, step, out) if out.isatty() else None
