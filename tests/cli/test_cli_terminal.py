"""The command line on a terminal and off it: progress with rate and ETA for restore, wait and
flush on a pty and nothing through a pipe; `status --watch` only on a terminal; a socket that
refuses the user says "permission denied", a missing daemon says it is not running; and the
shell completion script, sourced by a real bash."""

from __future__ import annotations

import grp
import json
import os
import select
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from support.ckpts import save_single
from support.config import write_layout

import ckptd.cli.render  # noqa: F401  (imported before a child drops root: it reads no files then)
from ckptd.cli.main import main
from ckptd.units import progress_line

ENV = {k: v for k, v in os.environ.items() if k not in ("CKPTD_SOCKET", "CKPTD_CONFIG")}
SLOW = {"max_bandwidth": "96KiB/s"}  # ~300 KiB stored: an upload takes seconds to watch


def test_progress_line_has_rate_and_eta() -> None:
    line = progress_line(1024 * 1024, 4 * 1024 * 1024, 2.0)
    assert "25.0%" in line and "1MiB / 4MiB" in line and "512KiB/s" in line and "ETA 6s" in line
    assert progress_line(0, 100, 0.0).endswith("-/s  ETA -")


def _on_pty(argv: list[str], timeout: float = 90,
            prog: tuple[str, ...] = ("-m", "ckptd")) -> tuple[int, str, str]:
    """Run `ckptd ARGV` with stderr on a pty (stdout a pipe): exit code, stdout, what the
    terminal got."""
    master, slave = os.openpty()
    proc = subprocess.Popen([sys.executable, *prog, *argv], stdout=subprocess.PIPE,
                            stderr=slave, env=ENV, text=True)
    os.close(slave)
    seen = b""
    try:
        while True:
            ready = select.select([master], [], [], timeout)[0]
            if not ready:
                raise AssertionError(f"{argv}: no end after {timeout}s; the terminal got {seen!r}")
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: every writer closed the terminal
                break
            if not chunk:
                break
            seen += chunk
        out = proc.stdout.read() if proc.stdout else ""
        return proc.wait(timeout), out, seen.decode(errors="replace")
    finally:
        os.close(master)
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _on_pipe(argv: list[str], prog: tuple[str, ...] = ("-m", "ckptd")) -> tuple[int, str, str]:
    done = subprocess.run([sys.executable, *prog, *argv], capture_output=True, text=True,
                          env=ENV, timeout=90)
    return done.returncode, done.stdout, done.stderr


def _no_progress(err: str) -> None:
    assert "ETA" not in err and "\r" not in err and "/s" not in err, err


def test_wait_flush_and_restore_draw_progress_on_a_terminal_only(
        inproc_daemon: Any, tmp_path: Path) -> None:
    url = f"file://{tmp_path / 'remote'}"
    d = inproc_daemon(roots=[{"name": "r1", "upload": {"url": url, **SLOW}}])
    sock = ["--socket", str(d.socket)]
    # wait --until uploaded
    save_single(d.roots["r1"], 1, n=300)
    code, out, tty = _on_pty(["wait", "r1", "1", "--until", "uploaded", "--timeout", "60", *sock])
    assert code == 0 and "r1 step 1 uploaded" in out, tty
    assert "r1 step 1 " in tty and "/s" in tty and "ETA" in tty and "%" in tty
    save_single(d.roots["r1"], 2, n=300)
    code, out, err = _on_pipe(["wait", "r1", "2", "--until", "uploaded", "--timeout", "60", *sock])
    assert code == 0 and "r1 step 2 uploaded" in out
    _no_progress(err)
    # flush
    save_single(d.roots["r1"], 3, n=300)
    assert d.client.wait("r1", 3, timeout=60)
    code, out, tty = _on_pty(["flush", "--timeout", "60", *sock])
    assert code == 0 and "r1 step 3 uploaded" in out, tty
    assert "r1 step 3 " in tty and "ETA" in tty
    save_single(d.roots["r1"], 4, n=300)
    assert d.client.wait("r1", 4, timeout=60)
    code, out, err = _on_pipe(["flush", "--timeout", "60", *sock])
    assert code == 0 and "r1 step 4 uploaded" in out
    _no_progress(err)
    # restore, on a node that has nothing of the root: from the remote
    node = write_layout(tmp_path / "node", tmp_path / "node.sock",
                        [{"name": "r1", "upload": {"url": url}}])
    cfg = ["--config", str(node.config)]
    code, out, tty = _on_pty(["restore", "r1", "1", "--to", str(tmp_path / "a"), *cfg])
    assert code == 0 and "restored r1 step 1" in out, tty
    assert "100.0%" in tty and "/s" in tty and "ETA" in tty
    code, out, err = _on_pipe(["restore", "r1", "2", "--to", str(tmp_path / "b"), *cfg])
    assert code == 0 and "restored r1 step 2" in out
    _no_progress(err)


LOAD = ("-c", "import sys, torch, ckptd.torch as c; m = torch.nn.Linear(512, 512);"
        " print(c.load(sys.argv[1], model=m, source='remote', remote=sys.argv[2])[0])")


def test_a_remote_load_draws_progress_on_a_terminal_only(tmp_path: Path) -> None:
    import torch
    from support.published import publish

    import ckptd.torch as ckpt
    from ckptd.backends import LocalBackend

    ckpt.save(tmp_path / "r", 3, model=torch.nn.Linear(512, 512), register=False)
    publish(tmp_path / "r", "r", 3, LocalBackend(str(tmp_path / "remote")))
    argv = [str(tmp_path / "elsewhere" / "r"), f"file://{tmp_path / 'remote'}"]
    code, out, tty = _on_pty(argv, prog=LOAD)
    assert code == 0 and out.strip() == "3", tty
    assert "100.0%" in tty and "/s" in tty and "ETA" in tty and "1MiB" in tty
    code, out, err = _on_pipe(argv, prog=LOAD)
    assert code == 0 and out.strip() == "3", err
    _no_progress(err)


def test_status_watch_needs_a_terminal(inproc_daemon: Any,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    d = inproc_daemon()
    assert main(["status", "--watch", "1", "--socket", str(d.socket)]) == 2
    err = capsys.readouterr().err
    assert "--watch" in err and "stdout is not a terminal" not in err and "stdout is not" in err
    code, out, err = _on_pipe(["status", "--watch", "--socket", str(d.socket)])
    assert code == 2 and out == ""
    assert "stdout is not" in err and "ckptd status --json" in err
    # on a terminal it redraws until interrupted
    master, slave = os.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "ckptd", "status", "--watch", "0.2",
                             "--socket", str(d.socket)], stdout=slave, stderr=subprocess.PIPE,
                            env=ENV)
    os.close(slave)
    seen = b""
    try:
        while seen.count(b"\x1b[2J") < 2 and select.select([master], [], [], 30)[0]:
            seen += os.read(master, 65536)
    finally:
        proc.kill()
        proc.wait()
        os.close(master)
    assert seen.count(b"\x1b[2J") >= 2 and b"r1" in seen


def _as_nobody(argv: list[str]) -> dict[str, Any]:
    """`main(argv)` in a forked child that dropped root for nobody: its exit code and stderr."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 1
        try:
            import io
            os.close(r)
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
            err, out = io.StringIO(), io.StringIO()
            sys.stderr, sys.stdout = err, out
            rc = main(argv)
            os.write(w, json.dumps({"code": rc, "err": err.getvalue(),
                                    "out": out.getvalue()}).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    data = b""
    while chunk := os.read(r, 65536):
        data += chunk
    os.close(r)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0 and data, "the child failed"
    return dict(json.loads(data))


def test_a_refused_socket_says_permission_denied(inproc_daemon: Any, short_dir: Path) -> None:
    os.chmod(short_dir, 0o755)  # nobody reaches the socket; the socket's mode refuses it
    d = inproc_daemon(socket_group="adm")
    st = os.stat(d.socket)
    assert st.st_gid == grp.getgrnam("adm").gr_gid and st.st_mode & 0o007 == 0
    got = _as_nobody(["status", "--socket", str(d.socket)])
    assert got["code"] == 69
    assert f"permission denied on {d.socket}: add yourself to group adm" in got["err"]
    assert "is the daemon running?" not in got["err"]
    got = _as_nobody(["status", "--socket", str(d.socket), "--json"])
    error = json.loads(got["out"])["error"]
    assert error["kind"] == "socket_refused" and error["exit_code"] == 69
    assert "permission denied" in error["message"]
    # wait gives up at once: waiting does not make the socket let it in
    got = _as_nobody(["wait", "r1", "1", "--timeout", "600", "--socket", str(d.socket)])
    assert got["code"] == 69 and "permission denied" in got["err"]


def test_no_daemon_still_says_is_it_running(short_dir: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    import socket

    missing = short_dir / "missing.sock"  # ENOENT
    assert main(["status", "--socket", str(missing)]) == 69
    assert "is the daemon running?" in capsys.readouterr().err
    dead = short_dir / "dead.sock"  # a socket file nothing listens on: ECONNREFUSED
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(dead))
    s.close()
    assert main(["status", "--socket", str(dead)]) == 69
    err = capsys.readouterr().err
    assert "is the daemon running?" in err and "permission denied" not in err


def _bash(script: str) -> str:
    done = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60,
                          env={**ENV, "CKPTD": f"{sys.executable} -m ckptd"})
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_bash_completion_from_the_parser() -> None:
    out = _bash("source <($CKPTD completion bash); complete -p ckptd")
    assert out.strip() == "complete -o default -F _ckptd ckptd"
    words = _bash('source <($CKPTD completion bash); COMP_WORDS=(ckptd re); COMP_CWORD=1;'
                  ' _ckptd; echo "${COMPREPLY[*]}"')
    assert words.split() == ["register", "restore"]
    words = _bash('source <($CKPTD completion bash); COMP_WORDS=(ckptd latest r --tier "");'
                  ' COMP_CWORD=4; _ckptd; echo "${COMPREPLY[*]}"')
    assert words.split() == ["any", "local", "remote"]
    words = _bash('source <($CKPTD completion bash); COMP_WORDS=(ckptd --socket /s probe "");'
                  ' COMP_CWORD=4; _ckptd; echo "${COMPREPLY[*]}"')
    assert {"live", "ready", "--timeout", "--json"} <= set(words.split())


@pytest.mark.parametrize("shell", ["zsh", "fish"])
def test_zsh_and_fish_scripts_name_every_command(shell: str,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["completion", shell]) == 0
    text = capsys.readouterr().out
    for command in ("status", "restore", "completion", "wait", "flush"):
        assert command in text
    if shell == "fish":
        assert "complete -c ckptd" in text and "-l json" in text
    else:
        assert text.startswith("#compdef ckptd") and "bashcompinit" in text
    assert main(["completion", "tcsh"]) == 2
