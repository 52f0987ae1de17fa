"""The `ckptd` command line: runs the command `cli.parser` parsed, maps errors to exit codes
and calls sys.exit. Client commands talk to the daemon through `ckptd.client`."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ckptd import needs_torch, torch_version
from ckptd.cli.parser import build_parser
from ckptd.client import Client, ClientError, DaemonUnavailable
from ckptd.errors import (
    CkptdError,
    ConfigError,
    DaemonUnreachable,
    NotFound,
    ServiceUnavailable,
    UsageError,
    exit_code,
)
from ckptd.heap import return_large_buffers

EXIT_NO = 1
DEFAULT_SOCKET = "/run/ckptd/ckptd.sock"


# -- entry point -------------------------------------------------------------------------------

def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        if args.command in ("run", "verify", "restore"):
            from ckptd.fileio import raise_open_file_limit

            raise_open_file_limit()  # a step's files are all held open while it is checked
        return int(COMMANDS[args.command](args))
    except UsageError as err:
        print(str(err), file=sys.stderr)
        return 2
    except CkptdError as err:
        print(f"ckptd: {err}", file=sys.stderr)
        return exit_code(err)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # `ckptd ls r | head`: the reader left; say nothing more (and not at exit either).
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def _config_path(args: argparse.Namespace) -> Path | None:
    from ckptd.config import find_config

    return find_config(getattr(args, "config", None))


def _load_config(args: argparse.Namespace, required: bool) -> Any:
    from ckptd.config import load_config

    path = _config_path(args)
    if path is None:
        if required:
            raise ConfigError("no config: pass --config PATH or set CKPTD_CONFIG (neither"
                              " /etc/ckptd/ckptd.toml nor ./ckptd.toml exists)")
        return None
    return load_config(path)


def _socket(args: argparse.Namespace) -> str:
    explicit = getattr(args, "socket", None) or os.environ.get("CKPTD_SOCKET")
    if explicit:
        return str(explicit)
    try:
        cfg = _load_config(args, required=False)
    except ConfigError:
        cfg = None
    return str(cfg.daemon.socket) if cfg is not None else DEFAULT_SOCKET


def _client(args: argparse.Namespace) -> Client:
    return Client(_socket(args), timeout=10.0, strict=True)


def _call(fn: Callable[[], Any]) -> Any:
    """Run a strict client call, translating its errors into ckptd's."""
    try:
        return fn()
    except ClientError as exc:
        raise _translate(exc) from exc


def _translate(exc: ClientError) -> CkptdError:
    if isinstance(exc, DaemonUnavailable):
        return DaemonUnreachable(f"{exc.message}\n  is the daemon running? (ckptd run)")
    if exc.status == 404:
        return NotFound(exc.message)
    if exc.status == 503:  # shutting down, or a service of it could not run the request in time
        return ServiceUnavailable(f"{exc.message}\n  the daemon cannot do it now; try again later")
    if exc.status in (400, 413, 422):
        return UsageError(f"ckptd: {exc.message}")
    return CkptdError(f"daemon answered {exc.status}: {exc.message}")


def _print_json(doc: Any) -> None:
    print(json.dumps(doc, indent=2))


# -- commands ----------------------------------------------------------------------------------

def cmd_run(args: argparse.Namespace) -> int:
    from ckptd.config import check_installed
    from ckptd.daemon import Daemon
    from ckptd.log import configure

    path = _config_path(args)
    cfg = _load_config(args, required=True)
    check_installed(cfg, str(path))
    if getattr(args, "socket", None):  # --socket overrides daemon.socket for this run
        cfg = cfg.model_copy(update={"daemon": cfg.daemon.model_copy(
            update={"socket": Path(args.socket).absolute()})})
    configure(cfg.daemon.log_format, cfg.daemon.log_level)
    return_large_buffers()
    return Daemon(cfg, path).run()


def cmd_status(args: argparse.Namespace) -> int:
    from ckptd.cli.render import render_status

    c = _client(args)
    while True:
        doc = _call(lambda: c.request_json("GET", "/v1/status"))
        if args.json:
            _print_json(doc)
        elif args.watch:
            sys.stdout.write("\x1b[H\x1b[2J" + render_status(doc) + "\n")  # clear, redraw
            sys.stdout.flush()
        else:
            print(render_status(doc))
        if not args.watch:
            return 0
        import time

        time.sleep(max(0.2, args.watch))


def cmd_ls(args: argparse.Namespace) -> int:
    c = _client(args)
    doc = _call(lambda: c.request_json("GET", f"/v1/roots/{_q(args.root)}/checkpoints"))
    if args.json:
        _print_json(doc)
        return 0
    from ckptd.cli.render import render_ls

    print(render_ls(doc))
    return 0


def cmd_latest(args: argparse.Namespace) -> int:
    c = _client(args)
    path = f"/v1/roots/{_q(args.root)}/latest?tier={args.tier}"
    try:
        doc = c.request_json("GET", path)
    except ClientError as exc:
        if exc.status == 404 and exc.code == "no_checkpoint":
            doc = {"root": args.root, "step": None, "path": None, "state": None,
                   "local": None, "remote": None}
        else:
            raise _translate(exc) from exc
    if args.json:
        _print_json(doc)
    elif doc["step"] is None:
        print(f"{args.root}: no valid checkpoint (tier {args.tier})")
    else:
        print(f"{doc['root']} step {doc['step']}  {doc['path']}  local={doc['local']}"
              f" remote={doc['remote']}")
    return 0 if doc["step"] is not None else EXIT_NO


def cmd_wait(args: argparse.Namespace) -> int:
    import math
    import time

    if not (math.isfinite(args.timeout) and 0 <= args.timeout <= 7 * 86400):
        raise UsageError("ckptd wait: --timeout must be from 0 to 604800 seconds")
    c = _client(args)
    deadline = time.monotonic() + args.timeout
    while True:
        left = deadline - time.monotonic()
        try:
            reached = c.wait(args.root, args.step, until=args.until, timeout=max(0.0, left))
            break
        except DaemonUnavailable:  # not up yet (just started): keep trying until the deadline
            if left <= 0:
                raise _translate(DaemonUnavailable(0, "unreachable", f"ckptd at {c.socket}"
                                                   " did not answer")) from None
            time.sleep(min(0.2, left))
        except ClientError as exc:
            if exc.status == 409:  # it became invalid: the answer is no
                print(f"{args.root} step {args.step}: {exc.message}", file=sys.stderr)
                return EXIT_NO
            raise _translate(exc) from exc
    if not reached:
        print(f"{args.root} step {args.step}: not {args.until} after {args.timeout:g}s",
              file=sys.stderr)
        return EXIT_NO
    print(f"{args.root} step {args.step} {args.until}")
    return 0


def cmd_probe(args: argparse.Namespace) -> int:
    from ckptd.cli.probe import verdict

    if not (0 < args.timeout <= 60):
        raise UsageError("ckptd probe: --timeout must be above 0 and at most 60 seconds")
    c = Client(_socket(args), timeout=args.timeout, strict=True)
    health = _call(lambda: c.request_json("GET", "/v1/health"))
    why = verdict(args.kind, health)
    if why is not None:
        print(f"ckptd is not {args.kind}: {why}", file=sys.stderr)
        return EXIT_NO
    print(f"ckptd is {args.kind} ({health.get('status')}, up {health.get('uptime_s')}s)")
    return 0


def cmd_flush(args: argparse.Namespace) -> int:
    import math

    from ckptd.cli.flush import flush

    if not (math.isfinite(args.timeout) and 0 <= args.timeout <= 7 * 86400):
        raise UsageError("ckptd flush: --timeout must be from 0 to 604800 seconds")
    done = _call(lambda: flush(_client(args), args.timeout, wait=not args.no_wait))
    if args.json:
        _print_json({"flushed": [f.as_json() for f in done]})
    elif not done:
        print("nothing to flush: the newest valid step of every uploading root is uploaded")
    else:
        for f in done:
            if f.uploaded is False:
                print(f"{f.root} step {f.step}: not uploaded: {f.message}", file=sys.stderr)
            else:
                print(f"{f.root} step {f.step} {f.message}")
    return EXIT_NO if any(f.uploaded is False for f in done) else 0


def cmd_register(args: argparse.Namespace) -> int:
    c = _client(args)
    paths = [os.path.abspath(p) for p in args.paths]
    _call(lambda: c.request_json("POST", f"/v1/roots/{_q(args.root)}/checkpoints",
                                 {"step": args.step, "paths": paths,
                                  "metrics": dict(args.metrics)}, ok=(202,)))
    print(f"registered {args.root} step {args.step}")
    return 0


def _pin(args: argparse.Namespace, method: str) -> int:
    c = _client(args)
    _call(lambda: c.request_json(method, f"/v1/roots/{_q(args.root)}/checkpoints/{args.step}/pin"))
    print(f"{'pinned' if method == 'PUT' else 'unpinned'} {args.root} step {args.step}")
    return 0


def cmd_hold(args: argparse.Namespace) -> int:
    import urllib.parse

    c = _client(args)
    query = urllib.parse.urlencode({"owner": args.owner, "ttl": args.ttl})
    path = f"/v1/roots/{_q(args.root)}/checkpoints/{args.step}/hold?{query}"
    _call(lambda: c.request_json("DELETE" if args.release else "PUT", path))
    if args.release:
        print(f"released {args.root} step {args.step} (owner {args.owner})")
    else:
        print(f"held {args.root} step {args.step} for {args.ttl:g}s (owner {args.owner})")
    return 0


def cmd_prune(args: argparse.Namespace) -> int:
    c = _client(args)
    path = f"/v1/roots/{_q(args.root)}/prune"
    if args.dry_run and args.apply:
        raise UsageError("prune: --dry-run and --apply exclude each other")
    if args.dry_run:
        doc = _call(lambda: c.request_json("GET", path))
        if args.json:
            _print_json(doc)
        else:
            from ckptd.cli.render import render_plan

            print(render_plan(doc))
        return 0
    doc = _call(lambda: c.request_json("POST", path, timeout=600))
    if args.json:
        _print_json(doc)
    else:
        for o in doc["outcomes"]:
            print(f"{o['tier']:<6} step {o['step']:>8}  {o['action']:<8} {o['reason']}")
        if not doc["outcomes"]:
            print(f"{args.root}: nothing to prune")
    return 0


def cmd_restore(args: argparse.Namespace) -> int:
    from ckptd.restore.files import restore, tty_progress

    return_large_buffers()

    if args.step != "latest" and not (args.step.isascii() and args.step.isdigit()):
        raise UsageError(f"ckptd restore: STEP must be a number or 'latest', got {args.step!r}")
    step: int | str = "latest" if args.step == "latest" else int(args.step)
    cfg = _load_config(args, required=True)
    print(f"ckptd: config {_config_path(args)}", file=sys.stderr)
    node = "*" if args.all else args.node
    n, paths = restore(cfg, args.root, step, Path(args.to), tty_progress(),  # type: ignore[arg-type]
                       node=node)
    if args.json:
        _print_json({"root": args.root, "step": n, "to": str(Path(args.to).resolve()),
                     "files": [str(p) for p in paths]})
    else:
        print(f"restored {args.root} step {n}: {len(paths)} file(s) into {args.to}")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from ckptd.cli.verify import verify_path
    from ckptd.config import check_trusted_globals

    try:
        trusted = frozenset(check_trusted_globals(list(args.trust)))
    except ValueError as exc:
        raise UsageError(f"ckptd verify: --trust {exc}") from None
    if args.deep and torch_version() is None:
        raise UsageError(f"ckptd {needs_torch('verify --deep')}")
    doc = verify_path(Path(args.path), deep=args.deep, trusted=trusted)
    if args.json:
        _print_json(doc)
    else:
        status = "valid" if doc["valid"] else f"INVALID ({doc['reason']}): {doc['message']}"
        print(f"{doc['path']}: {doc['layout']} step {doc['step']}: {status}")
        for f in doc["files"]:
            print(f"  {f['size']:>14,}  {f['hash']}  {f['path']}")
    return 0 if doc["valid"] else EXIT_NO


def cmd_config(args: argparse.Namespace) -> int:
    from ckptd.config import check_installed, load_config, render_toml

    path = args.path or getattr(args, "config", None) or os.environ.get("CKPTD_CONFIG")
    if not path:
        raise UsageError("ckptd config check: give the config file's path")
    cfg = load_config(Path(path))
    check_installed(cfg, str(path))
    print(f"# {path}: OK ({len(cfg.roots)} root(s))")
    print(render_toml(cfg.redacted()))
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from ckptd.demo import run_demo

    if getattr(args, "config", None) or getattr(args, "socket", None):
        raise UsageError("ckptd demo runs on its own embedded config in ./.demo; --config and"
                         " --socket are not used (start a real daemon with `ckptd run`)")
    return run_demo()


def cmd_doctor(args: argparse.Namespace) -> int:
    from ckptd.cli import doctor

    path = _config_path(args)
    cfg = _load_config(args, required=True)
    checks = doctor.run(cfg, path, Path(args.unit) if args.unit else None,
                        remote=not args.no_remote)
    if args.json:
        _print_json({"config": str(path), **doctor.as_json(checks)})
    else:
        print(f"ckptd doctor: config {path}")
        for line in doctor.render(checks):
            print(line)
    return 0 if doctor.as_json(checks)["ok"] else EXIT_NO


def _q(s: str) -> str:
    import urllib.parse

    return urllib.parse.quote(s, safe="")


COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "run": cmd_run, "status": cmd_status, "ls": cmd_ls, "latest": cmd_latest,
    "register": cmd_register, "wait": cmd_wait, "pin": lambda a: _pin(a, "PUT"),
    "unpin": lambda a: _pin(a, "DELETE"), "hold": cmd_hold, "prune": cmd_prune,
    "restore": cmd_restore, "flush": cmd_flush, "probe": cmd_probe,
    "verify": cmd_verify, "config": cmd_config,
    "demo": cmd_demo, "doctor": cmd_doctor,
}
