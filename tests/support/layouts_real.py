"""Layout detection on real files: a test-only snapshot of a root, detect() as a scan would see
it, and the cases each framework's writer makes. Holds no tests."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import layout_writers as w

from ckptd import layouts
from ckptd.model import Candidate, FileInfo, RootOptions, Snapshot

SETTLE = 5.0


def snapshot(root: Path) -> Snapshot:
    """A test-only scanner: os.walk + stat, every file first seen at its mtime."""
    files: dict[str, FileInfo] = {}
    dirs: set[str] = set()
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = os.path.relpath(dirpath, root).replace(os.sep, "/")
        prefix = "" if rel_dir == "." else rel_dir + "/"
        dirs.update(prefix + d for d in dirnames)
        for name in filenames:
            st = os.stat(os.path.join(dirpath, name))
            files[prefix + name] = FileInfo(prefix + name, st.st_size, st.st_mtime, st.st_mtime)
    contents = {rel: (root / rel).read_bytes() for rel in files if layouts.wants_content(rel)}
    return Snapshot(files=files, dirs=frozenset(dirs), contents=contents)


def detect(root: Path, world_size: int = 0, after: float = SETTLE + 1,
           layout: str = "auto", multi_node: bool = False) -> list[Candidate]:
    """Candidates as a scan `after` seconds past the newest write would see them."""
    snap = snapshot(root)
    newest = max((f.mtime for f in snap.files.values()), default=0.0)
    opts = RootOptions(settle=SETTLE, world_size=world_size, multi_node=multi_node)
    return layouts.detect(snap, opts, newest + after, layout)


Writer = Callable[..., Path]


# name -> (writer, kwargs, world_size option, expected layout, step, anchor relative to root)
CASES: dict[str, tuple[Writer, dict[str, Any], int, str, int, str]] = {
    "native": (w.write_native, {"step": 5}, 0, "native", 5, "step-5"),
    "split": (w.write_split, {"step": 5}, 0, "split", 5, "step_5_model.pt"),
    "ranked": (w.write_ranked, {"step": 7}, 0, "ranked", 7, "model_7.pt"),
    "single": (w.write_single, {"step": 9}, 0, "single", 9, "model_step_9.pt"),
    "hf": (w.write_hf, {"step": 500}, 0, "hf", 500, "checkpoint-500"),
    "deepspeed": (w.write_deepspeed, {"step": 100}, 2, "deepspeed", 100, "global_step100"),
    "megatron": (w.write_megatron, {"iteration": 100}, 0, "megatron", 100, "iter_0000100"),
    "megatron_torch_dist": (w.write_megatron, {"iteration": 100, "torch_dist": True}, 0,
                            "megatron", 100, "iter_0000100"),
    "orbax": (w.write_orbax, {"step": 100}, 0, "orbax", 100, "100"),
    "nemo": (w.write_nemo, {"step": 100}, 0, "dcp", 100,
             "megatron_gpt--val_loss=1.23-step=100-consumed_samples=800.0-last"),
}
