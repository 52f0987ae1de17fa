"""`--json` on every command: the parser's commands are walked and each one is run with
`--json` against a real daemon (a file:// remote, an uploaded step), its stdout parsed as JSON;
an error with `--json` is one `{"error": {...}}` object on stdout with the exit code it has
without `--json`."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from support.ckpts import save_single
from support.config import write_layout
from support.wait import wait_until

from ckptd.cli.main import COMMANDS, main
from ckptd.cli.parser import build_parser
from ckptd.client import Client, ClientError


def _commands() -> list[str]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sorted(sub.choices)


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, Any, str]:
    code = main(argv)
    out = capsys.readouterr()
    try:
        return code, json.loads(out.out), out.err
    except json.JSONDecodeError:
        raise AssertionError(f"{argv}: stdout is not one JSON document:\n{out.out!r}") from None


def _argvs(d: Any, tmp_path: Path, saved: Path) -> dict[str, list[str]]:
    sock, cfg = ["--socket", str(d.socket)], ["--config", str(d.config)]
    extra = d.roots["r1"] / "extra.bin"
    extra.write_bytes(b"x" * 10)
    return {
        "status": ["status", *sock],
        "ls": ["ls", "r1", *sock],
        "latest": ["latest", "r1", *sock],
        "register": ["register", "r1", "7", "--path", str(extra), *sock],
        "wait": ["wait", "r1", "1", "--until", "uploaded", "--timeout", "30", *sock],
        "flush": ["flush", "--timeout", "30", *sock],
        "probe": ["probe", "ready", *sock],
        "pin": ["pin", "r1", "1", *sock],
        "unpin": ["unpin", "r1", "1", *sock],
        "hold": ["hold", "r1", "1", "--owner", "json-test", "--ttl", "60", *sock],
        "prune": ["prune", "r1", "--dry-run", *sock],
        "restore": ["restore", "r1", "1", "--to", str(tmp_path / "restored"), *cfg],
        "verify": ["verify", str(saved)],
        "config": ["config", "check", str(d.config)],
        "doctor": ["doctor", "--no-remote", *cfg],
        "completion": ["completion", "bash"],
        # the daemon and the demo: each in its own test below
    }


def test_every_command_answers_json(inproc_daemon: Any, tmp_path: Path,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    d = inproc_daemon(roots=[{"name": "r1", "upload": {"url": f"file://{tmp_path / 'remote'}"}}])
    saved = save_single(d.roots["r1"], 1)
    assert d.client.wait("r1", 1, until="uploaded", timeout=60)
    argvs = _argvs(d, tmp_path, saved)
    # run and demo: each in its own test; memory fetch: tests/memory/test_memory_peers.py
    assert set(_commands()) == set(argvs) | {"run", "demo", "memory"} == set(COMMANDS)
    docs = {}
    for name, argv in argvs.items():
        code, doc, err = _run([*argv, "--json"], capsys)
        assert code in (0, 1), (name, code, err)  # doctor: 1 when it found a problem
        assert isinstance(doc, dict) and "error" not in doc, (name, doc)
        docs[name] = doc
    assert docs["latest"]["step"] == 1 and docs["wait"]["reached"] is True
    assert docs["pin"] == {"root": "r1", "step": 1, "pinned": True}
    assert docs["unpin"]["pinned"] is False and docs["hold"]["held"] is True
    assert docs["register"]["registered"] is True and docs["probe"]["ok"] is True
    assert docs["restore"]["step"] == 1 and docs["verify"]["valid"] is True
    assert docs["config"]["ok"] is True and docs["config"]["config"]["roots"][0]["name"] == "r1"
    assert docs["completion"]["shell"] == "bash" and "complete -" in docs["completion"]["script"]
    # --json is accepted before the command too
    code, doc, _ = _run(["--json", "status", "--socket", str(d.socket)], capsys)
    assert code == 0 and doc["status"] in ("ok", "degraded")


ERRORS = [  # (argv, exit code, kind)
    (["pin", "r1", "not-a-step"], 2, "usage"),
    (["no-such-command"], 2, "usage"),
    (["wait", "r1", "1", "--timeout", "-1"], 2, "usage"),
    (["ls", "no-such-root"], 1, "not_found"),
    (["status", "--socket", "/tmp/ckd-no-such-dir/ckptd.sock"], 69, "daemon_unreachable"),
]


@pytest.mark.parametrize(("argv", "code", "kind"), ERRORS, ids=[" ".join(a) for a, _, _ in ERRORS])
def test_an_error_is_one_json_object_with_the_same_exit_code(
        inproc_daemon: Any, argv: list[str], code: int, kind: str,
        capsys: pytest.CaptureFixture[str]) -> None:
    d = inproc_daemon()
    argv = [*argv, "--socket", str(d.socket)] if "--socket" not in argv else argv
    assert main(argv) == code
    plain = capsys.readouterr()
    assert plain.out == ""
    got, doc, err = _run([*argv, "--json"], capsys)
    assert got == code
    assert set(doc) == {"error"} and set(doc["error"]) == {"message", "kind", "exit_code"}
    assert doc["error"]["exit_code"] == code and doc["error"]["kind"] == kind
    assert doc["error"]["message"] and err  # the person's line is still on stderr


def test_a_bad_config_is_a_json_error_too(tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "ckptd.toml"
    bad.write_text("[daemon]\nno_such_key = 1\n")
    code, doc, _ = _run(["config", "check", str(bad), "--json"], capsys)
    assert code == 78 and doc["error"]["exit_code"] == 78 and doc["error"]["kind"] == "config"
    assert "no_such_key" in doc["error"]["message"]


def test_demo_with_json_is_json(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    # the demo trains a model for minutes; its refusal of --config is the answer looked at here
    code, doc, _ = _run(["demo", "--json", "--config", str(tmp_path / "x.toml")], capsys)
    assert code == 2 and doc["error"]["kind"] == "usage"


def _answers(sock: Path) -> bool:
    try:
        return bool(Client(sock, timeout=2.0, strict=True).request_json("GET", "/v1/status"))
    except ClientError:
        return False


def test_run_with_json_logs_json_lines(tmp_path: Path, short_dir: Path) -> None:
    layout = write_layout(tmp_path, short_dir / "ckptd.sock", log_format="console")
    env = {k: v for k, v in os.environ.items() if k not in ("CKPTD_SOCKET", "CKPTD_CONFIG")}
    proc = subprocess.Popen([sys.executable, "-m", "ckptd", "run", "--json", "--config",
                             str(layout.config)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    try:
        wait_until(lambda: proc.poll() is not None or _answers(layout.socket), 60,
                   "the daemon answering")
    finally:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    lines = [line for line in out.splitlines() if line.strip()]
    assert lines, err
    events = [json.loads(line) for line in lines]  # console format asked for; --json wins
    assert all(isinstance(e, dict) and "event" in e for e in events)
