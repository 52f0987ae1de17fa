"""`ckptd verify PATH` offline (no daemon): recognises the layout, validates, prints the SPEC's
JSON shape, and exits 0 valid / 1 invalid."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
from support.ckpts import flip_byte, tiny_state

SHAPE = {"path", "layout", "step", "valid", "reason", "message", "files"}


def verify(path: Path, *extra: str) -> tuple[int, dict[str, Any]]:
    r = subprocess.run([sys.executable, "-m", "ckptd", "verify", str(path), "--json", *extra],
                       capture_output=True, text=True, timeout=120)
    return r.returncode, json.loads(r.stdout)


def test_single_file_valid_then_corrupt(tmp_path: Path) -> None:
    p = tmp_path / "model_step_12.pt"
    torch.save(tiny_state(1), p)
    code, doc = verify(p)
    assert code == 0 and set(doc) == SHAPE
    assert doc["valid"] and doc["layout"] == "single" and doc["step"] == 12
    assert doc["files"][0]["path"] == "model_step_12.pt" and len(doc["files"][0]["hash"]) == 32
    flip_byte(p)
    code, doc = verify(p)
    assert code == 1 and not doc["valid"] and doc["reason"] == "crc_mismatch"


def test_dcp_dir_and_missing_metadata(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    ck = tmp_path / "step-40"
    dcp.save(tiny_state(2), checkpoint_id=str(ck))
    code, doc = verify(ck)
    assert code == 0 and doc["layout"] == "dcp" and doc["step"] == 40
    (ck / ".metadata").unlink()
    code, doc = verify(ck)
    assert code == 1 and not doc["valid"] and ".metadata" in doc["message"]


def test_native_dir_deep_nan(tmp_path: Path) -> None:
    import ckptd.torch as ct

    model = torch.nn.Linear(4, 4)
    path = ct.save(tmp_path, 3, model=model, register=False)
    code, doc = verify(path, "--deep")
    assert code == 0 and doc["layout"] == "native"
    with torch.no_grad():
        model.weight[0, 0] = float("nan")
    path = ct.save(tmp_path, 4, model=model, register=False)
    code, doc = verify(path, "--deep")
    assert code == 1 and doc["reason"] == "nan"


def test_missing_path_and_human_output(tmp_path: Path) -> None:
    code, doc = verify(tmp_path / "nope.pt")
    assert code == 1 and doc["reason"] == "missing_file"
    p = tmp_path / "weights_step_1.pt"
    torch.save(tiny_state(3), p)
    r = subprocess.run([sys.executable, "-m", "ckptd", "verify", str(p)], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0 and "valid" in r.stdout


def test_trusted_globals_accept_framework_objects_but_never_code(tmp_path: Path) -> None:
    """Megatron pickles its argparse.Namespace args into the model file: refused by the
    weights-only allow-list, accepted when trusted; a code-running global is never trusted."""
    import argparse

    p = tmp_path / "model_step_5.pt"
    torch.save({"model": tiny_state(1)["model"], "args": argparse.Namespace(lr=0.1)}, p)
    code, doc = verify(p)
    assert code == 1 and doc["reason"] == "unsafe_pickle"
    code, doc = verify(p, "--trust", "argparse.Namespace", "--deep")
    assert code == 0 and doc["valid"]
    r = subprocess.run([sys.executable, "-m", "ckptd", "verify", str(p), "--trust", "os.system"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "never trusted" in r.stderr
