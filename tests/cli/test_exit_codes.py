"""Every exit code docs/CLI.md lists is reached by the real command line, each by a real cause:
a good and a bad answer, a bad command line, no daemon, a held state directory, a bad config.
69 for a daemon that answers 503 is reached in test_retention_service (its retention not run).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from support.config import write_layout

from ckptd.cli.main import main
from ckptd.service.recovery import StateDirLock

DOCS = Path(__file__).resolve().parents[2] / "docs" / "CLI.md"
REACHED_HERE = {0, 1, 2, 69, 75, 78}


def documented_codes() -> set[int]:
    text = DOCS.read_text()
    table = text.split("### Exit codes", 1)[1].split("\n## ", 1)[0]
    return {int(m) for m in re.findall(r"^\| (\d+) \|", table, re.MULTILINE)}


def test_every_documented_exit_code_is_reached_here() -> None:
    assert documented_codes() == REACHED_HERE


def test_0_ok_and_1_no(tmp_path: Path, short_dir: Path) -> None:
    layout = write_layout(tmp_path, short_dir / "ckptd.sock")
    assert main(["config", "check", str(layout.config)]) == 0
    bad = tmp_path / "model_step_5.pt"
    bad.write_bytes(b"not a torch file")
    assert main(["verify", str(bad)]) == 1


def test_2_usage(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["no-such-command"]) == 2
    assert main(["pin", "r1", "not-a-step"]) == 2
    assert "usage" in capsys.readouterr().err


def test_69_no_daemon(short_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["status", "--socket", str(short_dir / "nobody.sock")]) == 69
    assert "is the daemon running?" in capsys.readouterr().err


def test_75_state_dir_held(tmp_path: Path, short_dir: Path) -> None:
    layout = write_layout(tmp_path, short_dir / "ckptd.sock")
    lock = StateDirLock(layout.state_dir)
    lock.acquire()
    try:
        done = subprocess.run([sys.executable, "-m", "ckptd", "run", "--config",
                               str(layout.config)], capture_output=True, text=True, timeout=60)
    finally:
        lock.release()
    assert done.returncode == 75, done.stderr
    assert "another ckptd" in done.stderr and "Traceback" not in done.stderr


def test_78_bad_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "ckptd.toml"
    bad.write_text("[daemon]\nno_such_key = 1\n")
    assert main(["config", "check", str(bad)]) == 78
    assert "no_such_key" in capsys.readouterr().err
