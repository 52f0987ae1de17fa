"""The `ckptd` command line: runs the command `cli.parser` parsed, maps errors to exit codes
and calls sys.exit. Client commands talk to the daemon through `ckptd.client`."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ckptd import needs_torch, torch_version
from ckptd.cli.output import call as _call
from ckptd.cli.output import error_kind, print_error, print_json, wants_json
from ckptd.cli.output import translate as _translate
from ckptd.cli.parser import build_parser
from ckptd.cli.wait import wait as _wait
from ckptd.client import Client, ClientError
from ckptd.errors import (
    CkptdError,
    ConfigError,
    UsageError,
    exit_code,
)
from ckptd.heap import return_large_buffers

EXIT_NO = 1
DEFAULT_SOCKET = "/run/ckptd/ckptd.sock"


# -- entry point -------------------------------------------------------------------------------

def main(argv: Sequence[str] | None = None) -> int:
    as_json = wants_json(argv)
    try:
        args = build_parser().parse_args(argv)
        args.json = as_json = bool(getattr(args, "json", False))
        if args.command in ("run", "verify", "restore"):
            from ckptd.fileio import raise_open_file_limit

            raise_open_file_limit()  # a step's files are all held open while it is checked
        return int(COMMANDS[args.command](args))
    except UsageError as err:
        return _failed(str(err), err, 2, as_json)
    except CkptdError as err:
        return _failed(f"ckptd: {err}", err, exit_code(err), as_json)
    except KeyboardInterrupt:
        if as_json:
            print_error("interrupted", "interrupted", 130)
        return 130
    except BrokenPipeError:
        # `ckptd ls r | head`: the reader left; say nothing more (and not at exit either).
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def _failed(line: str, err: CkptdError, code: int, as_json: bool) -> int:
    """An error: its line on stderr and, with --json, its document on stdout; the exit code."""
    print(line, file=sys.stderr)
    if as_json:
        print_error(str(err).removeprefix("ckptd: "), error_kind(err), code)
    return code


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
    configure("json" if args.json else cfg.daemon.log_format, cfg.daemon.log_level)
    return_large_buffers()
    return Daemon(cfg, path).run()


def cmd_status(args: argparse.Namespace) -> int:
    from ckptd.cli.render import render_status

    if args.watch is not None and not sys.stdout.isatty():
        raise UsageError("ckptd status: --watch redraws a terminal, and stdout is not one; for"
                         " a pipe or a file use `ckptd status --json`, once or in a loop")
    c = _client(args)
    while True:
        doc = _call(lambda: c.request_json("GET", "/v1/status"))
        if args.json:
            print_json(doc)
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
        print_json(doc)
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
        print_json(doc)
    elif doc["step"] is None:
        print(f"{args.root}: no valid checkpoint (tier {args.tier})")
    else:
        print(f"{doc['root']} step {doc['step']}  {doc['path']}  local={doc['local']}"
              f" remote={doc['remote']}")
    return 0 if doc["step"] is not None else EXIT_NO


def cmd_probe(args: argparse.Namespace) -> int:
    from ckptd.cli.probe import verdict

    if not (0 < args.timeout <= 60):
        raise UsageError("ckptd probe: --timeout must be above 0 and at most 60 seconds")
    c = Client(_socket(args), timeout=args.timeout, strict=True)
    health = _call(lambda: c.request_json("GET", "/v1/health"))
    why = verdict(args.kind, health)
    if args.json:
        print_json({"kind": args.kind, "ok": why is None, "reason": why, "health": health})
    elif why is not None:
        print(f"ckptd is not {args.kind}: {why}", file=sys.stderr)
    else:
        print(f"ckptd is {args.kind} ({health.get('status')}, up {health.get('uptime_s')}s)")
    return 0 if why is None else EXIT_NO


def cmd_flush(args: argparse.Namespace) -> int:
    import math

    from ckptd.cli.flush import flush

    if not (math.isfinite(args.timeout) and 0 <= args.timeout <= 7 * 86400):
        raise UsageError("ckptd flush: --timeout must be from 0 to 604800 seconds")
    done = _call(lambda: flush(_client(args), args.timeout, wait=not args.no_wait, tty=True))
    if args.json:
        print_json({"flushed": [f.as_json() for f in done]})
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
    _said(args, {"root": args.root, "step": args.step, "registered": True},
          f"registered {args.root} step {args.step}")
    return 0


def _pin(args: argparse.Namespace, method: str) -> int:
    c = _client(args)
    _call(lambda: c.request_json(method, f"/v1/roots/{_q(args.root)}/checkpoints/{args.step}/pin"))
    _said(args, {"root": args.root, "step": args.step, "pinned": method == "PUT"},
          f"{'pinned' if method == 'PUT' else 'unpinned'} {args.root} step {args.step}")
    return 0


def cmd_hold(args: argparse.Namespace) -> int:
    import urllib.parse

    c = _client(args)
    query = urllib.parse.urlencode({"owner": args.owner, "ttl": args.ttl})
    path = f"/v1/roots/{_q(args.root)}/checkpoints/{args.step}/hold?{query}"
    _call(lambda: c.request_json("DELETE" if args.release else "PUT", path))
    _said(args, {"root": args.root, "step": args.step, "owner": args.owner,
                 "held": not args.release, "ttl": None if args.release else args.ttl},
          f"released {args.root} step {args.step} (owner {args.owner})" if args.release else
          f"held {args.root} step {args.step} for {args.ttl:g}s (owner {args.owner})")
    return 0


def cmd_prune(args: argparse.Namespace) -> int:
    c = _client(args)
    path = f"/v1/roots/{_q(args.root)}/prune"
    if args.dry_run and args.apply:
        raise UsageError("prune: --dry-run and --apply exclude each other")
    if args.dry_run:
        doc = _call(lambda: c.request_json("GET", path))
        if args.json:
            print_json(doc)
        else:
            from ckptd.cli.render import render_plan

            print(render_plan(doc))
        return 0
    doc = _call(lambda: c.request_json("POST", path, timeout=600))
    if args.json:
        print_json(doc)
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
        print_json({"root": args.root, "step": n, "to": str(Path(args.to).resolve()),
                     "files": [str(p) for p in paths]})
    else:
        print(f"restored {args.root} step {n}: {len(paths)} file(s) into {args.to}")
    return 0


def cmd_memory(args: argparse.Namespace) -> int:
    from ckptd.cli import memory
    from ckptd.log import configure

    cfg = _load_config(args, required=True)
    configure("json" if args.json else "auto", "info", stream=sys.stderr)  # stdout: the answer
    doc = memory.run(args, cfg)
    if args.json:
        print_json(doc)
    else:
        print(f"fetched {doc['root']} step {doc['step']} of node {doc['node']}: ranks"
              f" {doc['ranks']} from {', '.join(doc['sources'])} into {doc['to']}"
              + ("" if doc["complete"] else " (not every rank: no meta.json written)"))
        for why in doc["skipped"]:
            print(f"  skipped: {why}", file=sys.stderr)
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
        print_json(doc)
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
    if args.json:
        print_json({"path": str(path), "ok": True, "config": cfg.redacted()})
        return 0
    print(f"# {path}: OK ({len(cfg.roots)} root(s))")
    print(render_toml(cfg.redacted()))
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from ckptd.demo import run_demo

    if getattr(args, "config", None) or getattr(args, "socket", None):
        raise UsageError("ckptd demo runs on its own embedded config in ./.demo; --config and"
                         " --socket are not used (start a real daemon with `ckptd run`)")
    if not args.json:
        return run_demo()
    import contextlib

    with contextlib.redirect_stdout(sys.stderr):  # the walk-through is for a person: stderr
        code = run_demo()
    print_json({"demo": "ok" if code == 0 else "failed", "exit_code": code})
    return code


def cmd_doctor(args: argparse.Namespace) -> int:
    from ckptd.cli import doctor

    path = _config_path(args)
    cfg = _load_config(args, required=True)
    checks = doctor.run(cfg, path, Path(args.unit) if args.unit else None,
                        remote=not args.no_remote)
    if args.json:
        print_json({"config": str(path), **doctor.as_json(checks)})
    else:
        print(f"ckptd doctor: config {path}")
        for line in doctor.render(checks):
            print(line)
    return 0 if doctor.as_json(checks)["ok"] else EXIT_NO


def _said(args: argparse.Namespace, doc: dict[str, Any], line: str) -> None:
    """A command's answer: `doc` with --json, else `line`."""
    if args.json:
        print_json(doc)
    else:
        print(line)


def cmd_completion(args: argparse.Namespace) -> int:
    from ckptd.cli.completion import script

    text = script(build_parser(), args.shell)
    if args.json:
        print_json({"shell": args.shell, "script": text})
    else:
        sys.stdout.write(text)
    return 0


def _q(s: str) -> str:
    import urllib.parse

    return urllib.parse.quote(s, safe="")


COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "run": cmd_run, "status": cmd_status, "ls": cmd_ls, "latest": cmd_latest,
    "register": cmd_register, "wait": lambda a: _wait(a, _socket(a)),
    "pin": lambda a: _pin(a, "PUT"), "unpin": lambda a: _pin(a, "DELETE"),
    "hold": cmd_hold, "prune": cmd_prune,
    "restore": cmd_restore, "flush": cmd_flush, "probe": cmd_probe, "memory": cmd_memory,
    "verify": cmd_verify, "config": cmd_config,
    "demo": cmd_demo, "doctor": cmd_doctor, "completion": cmd_completion,
}
