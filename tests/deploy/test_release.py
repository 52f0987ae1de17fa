"""The release as a user gets it: the wheel built from this tree (`python -m build`, as
`make dist` does), installed by pip into a fresh virtualenv whose dependencies come from the
package index as `pip install ckptd` gets them, and no torch there. In it the command line, the
client and a real `ckptd run` work (a torch file validated, compressed and uploaded to a
`file://` remote), and each feature that needs torch says so in one line.

The wheel and the virtualenv are made once for the whole run: under xdist the first worker to
need them makes them in the workers' shared temp dir while the other waits (pip's cache makes a
rerun quick; the first run fills it).
"""

from __future__ import annotations

import copy
import fcntl
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import tomllib
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from support.proc import parse_events
from support.wait import wait_until

import ckptd

ROOT = Path(__file__).resolve().parents[2]
# What the sdist holds beside the package (MANIFEST.in), copied so the build never writes into
# the checkout (no build/ or egg-info left to mix into a later wheel).
SOURCES = ("ckptd", "pyproject.toml", "README.md", "MANIFEST.in", "CHANGELOG.md", "LICENSE",
           "config.example.toml", "systemd", "deploy/ckptd.toml")
TORCH_LINE = "ModuleNotFoundError: {} needs PyTorch: pip install 'ckptd[torch]'"
INSTALL_S = 600.0  # a first run downloads the dependencies into pip's cache

pytestmark = pytest.mark.slow


@dataclass(frozen=True)
class Slim:
    """The built wheel and the fresh virtualenv it is installed into."""

    wheel: Path
    venv: Path

    def bin(self, name: str) -> str:
        return str(self.venv / "bin" / name)


def _env() -> dict[str, str]:
    """The test's environment without what would point the slim install at this checkout or
    at another daemon."""
    drop = {"PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "CKPTD_CONFIG", "CKPTD_SOCKET"}
    return {k: v for k, v in os.environ.items() if k not in drop}


def _run(argv: list[str], cwd: Path, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, cwd=cwd, env=_env(), capture_output=True, text=True,
                          timeout=timeout, check=False)


def _checked(argv: list[str], cwd: Path, timeout: float) -> str:
    done = _run(argv, cwd, timeout)
    assert done.returncode == 0, f"{argv} exited {done.returncode}:\n{done.stdout}{done.stderr}"
    return done.stdout


def _torch_file(root: Path, step: int) -> Path:
    """A plain `torch.save` file of the `single` layout, written by this process's torch."""
    import torch

    path = root / f"model_step_{step}.pt"
    torch.save({"w": torch.arange(64.0).reshape(8, 8), "step": step}, path)
    return path


def _make(base: Path) -> None:
    src, dist, venv = base / "src", base / "dist", base / "venv"
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info")
    src.mkdir(parents=True)
    for name in SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name, ignore=ignore)
        else:
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, src / name)
    _checked([sys.executable, "-m", "build", "--wheel", "--outdir", str(dist), str(src)],
             base, INSTALL_S)
    # A bare venv, and this environment's pip installing into it: the same install as the
    # venv's own pip would do, without seconds of bootstrapping pip into it first.
    _checked([sys.executable, "-m", "venv", "--without-pip", str(venv)], base, 60)
    wheel, = dist.glob("ckptd-*.whl")
    _checked([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install",
              "--quiet", str(wheel)], base, INSTALL_S)


@pytest.fixture(scope="module")
def slim(tmp_path_factory: pytest.TempPathFactory, worker_id: str) -> Slim:
    shared = tmp_path_factory.getbasetemp()
    if worker_id != "master":
        shared = shared.parent
    base = shared / "slim-install"
    with open(shared / "slim-install.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (base / "done").exists():
            shutil.rmtree(base, ignore_errors=True)
            _make(base)
            (base / "done").touch()
    wheel, = (base / "dist").glob("ckptd-*.whl")
    return Slim(wheel, base / "venv")


def test_the_wheel_holds_every_module_and_needs_no_torch(slim: Slim) -> None:
    # A platform wheel: it carries the compiled plane kernels (ckptd/codec/_planes.c).
    assert slim.wheel.name.startswith(f"ckptd-{ckptd.__version__}-cp3")
    with zipfile.ZipFile(slim.wheel) as whl:
        names = set(whl.namelist())
        meta = whl.read(f"ckptd-{ckptd.__version__}.dist-info/METADATA").decode()
        scripts = whl.read(f"ckptd-{ckptd.__version__}.dist-info/entry_points.txt").decode()
    assert any(n.startswith("ckptd/codec/_planes.") and n.endswith(".so") for n in names)
    package = {str(p.relative_to(ROOT)) for p in (ROOT / "ckptd").rglob("*")
               if p.is_file() and "__pycache__" not in p.parts}
    assert package - names == set(), "files of ckptd/ missing from the wheel"
    assert f"Version: {ckptd.__version__}" in meta.splitlines()
    requires = [line for line in meta.splitlines() if line.startswith("Requires-Dist: ")]
    torch_req = [r for r in requires if re.match(r"Requires-Dist: torch\b", r)]
    assert torch_req == ['Requires-Dist: torch<3,>=2.3; extra == "torch"'], requires
    assert "ckptd = ckptd.cli.main:main" in scripts


def test_the_slim_install_has_no_torch_and_says_what_needs_it(slim: Slim,
                                                               tmp_path: Path) -> None:
    py = slim.bin("python")
    no_torch = _run([py, "-c", "import torch"], tmp_path)
    assert no_torch.returncode == 1
    assert "No module named 'torch'" in no_torch.stderr
    # The installed package, not this checkout; the daemon's side imports with no torch.
    where = _checked([py, "-c", "import sys, ckptd, ckptd.client, ckptd.cli.main, ckptd.daemon;"
                      " print(ckptd.__file__); print(sorted(m for m in sys.modules"
                      " if m.split('.')[0] == 'torch'))"], tmp_path, 60).splitlines()
    assert Path(where[0]).is_relative_to(slim.venv), where
    assert where[1] == "[]"
    for module in ("ckptd.torch", "ckptd.dcp"):
        done = _run([py, "-c", f"import {module}"], tmp_path)
        assert done.returncode == 1
        assert done.stderr.splitlines()[-1] == TORCH_LINE.format(module), done.stderr
    # The deep check's child, were torch gone from under a running daemon: the job fails
    # with this line (retried later); the checkpoint is not called invalid for it.
    done = _run([py, "-m", "ckptd.stages.deep.deepscan", "0", "model.pt"], tmp_path)
    assert (done.returncode, done.stdout) == (1, "")
    assert done.stderr == "deep_validate needs PyTorch: pip install 'ckptd[torch]'\n"


def test_version_names_python_the_platform_and_torchs_absence(slim: Slim,
                                                               tmp_path: Path) -> None:
    lines = _checked([slim.bin("ckptd"), "--version"], tmp_path, 30).splitlines()
    assert lines[0] == f"ckptd {ckptd.__version__}"
    assert re.fullmatch(r"python 3\.\d+\.\d+ \(CPython, .*\)", lines[1]), lines
    assert lines[2].startswith("platform Linux-"), lines
    assert lines[3] == ("torch not installed: deep_validate, ckptd.torch, ckptd.dcp and"
                        " ckptd demo need it (pip install 'ckptd[torch]')"), lines
    assert len(lines) == 4


def test_version_with_torch_names_its_version(capsys: pytest.CaptureFixture[str]) -> None:
    """This environment's (torch installed): the version pip installed, torch never imported
    for it."""
    import importlib.metadata

    from ckptd.cli.main import main

    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"ckptd {ckptd.__version__}"
    assert lines[3] == f"torch {importlib.metadata.version('torch')}"


def test_the_changelog_names_this_version_as_the_newest_release() -> None:
    """The wheel built from this tree is `ckptd.__version__`: the changelog's newest release
    section is that version, and everything since is under an Unreleased heading on top."""
    text = (ROOT / "CHANGELOG.md").read_text()
    headings = re.findall(r"^## \[([^]]+)\](.*)$", text, re.MULTILINE)
    assert headings[0] == ("Unreleased", ""), headings
    assert headings[1][0] == ckptd.__version__, headings
    assert re.fullmatch(r" - \d{4}-\d{2}-\d{2}", headings[1][1]), headings
    assert [h for h, _ in headings].count(ckptd.__version__) == 1, headings


def test_config_check_and_the_torch_features_of_the_command_line(slim: Slim,
                                                                 tmp_path: Path) -> None:
    ckptd_bin = slim.bin("ckptd")
    example = tmp_path / "ckptd.toml"  # relative paths count from here: all under tmp_path
    shutil.copy(ROOT / "config.example.toml", example)
    out = _checked([ckptd_bin, "config", "check", str(example)], tmp_path, 30)
    assert out.startswith(f"# {example}: OK (2 root(s))")
    assert f'state_dir = "{tmp_path / ".demo" / "state"}"' in out

    deep = tmp_path / "deep.toml"
    deep.write_text(example.read_text().replace("deep_validate = false", "deep_validate = true"))
    line = ("roots[{}].deep_validate = true needs PyTorch: pip install 'ckptd[torch]'")
    for argv in ([ckptd_bin, "config", "check", str(deep)],
                 [ckptd_bin, "run", "--config", str(deep)]):
        done = _run(argv, tmp_path)
        assert done.returncode == 78, done.stderr
        assert done.stderr.splitlines() == [f"ckptd: {deep}: 2 problems:",
                                            f"  {line.format(0)}", f"  {line.format(1)}"]
    assert not (tmp_path / ".demo").exists(), "a refused `ckptd run` created its dirs"

    ckpt = _torch_file(tmp_path, 5)
    for argv, what in (([ckptd_bin, "verify", str(ckpt), "--deep"], "verify --deep"),
                       ([ckptd_bin, "demo"], "demo")):
        done = _run(argv, tmp_path)
        assert (done.returncode, done.stdout) == (2, ""), done.stderr
        assert done.stderr == f"ckptd {what} needs PyTorch: pip install 'ckptd[torch]'\n"
    out = _checked([ckptd_bin, "verify", str(ckpt)], tmp_path, 30)
    assert out.startswith(f"{ckpt}: single step 5: valid"), out


def test_the_server_config_checks_as_installed_and_matches_the_unit(slim: Slim,
                                                                    tmp_path: Path) -> None:
    """deploy/ckptd.toml, the config for /etc/ckptd/ckptd.toml: the installed `ckptd config
    check` accepts it as is, and its state directory and socket are where the systemd unit's
    StateDirectory= and RuntimeDirectory= put them."""
    server = ROOT / "deploy" / "ckptd.toml"
    out = _checked([slim.bin("ckptd"), "config", "check", str(server)], tmp_path, 30)
    assert out.startswith(f"# {server}: OK (1 root(s))"), out
    parsed = tomllib.loads(server.read_text())
    unit = (ROOT / "systemd" / "ckptd.service").read_text()
    state = re.search(r"^StateDirectory=(\S+)$", unit, re.M)
    runtime = re.search(r"^RuntimeDirectory=(\S+)$", unit, re.M)
    assert state and runtime
    assert parsed["daemon"]["state_dir"] == f"/var/lib/{state[1]}"
    assert Path(parsed["daemon"]["socket"]).parent == Path(f"/run/{runtime[1]}")
    assert parsed["metrics"]["listen"].startswith("127.0.0.1:")  # no open port by default
    assert not any(k in parsed["defaults"]["upload"] for k in
                   ("access_key_id", "secret_access_key")), "credentials belong elsewhere"


def _example_moved(base: Path, sock: Path) -> tuple[Path, dict[str, Any]]:
    """config.example.toml as shipped, with only its paths moved: each `.demo/...` path to
    `base/.demo/...` (absolute), the socket to `sock` (a short path: at most 107 bytes) and the
    `file:` remote to a `file://` URL under `base`. Every other line, comments and values, is the
    example's own; the rewritten file and its parsed form are returned."""
    text = (ROOT / "config.example.toml").read_text()
    example = tomllib.loads(text)

    def moved(value: str) -> str:
        if value.startswith("file:"):
            rel = value.removeprefix("file:")
            assert rel.startswith(".demo/"), value
            return f"file://{base / rel}"
        assert value.startswith(".demo/"), value
        return str(sock) if value == example["daemon"]["socket"] else str(base / value)

    # Every path the example holds (a root's own upload.url too, were there one).
    paths = [example["daemon"]["state_dir"], example["daemon"]["socket"],
             example["defaults"]["upload"]["url"]]
    paths += [r["path"] for r in example["roots"]]
    paths += [r["upload"]["url"] for r in example["roots"] if "url" in r.get("upload", {})]
    for value in paths:
        quoted = f'= "{value}"\n'
        assert text.count(quoted) == 1, f"{value!r} is not one plain value of the example"
        text = text.replace(quoted, f'= "{moved(value)}"\n')
    config = base / "ckptd.toml"
    config.write_text(text)
    parsed = tomllib.loads(text)
    # Nothing but the paths changed.
    expect = copy.deepcopy(example)
    for keys in (("daemon", "state_dir"), ("daemon", "socket"), ("defaults", "upload", "url")):
        table = expect
        for key in keys[:-1]:
            table = table[key]
        table[keys[-1]] = moved(table[keys[-1]])
    for root in expect["roots"]:
        root["path"] = moved(root["path"])
        if "url" in root.get("upload", {}):
            root["upload"]["url"] = moved(root["upload"]["url"])
    assert parsed == expect
    assert ".demo" not in json.dumps(parsed).replace(
        str(base / ".demo"), ""), "a path of the example was left relative"
    return config, parsed


def test_the_slim_daemon_runs_the_example_config(slim: Slim, tmp_path: Path,
                                                 short_dir: Path) -> None:
    """`ckptd run` on config.example.toml itself (its paths moved under tmp_path): it answers
    `status` and `probe ready` through the example's socket setting, uploads a torch file
    dropped into the example's `demo-single` root to the example's file remote, refuses a reload
    that asks for deep_validate, and stops on SIGTERM."""
    ckptd_bin = slim.bin("ckptd")
    config, example = _example_moved(tmp_path, short_dir / "ckptd.sock")
    roots = {r["name"]: Path(r["path"]) for r in example["roots"]}
    assert list(roots) == ["demo", "demo-single"]
    remote = Path(example["defaults"]["upload"]["url"].removeprefix("file://"))
    socket = Path(example["daemon"]["socket"])
    cfg = ["--config", str(config)]  # the clients find the socket through the config
    for path in roots.values():  # the daemon watches roots; it does not make them
        path.mkdir(parents=True)
    log = tmp_path / "daemon.log"
    with open(log, "wb") as logf:
        proc = subprocess.Popen([ckptd_bin, "run", *cfg], cwd=tmp_path, env=_env(),
                                stdout=logf, stderr=subprocess.STDOUT)
    try:
        def answers(argv: list[str]) -> bool:
            if proc.poll() is not None:
                raise AssertionError(f"the daemon exited {proc.returncode}:\n{log.read_text()}")
            return _run([ckptd_bin, *argv, *cfg], tmp_path, 30).returncode == 0

        wait_until(lambda: answers(["status"]), 30, "`ckptd status` to answer", interval=0.1,
                   detail=log.read_text)
        wait_until(lambda: answers(["probe", "ready"]), 30, "`ckptd probe ready` to say yes",
                   interval=0.1, detail=log.read_text)
        status = json.loads(_checked([ckptd_bin, "status", "--json", *cfg], tmp_path, 30))
        assert sorted(r["name"] for r in status["roots"]) == ["demo", "demo-single"], status
        _torch_file(roots["demo-single"], 100)
        _checked([ckptd_bin, "wait", "demo-single", "100", "--until", "uploaded",
                  "--timeout", "60", *cfg], tmp_path, 90)
        latest = json.loads(_checked([ckptd_bin, "latest", "demo-single", "--tier", "remote",
                                      "--json", *cfg], tmp_path, 30))
        assert (latest["step"], latest["state"], latest["remote"]) == (100, "valid", "uploaded")
        assert list((remote / "demo-single").rglob("MANIFEST.json")), \
            "no committed step on the example's remote"

        # A reload that asks for deep_validate is refused in one line; the daemon goes on.
        text = config.read_text() + "deep_validate = true\n"  # into the last table
        assert tomllib.loads(text)["roots"][1] == {**example["roots"][1], "deep_validate": True}
        config.write_text(text)
        proc.send_signal(signal.SIGHUP)
        rejected = wait_until(lambda: parse_events(log.read_text(), "config_reload_rejected"),
                              30, "the reload to be refused", detail=log.read_text)
        assert rejected[0]["error"] == (f"{config}: roots[1].deep_validate = true needs"
                                        " PyTorch: pip install 'ckptd[torch]'")
        _checked([ckptd_bin, "status", *cfg], tmp_path, 30)
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, log.read_text()
        assert time.monotonic() - started < 10
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    text = log.read_text()
    assert parse_events(text, "daemon_stopped"), text[-4000:]
    assert "Traceback" not in text, text[-4000:]
    assert not socket.exists()
