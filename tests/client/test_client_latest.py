"""`Client.latest()` never lets a resume silently start over: None only when the daemon, or
`<root>/.ckptd/latest.json` with no daemon, says the root has no valid checkpoint; when neither
can tell (a wrong socket path, a refused socket, a dead daemon with no readable latest.json)
it raises DaemonUnavailable, `strict` or not. And the client finds the daemon's socket the way
the command line does: explicit > $CKPTD_SOCKET > the config's `[daemon] socket` > default."""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support.ckpts import save_single
from support.wait import wait_until

from ckptd import client as client_mod
from ckptd.client import DEFAULT_SOCKET, Client, ClientError, DaemonUnavailable
from ckptd.config import find_config


@pytest.fixture
def no_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CKPTD_SOCKET", raising=False)
    monkeypatch.delenv("CKPTD_CONFIG", raising=False)


@pytest.fixture
def refused(short_dir: Path) -> Iterator[Path]:
    """A socket file nobody listens on: connecting is refused (a daemon killed with -9
    leaves one)."""
    path = short_dir / "dead.sock"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(path))  # bound, never listening: ECONNREFUSED
    try:
        yield path
    finally:
        s.close()


def write_latest(root: Path, doc: Any) -> Path:
    (root / ".ckptd").mkdir(exist_ok=True)
    target = root / ".ckptd" / "latest.json"
    target.write_bytes(doc if isinstance(doc, bytes) else json.dumps(doc).encode())
    return target


# -- no daemon: latest.json answers, or latest() raises -------------------------------------


@pytest.mark.parametrize("strict", [False, True])
def test_a_refused_socket_and_no_latest_json_raises(refused: Path, tmp_path: Path,
                                                    strict: bool) -> None:
    c = Client(refused, timeout=1, strict=strict)
    with pytest.raises(DaemonUnavailable, match="latest.json: no such file"):
        c.latest("r", root_dir=tmp_path)
    with pytest.raises(DaemonUnavailable, match="no root_dir"):
        c.latest("not-a-directory")


@pytest.mark.parametrize("strict", [False, True])
def test_a_wrong_socket_path_raises(tmp_path: Path, strict: bool) -> None:
    c = Client(tmp_path / "nothing-here.sock", timeout=1, strict=strict)
    with pytest.raises(DaemonUnavailable):
        c.latest("r", root_dir=tmp_path)
    with pytest.raises(DaemonUnavailable):
        c.latest(str(tmp_path))  # root_dir defaults to root when it is a directory


def test_latest_json_answers_for_a_daemon_not_reached(refused: Path, tmp_path: Path) -> None:
    write_latest(tmp_path, {"step": 7, "path": "step-7", "local": "present", "remote": "none"})
    c = Client(refused, timeout=1)
    got = c.latest("r", root_dir=tmp_path)
    assert got is not None and got["step"] == 7 and got["source"] == "latest.json"
    assert c.latest("r", tier="local", root_dir=tmp_path)["step"] == 7  # type: ignore[index]
    with pytest.raises(DaemonUnavailable, match="not in tier 'remote'"):
        c.latest("r", tier="remote", root_dir=tmp_path)  # an older step may be uploaded


def test_a_latest_json_saying_none_is_none(refused: Path, tmp_path: Path) -> None:
    write_latest(tmp_path, {"step": None, "path": None, "updated": "2026-01-01T00:00:00Z"})
    assert Client(refused, timeout=1).latest("r", root_dir=tmp_path) is None
    assert Client(refused, timeout=1, strict=True).latest("r", root_dir=tmp_path) is None


@pytest.mark.parametrize("content", [
    b"", b"{", b"[]", b"null", b'{"path": "step-1"}', b'{"step": "5", "path": "step-5"}',
    b'{"step": -1, "path": "step-1"}', b'{"step": 1.5, "path": "x"}',
    b'{"step": true, "path": "x"}', b'{"step": 9223372036854775808, "path": "x"}',
    b'{"step": 3}', b'{"step": NaN, "path": "x"}', b"\xff\xfe", b"[" * 100_000,
    b'{"step": 1, "path": "x", "pad": "' + b"a" * (64 * 1024) + b'"}',
], ids=lambda c: c[:24].decode("latin-1"))
def test_an_unreadable_latest_json_raises(refused: Path, tmp_path: Path, content: bytes) -> None:
    write_latest(tmp_path, content)
    with pytest.raises(DaemonUnavailable, match=r"latest\.json: (unreadable|not a latest)"):
        Client(refused, timeout=1).latest("r", root_dir=tmp_path)


def test_a_latest_json_that_is_a_link_or_a_fifo_raises(refused: Path, tmp_path: Path) -> None:
    real = tmp_path / "elsewhere.json"
    real.write_text(json.dumps({"step": 5, "path": "step-5"}))
    (tmp_path / ".ckptd").mkdir()
    (tmp_path / ".ckptd" / "latest.json").symlink_to(real)
    c = Client(refused, timeout=1)
    with pytest.raises(DaemonUnavailable, match="unreadable"):
        c.latest("r", root_dir=tmp_path)
    (tmp_path / ".ckptd" / "latest.json").unlink()
    os.mkfifo(tmp_path / ".ckptd" / "latest.json")  # must not block
    with pytest.raises(DaemonUnavailable, match="unreadable"):
        c.latest("r", root_dir=tmp_path)


# -- a real daemon -----------------------------------------------------------------------------


def test_a_dead_daemon_with_and_without_latest_json(inproc_daemon: Any) -> None:
    d = inproc_daemon()
    root = d.roots["r1"]
    assert d.client.latest("r1") is None  # the daemon says: none yet
    save_single(root, 6)
    d.wait_for("r1", 6)
    assert d.client.latest("r1")["step"] == 6
    d.stop()
    c = Client(d.socket, timeout=1)  # the socket is gone with the daemon
    assert c.latest("r1", root_dir=root)["step"] == 6  # type: ignore[index]
    (root / ".ckptd" / "latest.json").unlink()
    with pytest.raises(DaemonUnavailable, match="latest.json: no such file"):
        c.latest("r1", root_dir=root)


def test_an_empty_root_is_none_with_the_daemon_down(inproc_daemon: Any) -> None:
    """The daemon publishes "none yet" for a root with no valid checkpoint (`"step": null`),
    so a trainer that starts while the daemon is down starts at step 0 by the daemon's word,
    not by a guess; and a root whose last step went away says none again."""
    d = inproc_daemon()
    root = d.roots["r1"]
    latest = root / ".ckptd" / "latest.json"
    doc = wait_until(lambda: latest.exists() and json.loads(latest.read_text()),
                     what="latest.json written")
    assert doc["step"] is None and doc["path"] is None
    d.stop()
    assert Client(d.socket, timeout=1).latest("r1", root_dir=root) is None


def test_the_daemon_refusing_the_question_raises(inproc_daemon: Any) -> None:
    """No such root, a bad tier: the daemon cannot say there is none, so neither may latest()."""
    d = inproc_daemon()
    c = Client(d.socket, timeout=5)
    with pytest.raises(ClientError) as err:
        c.latest("no-such-root")
    assert err.value.status == 404 and err.value.code == "no_root"
    with pytest.raises(ClientError) as err:
        c.latest("r1", tier="everywhere")
    assert err.value.status == 400


# -- where the socket is -----------------------------------------------------------------------


def test_the_socket_comes_from_the_daemons_config(inproc_daemon: Any, no_env: None,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    d = inproc_daemon()
    save_single(d.roots["r1"], 3)
    d.wait_for("r1", 3)
    monkeypatch.setenv("CKPTD_CONFIG", str(d.config))
    c = Client()
    assert c.socket == str(d.socket)
    assert c.latest("r1")["step"] == 3  # type: ignore[index]
    monkeypatch.setenv("CKPTD_SOCKET", "/run/elsewhere.sock")
    assert Client().socket == "/run/elsewhere.sock"  # $CKPTD_SOCKET before the config
    assert Client(socket="/x/given.sock").socket == "/x/given.sock"  # explicit before both


def test_a_relative_socket_counts_from_the_configs_directory(tmp_path: Path, no_env: None,
                                                            monkeypatch: pytest.MonkeyPatch
                                                            ) -> None:
    conf = tmp_path / "etc" / "ckptd.toml"
    conf.parent.mkdir()
    conf.write_text('[daemon]\nsocket = "run/../ckptd.sock"\nworkers = 2\n\n[[roots]]\n'
                    'name = "a"\npath = "/data/a"\n')
    monkeypatch.setenv("CKPTD_CONFIG", str(conf))
    assert Client().socket == str(tmp_path / "etc" / "ckptd.sock")


@pytest.mark.parametrize("content", [
    b"", b"[daemon]\nworkers = 2\n", b"not toml [", b"[daemon]\nsocket = 5\n",
    b'[daemon]\nsocket = ""\n', b"daemon = 3\n", b"\xff", b'[daemon]\nsocket = "/' +
    b"a" * 200 + b'"\n', b"x = 1\n" + b"#" * (1024 * 1024),
], ids=lambda c: c[:16].decode("latin-1"))
def test_a_config_without_a_usable_socket_gives_the_default(tmp_path: Path, no_env: None,
                                                            monkeypatch: pytest.MonkeyPatch,
                                                            content: bytes) -> None:
    conf = tmp_path / "ckptd.toml"
    conf.write_bytes(content)
    monkeypatch.setenv("CKPTD_CONFIG", str(conf))
    assert Client().socket == DEFAULT_SOCKET


def test_no_config_gives_the_default(tmp_path: Path, no_env: None,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    if os.path.isfile(client_mod.DEFAULT_CONFIG):
        pytest.skip("this machine has /etc/ckptd/ckptd.toml")
    assert Client().socket == DEFAULT_SOCKET
    monkeypatch.setenv("CKPTD_CONFIG", str(tmp_path / "missing.toml"))
    assert Client().socket == DEFAULT_SOCKET


def test_the_client_finds_the_config_the_daemon_finds(tmp_path: Path, no_env: None,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The client mirrors `ckptd.config.find_config` (it may import nothing of ckptd)."""
    monkeypatch.chdir(tmp_path)
    found = find_config()
    assert client_mod.config_path() == (None if found is None else str(found))
    (tmp_path / "ckptd.toml").write_text('[daemon]\nsocket = "here.sock"\n')
    found = find_config()
    assert found is not None and client_mod.config_path() == str(found)
    monkeypatch.setenv("CKPTD_CONFIG", str(tmp_path / "other.toml"))
    assert client_mod.config_path() == str(find_config()) == str(tmp_path / "other.toml")
