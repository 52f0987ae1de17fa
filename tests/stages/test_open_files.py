"""A step with more files than the process may open at once: validation holds every file of a
step open, so a 10,000-file DCP step meets the 1,024 open files a login shell or a Slurm step
often starts with. The CLI raises its soft limit to the hard one; where that is still too few,
the stage fails as a retryable error naming the limit, and the checkpoint is never invalid."""

from __future__ import annotations

import resource
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from support.wait import wait_until

from ckptd.errors import TooManyFiles
from ckptd.model import Candidate
from ckptd.stages.validate import validate

FILES = 300  # tensors; DCP writes one file each, plus .metadata


def _many_file_step(path: Path, files: int = FILES) -> None:
    state = {f"t{i:04d}": torch.full((16,), float(i)) for i in range(files)}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(path), single_file_per_rank=False,
                                                         thread_count=1))


@pytest.fixture(scope="module")
def step(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("many")
    _many_file_step(root / "step-7")
    return root / "step-7"


@pytest.fixture
def soft_limit() -> Iterator[Any]:
    """Set this process's soft open-file limit for a test; put it back after."""
    before = resource.getrlimit(resource.RLIMIT_NOFILE)

    def set_soft(n: int | None) -> None:
        """`n` open files, or (None) the limit the test started with."""
        resource.setrlimit(resource.RLIMIT_NOFILE, (before[0] if n is None else n, before[1]))

    try:
        yield set_soft
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, before)


def _candidate(step: Path) -> Candidate:
    files = tuple(sorted(f"{step.name}/{p.name}" for p in step.iterdir()))
    return Candidate("dcp", 7, step.name, files, complete=True)


def test_under_a_low_limit_validation_says_which_limit_and_is_not_a_verdict(
        step: Path, soft_limit: Any) -> None:
    cand = _candidate(step)
    soft_limit(FILES + 100)  # enough for the files themselves, not with the headroom kept
    with pytest.raises(TooManyFiles, match=r"301 files.*open-file limit is 400.*LimitNOFILE"):
        validate(step.parent, cand)
    soft_limit(None)
    assert validate(step.parent, cand).valid


def _cli(args: list[str], soft: int, hard: int) -> subprocess.CompletedProcess[str]:
    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))

    return subprocess.run([sys.executable, "-m", "ckptd", *args], capture_output=True,
                          text=True, preexec_fn=limit, timeout=120)


def test_ckptd_verify_raises_its_soft_limit_to_the_hard_one(step: Path) -> None:
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard != resource.RLIM_INFINITY and hard < 2048:
        pytest.skip(f"this machine's hard open-file limit is {hard}")
    done = _cli(["verify", str(step)], soft=256, hard=2048)
    assert done.returncode == 0, done.stderr
    assert "valid" in done.stdout


def test_ckptd_verify_under_a_hard_limit_too_low_names_it(step: Path) -> None:
    done = _cli(["verify", str(step)], soft=300, hard=300)
    assert done.returncode != 0
    assert "open-file limit is 300" in done.stderr and "Traceback" not in done.stderr


def test_the_daemon_retries_the_step_and_never_calls_it_invalid(
        inproc_daemon: Any, soft_limit: Any) -> None:
    d = inproc_daemon()
    root = d.roots["r1"]
    soft_limit(FILES + 200)
    try:
        _many_file_step(root / "step-9")

        def failed() -> str | None:
            err = d.store.root_info("r1")["last_error"]
            return err if "open-file limit" in err else None

        error = wait_until(failed, 30.0, "the stage failing on the open-file limit")
        assert "raise it" in error
        rec = d.client.checkpoint("r1", 9)
        assert rec is not None and rec["state"] != "invalid"
    finally:
        soft_limit(None)
    assert d.wait_for("r1", 9, timeout=60.0)["state"] == "valid"  # retried once it can
