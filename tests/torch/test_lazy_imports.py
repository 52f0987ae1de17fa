"""What a training process imports: `import ckptd.torch` and a load pull in only what that load
reads with. Each case runs in a fresh interpreter and checks `sys.modules` afterwards; no timing.

A local load never needs the config models (pydantic), the daemon's logging (structlog, and the
rich it pulls in), the object-store library, the codec, the async save's arena or the daemon's
own packages; a load from a bucket URL needs the backends and the codec, still not the config,
the logging or the daemon.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from support.published import publish

import ckptd.torch as ckpt
from ckptd.backends import LocalBackend

REPO = Path(__file__).resolve().parents[2]

# Never imported by a process that only loads, wherever from.
NEVER = ("pydantic", "structlog", "rich", "ckptd.config", "ckptd.layouts",
         "ckptd.store", "ckptd.service", "ckptd.api", "ckptd.daemon", "ckptd.cli",
         "ckptd.stages", "ckptd.retention", "ckptd.watch", "ckptd.memory", "sqlite3",
         "ckptd.arena_write", "ckptd.torch._async", "ckptd.torch._arena_copy",
         "ckptd.torch._nodelocal")
# Besides, never imported by `import ckptd.torch` or a load of local files.
LOCAL_NEVER = (*NEVER, "obstore", "zstandard", "ckptd.backends", "ckptd.codec", "ckptd.fetch",
               "ckptd.copies", "ckptd.remote", "ckptd.torch._remote", "ckptd.torch._memory",
               "ckptd.arena", "ckptd.formats.zipcrc", "ckptd.log")

PROBE = """
import json, sys
import torch
import ckptd.torch
how, where = sys.argv[1], sys.argv[2]
model = torch.nn.Linear(8, 8)
if how == "step":
    ckptd.torch.load(where, model=model)
elif how == "remote":
    ckptd.torch.load(sys.argv[3], model=model, source="remote", remote=where)
print(json.dumps(sorted(sys.modules)))
"""


def imported(*argv: str) -> set[str]:
    """The modules a fresh interpreter holds after the probe ran with `argv`."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        filter(None, [str(REPO), os.environ.get("PYTHONPATH")])), "CKPTD_SOCKET": "/nonexistent"}
    out = subprocess.run([sys.executable, "-c", PROBE, *argv], env=env, capture_output=True,
                         text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    return set(json.loads(out.stdout.strip().splitlines()[-1]))


def offenders(modules: set[str], never: tuple[str, ...]) -> list[str]:
    return sorted(m for m in modules if any(m == n or m.startswith(n + ".") for n in never))


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    root = tmp_path / "r"
    torch.manual_seed(0)
    ckpt.save(root, 5, model=torch.nn.Linear(8, 8), register=False)
    return root


def test_import_alone_pulls_in_no_save_or_daemon_module(tmp_path: Path) -> None:
    modules = imported("none", str(tmp_path))
    assert "ckptd.torch" in modules and "ckptd.torch._load" in modules
    assert offenders(modules, LOCAL_NEVER) == []


def test_a_local_step_loads_without_them(saved: Path) -> None:
    modules = imported("step", str(saved / "step-5"))
    assert offenders(modules, LOCAL_NEVER) == []


def test_a_bucket_load_needs_no_config_logging_or_daemon(tmp_path: Path, saved: Path) -> None:
    publish(saved, "r", 5, LocalBackend(str(tmp_path / "remote")))
    modules = imported("remote", f"file://{tmp_path / 'remote'}", str(tmp_path / "far" / "r"))
    assert {"ckptd.torch._remote", "ckptd.fetch.step", "ckptd.codec"} <= modules
    assert offenders(modules, NEVER) == []


def test_the_lazy_names_are_still_there() -> None:
    assert ckpt.SaveHandle.__module__ == "ckptd.torch._async"
    assert callable(ckpt.flush)
    assert all(hasattr(ckpt, name) for name in ckpt.__all__)
    assert set(ckpt.__all__) <= set(dir(ckpt))
    with pytest.raises(AttributeError):
        ckpt.no_such_name  # noqa: B018
