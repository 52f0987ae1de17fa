"""The `ckptd` argument parser: every command, its options, help and examples. Parses only;
running a command is `cli.main`'s (usage errors are raised as UsageError, exit 2 there)."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from ckptd import build_info
from ckptd.errors import BadValue, UsageError


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # usage errors exit 2 with a clear line
        self.print_usage(sys.stderr)
        raise UsageError(f"{self.prog}: {message}")


class _Version(argparse.Action):
    """`--version`: the version, Python, the platform and torch (or its absence), each on a
    line, for a bug report; worked out only when asked."""

    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS,
                 default: str = argparse.SUPPRESS, help: str | None = None) -> None:  # noqa: A002
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        print(build_info())
        parser.exit()


def _common() -> _Parser:
    """--socket/--config/--json accepted by every command, before or after its own arguments."""
    p = _Parser(add_help=False)
    p.add_argument("--json", action="store_true", default=argparse.SUPPRESS,
                   help="print one JSON document on stdout (an error too: {\"error\": {...}})")
    p.add_argument("--socket", default=argparse.SUPPRESS, help="daemon socket path")
    p.add_argument("--config", default=argparse.SUPPRESS, help="config file (TOML)")
    return p


_EXAMPLES = """examples:
  ckptd demo                                   the whole pipeline on a toy run, in ./.demo
  ckptd run --config /etc/ckptd/ckptd.toml     the daemon (what systemd runs)
  ckptd status                                 health and each root's latest, queue, errors
  ckptd ls llm-7b                              every checkpoint of a root
  ckptd latest llm-7b --tier remote            the newest step safe in object storage
  ckptd register llm-7b 1200 --metric val_loss=1.93
  ckptd pin llm-7b 1200                        never prune step 1200
  ckptd hold llm-7b 1200 --owner job7          keep step 1200 while job7 reads it
  ckptd prune llm-7b --dry-run                 what retention would keep and delete, and why
  ckptd verify /data/ckpt/llm-7b/step-1200     offline check of one checkpoint
  ckptd restore llm-7b latest --to /scratch/resume
  ckptd doctor                                 check the setup; each problem with its fix
  ckptd flush --timeout 240                    upload each root's newest step first, wait
  ckptd probe ready                            exit 0 when the daemon serves (for probes)
exit codes: 0 ok, 1 no/invalid, 2 usage, 69 daemon unreachable or unable to do it now,
75 state dir locked, 78 bad config or environment (docs/CLI.md)."""

_COMMAND_EXAMPLES = {
    "memory": "  ckptd memory fetch llm-7b 1200 --node n3 --to /scratch/n3-state",
    "run": "  ckptd run --config /etc/ckptd/ckptd.toml\n"
           "  ckptd run --config ./ckptd.toml --socket /tmp/ckptd-test.sock",
    "status": "  ckptd status\n  ckptd status --watch 5\n  ckptd status --json | jq .roots",
    "ls": "  ckptd ls llm-7b\n  ckptd ls llm-7b --json | jq '.checkpoints[] | {step, state}'",
    "latest": "  ckptd latest llm-7b\n  ckptd latest llm-7b --tier remote --json\n"
              "exit 1 when the root has no valid checkpoint.",
    "register": "  ckptd register llm-7b 1200\n"
                "  ckptd register llm-7b 1200 --path ckpt/1200/model.pt --metric val_loss=1.93",
    "pin": "  ckptd pin llm-7b 1200",
    "wait": "  ckptd wait llm-7b 1200\n  ckptd wait llm-7b 1200 --until uploaded --timeout 900"
            "   (a job script before it exits)\nexit 0 when reached, 1 on timeout or when the"
            " step became invalid.",
    "unpin": "  ckptd unpin llm-7b 1200",
    "hold": "  ckptd hold llm-7b 1200 --owner job7 --ttl 3600   (before a copy or a restore)\n"
            "  ckptd hold llm-7b 1200 --owner job7 --release   (after it)\n"
            "the same owner again renews the hold; it ends by itself after --ttl seconds.",
    "prune": "  ckptd prune llm-7b --dry-run\n  ckptd prune llm-7b --apply"
             "   (also deletes adopted checkpoints the rules do not keep)",
    "restore": "  ckptd restore llm-7b latest --to /scratch/resume\n"
               "  ckptd restore llm-7b 1200 --to ./step-1200 --config ./ckptd.toml",
    "verify": "  ckptd verify /data/ckpt/llm-7b/step-1200\n"
              "  ckptd verify model_step_1200.pt --deep --json",
    "config": "  ckptd config check /etc/ckptd/ckptd.toml",
    "demo": "  ckptd demo   (or `make demo` from the repository)",
    "flush": "  ckptd flush --timeout 240   (a preStop hook, or before a node is released)\n"
             "  ckptd flush --no-wait\nexit 0 when every flushed step is uploaded (or none"
             " needed it), 1 when one is not\n(its upload failed, it became invalid, or the"
             " time ran out), 69 daemon unreachable or stopping.",
    "probe": "  ckptd probe live    (liveness: restart the daemon when this fails)\n"
             "  ckptd probe ready   (readiness and start-up)\nexit 0 yes, 1 the daemon"
             " answered no (the reason on stderr), 69 no answer within --timeout.",
    "completion": "  source <(ckptd completion bash)        (in ~/.bashrc)\n"
                  "  ckptd completion zsh > \"${fpath[1]}/_ckptd\"\n"
                  "  ckptd completion fish > ~/.config/fish/completions/ckptd.fish",
    "doctor": "  ckptd doctor\n  ckptd doctor --config ./ckptd.toml --no-remote\n"
              "exit 0 when no problem was found, 1 otherwise.",
}


def build_parser() -> argparse.ArgumentParser:
    common = _common()
    p = _Parser(prog="ckptd", parents=[common],
                description="Checkpoint daemon for ML training: finds complete checkpoints,"
                            " validates, compresses, uploads and prunes them.",
                epilog=_EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action=_Version,
                   help="print the version, Python, the platform and torch's version, and exit")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    def cmd(name: str, help: str) -> argparse.ArgumentParser:  # noqa: A002
        example = _COMMAND_EXAMPLES.get(name, "")
        return sub.add_parser(name, help=help, parents=[common], description=help,
                              epilog=f"examples:\n{example}" if example else None,
                              formatter_class=argparse.RawDescriptionHelpFormatter)

    cmd("run", "run the daemon in the foreground")
    s = cmd("status", "daemon health and per-root summary")
    s.add_argument("--watch", nargs="?", const=2.0, type=float, metavar="SECONDS",
                   help="refresh every SECONDS (default 2) until interrupted")
    s = cmd("ls", "every checkpoint of a root")
    s.add_argument("root")
    s = cmd("latest", "the latest valid checkpoint of a root")
    s.add_argument("root")
    s.add_argument("--tier", choices=["any", "local", "remote"], default="any")
    s = cmd("wait", "wait until a step is valid (or uploaded); waits for the daemon to come up"
                    " too")
    s.add_argument("root")
    s.add_argument("step", type=_nonneg_int)
    s.add_argument("--until", choices=["valid", "uploaded"], default="valid")
    s.add_argument("--timeout", type=float, default=600.0, metavar="SECONDS",
                   help="give up after this long (default 600); exit 1")
    s = cmd("flush", "preemption: upload each uploading root's newest valid step before other"
                     " work, and wait until it is uploaded")
    s.add_argument("--timeout", type=float, default=600.0, metavar="SECONDS",
                   help="stop waiting after this long (default 600); exit 1")
    s.add_argument("--no-wait", action="store_true", help="ask for the flush and return")
    s = cmd("probe", "one health check for a liveness or readiness probe (exit 0 yes, 1 no,"
                     " 69 no answer)")
    s.add_argument("kind", choices=["live", "ready"],
                   help="live: the daemon makes progress (restart it otherwise); ready: it"
                        " answers and serves its roots")
    s.add_argument("--timeout", type=float, default=5.0, metavar="SECONDS",
                   help="how long to wait for the answer (default 5)")
    s = cmd("register", "tell the daemon a save finished")
    s.add_argument("root")
    s.add_argument("step", type=_nonneg_int)
    s.add_argument("--path", action="append", default=[], dest="paths")
    s.add_argument("--metric", action="append", default=[], dest="metrics", type=_metric)
    for name in ("pin", "unpin"):
        s = cmd(name, f"{name} a checkpoint (pinned ones are never pruned)")
        s.add_argument("root")
        s.add_argument("step", type=_nonneg_int)
    s = cmd("hold", "a reader's hold: retention never deletes the step while it lasts")
    s.add_argument("root")
    s.add_argument("step", type=_nonneg_int)
    s.add_argument("--owner", default=f"ckptd-cli-{os.getpid()}",
                   help="whose hold (give the same to renew or --release it)")
    s.add_argument("--ttl", type=float, default=600.0, metavar="SECONDS",
                   help="how long it lasts unless renewed (1 to 86400; default 600)")
    s.add_argument("--release", action="store_true", help="end the owner's hold now")
    s = cmd("prune", "the retention plan (--dry-run), or run retention now")
    s.add_argument("root")
    s.add_argument("--dry-run", action="store_true", help="print the plan; delete nothing")
    s.add_argument("--apply", action="store_true",
                   help="run the plan once now, adopted checkpoints included (the default"
                        " without --dry-run)")
    s = cmd("restore", "rebuild a checkpoint's original files from its local compressed copy"
                       " or the remote (no daemon needed)")
    s.add_argument("root")
    s.add_argument("step", nargs="?", default="latest", help="a step number, or latest")
    s.add_argument("--to", required=True, help="directory to write the original files into")
    which = s.add_mutually_exclusive_group()
    which.add_argument("--all", action="store_true",
                       help="multi-node root: the whole checkpoint in one directory")
    which.add_argument("--node", metavar="ID",
                       help="multi-node root: node ID's files and the commit record"
                            " (default: this node's)")
    s = cmd("memory", "restoring from memory (docs/MEMORY.md)")
    msub = s.add_subparsers(dest="memory_command", required=True, parser_class=_Parser)
    m = msub.add_parser("fetch", parents=[common],
                        help="fetch one node's state of a step back from the peers that hold"
                             " it, as a replaced node does, and write its files")
    m.add_argument("root")
    m.add_argument("step", type=_nonneg_int)
    m.add_argument("--node", required=True, metavar="ID", help="whose state (its daemon.node)")
    m.add_argument("--to", required=True, help="directory to write step-<STEP>/ into")
    s = cmd("verify", "validate one checkpoint offline (no daemon needed)")
    s.add_argument("path")
    s.add_argument("--deep", action="store_true", help="also load tensors and scan for NaN/Inf")
    s.add_argument("--trust", action="append", default=[], metavar="MODULE.NAME",
                   help="accept this global in pickles (like a root's trusted_globals)")
    s = cmd("config", "configuration commands")
    csub = s.add_subparsers(dest="config_command", required=True, parser_class=_Parser)
    c = csub.add_parser("check", help="validate a config and print the effective config",
                        parents=[common])
    c.add_argument("path", nargs="?")
    cmd("demo", "run a self-contained demo in ./.demo")
    s = cmd("doctor", "check the setup (dirs, roots, space, remote, the unit's sandbox) and say"
                      " how to fix each problem")
    s.add_argument("--unit", metavar="PATH", help="the systemd unit to check (default: the"
                   " installed ckptd.service, with its drop-ins)")
    s.add_argument("--no-remote", action="store_true", help="skip the remote probe")
    s = cmd("completion", "print a shell completion script for ckptd")
    s.add_argument("shell", choices=["bash", "zsh", "fish"])
    return p


def _nonneg_int(text: str) -> int:
    if not (text.isascii() and text.isdigit()) or len(text) > 19 or int(text) >= 2**63:
        raise argparse.ArgumentTypeError(f"must be an integer from 0 to 2^63-1, got {text!r}")
    return int(text)


def _metric(text: str) -> tuple[str, float]:
    key, sep, value = text.partition("=")
    try:
        if not sep or not key:
            raise BadValue
        return key, float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"metrics are KEY=NUMBER, got {text!r}") from None
